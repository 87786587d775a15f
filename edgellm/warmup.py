"""JIT warm-up: compile (or load from Numba's cache) every kernel the model uses, with progress shown
the first time (when compiling takes long enough to notice)."""
from __future__ import annotations

import threading

PREFILL_ROWS = 144  # warm-up prefill: quantization, row-wise ops and attention split from 64-128 rows
# With one kernel thread nothing splits and every prefill length runs the same kernels: a short prefill compiles
# them all (144 rows took 45 s to run under emulation on a Cortex-A72, and a second or more on a Pi 4, every start)
PREFILL_ROWS_ONE_THREAD = 4


def _distinct_weights(model) -> list:
    seen, out = set(), []
    for w in [model.output] + [m for L in model.layers for m in vars(L).values()]:
        key = getattr(w, "qtype", None)
        if key is not None and key not in seen:
            seen.add(key)
            out.append(w)
    return out


def warm_up(llm, *, progress: bool = True) -> None:
    """Compile every distinct matmul type's drivers, then run a prefill long enough to take the split
    (multi-threaded) forms of the other kernels (with one thread: a few rows), and a decode step.

    Runs in a short-lived thread: a thread that launches prange loops keeps its own OpenMP worker team while
    it lives, and with two live teams (the caller's and, later, the engine thread's) libgomp counts more
    threads than cores and lets idle workers sleep almost at once, so each launch pays a slow wake-up
    (a 2048x640 decode matmul: 31 -> 105 us here). Generation runs on the engine thread alone."""
    err: list[BaseException] = []

    def run():
        try:
            _warm_up(llm, progress=progress)
        except BaseException as e:  # re-raised in the caller
            err.append(e)

    t = threading.Thread(target=run, name="edgellm-warmup", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]


def _warm_up(llm, *, progress: bool) -> None:
    from tqdm import tqdm

    from kernels_cpu import get_threads
    from kernels_cpu.matmul import warm

    model = llm.model
    weights = _distinct_weights(model)
    steps = len(weights) + 1
    with tqdm(total=steps, desc="compiling kernels (first run only)", disable=not progress, delay=1.0,
              leave=False, unit="kernel") as bar:
        for w in weights:
            warm(w)
            bar.update(1)
        cap = llm.capacity
        rows = PREFILL_ROWS if get_threads() > 1 else PREFILL_ROWS_ONE_THREAD
        n = max(2, min(rows, cap.token_budget, cap.max_len - 1))
        with llm.scratch(n + 1) as sc:
            sc.forward([0] * n, 0)
            sc.forward([0], n)
        bar.update(1)

