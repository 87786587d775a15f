"""q8_0 K/V caches (llama.cpp's --cache-type-k/-v q8_0): the cache form, its quantizer and a NumPy reference.

Every (token, KV head) row of head_dim values is cut into ggml's q8_0 blocks of 32 along head_dim: one f16
scale d = amax / 127 and 32 int8 q = round(x / d) (quantize_row_q8_0_ref, bit-exact with gguf.quants Q8_0). The
bytes of a block are kept in two arrays with the row's leading axes, block / slot first:

    qs (NB, BS, KVH, hd) int8          the 32 q of each block, in order
    d  (NB, BS, KVH, hd // 32) int16   the block scales as f16 bits

1.0625 bytes per value (f16: 2). The attention kernels (kernels_cpu/attention.py, attention_ir.py) read the
blocks in place: an element is d * q, exact in float32, and every sum runs over those values in the order the
F32 cache uses, so a q8_0 cache gives what an F32 cache of its dequantized values gives, bit for bit.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kernels_cpu.quantize import _q8_0

QK8_0 = 32  # values per block


class Q8Cache(NamedTuple):
    """One q8_0 K or V cache (or its rows): qs (..., hd) int8 and d (..., hd // 32) int16 f16-bit scales."""

    qs: np.ndarray
    d: np.ndarray

    @property
    def shape(self) -> tuple:
        """The shape of the values: qs's."""
        return self.qs.shape

    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """(qs, d) as flat C-order arrays (views when contiguous), the form the kernels take; shapes checked."""
        hd = self.qs.shape[-1]
        if self.qs.dtype != np.int8 or self.d.dtype != np.int16 or hd % QK8_0 or \
                self.d.shape != self.qs.shape[:-1] + (hd // QK8_0,):
            raise ValueError(f"q8_0 cache: qs {self.qs.dtype}{self.qs.shape} and d {self.d.dtype}{self.d.shape} "
                             f"do not make blocks of {QK8_0}")
        return np.ascontiguousarray(self.qs).reshape(-1), np.ascontiguousarray(self.d).reshape(-1)


def quantize_q8_0(x: np.ndarray) -> Q8Cache:
    """float32 (..., hd) with hd % 32 == 0 -> its q8_0 blocks along the last axis (quantize_row_q8_0_ref)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % QK8_0:
        raise ValueError(f"q8_0 needs rows of a multiple of {QK8_0} values, got {x.shape[-1]}")
    blocks = x.reshape(-1, QK8_0)
    d = np.empty(len(blocks), np.float32)  # amax / 127, before its f16 rounding (q uses the unrounded one)
    qs = np.empty(blocks.shape, np.int8)
    _q8_0(blocks, d, qs)
    return Q8Cache(qs.reshape(x.shape), d.astype(np.float16).view(np.int16).reshape(x.shape[:-1] + (-1,)))


def dequantize_q8_0(c: Q8Cache) -> np.ndarray:
    """NumPy reference: the float32 values d * q of q8_0 blocks, shape c.qs.shape."""
    d = c.d.view(np.float16).astype(np.float32)
    return (c.qs.reshape(*d.shape, QK8_0).astype(np.float32) * d[..., None]).reshape(c.qs.shape)
