"""KV cache types side by side: decode step time at a long context, prefill time, KV bytes per token.

    python benchmarks/kv_dtype.py [--model PATH] [--prompt 2000] [--steps 32] [--dtypes f16,q8_0,f32]

One LLM per KV type over the same model; each prefills the same random prompt (timed), then the decode steps run
round-robin (one step of each type in turn, so load on a shared machine hits all alike); medians, and ratios to
the first type.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from edgellm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", type=int, default=2000, help="prompt tokens before the decode steps")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per KV type")
    ap.add_argument("--dtypes", default="f16,q8_0", help="comma-separated KV types; ratios are to the first")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    names = a.dtypes.split(",")
    n_ctx = a.prompt + a.steps + 1
    llms = {n: LLM(a.model, kv_dtype=n, ctx_size=n_ctx, kv_cache_tokens=n_ctx + 16, max_batch=1,
                   threads=a.threads, progress=False) for n in names}
    first = llms[names[0]]
    toks = np.random.default_rng(0).integers(0, first.config.n_vocab, a.prompt)
    scratches = {n: llm.scratch(n_ctx) for n, llm in llms.items()}
    sc = {n: cm.__enter__() for n, cm in scratches.items()}
    prefill, steps, tok = {}, {n: [] for n in names}, {}
    for n in names:
        t = time.perf_counter()
        for s in range(0, a.prompt, 256):
            logits = sc[n].forward(toks[s:s + 256], s)
        prefill[n] = time.perf_counter() - t
        tok[n] = int(np.argmax(logits[-1]))
    for i in range(a.steps):
        for n in names:
            t = time.perf_counter()
            tok[n] = int(np.argmax(sc[n].forward([tok[n]], a.prompt + i)[0]))
            steps[n].append(time.perf_counter() - t)
    for cm in scratches.values():
        cm.__exit__(None, None, None)
    base = statistics.median(steps[names[0]])
    print(f"{a.prompt}-token prompt, {a.steps} decode steps each, {first.threads} threads "
          f"({first.config.name or 'model'})")
    for n in names:
        med = statistics.median(steps[n])
        kv = llms[n].engine.kv
        per_tok = kv.nbytes / (kv.n_blocks * kv.block_size)
        print(f"  {n:5s} decode {med * 1e3:7.2f} ms/token ({1 / med:6.1f} tok/s, {base / med:.3f}x {names[0]})  "
              f"prefill {a.prompt / prefill[n]:7.1f} tok/s ({prefill[names[0]] / prefill[n]:.3f}x)  "
              f"KV {per_tok:8.0f} B/token ({kv.nbytes / llms[names[0]].engine.kv.nbytes:.3f}x)")

if __name__ == "__main__":
    main()
