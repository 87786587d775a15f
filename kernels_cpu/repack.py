"""Load-time weight layouts for the fused matmul kernels (NumPy, run once per weight).

Rows are taken in groups of R = 16 (N padded with zero rows). For every (group g, block b) the bit planes
of the 16 rows' codes are stored contiguously in qs (G, NB, QB) uint8, and their scales in sc (G, NB, SB)
uint8 — see matmul_q / matmul_k / matmul_kquad / matmul_iq for the exact planes. Bits stay packed: memory is the
file size plus a few percent (k-quant 6-bit scales are stored unpacked, one byte each).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from quant.formats import k_scale_min, q3_k_scales
from quant.iquants import iq4_xs_scales
from quant.types import FORMATS
from quant.types import QuantType as Q

from ._jit import ARM, host_features, jit

R = 16
_GROUP_CHUNK = 1024  # groups repacked per step (bounds the temporary arrays)


@dataclass(frozen=True)
class Layout:
    """How one format is repacked: K elements per kernel block, bytes per (group, block) in qs and sc."""

    block: int  # K elements per kernel call (32 or 256)
    qbytes: int
    sbytes: int
    act_block: int  # activation quantization block (0 = float activations)
    split: Callable  # (blocks (n, NB, type_size) uint8) -> (codes (n, NB, block) uint8, [scale arrays (n, NB, s)])
    planes: tuple  # ("q8"|"nib"|"crumb_lo"|"crumb_hi"|"bit4"|"bit2", ...)


def _u16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.uint16)  # (..., 1) per f16 field


def _nib32(qs: np.ndarray) -> np.ndarray:
    """(..., 16) packed -> (..., 32) codes: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """(..., 4) little-endian u32 -> (..., 32) bits (element e = bit e)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _split_q8_0(b):
    return b[..., 2:], [_u16(b[..., 0:2])]


def _split_q4_0(b):
    return _nib32(b[..., 2:18]), [_u16(b[..., 0:2])]


def _split_q4_1(b):
    return _nib32(b[..., 4:20]), [_u16(b[..., 0:2]), _u16(b[..., 2:4])]


def _split_q5_0(b):
    return _nib32(b[..., 6:22]) | (_bits32(b[..., 2:6]) << 4), [_u16(b[..., 0:2])]


def _split_q5_1(b):
    return _nib32(b[..., 8:24]) | (_bits32(b[..., 4:8]) << 4), [_u16(b[..., 0:2]), _u16(b[..., 2:4])]


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 128) -> (..., 256): per 32 bytes, 32 low nibbles then 32 high nibbles (Q4_K / Q5_K / Q6_K ql)."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    return (q & 15).reshape(*qs.shape[:-1], 256)


def _split_q4_k(b):
    sc, m = k_scale_min(b[..., 4:16])
    return _k_nibbles(b[..., 16:144]), [sc, m, _u16(b[..., 0:2]), _u16(b[..., 2:4])]


def _split_q5_k(b):
    sc, m = k_scale_min(b[..., 4:16])
    qh = b[..., 16:48]  # (..., 32): bit j of byte l -> element 32j + l
    hb = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (..., 8, 32)
    codes = _k_nibbles(b[..., 48:176]) | (hb.reshape(*b.shape[:-1], 256) << 4)
    return codes, [sc, m, _u16(b[..., 0:2]), _u16(b[..., 2:4])]


def _split_q6_k(b):
    ql, qh, scales = b[..., 0:128], b[..., 128:192], b[..., 192:208]
    lo = (ql.reshape(*ql.shape[:-1], 2, 2, 1, 32) >> np.array([0, 4], np.uint8)[:, None]) & 15  # h, half, nib, l
    lo = lo.transpose(*range(lo.ndim - 4), -4, -2, -3, -1)  # (..., h, nib, half, l): element 128h+64nib+32half+l
    hi = (qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # h, s, l
    codes = lo.reshape(*b.shape[:-1], 256) | (hi.reshape(*b.shape[:-1], 256) << 4)
    return codes, [scales.copy(), _u16(b[..., 208:210])]


def _k_crumbs(qs: np.ndarray) -> np.ndarray:
    """(..., 64) -> (..., 256): element 128h + 32j + l = bits 2j of byte 32h + l."""
    q = (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    return q.reshape(*qs.shape[:-1], 256)


def _split_q2_k(b):
    return _k_crumbs(b[..., 16:80]), [b[..., 0:16].copy(), _u16(b[..., 80:82]), _u16(b[..., 82:84])]


def _split_q3_k(b):
    hm = b[..., 0:32]  # element 128h + 32j + l: bit (4h + j) of byte l
    hb = (hm[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (..., 8, 32)
    codes = _k_crumbs(b[..., 32:96]) | (hb.reshape(*b.shape[:-1], 256) << 2)
    return codes, [q3_k_scales(b[..., 96:108]).view(np.uint8), _u16(b[..., 108:110])]


def _split_iq4_nl(b):
    return _nib32(b[..., 2:18]), [_u16(b[..., 0:2])]


def _split_mxfp4(b):
    return _nib32(b[..., 1:17]), [b[..., 0:1].copy()]


def _split_iq4_xs(b):
    """(..., 136) -> codes (..., 256) (per 32: 16 low nibbles, 16 high), [scales ls - 32 as int8 bytes, d]."""
    lead = b.shape[:-1]
    codes = _nib32(b[..., 8:136].reshape(*lead, 8, 16)).reshape(*lead, 256)
    ls = iq4_xs_scales(b.reshape(-1, 136)).astype(np.int8).view(np.uint8).reshape(*lead, 8)
    return codes, [ls, _u16(b[..., 0:2])]


def _split_float(dtype):
    def split(b):
        return b, []
    return split


# The k-quants whose x86 kernels take quad vectors (matmul_kquad): their planes are "nibq" (+ "bitq" / "crumbq"),
# or "crumbq0" (+ "bitq2") there; on AArch64 the pair-vector planes of matmul_k (its NEON forms read pairs).
QUAD_K: frozenset[Q] = frozenset() if ARM else frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})


# The 32-element block formats with unsigned codes whose kernels take quad vectors on x86 (matmul_q's quad bodies:
# 8-row slices on AVX2 / AVX-VNNI, 16 with AVX-512): planes "nibq" (+ "bitq"), as the k-quants' run of 32. On
# AArch64 they keep the pair vectors (NEON). With AVX-512 (Zen 4, 2 threads) the quads beat the pair vectors'
# vpdpwssd / uint8 VNNI forms: Q5_0 2048x640 M=1 0.023 -> 0.017 ms, M=8 0.068 -> 0.053, M=64 0.47 -> 0.34.
# Q8_0 joins them where the slice width has vpdpbusd (AVX512-VNNI, AVX-VNNI): plane "q8q", its quads with the
# codes + 128 (unsigned, exact in vpdpbusd's int32 sums; vpmaddubsw's int16 pairs would saturate, so plain AVX2 and
# AVX-512 keep the int16 pair vectors, "q8").
_VNNI = bool({"avx512vnni", "avxvnni"} & host_features())
QUAD_32: frozenset[Q] = frozenset() if ARM else frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1} | ({Q.Q8_0} if _VNNI else set()))


def _quad_planes(qtype: Q, pairs: tuple, quads: tuple) -> tuple:
    """The quad-vector planes where qtype is stored as quads on this target (QUAD_K, QUAD_32), else the pair planes."""
    return quads if qtype in QUAD_K | QUAD_32 else pairs


LAYOUTS: dict[Q, Layout] = {
    Q.Q8_0: Layout(32, 512, 32, 32, _split_q8_0, _quad_planes(Q.Q8_0, ("q8",), ("q8q",))),
    Q.Q4_0: Layout(32, 256, 32, 32, _split_q4_0, _quad_planes(Q.Q4_0, ("nib",), ("nibq",))),
    Q.Q4_1: Layout(32, 256, 64, 32, _split_q4_1, _quad_planes(Q.Q4_1, ("nib",), ("nibq",))),
    Q.Q5_0: Layout(32, 320, 32, 32, _split_q5_0, _quad_planes(Q.Q5_0, ("nib", "bit4"), ("nibq", "bitq"))),
    Q.Q5_1: Layout(32, 320, 64, 32, _split_q5_1, _quad_planes(Q.Q5_1, ("nib", "bit4"), ("nibq", "bitq"))),
    Q.IQ4_NL: Layout(32, 256, 32, 32, _split_iq4_nl, ("nibq",)),
    Q.MXFP4: Layout(32, 256, 16, 32, _split_mxfp4, ("nibq",)),
    Q.IQ4_XS: Layout(256, 2048, 160, 256, _split_iq4_xs, ("nibq",)),
    Q.Q2_K: Layout(256, 1024, 320, 256, _split_q2_k, _quad_planes(Q.Q2_K, ("crumb_lo",), ("crumbq0",))),
    Q.Q3_K: Layout(256, 1536, 288, 256, _split_q3_k, _quad_planes(Q.Q3_K, ("crumb_lo", "bit2"), ("crumbq0", "bitq2"))),
    Q.Q4_K: Layout(256, 2048, 320, 256, _split_q4_k, _quad_planes(Q.Q4_K, ("nib",), ("nibq",))),
    Q.Q5_K: Layout(256, 2560, 320, 256, _split_q5_k, _quad_planes(Q.Q5_K, ("nib", "bit4"), ("nibq", "bitq"))),
    Q.Q6_K: Layout(256, 3072, 288, 256, _split_q6_k, _quad_planes(Q.Q6_K, ("nib", "crumb_hi"), ("nibq", "crumbq"))),
    Q.F32: Layout(32, 32 * R * 4, 1, 0, _split_float(np.float32), ()),
    Q.F16: Layout(32, 32 * R * 2, 1, 0, _split_float(np.float16), ()),
    Q.BF16: Layout(32, 32 * R * 2, 1, 0, _split_float(np.uint16), ()),
}


@jit
def _pairs_kernel(pv, codes):
    # pv (G, NB, B/2, 2R) <- codes (G*R, NB, B)
    n, NB, B = codes.shape
    for row in range(n):
        g, r = row // R, row % R
        for nb in range(NB):
            for p in range(B // 2):
                pv[g, nb, p, 2 * r] = codes[row, nb, 2 * p]
                pv[g, nb, p, 2 * r + 1] = codes[row, nb, 2 * p + 1]


def _pairs(codes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(G*R, NB, B) codes -> (G, NB, B/2, 2R) pair vectors: lane 2r+e = row r, element 2p+e."""
    n, NB, B = codes.shape
    pv = np.empty((n // R, NB, B // 2, 2 * R), np.uint8) if out is None else out.reshape(n // R, NB, B // 2, 2 * R)
    _pairs_kernel(pv, codes)
    return pv


def _quads(pv: np.ndarray) -> np.ndarray:
    """Pair vectors pv (G, NB, P, 32) -> quad vectors (G, NB, P/16, 8, 64): per run of 32 elements, quad l holds
    pairs 2l, 2l+1 with byte 4r+e = row r, element 4l+e of the run."""
    G, NB, P, _ = pv.shape
    return pv.reshape(G, NB, P // 2, 2, R, 2).transpose(0, 1, 2, 4, 3, 5).reshape(G, NB, P // 16, 8, 64)


def _plane(kind: str, pv: np.ndarray) -> np.ndarray:
    """Pack pair vectors pv (G, NB, P, 32) of codes into one bit plane, flattened per (g, b)."""
    G, NB, P, _ = pv.shape
    if kind == "q8":
        return pv.reshape(G, NB, -1)
    if kind == "nib":  # per run of 16 pairs: vector v = pair v (low nibble) | pair v+8 (high nibble)
        r = pv.reshape(G, NB, P // 16, 2, 8, 32)
        return ((r[:, :, :, 0] & 15) | ((r[:, :, :, 1] & 15) << 4)).reshape(G, NB, -1)
    if kind == "q8q":  # the 8 quads of the run, codes + 128 (int8 -> offset uint8)
        return (_quads(pv) ^ np.uint8(0x80)).reshape(G, NB, -1)
    if kind == "nibq":  # per run: vector j (0..3) = quad j (low nibbles) | quad j+4 (high nibbles)
        q = _quads(pv).reshape(G, NB, P // 16, 2, 4, 64)
        return ((q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)).reshape(G, NB, -1)
    if kind in ("bitq", "bitq2"):  # per run: one vector, bit l of byte 4r+e = bit 4 (bitq2: 2) of quad l
        q = (_quads(pv) >> (4 if kind == "bitq" else 2)) & 1
        return (q << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8).reshape(G, NB, -1)
    if kind in ("crumbq", "crumbq0"):  # per run: vector u (0, 1) = bits 4-5 (crumbq0: 0-1) of quads u, u+2, u+4,
        # u+6 at bits 0-1, 2-3, 4-5, 6-7
        q = ((_quads(pv) >> (4 if kind == "crumbq" else 0)) & 3).reshape(G, NB, P // 16, 4, 2, 64)  # [s, u]: quad 2s+u
        sh = (2 * np.arange(4, dtype=np.uint8))[:, None, None]
        return (q << sh).sum(-3, dtype=np.uint8).reshape(G, NB, -1)
    if kind in ("crumb_lo", "crumb_hi"):  # per run of 16 pairs: vector u = pairs u, u+4, u+8, u+12
        src = pv if kind == "crumb_lo" else pv >> 4
        r = (src & 3).reshape(G, NB, P // 16, 4, 4, 32)
        out = r[:, :, :, 0] | (r[:, :, :, 1] << 2) | (r[:, :, :, 2] << 4) | (r[:, :, :, 3] << 6)
        return out.reshape(G, NB, -1)
    if kind in ("bit4", "bit2"):  # one little-endian u32 per pair, bit = lane
        bit = (pv >> (4 if kind == "bit4" else 2)) & 1
        return np.packbits(bit, axis=-1, bitorder="little").reshape(G, NB, -1)
    raise ValueError(kind)


def _by_runs(planes: list) -> np.ndarray:
    """The quad planes (G, NB, bytes) of a super-block stored run by run: run t's nibq bytes, then its bitq /
    crumbq bytes, then run t+1's: the kernel reads each (group, block) as one ascending stream (two planes read
    side by side ran Q5_K / Q6_K at half speed once the weights were out of L2)."""
    G, NB = planes[0].shape[:2]
    return np.concatenate([p.reshape(G, NB, 8, -1) for p in planes], axis=-1).reshape(G, NB, -1)


def repack(raw: np.ndarray, qtype: Q, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """raw (n, row_bytes) uint8 -> (qs (G, NB, QB) uint8, sc (G, NB, SB) uint8), G = ceil(n/16)."""
    lay = LAYOUTS[qtype]
    G = -(-n // R)
    if lay.act_block == 0:
        return _repack_float(raw, qtype, n, k, G), np.zeros((G, -(-k // lay.block), 1), np.uint8)
    fmt = FORMATS[qtype]
    NB = k // fmt.block_size  # blocks of the format = kernel blocks
    qs = np.empty((G, NB, lay.qbytes), np.uint8)
    sc = np.empty((G, NB, lay.sbytes), np.uint8)
    for g0 in range(0, G, _GROUP_CHUNK):
        g1 = min(G, g0 + _GROUP_CHUNK)
        rows = raw[g0 * R:g1 * R].reshape(-1, NB, fmt.type_size)  # (rows, NB, type_size)
        if rows.shape[0] < (g1 - g0) * R:  # zero rows pad the last group (zero scales -> zero outputs)
            pad = np.zeros(((g1 - g0) * R - rows.shape[0], NB, fmt.type_size), np.uint8)
            rows = np.concatenate([rows, pad])
        codes, scales = lay.split(rows)  # codes (rows, NB, block)
        if lay.planes == ("q8",):  # the pair vectors are the plane: write them in place
            _pairs(codes, qs[g0:g1])
        else:
            pv = _pairs(codes)
            planes = [_plane(p, pv) for p in lay.planes]
            qs[g0:g1] = _by_runs(planes) if qtype in QUAD_K else np.concatenate(planes, axis=-1)
        # scales: (rows, NB, s) -> (g, NB, s, R) sub-block-major, bytes
        parts = [s.reshape(g1 - g0, R, NB, -1).transpose(0, 2, 3, 1) for s in scales]
        sc[g0:g1] = np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(g1 - g0, NB, -1)
                                    for p in parts], axis=-1)
    return qs, sc


def _repack_float(raw: np.ndarray, qtype: Q, n: int, k: int, G: int) -> np.ndarray:
    """Float rows -> (G, KB, 32*16*esize) bytes: per 32 k-values, the 16 rows' values for each k."""
    esize = FORMATS[qtype].type_size
    KB = -(-k // 32)
    vals = raw.view(np.uint8).reshape(n, k * esize).view({4: np.uint32, 2: np.uint16}[esize])  # (n, k)
    out = np.zeros((G * R, KB * 32), vals.dtype)
    out[:n, :k] = vals
    out = out.reshape(G, R, KB, 32).transpose(0, 2, 3, 1)  # (G, KB, 32, R)
    return np.ascontiguousarray(out).view(np.uint8).reshape(G, KB, -1)
