"""Prompt cache on disk (issue 18): time to first token of a long prompt computed cold vs restored from disk by a
second process.

    python benchmarks/prompt_cache.py [--model GGUF] [--tokens 1000] [--rounds 2] [--max-batch 8] [--dir DIR]

A first process computes --rounds prompts of --tokens tokens (saving their blocks) and exits; a second process
alternates prompts it has never seen (cold) with the first one's (restored from disk), so both kinds are timed side
by side under the same load. TTFT is measured inside each process around the request (after a short warm-up
request: JIT and page-in are not counted), each request after the previous one's background writes finished.
Greedy outputs of the restored prompts must equal the first process's.
tests/test_prompt_cache.py runs the same child processes (`--child`) for its acceptance test.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def prompt(seed: int, n_tokens: int) -> list[int]:
    """BOS and n_tokens - 1 random ids: the same for the same seed."""
    return [2] + np.random.default_rng(seed).integers(100, 20000, n_tokens - 1).tolist()


def child_main(a) -> None:
    """One process: load, warm up, run the plan [[kind, seed], ...], print one JSON line of results."""
    from edgellm import LLM, SamplingParams

    llm = LLM(a.model, progress=False, max_batch=a.max_batch, prompt_cache=a.child)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    llm.generate(prompt(10_000 + a.seed, 200), greedy)  # JIT and page-in, not measured
    out: dict = {"trimmed": llm.engine.kv.windows is not None}
    for kind, seed in json.loads(a.plan):
        h = llm.submit(prompt(seed, a.tokens), greedy)
        r = h.result()
        # the request's blocks are written in the background: wait, so that the next request is timed alone (a
        # "new" request's 36 MB of writes took a core from every "warm" one after it, and from no "new" one)
        llm.engine.prompt_cache.flush()
        out.setdefault(kind, []).append({"ttft": r.metrics["ttft_s"], "ids": r.token_ids,
                                         "cached": r.metrics["cached_tokens"],
                                         "logprobs": [lp for lp, _ in h.request.logprobs]})
    out["stats"] = llm.stats()
    print(json.dumps(out))  # no shutdown(): interpreter exit writes the queued blocks


def run_child(cache, plan, *, seed: int, model: str | None = None, tokens: int = 1000, max_batch: int = 8,
              timeout: float = 900) -> dict:
    """Run child_main in a new Python process (given up after `timeout` seconds: a hang guard); its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(cache), "--plan", json.dumps(plan),
           "--seed", str(seed), "--tokens", str(tokens), "--max-batch", str(max_batch)]
    if model:
        cmd += ["--model", model]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"child process failed:\n{r.stderr}")
    return json.loads(r.stdout.splitlines()[-1])


def cold_and_warm(cache, *, rounds: int = 2, **kw) -> tuple[dict, dict]:
    """(first process's results, second process's): the first computes `rounds` prompts, the second alternates
    new prompts ("new") with those ("warm")."""
    seeds = [101 + i for i in range(rounds)]
    first = run_child(cache, [["cold", s] for s in seeds], seed=0, **kw)
    second = run_child(cache, [x for s in seeds for x in (["new", 200 + s], ["warm", s])], seed=1, **kw)
    return first, second


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8, help="2 trims the default model's sliding-window layers")
    ap.add_argument("--dir", default=None, help="cache directory (default: a fresh temporary one)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--plan", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child_main(a)
    with tempfile.TemporaryDirectory() as tmp:
        first, second = cold_and_warm(a.dir or tmp, rounds=a.rounds, model=a.model, tokens=a.tokens,
                                      max_batch=a.max_batch)
    med = {k: float(np.median([r["ttft"] for r in res[k]])) for res, k in ((first, "cold"), (second, "new"),
                                                                          (second, "warm"))}
    same = [(w["ids"], w["logprobs"]) for w in second["warm"]] == [(c["ids"], c["logprobs"]) for c in first["cold"]]
    st = second["stats"]
    print(f"{a.tokens}-token prompts, {a.rounds} rounds, sliding-window layers trimmed: {first['trimmed']}")
    print(f"TTFT cold, first process      {med['cold']:8.3f} s")
    print(f"TTFT cold, second process     {med['new']:8.3f} s")
    print(f"TTFT restored from disk       {med['warm']:8.3f} s   {med['warm'] / med['new']:.3f}x of cold")
    print(f"restored outputs identical    {same}")
    print(f"disk: {st['disk_hit_blocks']} blocks loaded, {st['disk_read_bytes'] / 1e6:.1f} MB read")


if __name__ == "__main__":
    main()
