"""The CPU features of a Linux aarch64 host, as the kernel states them: getauxval(AT_HWCAP / AT_HWCAP2), or
/proc/self/auxv where libc cannot be called. Not /proc/cpuinfo: under qemu-user it is the emulating host's
(an x86 file), and it is what LLVM's host detection reads, so llvmlite sees a 'generic' CPU with no features.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import struct

AT_HWCAP, AT_HWCAP2 = 16, 26

# (auxv entry, bit) -> LLVM AArch64 feature name (arch/arm64/include/uapi/asm/hwcap.h)
HWCAP_BITS: dict[tuple[int, int], str] = {
    (AT_HWCAP, 0): "fp-armv8",     # HWCAP_FP
    (AT_HWCAP, 1): "neon",         # HWCAP_ASIMD
    (AT_HWCAP, 4): "aes",          # HWCAP_PMULL (LLVM folds pmull into aes)
    (AT_HWCAP, 7): "crc",          # HWCAP_CRC32
    (AT_HWCAP, 8): "lse",          # HWCAP_ATOMICS
    (AT_HWCAP, 10): "fullfp16",    # HWCAP_ASIMDHP
    (AT_HWCAP, 12): "rdm",         # HWCAP_ASIMDRDM
    (AT_HWCAP, 20): "dotprod",     # HWCAP_ASIMDDP: sdot / udot
    (AT_HWCAP, 22): "sve",         # HWCAP_SVE
    (AT_HWCAP, 23): "fp16fml",     # HWCAP_ASIMDFHM
    (AT_HWCAP2, 1): "sve2",        # HWCAP2_SVE2
    (AT_HWCAP2, 13): "i8mm",       # HWCAP2_I8MM: smmla / usdot
    (AT_HWCAP2, 14): "bf16",       # HWCAP2_BF16
}


def _getauxval() -> dict[int, int] | None:
    """{AT_HWCAP: bits, AT_HWCAP2: bits} from libc's getauxval, or None when libc has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.getauxval
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    return {t: int(fn(t)) for t in (AT_HWCAP, AT_HWCAP2)}


def _auxv_file(path: str = "/proc/self/auxv") -> dict[int, int] | None:
    """The same entries read from the auxiliary vector file (pairs of native unsigned longs)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    n = len(data) // 16
    words = struct.unpack(f"<{2 * n}Q", data[:16 * n])
    vec = dict(zip(words[0::2], words[1::2]))
    return {t: vec.get(t, 0) for t in (AT_HWCAP, AT_HWCAP2)}


def features_from_auxv(aux: dict[int, int]) -> frozenset[str]:
    """LLVM feature names of the bits set in aux ({AT_HWCAP: bits, AT_HWCAP2: bits})."""
    return frozenset(name for (t, bit), name in HWCAP_BITS.items() if aux.get(t, 0) >> bit & 1)


def arm_features() -> frozenset[str]:
    """LLVM feature names of this aarch64 CPU from the kernel's auxiliary vector (empty when unreadable)."""
    aux = _getauxval() or _auxv_file()
    return features_from_auxv(aux) if aux else frozenset()
