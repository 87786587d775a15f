"""llama-bench-style throughput: prompt processing (pp) and token generation (tg) tokens/s, peak RSS."""
from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class BenchResult:
    pp_tps: float | None
    tg_tps: float | None
    threads: int
    rss_mb: float
    n_prompt: int
    n_gen: int
    repetitions: int

    def as_dict(self) -> dict:
        return asdict(self)


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def _prefill(sc, tokens: np.ndarray, chunk: int) -> None:
    for s in range(0, len(tokens), chunk):
        sc.forward(tokens[s:s + chunk], s)


def bench(llm, *, n_prompt: int = 512, n_gen: int = 128, repetitions: int = 3, chunk: int = 512) -> BenchResult:
    """Median tokens/s over repetitions: pp = one prompt of n_prompt random tokens (logits of the last
    row only, as llama-bench), tg = n_gen single-token decode steps with greedy picks."""
    rng = np.random.default_rng(0)
    pp, tg = [], []
    with llm.scratch(max(n_prompt, n_gen) + 1) as sc:
        for _ in range(repetitions):
            if n_prompt:
                toks = rng.integers(0, llm.config.n_vocab, n_prompt)
                t = time.perf_counter()
                _prefill(sc, toks, chunk)
                pp.append(n_prompt / (time.perf_counter() - t))
            if n_gen:
                tok = int(rng.integers(0, llm.config.n_vocab))
                t = time.perf_counter()
                for i in range(n_gen):
                    tok = int(np.argmax(sc.forward([tok], i)[0]))
                tg.append(n_gen / (time.perf_counter() - t))
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return BenchResult(med(pp), med(tg), llm.threads, peak_rss_mb(), n_prompt, n_gen, repetitions)
