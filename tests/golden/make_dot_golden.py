"""Golden outputs of llama.cpp's own CPU dot products, to check the matmul kernels bit for bit.

    python tests/golden/make_dot_golden.py [--types IQ4_NL,IQ4_XS]  # needs llama-cpp-python (the `bench` extra)

--types: rewrite only those types' arrays in the existing dot_golden.npz (the others keep the outputs of the
llama.cpp build that made them); the random draws are those of a full run.

For each weight type: random GGUF blocks (random code bytes, f16 scales drawn in a realistic range), random
activation rows (normal, with a few outliers and an all-zero block), quantized by llama.cpp's `from_float`
(quantize_row_q8_0 / q8_1 / q8_K of libggml-cpu) and multiplied by llama.cpp's `ggml_vec_dot_<type>_<act>` row by
row, exactly as ggml_compute_forward_mul_mat does for a matmul (the llamafile tinyBLAS path taken for Q4_0 / Q5_0 /
Q8_0 prefill rounds identically). Writes tests/golden/dot_golden.npz: for type T, T_w (N, row bytes) uint8,
T_x (M, K) float32, T_y (M, N) float32. tests/test_kernels_matmul.py compares kernels_cpu.matmul with T_y.
"""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from quant.types import FORMATS, QuantType  # noqa: E402

N, M, K = 32, 4, 512  # 32 rows = 2 kernel row groups; K = 2 super-blocks / 16 blocks

# type -> (vec_dot symbol, activation type, byte offsets of the f16 fields in a block)
CASES = {
    "Q4_0": ("ggml_vec_dot_q4_0_q8_0", "q8_0", (0,)),
    "Q4_1": ("ggml_vec_dot_q4_1_q8_1", "q8_1", (0, 2)),
    "Q5_0": ("ggml_vec_dot_q5_0_q8_0", "q8_0", (0,)),
    "Q5_1": ("ggml_vec_dot_q5_1_q8_1", "q8_1", (0, 2)),
    "Q8_0": ("ggml_vec_dot_q8_0_q8_0", "q8_0", (0,)),
    "Q2_K": ("ggml_vec_dot_q2_K_q8_K", "q8_K", (80, 82)),
    "Q3_K": ("ggml_vec_dot_q3_K_q8_K", "q8_K", (108,)),
    "Q4_K": ("ggml_vec_dot_q4_K_q8_K", "q8_K", (0, 2)),
    "Q5_K": ("ggml_vec_dot_q5_K_q8_K", "q8_K", (0, 2)),
    "Q6_K": ("ggml_vec_dot_q6_K_q8_K", "q8_K", (208,)),
    "IQ4_NL": ("ggml_vec_dot_iq4_nl_q8_0", "q8_0", (0,)),
    "IQ4_XS": ("ggml_vec_dot_iq4_xs_q8_K", "q8_K", (0,)),
    "MXFP4": ("ggml_vec_dot_mxfp4_q8_0", "q8_0", ()),
}
E8M0_AT = {"MXFP4": 0}  # byte offset of the E8M0 block exponent: drawn in 2^-10 .. 2^1 (random bytes overflow)
ACT_BYTES = {"q8_0": (32, 34), "q8_1": (32, 36), "q8_K": (256, 292)}  # (block, bytes per block)


def _lib():
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    lib.ggml_cpu_init()  # fp16 tables and feature detection
    return lib


def _weights(rng, qt: QuantType, f16_at) -> np.ndarray:
    fmt = FORMATS[qt]
    nblk = K // fmt.block_size
    w = rng.integers(0, 256, size=(N, nblk, fmt.type_size), dtype=np.uint8)
    for off in f16_at:  # scales: |d| in [1e-3, 3e-2], the range real weights use; random signs for mins
        v = (rng.uniform(1e-3, 3e-2, size=(N, nblk)) * rng.choice([-1.0, 1.0], size=(N, nblk))).astype(np.float16)
        w[:, :, off:off + 2] = v.view(np.uint8).reshape(N, nblk, 2)
    if qt.name in E8M0_AT:
        w[:, :, E8M0_AT[qt.name]] = rng.integers(118, 130, size=(N, nblk))
    return w.reshape(N, nblk * fmt.type_size)


def _activations(rng) -> np.ndarray:
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[1, 5] = 40.0  # an outlier dominates its block's scale
    x[2, :] *= 1e-3
    x[3, 256:512] = 0.0  # an all-zero super-block
    return x


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="", help="comma-separated types to rewrite (default: all)")
    only = set(filter(None, ap.parse_args().types.split(",")))
    lib = _lib()
    rng = np.random.default_rng(1234)
    out = {}
    for name, (sym, act, f16_at) in CASES.items():
        qt = QuantType[name]
        w = _weights(rng, qt, f16_at)
        x = _activations(rng)
        blk, nbytes = ACT_BYTES[act]
        quant = getattr(lib, f"quantize_row_{act}")
        quant.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        dot = getattr(lib, sym)
        dot.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                        ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        y = np.zeros((M, N), np.float32)
        s = (ctypes.c_float * 1)()
        for m in range(M):
            xq = np.zeros(K // blk * nbytes, np.uint8)
            quant(x[m].ctypes.data, xq.ctypes.data, K)
            for n in range(N):
                dot(K, s, 0, w[n].ctypes.data, 0, xq.ctypes.data, 0, 1)
                y[m, n] = s[0]
        assert np.isfinite(y).all(), name
        out[f"{name}_w"], out[f"{name}_x"], out[f"{name}_y"] = w, x, y
        print(f"{name}: {sym} on {M}x{K} @ {N}x{K}")
    if only:  # keep the other types' arrays as they are
        old = dict(np.load(HERE / "dot_golden.npz"))
        out = {**old, **{k: v for k, v in out.items() if k.rsplit("_", 1)[0] in only}}
    np.savez_compressed(HERE / "dot_golden.npz", **out)
    print(f"wrote {HERE / 'dot_golden.npz'}")


if __name__ == "__main__":
    main()
