"""The one place that sets Numba options for the CPU kernels, and the host facts they are built for (the thread
count is kernels_cpu.parallel's).

Every kernel is compiled with `cache=True` (compiled code is reused across processes), `nogil=True` (a
running kernel releases the GIL) and `error_model="numpy"` (a float division by zero gives inf / NaN: the
Python model's check per division kept element-wise loops scalar, swiglu 24 -> 3 us a row). `fastmath` is only
used where a kernel's result must not depend on it: the quantized matmul kernels spell their float arithmetic
out in LLVM IR (fixed order, explicit FMA), so their results are the same for every batch size.
"""
from __future__ import annotations

import functools
import os
import platform

import numba as nb

# Options for serial kernels and for kernels with a prange loop.
JIT_OPTIONS = dict(cache=True, nogil=True, error_model="numpy")
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


# Forced instruction sets (EDGELLM_ISA): the LLVM CPU and the feature names the kernels then see. Each tells
# Numba's code generator the same target, so a forced path is compiled as it would be on such a host (no AVX-512
# register or instruction leaks into an "avx2" build) and is cached separately.
_X86_V3 = frozenset({"sse2", "sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi",
                     "bmi2", "lzcnt", "movbe"})
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
X86_ISAS: dict[str, tuple[str, frozenset[str]]] = {
    "avx2": ("x86-64-v3", _X86_V3),                        # AMD Zen 2/3, Intel before Alder Lake
    "avx2-vnni": ("x86-64-v3", _X86_V3 | {"avxvnni"}),     # Intel Alder Lake and later client chips
    "avx512": ("x86-64-v4", _X86_V4),
    "avx512-vnni": ("x86-64-v4", _X86_V4 | {"avx512vnni"}),
    # the target-independent IR forms, on SSE4.2 + F16C: without F16C LLVM turns half conversions into runtime
    # library calls that Numba's JIT does not link
    "portable": ("x86-64-v2", frozenset({"sse2", "sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "f16c"})),
}
# AArch64: NEON is in every core (LLVM's generic CPU has it); "neon" in the kernels' features selects the NEON
# bodies, "dotprod" their sdot form (Cortex-A76 / Raspberry Pi 5; the A72 of a Pi 4 has none).
ARM_ISAS: dict[str, tuple[str, frozenset[str]]] = {
    "neon": ("generic", frozenset({"fp-armv8", "neon"})),
    "neon-dotprod": ("generic", frozenset({"fp-armv8", "neon", "dotprod"})),
    "portable": ("generic", frozenset({"fp-armv8"})),  # the target-independent IR forms (LLVM still has NEON)
}
ARM = platform.machine().lower() in ("aarch64", "arm64")
FORCED_ISAS = ARM_ISAS if ARM else X86_ISAS


def cpu_features() -> frozenset[str]:
    """LLVM feature names this CPU has (whatever EDGELLM_ISA forces). On Linux aarch64 the kernel's hardware
    capabilities (see hwcap.py) with what LLVM's own detection finds."""
    import llvmlite.binding as ll

    found = frozenset(k for k, v in ll.get_host_cpu_features().items() if v)
    if ARM:
        from .hwcap import arm_features

        found |= arm_features()
    return found


def _set_target(cpu: str, feats: frozenset[str]) -> None:
    nb.config.CPU_NAME = cpu
    nb.config.CPU_FEATURES = ",".join(f"+{f}" for f in sorted(feats))


def _force_isa() -> frozenset[str] | None:
    """Apply EDGELLM_ISA (one of FORCED_ISAS) to Numba's target before anything is compiled; the features the
    kernels use, or None when the host's own are used. A forced set must be one the host can run. On aarch64
    the host's own features are told to LLVM too (its detection reads /proc/cpuinfo, which under emulation is
    the emulating host's), unless NUMBA_CPU_NAME chooses a target."""
    name = os.environ.get("EDGELLM_ISA", "").strip().lower()
    if not name or name == "native":
        if ARM and not os.environ.get("NUMBA_CPU_NAME"):
            feats = cpu_features()
            _set_target("generic", feats)
            return feats
        return None
    if name not in FORCED_ISAS:
        raise ValueError(f"EDGELLM_ISA={name!r}: expected one of native, {', '.join(FORCED_ISAS)}")
    cpu, feats = FORCED_ISAS[name]
    missing = sorted(feats - cpu_features())
    if missing:
        raise ValueError(f"EDGELLM_ISA={name}: this CPU lacks {', '.join(missing)}")
    _set_target(cpu, feats)
    return frozenset(feats)


_host_features: frozenset[str] | None = _force_isa()


def host_features() -> frozenset[str]:
    """LLVM feature names the kernels are built for (e.g. 'avx512bw', 'avx512vnni', 'f16c'; 'neon', 'dotprod'):
    the host CPU's, or the set forced by EDGELLM_ISA."""
    global _host_features
    if _host_features is None:
        _host_features = cpu_features()
    return _host_features
