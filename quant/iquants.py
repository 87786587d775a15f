"""NumPy reference (de)quantization of the non-linear 4-bit formats IQ4_NL, IQ4_XS and MXFP4.

Layouts (one block, little endian):
    IQ4_NL  d:f16 | qs[16]                                 x[j] = d*kv[lo(qs[j])], x[j+16] = d*kv[hi(qs[j])]
    IQ4_XS  d:f16 | scales_h:u16 | scales_l[4] | qs[128]   8 sub-blocks of 32, 6-bit scale ls = scales_l nibble
                                                           | 2 bits of scales_h << 4; x = d*(ls-32)*kv[q]
    MXFP4   e:u8 (E8M0) | qs[16]                           x = 2^(e-128) * kv4[q] (kv4: doubled E2M1 values)
with kv = kvalues_iq4nl and kv4 = kvalues_mxfp4 of ggml-common.h.

The quantizers follow llama.cpp's ggml-quants.c without an importance matrix (quantize_iq4_nl / quantize_iq4_xs,
i.e. quantize_row_iq4_nl_impl with ntry = 7; quantize_row_mxfp4_ref): the same float32 operations in the same
order, vectorized across blocks and sequential along a block, so the bytes equal llama.cpp's
(tests/test_iquants.py, golden bytes from llama.cpp's own quantizer).
"""
from __future__ import annotations

import numpy as np

f32 = np.float32
KV_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
KV_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
GROUP_MAX_EPS = f32(1e-15)
NTRY = 7
QK_K = 256


# -- dequantization ----------------------------------------------------------------------------------------------

def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(f32)


def _codes(qs: np.ndarray) -> np.ndarray:
    """(n, 16*m) packed nibbles -> (n, 32*m) codes: per 32, the 16 low nibbles then the 16 high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(15)).reshape(n, -1)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml_e8m0_to_fp32_half: 2^(e-128) as float32 bits (denormal for e < 2)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(f32)


def deq_iq4_nl(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * KV_IQ4NL[_codes(b[:, 2:])].astype(f32)


def iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """(n, 136) blocks -> (n, 8) int scales ls - 32."""
    n = b.shape[0]
    sh = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).reshape(n, 1)
    sl = b[:, 4:8]
    lo = (sl.reshape(n, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)).reshape(n, 8) & np.uint8(15)
    hi = (sh >> np.arange(0, 16, 2, dtype=np.uint16).reshape(1, 8)).astype(np.uint8) & np.uint8(3)
    return (lo | (hi << np.uint8(4))).astype(np.int32) - 32


def deq_iq4_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl = _f16(b[:, :2]) * iq4_xs_scales(b).astype(f32)  # (n, 8)
    q = KV_IQ4NL[_codes(b[:, 8:])].astype(f32).reshape(n, 8, 32)
    return (dl[:, :, None] * q).reshape(n, QK_K)


def deq_mxfp4(b: np.ndarray) -> np.ndarray:
    return e8m0_half(b[:, :1]) * KV_MXFP4[_codes(b[:, 1:])].astype(f32)


# -- quantization ------------------------------------------------------------------------------------------------

def best_index(x: np.ndarray, values: np.ndarray) -> np.ndarray:
    """best_index_int8: the index of the value nearest x (ties and the binary search's order as in C)."""
    v = values.astype(f32)
    mu = np.clip(np.searchsorted(v, x, side="right"), 1, len(v) - 1)
    lo = np.where((x - v[mu - 1]) < (v[mu] - x), mu - 1, mu)
    return np.where(x <= v[0], 0, np.where(x >= v[-1], len(v) - 1, lo)).astype(np.uint8)


def _seq_sums(w: np.ndarray, q: np.ndarray, xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sumqx += w*q*x, sumq2 += w*q*q element by element ((n, 32) each -> (n,) twice)."""
    sqx = np.zeros(w.shape[0], f32)
    sq2 = np.zeros(w.shape[0], f32)
    for j in range(w.shape[1]):
        wq = w[:, j] * q[:, j]
        sqx = sqx + wq * xb[:, j]
        sq2 = sq2 + wq * q[:, j]
    return sqx, sq2


def _block_scales(xb: np.ndarray, values: np.ndarray) -> np.ndarray:
    """quantize_row_iq4_nl_impl's per-32 scale search (no importance matrix): (n, 32) -> (n,) float32 scales."""
    w = xb * xb
    ax = np.abs(xb)
    first = np.argmax(ax == ax.max(axis=1, keepdims=True), axis=1)  # the first |x| maximum (strict > in C)
    mx = xb[np.arange(len(xb)), first]
    amax = ax[np.arange(len(xb)), first]
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, f32(1), mx)
    v0 = f32(values[0])
    with np.errstate(divide="ignore", invalid="ignore"):
        d = -mx / v0
        iden = f32(1) / d
        q = values[best_index(iden[:, None] * xb, values)].astype(f32)
        sqx, sq2 = _seq_sums(w, q, xb)
        d = np.where(sq2 > 0, sqx / sq2, f32(0))
        best = d * sqx
        for itry in range(-NTRY, NTRY + 1):
            iden = f32(itry + int(values[0])) / mx
            q = values[best_index(iden[:, None] * xb, values)].astype(f32)
            sqx, sq2 = _seq_sums(w, q, xb)
            better = (sq2 > 0) & (sqx * sqx > best * sq2)
            d = np.where(better, sqx / sq2, d)
            best = np.where(better, d * sqx, best)
    return np.where(zero, f32(0), d).astype(f32)


def _pack(codes: np.ndarray) -> np.ndarray:
    """(n, 32*m) codes -> (n, 16*m) bytes: low nibble = element j, high = j + 16 of each 32."""
    n = codes.shape[0]
    c = codes.reshape(n, -1, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << np.uint8(4))).reshape(n, -1)


def _inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, f32(1) / d, f32(0)).astype(f32)


def q_iq4_nl(x: np.ndarray) -> np.ndarray:
    """(n, 32) -> (n, 18): one scale per block, then every code again with id = 1/scale."""
    d = _block_scales(x, KV_IQ4NL)
    codes = best_index(_inv(d)[:, None] * x, KV_IQ4NL)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), _pack(codes)], axis=1)


def q_iq4_xs(x: np.ndarray) -> np.ndarray:
    """(n, 256) -> (n, 136): 8 scales per block, quantized to 6 bits against d = -max_scale/32."""
    n = x.shape[0]
    xb = x.reshape(n * 8, 32)
    sc = _block_scales(xb, KV_IQ4NL).reshape(n, 8)
    first = np.argmax(np.abs(sc) == np.abs(sc).max(axis=1, keepdims=True), axis=1)  # first strict maximum
    max_scale = sc[np.arange(n), first]
    max_scale = np.where(np.abs(sc).max(axis=1) > 0, max_scale, f32(0))  # amax_scale starts at 0 (strict >)
    d = (-max_scale / f32(32)).astype(f32)
    iden = _inv(d)
    ls = np.clip(np.rint(iden[:, None] * sc), -32, 31).astype(np.int32)  # (n, 8): nearest_int
    dl = d[:, None] * ls.astype(f32)
    codes = best_index((_inv(dl).reshape(-1, 1) * xb), KV_IQ4NL).reshape(n, QK_K)
    l = (ls + 32).astype(np.uint32)
    scales_l = ((l[:, 0::2] & 15) | ((l[:, 1::2] & 15) << 4)).astype(np.uint8)  # (n, 4)
    scales_h = np.zeros(n, np.uint32)
    for ib in range(8):
        scales_h |= (l[:, ib] >> 4) << (2 * ib)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                           scales_h.astype(np.uint16).view(np.uint8).reshape(-1, 2), scales_l, _pack(codes)], axis=1)


def q_mxfp4(x: np.ndarray) -> np.ndarray:
    """(n, 32) -> (n, 17): quantize_row_mxfp4_ref (shared exponent from the block's |x| maximum)."""
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    d = e8m0_half(e)
    err = np.abs(d[:, None, None] * KV_MXFP4.astype(f32)[None, None, :] - x[:, :, None])  # (n, 32, 16)
    codes = np.argmin(err, axis=-1).astype(np.uint8)  # best_index_mxfp4: the first of equal errors
    return np.concatenate([e[:, None], _pack(codes)], axis=1)


IQUANTS = {  # GGML type id -> (block size, type size, dequantize, quantize)
    20: (32, 2 + 16, deq_iq4_nl, q_iq4_nl),
    23: (QK_K, 2 + 2 + QK_K // 64 + QK_K // 2, deq_iq4_xs, q_iq4_xs),
    39: (32, 1 + 16, deq_mxfp4, q_mxfp4),
}
