"""parallel_for: split a range of independent jobs over worker threads running nogil Numba kernels.

Numba's own `parallel=True` runtime launches its thread pool per call (~tens of µs to ms under load) and
fights the matmul threads; the spinning helpers of kernels_cpu.handoff with contiguous chunks avoid both
(a ThreadPoolExecutor is the fallback while another thread holds the helpers).
"""
from __future__ import annotations

import importlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from kernels_cpu._jit import get_threads
from kernels_cpu.handoff import run_split

_POOL: ThreadPoolExecutor | None = None


def _fast_prange() -> bool:
    """True when Numba's prange runs on a persistent OpenMP or TBB pool (a ~2 µs hand-off, no GIL): then the
    kernels split work with prange twins. Else (the workqueue layer starts threads per call) they use
    parallel_for's Python-level hand-off.

    Unless the user chose a layer (NUMBA_THREADING_LAYER), OpenMP is preferred where it loads: Numba's default
    order tries TBB first, whose idle worker does not pick up a 2-chunk loop in time for a ~50 µs decode
    matmul (no speed-up measured; OpenMP: 57 -> 31 µs)."""
    if "NUMBA_THREADING_LAYER" not in os.environ and str(numba.config.THREADING_LAYER) == "default":
        try:
            importlib.import_module("numba.np.ufunc.omppool")
            numba.config.THREADING_LAYER = "omp"
        except (ImportError, OSError):
            pass
    layer = str(numba.config.THREADING_LAYER)
    if layer == "workqueue":
        return False
    pools = {"omp": ["omppool"], "tbb": ["tbbpool"], "safe": ["tbbpool"]}.get(layer, ["tbbpool", "omppool"])
    for mod in pools:
        try:
            importlib.import_module(f"numba.np.ufunc.{mod}")
            return True
        except (ImportError, OSError):
            continue
    return False


FAST_PRANGE = _fast_prange()


def _after_fork_in_child() -> None:
    """GNU OpenMP terminates a forked child that launches a parallel region once the parent has used it,
    and the parent's worker threads do not exist in the child: there, use the Python-level hand-off."""
    global FAST_PRANGE, _POOL
    FAST_PRANGE = False
    _POOL = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def chunk_bounds(n_jobs: int, threads: int, cost: np.ndarray | None = None) -> list[int]:
    """threads + 1 increasing bounds over [0, n_jobs): equal job counts, or (cost: (n_jobs,) per-job work)
    equal shares of the total cost."""
    if cost is None:
        return [n_jobs * c // threads for c in range(threads + 1)]
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(cost, dtype=np.float64))])  # cum[j]: cost of jobs < j
    target = cum[-1] * np.arange(1, threads) / threads
    hi = np.minimum(np.searchsorted(cum, target, side="left"), n_jobs)  # first bound with cum >= target
    cuts = np.where(cum[hi] - target <= target - cum[np.maximum(hi - 1, 0)], hi, hi - 1)  # the nearer one
    return [0, *np.maximum(cuts, 0).tolist(), n_jobs]


_TEAM = threading.local()  # .size: the Numba team size last set from this launching thread
_EVEN: dict[tuple[int, int], np.ndarray] = {}  # (n_jobs, threads) -> equal-count prange bounds


def prange_bounds(n_jobs: int, threads: int, cost=None) -> np.ndarray | None:
    """int64 chunk bounds for a prange twin over `threads` chunks (see chunk_bounds), or None when prange
    twins are not in use (FAST_PRANGE false: use the Python-level hand-off). Numba's team size is per
    launching thread and defaults to every logical CPU: it is set to the kernels' thread count here, so
    hyper-thread siblings do not spin beside the working threads. Equal-count bounds are made once per shape
    (a decode step asks for the same few thousands of times)."""
    if not FAST_PRANGE:
        return None
    n = get_threads()
    if getattr(_TEAM, "size", None) != n:
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)
        _TEAM.size = n
    if cost is not None:
        return np.asarray(chunk_bounds(n_jobs, threads, cost), np.int64)
    b = _EVEN.get((n_jobs, threads))
    if b is None:
        if len(_EVEN) > 4096:
            _EVEN.clear()
        b = _EVEN[(n_jobs, threads)] = np.asarray(chunk_bounds(n_jobs, threads), np.int64)  # kernels only read it
    return b


def parallel_for(kernel, n_jobs: int, min_jobs_per_thread: int, scratch_fn, *args, cost=None, split=None) -> None:
    """Call kernel(*args, lo, hi, scratch) over contiguous chunks of [0, n_jobs); the caller's thread
    takes the first chunk. scratch_fn() makes one private scratch array per chunk (None: no scratch, kernels
    get None). cost: optional (n_jobs,) work per job (e.g. causal attention rows), to split by work instead
    of job count. split: optional prange twin split(*args, bounds[, scratches]) running
    kernel(*args, bounds[c], bounds[c+1], scratches[c]) for each chunk c, used when FAST_PRANGE."""
    global _POOL
    threads = max(1, min(get_threads(), n_jobs // max(1, min_jobs_per_thread)))
    scratch = scratch_fn or (lambda: None)
    if threads == 1:
        kernel(*args, 0, n_jobs, scratch())
        return
    bounds = prange_bounds(n_jobs, threads, cost) if split is not None else None
    if bounds is not None:
        split(*args, bounds, *(() if scratch_fn is None else (np.stack([scratch() for _ in range(threads)]),)))
        return
    if _POOL is None or _POOL._max_workers < threads - 1:
        _POOL = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="edgellm-par")
    bounds = chunk_bounds(n_jobs, threads, cost)
    if run_split(lambda lo, hi: kernel(*args, lo, hi, scratch()), bounds):
        return
    futs = [_POOL.submit(kernel, *args, bounds[c], bounds[c + 1], scratch()) for c in range(1, threads)]
    kernel(*args, bounds[0], bounds[1], scratch())
    for f in futs:
        f.result()
