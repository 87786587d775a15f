"""NumPy reference (de)quantization of GGUF block formats: the spec the Numba kernels are tested against.

Every format is a pair of plain functions on whole blocks, registered in two dicts keyed by `QuantType`:

    _DEQUANT[qtype]: (n_blocks, type_size) uint8   -> (n_blocks, block_size) float32
    _QUANT[qtype]:   (n_blocks, block_size) float32 -> (n_blocks, type_size) uint8

The arithmetic (operation order, float32 intermediates, rounding) follows llama.cpp's `ggml-quants.c` and is
bit-exact with `gguf.quants` (gguf-py); tests/test_quant_formats.py checks this on random blocks.

Byte layouts (little endian, f16 = IEEE half, one block):
    Q4_0  d:f16 | qs[16]                    x[j] = d*(lo(qs[j])-8), x[j+16] = d*(hi(qs[j])-8)
    Q4_1  d:f16 m:f16 | qs[16]              x = d*q + m
    Q5_0  d:f16 | qh:u32 | qs[16]           q = nibble | bit j of qh << 4;  x = d*(q-16)
    Q5_1  d:f16 m:f16 | qh:u32 | qs[16]     x = d*q + m
    Q8_0  d:f16 | qs:i8[32]                 x = d*q
    Q2_K  scales[16] | qs[64] | d dmin      x = d*(sc&15)*q - dmin*(sc>>4), 16 sub-blocks of 16
    Q3_K  hmask[32] | qs[64] | scales[12] | d         x = d*(sc-32)*(q2 - 4*!hbit)
    Q4_K  d dmin | scales[12] | qs[128]               x = d*sc*q - dmin*m, 8 sub-blocks of 32
    Q5_K  d dmin | scales[12] | qh[32] | qs[128]
    Q6_K  ql[128] | qh[64] | scales:i8[16] | d        x = d*sc*(q-32)
    Q8_K  d:f32 | qs:i8[256] | bsums:i16[16]          x = d*q
    IQ4_NL, IQ4_XS, MXFP4: see quant/iquants.py
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from quant.errors import QuantTypeError
from quant.iquants import IQUANTS as _IQUANTS
from quant.kquants import KQUANTS as _KQUANTS
from quant.types import FORMATS, QK_K, QuantType

__all__ = [
    "dequantize",
    "dequantize_rows",
    "quantize",
    "k_scale_min",
    "q3_k_scales",
    "supported_dequant_types",
    "supported_quant_types",
]

# Blocks processed per chunk: bounds the temporaries (~10x the output) for big tensors.
_CHUNK_BLOCKS = 1 << 16

_NIBBLE_SHIFT = np.array([0, 4], dtype=np.uint8)  # low nibble first, then high nibble
_CRUMB_SHIFT = np.array([0, 2, 4, 6], dtype=np.uint8)  # 2-bit fields, lowest first
_BIT_SHIFT = np.arange(8, dtype=np.uint8)  # single bits, lowest first


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def dequantize(data: np.ndarray, qtype: QuantType | int, n_elements: int | None = None) -> np.ndarray:
    """Dequantize GGUF blocks to float32.

    data: uint8 array (..., n_bytes) whose last axis holds whole blocks of `qtype`.
    n_elements: if given, the expected length of the output's last axis (checked, ValueError if different).
    Returns float32 (..., n_bytes // type_size * block_size).
    Raises QuantTypeError for a type without a reference dequantizer, ValueError for a byte length
    that is not a whole number of blocks.
    """
    qtype = _as_qtype(qtype)
    fn = _DEQUANT.get(qtype)
    if fn is None:
        raise QuantTypeError(f"no dequantizer for quant type {qtype.name} ({int(qtype)})")
    fmt = FORMATS[qtype]
    data = _as_bytes(data)
    n_bytes = data.shape[-1]
    if n_bytes % fmt.type_size:
        raise ValueError(f"{qtype.name}: {n_bytes} bytes per row is not a multiple of the block size "
                         f"{fmt.type_size} bytes")
    k = n_bytes // fmt.type_size * fmt.block_size
    if n_elements is not None and n_elements != k:
        raise ValueError(f"{qtype.name}: {n_bytes} bytes hold {k} elements, expected {n_elements}")
    blocks = data.reshape(-1, fmt.type_size)  # (n_blocks, type_size)
    out = np.empty((blocks.shape[0], fmt.block_size), dtype=np.float32)  # (n_blocks, block_size)
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN scales give inf/NaN silently, as in C
        for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            stop = start + _CHUNK_BLOCKS
            out[start:stop] = fn(blocks[start:stop])
    return out.reshape(*data.shape[:-1], k)


def dequantize_rows(raw2d: np.ndarray, qtype: QuantType | int, rows: np.ndarray) -> np.ndarray:
    """Dequantize selected rows of a 2-D quantized matrix (e.g. an embedding lookup).

    raw2d: uint8 (n_rows, row_bytes); rows: int array (n,) of row indices (negative indices count from the end).
    Returns float32 (n, K) with K = row_bytes // type_size * block_size.
    """
    raw2d = _as_bytes(raw2d)
    if raw2d.ndim != 2:
        raise ValueError(f"raw2d must be 2-D (n_rows, row_bytes), got shape {raw2d.shape}")
    rows = np.asarray(rows)
    if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"rows must be a 1-D integer array, got {rows.dtype} {rows.shape}")
    return dequantize(raw2d[rows], qtype)  # (n, K)


def quantize(x: np.ndarray, qtype: QuantType | int) -> np.ndarray:
    """Quantize float32 rows to GGUF blocks, bit-exact with `gguf.quants.quantize` (as bytes).

    x: float array (..., K) (converted to float32 first), K a multiple of the block size.
    Returns uint8 (..., K // block_size * type_size).
    Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and Q2_K..Q6_K (bit-exact with llama.cpp's
    `quantize_row_qN_K_ref`, quant/kquants.py); QuantTypeError otherwise.
    """
    qtype = _as_qtype(qtype)
    fn = _QUANT.get(qtype)
    if fn is None:
        raise QuantTypeError(f"no reference quantizer for quant type {qtype.name} ({int(qtype)})")
    fmt = FORMATS[qtype]
    x = np.asarray(x).astype(np.float32, copy=False)
    if x.ndim == 0:
        raise ValueError("quantize needs at least one axis")
    k = x.shape[-1]
    if k % fmt.block_size:
        raise ValueError(f"{qtype.name}: row of {k} elements is not a multiple of the block size {fmt.block_size}")
    blocks = x.reshape(-1, fmt.block_size)  # (n_blocks, block_size)
    out = np.empty((blocks.shape[0], fmt.type_size), dtype=np.uint8)  # (n_blocks, type_size)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        out[start:stop] = fn(blocks[start:stop])
    return out.reshape(*x.shape[:-1], k // fmt.block_size * fmt.type_size)


def supported_dequant_types() -> frozenset[QuantType]:
    """Types `dequantize` handles."""
    return frozenset(_DEQUANT)


def supported_quant_types() -> frozenset[QuantType]:
    """Types `quantize` handles."""
    return frozenset(_QUANT)


# ----------------------------------------------------------------------------------------------------------------
# Unpack helpers (shared with the kernel tests)
# ----------------------------------------------------------------------------------------------------------------


def k_scale_min(scales12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte 6-bit scales of Q4_K / Q5_K.

    scales12: uint8 (..., 12). Returns (sc, m), each uint8 (..., 8) in 0..63, one per 32-element sub-block.
    Layout (bytes 0-3 / 4-7 / 8-11 as rows; upper-case = high 2 bits, lower-case = low bits):
        j < 4:  sc[j] = b[j] & 63,                          m[j] = b[j+4] & 63
        j >= 4: sc[j] = (b[j+4] & 15) | (b[j-4] >> 6) << 4,  m[j] = (b[j+4] >> 4) | (b[j] >> 6) << 4
    """
    b = np.asarray(scales12, dtype=np.uint8)
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]  # each (..., 4)
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)  # (..., 8)
    m = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)  # (..., 8)
    return sc, m


def q3_k_scales(scales12: np.ndarray) -> np.ndarray:
    """Unpack the 12-byte 6-bit scales of Q3_K to signed int8 (..., 16) in -32..31 (one per 16 elements).

    Low 4 bits: scale i < 8 in the low nibble of byte i, scale i >= 8 in the high nibble of byte i-8.
    High 2 bits: scale i in bits 2*(i // 4) .. of byte 8 + i % 4.
    """
    b = np.asarray(scales12, dtype=np.uint8)
    low = (b[..., :8, None] >> _NIBBLE_SHIFT) & 0x0F  # (..., 8, 2): [byte, nibble]
    low = np.swapaxes(low, -1, -2).reshape(*b.shape[:-1], 16)  # (..., 16): nibble-major
    high = (b[..., 8:12, None] >> _CRUMB_SHIFT) & 0x03  # (..., 4, 4): [byte, shift]
    high = np.swapaxes(high, -1, -2).reshape(*b.shape[:-1], 16)  # (..., 16): shift-major
    return ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.int8)


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 -> (n, 1) float32 from little-endian f16."""
    with np.errstate(invalid="ignore"):  # NaN bits: AArch64 flags signalling NaNs as invalid (x86 does not)
        return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """(n, B) uint8 -> (n, 2*B) uint8: each run of `group` bytes gives `group` low nibbles then `group` high."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> _NIBBLE_SHIFT[:, None]  # (n, B/group, 2, group)
    return (q & 0x0F).reshape(n, -1)


def _crumbs(qs: np.ndarray, group: int) -> np.ndarray:
    """(n, B) uint8 -> (n, 4*B) uint8 of 2-bit fields: per run of `group` bytes, bits 0-1 of all, then 2-3, ..."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> _CRUMB_SHIFT[:, None]  # (n, B/group, 4, group)
    return (q & 0x03).reshape(n, -1)


def _bits(qh: np.ndarray) -> np.ndarray:
    """(n, B) uint8 -> (n, 8*B) uint8 in {0,1}: bit 0 of every byte, then bit 1 of every byte, ..."""
    n = qh.shape[0]
    q = qh.reshape(n, 1, -1) >> _BIT_SHIFT[:, None]  # (n, 8, B)
    return (q & 0x01).reshape(n, -1)


# ----------------------------------------------------------------------------------------------------------------
# Dequantizers: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32
# ----------------------------------------------------------------------------------------------------------------


def _deq_f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f4").astype(np.float32)


def _deq_f16(b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # NaN bits: AArch64 flags signalling NaNs as invalid (x86 does not)
        return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _deq_bf16(b: np.ndarray) -> np.ndarray:
    hi = np.ascontiguousarray(b).view("<u2").astype(np.uint32)  # (n, 1)
    return (hi << 16).view(np.float32)


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])  # (n, 1)
    q = _nibbles(b[:, 2:18], 16).astype(np.int8) - np.int8(8)  # (n, 32) in -8..7
    return d * q.astype(np.float32)


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (n, 1) each
    q = _nibbles(b[:, 4:20], 16).astype(np.float32)  # (n, 32) in 0..15
    return d * q + m


def _q5_quants(qh4: np.ndarray, qs16: np.ndarray) -> np.ndarray:
    """qh (n, 4) + qs (n, 16) -> 5-bit quants (n, 32) uint8; bit j of the little-endian u32 qh is element j's bit 4."""
    n = qh4.shape[0]
    high = ((qh4[:, :, None] >> _BIT_SHIFT) & 0x01).reshape(n, 32)  # (n, 32): byte-major = element order
    return _nibbles(qs16, 16) | (high << 4)


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])  # (n, 1)
    q = _q5_quants(b[:, 2:6], b[:, 6:22]).astype(np.int8) - np.int8(16)  # (n, 32) in -16..15
    return d * q.astype(np.float32)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (n, 1) each
    q = _q5_quants(b[:, 4:8], b[:, 8:24]).astype(np.float32)  # (n, 32) in 0..31
    return d * q + m


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])  # (n, 1)
    q = b[:, 2:34].view(np.int8).astype(np.float32)  # (n, 32)
    return q * d


def _deq_q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    scales = b[:, 0:16]  # (n, 16): low nibble scale, high nibble min, per 16 elements
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])  # (n, 1) each
    dl = (d * (scales & 0x0F).astype(np.float32))[:, :, None]  # (n, 16, 1)
    ml = (dmin * (scales >> 4).astype(np.float32))[:, :, None]  # (n, 16, 1)
    q = _crumbs(b[:, 16:80], 32).reshape(n, 16, 16).astype(np.float32)  # (n, 16 sub-blocks, 16)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 108:110])  # (n, 1)
    dl = (d * q3_k_scales(b[:, 96:108]).astype(np.float32))[:, :, None]  # (n, 16, 1)
    low = _crumbs(b[:, 32:96], 32)  # (n, 256) in 0..3
    hbit = _bits(b[:, 0:32])  # (n, 256): bit set means no -4 offset
    q = low.astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)  # (n, 256) in -4..3
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (n, 1) each
    sc, m = k_scale_min(b[:, 4:16])  # (n, 8) each
    dl = (d * sc.astype(np.float32))[:, :, None]  # (n, 8, 1)
    ml = (dmin * m.astype(np.float32))[:, :, None]  # (n, 8, 1)
    q = _nibbles(b[:, 16:144], 32).reshape(n, 8, 32).astype(np.float32)  # (n, 8 sub-blocks, 32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (n, 1) each
    sc, m = k_scale_min(b[:, 4:16])  # (n, 8) each
    dl = (d * sc.astype(np.float32))[:, :, None]  # (n, 8, 1)
    ml = (dmin * m.astype(np.float32))[:, :, None]  # (n, 8, 1)
    q = _nibbles(b[:, 48:176], 32) | (_bits(b[:, 16:48]) << 4)  # (n, 256) in 0..31
    return (dl * q.reshape(n, 8, 32).astype(np.float32) - ml).reshape(n, QK_K)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 208:210])  # (n, 1)
    dl = (d * b[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]  # (n, 16, 1)
    low = _nibbles(b[:, 0:128], 64)  # (n, 256) in 0..15
    high = _crumbs(b[:, 128:192], 32)  # (n, 256) in 0..3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)  # (n, 256) in -32..31
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _deq_q8_k(b: np.ndarray) -> np.ndarray:
    d = np.ascontiguousarray(b[:, 0:4]).view("<f4").astype(np.float32)  # (n, 1)
    q = b[:, 4:4 + QK_K].view(np.int8).astype(np.float32)  # (n, 256); the bsums are not needed
    return d * q


_DEQUANT: dict[QuantType, Callable[[np.ndarray], np.ndarray]] = {
    QuantType.F32: _deq_f32,
    QuantType.F16: _deq_f16,
    QuantType.BF16: _deq_bf16,
    QuantType.Q4_0: _deq_q4_0,
    QuantType.Q4_1: _deq_q4_1,
    QuantType.Q5_0: _deq_q5_0,
    QuantType.Q5_1: _deq_q5_1,
    QuantType.Q8_0: _deq_q8_0,
    QuantType.Q2_K: _deq_q2_k,
    QuantType.Q3_K: _deq_q3_k,
    QuantType.Q4_K: _deq_q4_k,
    QuantType.Q5_K: _deq_q5_k,
    QuantType.Q6_K: _deq_q6_k,
    QuantType.Q8_K: _deq_q8_k,
}
# IQ4_NL, IQ4_XS, MXFP4: quant/iquants.py
_DEQUANT.update({QuantType(t): deq for t, (_, _, deq, _) in _IQUANTS.items()})


# ----------------------------------------------------------------------------------------------------------------
# Quantizers: (n_blocks, block_size) float32 -> (n_blocks, type_size) uint8
# ----------------------------------------------------------------------------------------------------------------


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """(n, 1) float32 -> (n, 2) uint8, little-endian f16 (round to nearest even)."""
    with np.errstate(invalid="ignore"):  # NaN stays NaN; AArch64 flags signalling NaNs as invalid
        return v.astype("<f2").view(np.uint8)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d in float32, with 0 where d == 0 (ggml: `id = d ? 1.0f/d : 0.0f`)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _trunc_u8(v: np.ndarray, qmax: int) -> np.ndarray:
    """C's `MIN(qmax, (int8_t)(v))` for v >= 0: truncate toward zero, clamp to 0..qmax, as uint8."""
    return np.clip(np.trunc(v), 0, qmax).astype(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) uint8 -> (n, 16): element j in the low nibble of byte j, element j+16 in the high nibble."""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _pack_qh(q: np.ndarray) -> np.ndarray:
    """(n, 32) 5-bit quants -> (n, 4) bytes of the little-endian u32 whose bit j is bit 4 of element j."""
    n = q.shape[0]
    bits = ((q >> 4) & 0x01).reshape(n, 4, 8)  # (n, byte, bit)
    return (bits << _BIT_SHIFT).sum(axis=-1, dtype=np.uint8)  # (n, 4)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """(n, B) -> (n, 1): the value with the largest magnitude (first one on ties), sign kept."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[:, None], axis=-1)


def _q_f32(x: np.ndarray) -> np.ndarray:
    return x.astype("<f4").view(np.uint8)


def _q_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):  # |x| > 65504 becomes inf, as in C; NaN stays NaN
        return x.astype("<f2").view(np.uint8)


def _q_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: NaN -> quiet NaN (keeping sign and top payload), else round to nearest even."""
    u = np.ascontiguousarray(x).view(np.uint32)  # (n, 1)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    u = np.where(is_nan, (u & 0xFFFF0000) | 0x00400000, u).astype(np.uint32)
    # no overflow: the largest non-NaN input is -inf 0xFF800000, NaNs have zero low halves
    u = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    return u.astype("<u2").view(np.uint8)


def _q_q4_0(x: np.ndarray) -> np.ndarray:
    d = _signed_absmax(x) / np.float32(-8)  # (n, 1): the extreme value maps to -8
    q = _trunc_u8(x * _inverse(d) + np.float32(8.5), 15)  # (n, 32)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=-1)


def _q_q4_1(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)  # (n, 1) each
    d = (hi - lo) / np.float32(15)
    q = _trunc_u8((x - lo) * _inverse(d) + np.float32(0.5), 15)  # (n, 32)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=-1)


def _q_q5_0(x: np.ndarray) -> np.ndarray:
    d = _signed_absmax(x) / np.float32(-16)  # (n, 1)
    q = _trunc_u8(x * _inverse(d) + np.float32(16.5), 31)  # (n, 32)
    return np.concatenate([_f16_bytes(d), _pack_qh(q), _pack_nibbles(q)], axis=-1)


def _q_q5_1(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)  # (n, 1) each
    d = (hi - lo) / np.float32(31)
    q = _trunc_u8((x - lo) * _inverse(d) + np.float32(0.5), 31)  # (n, 32)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_qh(q), _pack_nibbles(q)], axis=-1)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf: round half away from zero (np.round rounds half to even). Exact: v - floor(v) is exact."""
    a = np.abs(v)
    fl = np.floor(a)
    return np.copysign(fl + (a - fl >= np.float32(0.5)), v)


def _q_q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)  # (n, 1)
    q = _roundf(x * _inverse(d)).astype(np.int8)  # (n, 32) in -127..127
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=-1)


_QUANT: dict[QuantType, Callable[[np.ndarray], np.ndarray]] = {
    QuantType.F32: _q_f32,
    QuantType.F16: _q_f16,
    QuantType.BF16: _q_bf16,
    QuantType.Q4_0: _q_q4_0,
    QuantType.Q4_1: _q_q4_1,
    QuantType.Q5_0: _q_q5_0,
    QuantType.Q5_1: _q_q5_1,
    QuantType.Q8_0: _q_q8_0,
}
# k-quants (llama.cpp's quantize_row_qN_K_ref, bit-exact): quant/kquants.py
_QUANT.update({QuantType(t): fn for t, fn in _KQUANTS.items()})
# IQ4_NL / IQ4_XS (llama.cpp's quantize_iq4_* without imatrix, bit-exact) and MXFP4: quant/iquants.py
_QUANT.update({QuantType(t): q for t, (_, _, _, q) in _IQUANTS.items()})


# ----------------------------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------------------------


def _as_qtype(qtype: QuantType | int) -> QuantType:
    """Accept QuantType, gguf.GGMLQuantizationType or a plain GGML id; unknown ids raise QuantTypeError."""
    try:
        return QuantType(int(qtype))
    except (ValueError, TypeError):
        name = getattr(qtype, "name", None)
        raise QuantTypeError(
            f"unknown quant type {qtype!r}" + (f" ({name})" if name else "")
            + f"; supported: {', '.join(t.name for t in sorted(_DEQUANT))}") from None


def _as_bytes(data: np.ndarray) -> np.ndarray:
    """Return `data` as a uint8 array (..., n_bytes); other dtypes are reinterpreted byte-wise along the last axis."""
    data = np.asarray(data)
    if data.dtype != np.uint8:
        if data.ndim == 0:
            raise ValueError("quantized data needs at least one axis")
        data = np.ascontiguousarray(data).view(np.uint8)
    if data.ndim == 0:
        raise ValueError("quantized data needs at least one axis")
    return data
