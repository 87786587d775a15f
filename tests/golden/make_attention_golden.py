"""Produce tests/golden/attention_ops.npz with llama.cpp (llama-cpp-python, a dev-only tool): inputs and outputs of
ggml-cpu's expf, rope and attention, for the bit-exact tests in test_kernels_ops.py / test_kernels_attention_ops.py.

    python tests/golden/make_attention_golden.py [--model GGUF]

Contents (all float32 unless noted):
  expf_x, expf_y        ggml_v_expf (AVX512 variant) of 2048 inputs, through ggml_vec_soft_max_f32(n, y, x, max=0);
  expf_sum (float64)    that call's return value per 64 inputs (16-lane reduce_add per 16, summed in double)
  From the default model (Gemma 3 270M), one sequence: a prefill of PREFILL tokens, then one decode step, with
  the configuration of make_model_golden.py (F32 K/V cache, no flash attention); l in LAYERS (local, global):
  rope_pos (int64), rope_in_<l>, rope_out_<l>   (R, 256): K rows before/after ggml_rope_ext (NeoX) at rope_pos
  and for layer ATTN_LAYER:
  attn_k, attn_v                                 (P, 256): roped K and V of positions 0..P-1 (the KV cache)
  attn_pos (int64), attn_q, attn_out             (R, 4, 256): roped (unscaled) Q rows and kqv_out at attn_pos;
                                                 the last row is the decode step (a single-token batch)
  attn_scale: the Q scale (Gemma 3: 1/16, applied to Q before KQ; exact, so the same as scaling KQ)
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_model_golden as M  # noqa: E402

PREFILL = 20  # crosses a 16-cell lane block of the softmax sums and of tinyBLAS
LAYERS = (0, 5)  # Gemma 3: layer 0 sliding-window (rope base 1e4), layer 5 global (rope base 1e6)
ATTN_LAYER = 0  # attention is the same computation in both kinds of layer below 512 positions
ROWS = (0, 15, 16, 19)  # prefill rows kept, + the decode row
ROPE_OP = 48  # GGML_OP_ROPE in the vendored ggml


def expf_inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = np.concatenate([
        -rng.exponential(3.0, 1024),  # softmax inputs: x - max <= 0
        rng.uniform(-110.0, 90.0, 768),  # the whole range incl. subnormal results and overflow
        [0.0, -0.0, -1e-30, 1e-30, -87.0, -87.5, -88.0, -100.0, -103.9, -104.0, -150.0, -200.0, 88.0, 88.5, 89.0,
         -np.inf, 0.5, -0.5, -0.693359375, 1.0],
    ]).astype(np.float32)
    return np.concatenate([x, -rng.uniform(0, 20, 2048 - len(x)).astype(np.float32)])


def ggml_expf(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    f = lib.ggml_vec_soft_max_f32
    f.restype = ctypes.c_double
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float]
    y = np.empty_like(x)
    sums = []
    for i in range(0, len(x), 64):
        xs, ys = np.ascontiguousarray(x[i:i + 64]), np.empty(64, np.float32)
        sums.append(f(64, ys.ctypes.data, xs.ctypes.data, 0.0))
        y[i:i + 64] = ys
    return y, np.array(sums)


class _Capture:
    """Eval callback keeping, per layer of LAYERS, the tensors the tests need (one dict per llama_decode)."""

    def __init__(self):
        import llama_cpp.llama_cpp as lc

        self.calls: list[dict] = []
        self.callback = lc.ggml_backend_sched_eval_callback(self._cb)

    def _cb(self, tp, ask, _ud):
        t = ctypes.cast(tp, ctypes.POINTER(M._GgmlTensor)).contents
        base, _, layer = t.name.decode().rpartition("-")
        if not layer.isdigit() or int(layer) not in LAYERS:
            return False
        key = {"Kcur_normed": "k_in", "Vcur": "v", "kqv_out": "out"}.get(base)
        if base in ("Qcur", "Kcur") and t.op == ROPE_OP:
            key = base[0].lower() + "_rope"
        if ask or key is None or t.type != M.GGML_TYPE_F32:
            return key is not None
        self.calls[-1][f"{key}_{layer}"] = M._tensor_f32(t)
        return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=M.DEFAULT_MODEL)
    model = Path(ap.parse_args().model)
    out = {}
    out["expf_x"] = expf_inputs()
    out["expf_y"], out["expf_sum"] = ggml_expf(out["expf_x"])

    cap = _Capture()
    M._with_eval_callback(cap)
    try:
        r = M.Runner(model, n_ctx=64, n_batch=64)
        tokens = ([r.bos] + r.tokenize(M.TINY_TEXT, add_bos=False) * 4)[:PREFILL + 1]
        r.clear()
        for pos0, chunk in ((0, tokens[:PREFILL]), (PREFILL, tokens[PREFILL:])):
            cap.calls.append({})
            r.decode(chunk, pos0, [False] * (len(chunk) - 1) + [True])
        r.close()
    finally:
        M._with_eval_callback(None)
    pre, dec = cap.calls
    rows = list(ROWS)
    out["attn_pos"] = out["rope_pos"] = np.array(rows + [PREFILL], np.int64)
    for layer in LAYERS:
        def cat(key, sl):  # prefill rows + the decode row; tensors are (1, T, heads, 256) or (1, 1, T, heads*256)
            return np.concatenate([pre[f"{key}_{layer}"].reshape(PREFILL, -1)[sl],
                                   dec[f"{key}_{layer}"].reshape(1, -1)])
        out[f"rope_in_{layer}"] = cat("k_in", rows)
        out[f"rope_out_{layer}"] = cat("k_rope", rows)
        if layer == ATTN_LAYER:
            out["attn_k"] = cat("k_rope", slice(None))
            out["attn_v"] = cat("v", slice(None))
            out["attn_q"] = cat("q_rope", rows).reshape(len(rows) + 1, -1, 256)
            out["attn_out"] = cat("out", rows).reshape(len(rows) + 1, -1, 256)
    out["attn_scale"] = np.float32(0.0625)
    path = HERE / "attention_ops.npz"
    np.savez_compressed(path, **out)
    print(f"wrote {path.relative_to(HERE.parent.parent)} ({path.stat().st_size // 1024} KB); model "
          f"{M.file_info(model)['sha256'][:12]}, {M.llama_cpp_info()['llama_cpp_python']}")


if __name__ == "__main__":
    main()
