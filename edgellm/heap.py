"""The process heap (glibc malloc) as a forward pass needs it: freed buffers kept for the next pass, and handed back
to the OS once after loading. A no-op where the C library is not glibc.

A forward pass allocates and frees the same few large arrays every layer (a 512-row prefill of a 1B model: the
(512, 8192) gate / up / product of the FFN, 16 MB each). glibc serves requests above its mmap threshold
(dynamic: 128 KiB up to the largest block freed so far) with fresh mmaps and trims the heap's free top past
twice that, so each pass touched ~100 MB of new pages: ~26,000 page faults per 512-row prefill of llama-1b, whose
zeroing cost ~0.2-0.8 s of system time (first touch of guest memory on a VM is slow: ~8-50 us a page, measured
on an Intel KVM guest). Fixed thresholds keep those buffers in the heap, reused pass after pass, as llama.cpp
reuses its compute buffer.
"""
from __future__ import annotations

import ctypes
import functools
import gc
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # blocks from 32 MiB up still get their own mapping (glibc's largest allowed threshold)
TRIM_THRESHOLD = 1 << 30  # free heap top kept up to 1 GiB: the next pass reuses it (trim() hands it back on demand)


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc's handle (opened once), or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_buffers() -> bool:
    """Make glibc keep freed blocks below 32 MiB in the heap for reuse (process-wide; idempotent). True if set."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                        TRIM_THRESHOLD))


def trim() -> None:
    """Collect garbage and give the heap's free memory back to the OS (after loading: the loader's and the
    tokenizer builder's temporary buffers)."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
