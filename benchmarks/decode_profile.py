"""Where a decode step's time goes: matmul kernels, attention, the other kernels, and what runs outside them.

    python benchmarks/decode_profile.py [--model GGUF] [--threads 2] [-n 128] [--repetitions 3]

Decodes n greedy single-token steps from an empty context (as `edgellm bench`'s tg) and prints per step:
- the wall time;
- compiled: the time inside calls from Python into Numba-compiled code (every CPUDispatcher call, timed at the
  outermost level, Numba's argument dispatch included) and their number;
- outside compiled code: the rest, the Python a step runs (models, kernel wrappers, sampling): the share issue 14
  asks for, which "one compiled call per layer" would remove;
- per group of what the models call (matmul / matmul_many, attend = K/V write + paged attention, the element-wise
  ops): time and calls, compiled and Python together.
The timers add ~0.5 us a call: compare shares, not the wall time, with `edgellm bench`.
"""
from __future__ import annotations

import argparse
import collections
import threading
import time

import numpy as np
from numba.core.registry import CPUDispatcher

from edgellm import LLM
from edgellm.models import common, gemma3, llama

# (module, imported name) -> group: the calls a model makes into kernels_cpu
TIMED = {(common, "matmul"): "matmul", (common, "matmul_many"): "matmul",
         (llama, "attend"): "attention", (gemma3, "attend"): "attention"}
TIMED.update({(m, n): "other kernels" for m in (llama, gemma3)
              for n in ("qk_norm_rope", "residual_norm", "rmsnorm", "rope_tables", "swiglu", "geglu") if hasattr(m, n)})


def install(times: dict, calls: collections.Counter) -> None:
    """Wrap every TIMED name in its module with a timer adding into times[group] / calls[group]."""
    for (mod, name), group in TIMED.items():
        fn = getattr(mod, name)

        def timed(*a, _fn=fn, _group=group, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                times[_group] += time.perf_counter() - t
                calls[_group] += 1

        setattr(mod, name, timed)


def install_compiled(times: dict, calls: collections.Counter) -> None:
    """Time every call from Python into Numba-compiled code (outermost level only) into times / calls["compiled"]."""
    call = CPUDispatcher.__call__
    depth = threading.local()

    def timed(self, *a, **k):
        if getattr(depth, "n", 0):
            return call(self, *a, **k)
        depth.n = 1
        t = time.perf_counter()
        try:
            return call(self, *a, **k)
        finally:
            times["compiled"] += time.perf_counter() - t
            calls["compiled"] += 1
            depth.n = 0

    CPUDispatcher.__call__ = timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repetitions", type=int, default=3)
    a = ap.parse_args()
    llm = LLM(a.model, threads=a.threads, ctx_size=a.n + 16, load_tokenizer=False, speculative="off")
    times: dict = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    install(times, calls)
    install_compiled(times, calls)
    rng = np.random.default_rng(0)
    shares = []
    with llm.scratch(a.n) as sc:
        for r in range(a.repetitions):
            times.clear()
            calls.clear()
            tok = int(rng.integers(0, llm.config.n_vocab))
            t0 = time.perf_counter()
            for i in range(a.n):
                tok = int(np.argmax(sc.forward([tok], i)[0]))
            wall = (time.perf_counter() - t0) / a.n
            compiled = times.pop("compiled") / a.n
            shares.append(1 - compiled / wall)
            parts = "  ".join(f"{g} {v / a.n * 1e3:.2f} ms ({calls[g] // a.n} calls)" for g, v in
                              sorted(times.items(), key=lambda kv: -kv[1]))
            print(f"rep {r + 1}: {wall * 1e3:.2f} ms a step ({1 / wall:.1f} tok/s); compiled code "
                  f"{compiled * 1e3:.2f} ms ({calls['compiled'] // a.n} calls), outside it {(wall - compiled) * 1e3:.2f}"
                  f" ms ({1 - compiled / wall:.0%}); by group: {parts}", flush=True)
    print(f"model {llm.loaded.path}, threads {llm.threads}: median share of a decode step outside compiled code "
          f"{float(np.median(shares)):.0%}")
    llm.shutdown()


if __name__ == "__main__":
    main()
