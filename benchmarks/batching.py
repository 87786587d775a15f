"""Continuous batching and prefix reuse on the default model (issue 4 figures).

    python benchmarks/batching.py [--model GGUF] [--threads 2] [--new 128] [--rounds 3] [--speculative ngram]

1. 8 greedy requests of --new tokens in one batch vs one request alone: aggregate decode tokens/s ratio,
   and the outputs must be identical to the single runs (median ratio over --rounds rounds). Speculative
   decoding is off by default here (--speculative ngram turns the engine's default back on): prompt-lookup
   drafts speed a lone greedy request of a base model up ~3x and would hide what batching gives
   (benchmarks/speculative.py measures them).
2. A request sharing a 1,000-token prefix with a finished one: cached tokens and TTFT ratio.
3. KV budget of 2,048 tokens: 16 requests (300-token prompts, 200 new tokens) all finish with outputs
   identical to an ample budget.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from edgellm import LLM, SamplingParams


def decode_tps(outs) -> float:
    """Aggregate decode tokens/s: generated tokens after the first, over the span from the first token
    of any request to the last finish."""
    t0 = min(o.metrics["ttft_s"] + 0 for o in outs)
    total = max(o.metrics["total_s"] for o in outs)
    n = sum(max(0, len(o.token_ids) - 1) for o in outs)
    return n / (total - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="batch-vs-single rounds (the median ratio is reported)")
    ap.add_argument("--speculative", default="off", choices=["off", "ngram"])
    a = ap.parse_args()
    llm = LLM(a.model, threads=a.threads, ctx_size=4096, kv_cache_tokens=8192, progress=True,
              speculative=a.speculative)
    rng = np.random.default_rng(0)
    words = "the of and a to in is was for on that with as by at from his her it an were are which".split()
    prompts = [" ".join(rng.choice(words, 24)) for _ in range(8)]
    p = SamplingParams(max_tokens=a.new, temperature=0, ignore_eos=True)

    ratios, same = [], True
    for r in range(a.rounds):  # the machine is noisy: each round times both sides back to back
        singles = [llm.generate(q, p) for q in prompts]
        single_tps = float(np.median([o.metrics["decode_tps"] for o in singles]))
        batch = llm.generate(prompts, p)
        same = same and all(b.token_ids == s.token_ids for b, s in zip(batch, singles))
        agg = decode_tps(batch)
        ratios.append(agg / single_tps)
        print(f"[batch] speculative {a.speculative}, round {r + 1}: 1 request: {single_tps:.1f} tok/s; "
              f"8 in one batch: {agg:.1f} tok/s aggregate -> {agg / single_tps:.2f}x")
    print(f"[batch] median over {a.rounds} rounds: {float(np.median(ratios)):.2f}x; outputs identical: {same}")

    prefix = " ".join(rng.choice(words, 1100))
    ids = llm.tokenize(prefix, add_bos=True)[:1000]
    q = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = llm.generate(ids + llm.tokenize(" first question"), q)
    second = llm.generate(ids + llm.tokenize(" another question entirely"), q)
    r = second.metrics["ttft_s"] / first.metrics["ttft_s"]
    print(f"[prefix] first TTFT {first.metrics['ttft_s'] * 1e3:.0f} ms, second TTFT {second.metrics['ttft_s'] * 1e3:.0f} ms "
          f"-> {r:.3f}x; cached tokens {second.metrics['cached_tokens']}")

    tight = LLM(a.model, threads=a.threads, ctx_size=4096, kv_cache_tokens=2048, progress=False,
                speculative=a.speculative)
    long_prompts = [ids[:1] + llm.tokenize(" ".join(rng.choice(words, 400)))[:299] for _ in range(16)]
    p2 = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs_tight = tight.generate(long_prompts, p2)
    dt = time.perf_counter() - t
    outs_ample = llm.generate(long_prompts, p2)
    ok = all(x.token_ids == y.token_ids for x, y in zip(outs_tight, outs_ample))
    print(f"[budget] 16 x (300 + 200) tokens in a 2,048-token KV cache: all finished "
          f"{all(o.finish_reason == 'length' for o in outs_tight)}, identical to ample budget: {ok}, "
          f"{dt:.1f} s, preemptions {tight.stats()['preemptions']}")


if __name__ == "__main__":
    main()
