"""parallel_for: split a range of independent jobs over worker threads running nogil Numba kernels.

Numba's own `parallel=True` runtime launches its thread pool per call (~tens of µs to ms under load) and
fights the matmul threads; the spinning helpers of kernels_cpu.handoff with contiguous chunks avoid both
(a ThreadPoolExecutor is the fallback while another thread holds the helpers).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from kernels_cpu._jit import get_threads
from kernels_cpu.handoff import run_split

_POOL: ThreadPoolExecutor | None = None


def parallel_for(kernel, n_jobs: int, min_jobs_per_thread: int, scratch_fn, *args) -> None:
    """Call kernel(*args, lo, hi, scratch) over contiguous chunks of [0, n_jobs); the caller's thread
    takes the first chunk. scratch_fn() makes one private scratch buffer per chunk."""
    global _POOL
    threads = max(1, min(get_threads(), n_jobs // max(1, min_jobs_per_thread)))
    if threads == 1:
        kernel(*args, 0, n_jobs, scratch_fn())
        return
    if _POOL is None or _POOL._max_workers < threads - 1:
        _POOL = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="edgellm-par")
    bounds = [n_jobs * c // threads for c in range(threads + 1)]
    if run_split(lambda lo, hi: kernel(*args, lo, hi, scratch_fn()), bounds):
        return
    futs = [_POOL.submit(kernel, *args, bounds[c], bounds[c + 1], scratch_fn()) for c in range(1, threads)]
    kernel(*args, bounds[0], bounds[1], scratch_fn())
    for f in futs:
        f.result()
