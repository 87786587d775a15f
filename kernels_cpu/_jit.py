"""The one place that sets Numba options for the CPU kernels, and the thread count.

Every kernel is compiled with `cache=True` (compiled code is reused across processes) and `nogil=True` (a
running kernel releases the GIL). `fastmath` is only used where a kernel's result must not depend on it:
the quantized matmul kernels spell their float arithmetic out in LLVM IR (fixed order, explicit FMA), so
their results are the same for every batch size.
"""
from __future__ import annotations

import functools
import os

import numba as nb

# Options for serial kernels and for kernels with a prange loop.
JIT_OPTIONS = dict(cache=True, nogil=True)
FAST_OPTIONS = dict(JIT_OPTIONS, fastmath=True)
PARALLEL_OPTIONS = dict(JIT_OPTIONS, parallel=True)

jit = functools.partial(nb.njit, **JIT_OPTIONS)
fast_jit = functools.partial(nb.njit, **FAST_OPTIONS)
parallel_jit = functools.partial(nb.njit, **PARALLEL_OPTIONS)


def physical_cores() -> int:
    """Number of physical cores (hyper-threads share one core's SIMD units, so they do not help here)."""
    try:
        import psutil  # optional

        n = psutil.cpu_count(logical=False)
        if n:
            return int(n)
    except Exception:  # pragma: no cover - psutil missing or failing
        pass
    n = _cores_from_proc()
    return n or (os.cpu_count() or 1)


def _cores_from_proc() -> int:
    """Count distinct (physical id, core id) pairs in /proc/cpuinfo (Linux); 0 when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return 0
    cores, phys = set(), "0"
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = val.strip()
        elif key == "core id":
            cores.add((phys, val.strip()))
    return len(cores)


_threads = 1


def set_threads(n: int | None = None) -> int:
    """Set the number of threads the kernels use (default: physical cores, capped by Numba's maximum).

    Process-wide for the matmul kernels (their own thread split); also sets Numba's prange thread count
    for the calling thread. Returns the number set."""
    global _threads
    if n is None:
        n = physical_cores()
    n = max(1, min(int(n), nb.config.NUMBA_NUM_THREADS))
    nb.set_num_threads(n)
    _threads = n
    return n


def get_threads() -> int:
    """Threads the matmul kernels use."""
    return _threads


_host_features: frozenset[str] | None = None


def host_features() -> frozenset[str]:
    """LLVM feature names of the host CPU that are enabled (e.g. 'avx512bw', 'avx512vnni', 'f16c')."""
    global _host_features
    if _host_features is None:
        import llvmlite.binding as ll

        feats = ll.get_host_cpu_features()
        _host_features = frozenset(k for k, v in feats.items() if v)
    return _host_features
