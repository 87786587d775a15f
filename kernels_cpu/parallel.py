"""The one owner of the kernels' threads: how many (set_threads, chosen once and explicitly by LLM(threads=...)
or the first kernel call: physical cores), how a range of jobs is split over them (chunk_bounds,
prange_bounds) and how a split runs (run_chunks, parallel_for).

A split runs as a prange twin on Numba's team when its threading layer keeps a persistent pool (OpenMP or TBB:
a ~2 µs hand-off, FAST_PRANGE), else through the spinning helpers of kernels_cpu.handoff (Numba's workqueue
layer starts threads per call: tens of µs to ms under load), else, while another thread holds the helpers,
on a ThreadPoolExecutor. The layer is chosen when the thread count is first set, before Numba starts a team.
"""
from __future__ import annotations

import importlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from kernels_cpu._jit import jit, physical_cores
from kernels_cpu.handoff import run_split

_POOL: ThreadPoolExecutor | None = None  # the fallback executor (threads - 1 workers)
_COUNT: int | None = None  # kernel threads; None until set_threads (explicit, or by the first get_threads)
FAST_PRANGE = False  # prange twins split the work (decided with the first set_threads)
_TEAM = threading.local()  # .size: the Numba team size last set from this launching thread


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


def _layer_in_use() -> str | None:
    """Numba's threading layer if a team has started already (it can no longer be chosen), else None."""
    try:
        return str(numba.threading_layer())
    except ValueError:
        return None


def set_threads(n: int | None = None) -> int:
    """Set the number of threads the kernels use (default: physical cores, capped by Numba's maximum); the
    first call also chooses how splits run (FAST_PRANGE). Sets Numba's team size for the calling thread (other
    launching threads get it in prange_bounds). Returns the number set."""
    global _COUNT, FAST_PRANGE
    n = max(1, min(int(physical_cores() if n is None else n), numba.config.NUMBA_NUM_THREADS))
    if _COUNT is None:
        layer = _layer_in_use()
        FAST_PRANGE = _fast_prange() if layer is None else layer in ("omp", "tbb")
    numba.set_num_threads(n)
    _TEAM.size = n
    _COUNT = n
    return n


def get_threads() -> int:
    """Threads the kernels use (set_threads' default the first time, if nothing set them)."""
    return set_threads() if _COUNT is None else _COUNT


def fast_prange() -> bool:
    """Whether splits run as prange twins (see the module docstring)."""
    get_threads()
    return FAST_PRANGE


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
    return _cost_bounds(np.asarray(cost, dtype=np.float64), threads).tolist()


@jit
def _cost_bounds(cost, threads):
    # (threads + 1,) int64 bounds splitting jobs of cost (n,) float64 into equal shares: per share c the cut at
    # the prefix sum nearest to total * c / threads (the lower one on a tie). One pass: a decode step's
    # attention asks for this per layer (NumPy's cumsum / searchsorted / where took ~12 us a call)
    n = cost.shape[0]
    cum = np.empty(n + 1, np.float64)  # cum[j]: cost of jobs < j
    cum[0] = 0.0
    for j in range(n):
        cum[j + 1] = cum[j] + cost[j]
    out = np.empty(threads + 1, np.int64)
    out[0], out[threads] = 0, n
    hi = 0
    for c in range(1, threads):
        target = cum[n] * c / threads
        while hi < n + 1 and cum[hi] < target:  # first bound with cum >= target (targets increase)
            hi += 1
        hi = min(hi, n)
        out[c] = max(hi if cum[hi] - target <= target - cum[max(hi - 1, 0)] else hi - 1, 0)
    return out


_EVEN: dict[tuple[int, int], np.ndarray] = {}  # (n_jobs, threads) -> equal-count prange bounds


def prange_team() -> int | None:
    """The kernels' thread count, with Numba's team of the calling thread set to it, when splits run as prange
    twins (FAST_PRANGE); else None. Numba's team size is per launching thread and defaults to every logical CPU:
    set here, hyper-thread siblings do not spin beside the working threads."""
    if not fast_prange():
        return None
    n = get_threads()
    if getattr(_TEAM, "size", None) != n:
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)
        _TEAM.size = n
    return n


def prange_bounds(n_jobs: int, threads: int, cost=None) -> np.ndarray | None:
    """int64 chunk bounds for a prange twin over `threads` chunks (see chunk_bounds), or None when prange
    twins are not in use (FAST_PRANGE false: use the Python-level hand-off); sets the team (prange_team).
    Equal-count bounds are made once per shape (a decode step asks for the same few thousands of times)."""
    if prange_team() is None:
        return None
    if cost is not None:
        return _cost_bounds(np.asarray(cost, dtype=np.float64), threads)
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
    threads = max(1, min(get_threads(), n_jobs // max(1, min_jobs_per_thread)))
    scratch = scratch_fn or (lambda: None)
    if threads == 1:
        kernel(*args, 0, n_jobs, scratch())
        return
    bounds = prange_bounds(n_jobs, threads, cost) if split is not None else None
    if bounds is not None:
        split(*args, bounds, *(() if scratch_fn is None else (np.stack([scratch() for _ in range(threads)]),)))
        return
    run_chunks(lambda lo, hi: kernel(*args, lo, hi, scratch()), chunk_bounds(n_jobs, threads, cost))


def run_chunks(fn, bounds: list[int], *args) -> None:
    """fn(*args, bounds[c], bounds[c+1]) for each chunk c, chunk 0 on the calling thread: on the hand-off
    helpers, or on the fallback executor while another thread holds them."""
    global _POOL
    if run_split(fn, bounds, *args):
        return
    workers = len(bounds) - 2
    if _POOL is None or _POOL._max_workers < workers:
        _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edgellm-par")
    futs = [_POOL.submit(fn, *args, bounds[c], bounds[c + 1]) for c in range(1, workers + 1)]
    fn(*args, bounds[0], bounds[1])
    for f in futs:
        f.result()
