"""Decode speed while other processes keep the cores busy (a laptop's normal state): edgellm's engine and
llama.cpp side by side, greedy, one request.

    python benchmarks/under_load.py [--model GGUF] [--threads 2] [--busy 1] [--new 96] [--rounds 3]

--busy N starts N busy-loop processes (plain priority, like a browser tab or a build) for the whole run; 0
measures the machine as it is. Each round runs the two alternately; reported: median decode tokens/s, ratio.
A kernel split over threads waits for all of them at its end, so a busy neighbour that holds a core stalls it
until the scheduler's next turn; edgellm's hand-off (OpenMP prange twins, ~130 per decode step) loses less
there than llama.cpp's graph barriers.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def edgellm_tps(llm, prompt: str, n: int) -> float:
    from edgellm import SamplingParams
    from edgellm.engine.engine import Engine

    eng = Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=llm.ctx_size)
    r = eng.add_request(llm.tokenizer.encode(prompt), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    eng.step()  # the prompt
    t = time.perf_counter()
    while eng.has_work():
        eng.step()
    dt = time.perf_counter() - t
    eng.close()
    return (len(r.output_ids) - 1) / dt


def llamacpp_tps(lm, prompt: str, n: int) -> float:
    toks = lm.tokenize(prompt.encode())
    lm.reset()
    lm.eval(toks)
    t = time.perf_counter()
    for _ in range(n - 1):
        tok = int(np.argmax(lm.scores[lm.n_tokens - 1]))
        lm.eval([tok])
    return (n - 1) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", type=int, default=1)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from edgellm import LLM
    from edgellm.model_path import resolve_model

    llm = LLM(a.model, threads=a.threads, ctx_size=1024, progress=False)
    try:
        from llama_cpp import Llama
        lm = Llama(model_path=str(resolve_model(a.model)), n_ctx=1024, n_threads=a.threads, n_batch=512,
                   logits_all=True, verbose=False)
    except ImportError:
        lm = None
        print("llama.cpp (llama-cpp-python, the bench extra) not importable: edgellm only")
    prompt = "The history of the city begins in the early middle ages, when"
    edgellm_tps(llm, prompt, 8)  # warm-up
    stop = mp.Event()
    procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(a.busy)]
    for p in procs:
        p.start()
    res: dict[str, list[float]] = {"edgellm": [], "llama.cpp": []}
    try:
        for rnd in range(a.rounds):
            res["edgellm"].append(edgellm_tps(llm, prompt, a.new))
            if lm is not None:
                res["llama.cpp"].append(llamacpp_tps(lm, prompt, a.new))
            print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in res.items() if v), flush=True)
    finally:
        stop.set()
        for p in procs:
            p.join()
    med = {k: statistics.median(v) for k, v in res.items() if v}
    print(f"\n{a.busy} busy process(es), {a.threads} threads, {a.new} tokens, medians of {a.rounds} rounds (tok/s):")
    for k, v in med.items():
        print(f"  {k:18s} {v:7.1f}")
    if "llama.cpp" in med:
        print(f"  edgellm / llama.cpp {med['edgellm'] / med['llama.cpp']:.2f}x")


if __name__ == "__main__":
    main()
