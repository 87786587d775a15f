"""Quantizer benchmark against llama.cpp on the default model.

    python benchmarks/quantize.py [--model PATH] [--ctx 256]

Round trip: default model -> F16 (--allow-requantize) -> Q4_K_M, once with edgellm's quantizer and once with
llama.cpp's (`llama_cpp.llama_model_quantize`); prints times, whether the bytes are equal, and the perplexity of
both (edgellm.perplexity on tests/golden/perplexity.txt, n_ctx=256). Then llama.cpp loads edgellm's Q4_K_M file
and continues the golden prompts (tests/golden/prompts.json) greedily for 48 tokens, as edgellm does on the same
file: the texts must be equal (llama.cpp with GGML_CPU_TILED_MM=0, as for the golden files).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "golden"))
os.environ["GGML_CPU_TILED_MM"] = "0"  # llama.cpp as for the golden files (read once, at its first matmul)


def llama_cpp_quantize(src, dst, ftype, threads):
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
    p.nthread = threads
    p.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0


def greedy_agreement(path, steps=48):
    """Greedy continuations of the golden prompts by llama.cpp and by edgellm on the GGUF at `path`:
    (prompts, equal token for token)."""
    import json

    import make_model_golden as M  # sets GGML_CPU_TILED_MM=0 before llama.cpp computes

    from edgellm.api import LLM
    from edgellm.sampling import SamplingParams

    prompts = json.loads((ROOT / "tests" / "golden" / "prompts.json").read_text())["prompts"]
    r = M.Runner(path, n_ctx=512, n_batch=512)
    want = []
    for p in prompts:
        ids = r.tokenize(p["text"])
        r.clear()
        logits, toks = r.decode(ids, 0, [False] * (len(ids) - 1) + [True])[-1], []
        for step in range(steps):
            toks.append(int(logits.argmax()))
            logits = r.decode([toks[-1]], len(ids) + step, [True])[0]
        want.append((ids, toks))
    r.close()
    llm = LLM(str(path), progress=False)
    got = llm.generate([ids for ids, _ in want], SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    return len(want), sum(o.token_ids == toks for o, (_, toks) in zip(got, want))


def digest(path):
    from edgellm.gguf_file import read_gguf

    g = read_gguf(path)
    h = hashlib.sha256()
    for n in sorted(g.tensors):
        h.update(n.encode())
        h.update(bytes(g.tensor_bytes(n)))
    return h.hexdigest()[:16]


def main():
    from edgellm.api import LLM
    from edgellm.model_path import default_model_path
    from edgellm.perplexity import perplexity
    from kernels_cpu import physical_cores
    from convert.quantize_model import quantize_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--ctx", type=int, default=256)
    a = ap.parse_args()
    src = a.model or default_model_path()
    threads = physical_cores()
    text = (ROOT / "tests" / "golden" / "perplexity.txt").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "f16.gguf"
        t0 = time.perf_counter()
        quantize_model(src, f16, "F16", allow_requantize=True, threads=threads)
        print(f"edgellm   -> F16     {time.perf_counter() - t0:6.1f} s")
        ours, ref = Path(tmp) / "ours.gguf", Path(tmp) / "ref.gguf"
        for ft in ("Q4_0", "Q4_K_M"):
            t0 = time.perf_counter()
            quantize_model(f16, ours, ft, threads=threads)
            t_ours = time.perf_counter() - t0
            t0 = time.perf_counter()
            llama_cpp_quantize(f16, ref, ft, threads)
            t_ref = time.perf_counter() - t0
            same = digest(ours) == digest(ref)
            print(f"F16 -> {ft:7s} edgellm {t_ours:6.1f} s   llama.cpp {t_ref:6.1f} s   bytes equal: {same}")
        p_ours = perplexity(LLM(str(ours)), text, n_ctx=a.ctx).ppl
        p_ref = perplexity(LLM(str(ref)), text, n_ctx=a.ctx).ppl
        print(f"Q4_K_M perplexity (n_ctx={a.ctx}): edgellm-quantized {p_ours:.4f}  llama.cpp-quantized {p_ref:.4f}  "
              f"ratio {p_ours / p_ref:.4f}")
        n, same = greedy_agreement(ours)
        print(f"llama.cpp on edgellm's Q4_K_M file: greedy 48 tokens equal to edgellm's for {same}/{n} prompts")


if __name__ == "__main__":
    main()
