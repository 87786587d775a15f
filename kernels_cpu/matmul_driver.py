"""Numba drivers of the fused matmul: activation quantization and the loops around `qdot`.

Loop order per thread chunk of row groups: activation row tiles of MT rows (kept in L2), then each row group,
then MB activation rows at a time (weights loaded once for MB rows), then the K blocks. Every output element
is computed by the same instruction sequence whatever M is, so results are batch invariant.
"""
from __future__ import annotations

import hashlib
import types
from pathlib import Path

import numba
import numpy as np

# matmul_iq / _k / _q register the IR bodies; the others generate parts of them (see _source_tag)
from . import ir_emit, matmul_iq, matmul_ir, matmul_k, matmul_kquad, matmul_neon, matmul_q, repack
from ._jit import host_features, jit
from .ops import bits_to_f32, f16_round, f32_to_bits
from .ir_emit import R, max_rows
from .matmul_ir import qdot

MB = 8  # activation rows per kernel call (at most)
MT = 64  # activation rows per L2 tile


ROUND_SHIFT = np.float32(1.5 * 2 ** 23)


@jit(inline="always")
def _rint(v):
    # np.rint(v) (round half to even) for float32 |v| < 2^22: v + 1.5 * 2^23 rounds v to an integer in the sum's
    # last place, subtracting the shift is exact. Two adds a lane, where np.rint became one scalar cvtss2si per
    # element and kept the code loops from vectorising (2-2.3x slower for qb = 32)
    return (v + ROUND_SHIFT) - ROUND_SHIFT


@jit
def quantize_act(xq, dx, bs, s1, x, qb):
    """Quantize activation rows to int16 codes in -127..127 per block of qb, exactly as llama.cpp's CPU
    backend does (so results track it): qb = 32 like quantize_row_q8_0 (scale rounded to f16,
    id = 127/amax, round half to even), qb = 256 like quantize_row_q8_K (iscale = -127/max by sign).

    x (M, K) float32 -> xq (M, K) int16 or int8 codes,
    dx (M, K/qb) float32 scales, bs (M, K/16) int32 sums of 16 codes.
    s1: (M, K/16) float32 filled only when it has columns (qb = 32, weights with a min: Q4_1 / Q5_1 use
    block_q8_1): s1[m, 2b] = block b's s of quantize_row_q8_1, i.e. d * sum(codes) with the unrounded
    d = amax/127, rounded to f16 (s1[m, 2b+1] = 0), so the min term m*s is llama.cpp's.
    """
    M, K = x.shape
    for m in range(M):
        xr, qr = x[m], xq[m]
        for blk in range(K // qb):
            # per block slices: loops over a view's whole range vectorize (over a range inside the row they did not)
            xb, cb = xr[blk * qb:(blk + 1) * qb], qr[blk * qb:(blk + 1) * qb]
            top = np.uint32(0)  # bits of the largest |x| (|x| orders as its bits); NaN skipped as by a > amax
            for k in range(qb):
                a = f32_to_bits(xb[k]) & np.uint32(0x7FFFFFFF)
                top = max(top, a if a <= np.uint32(0x7F800000) else np.uint32(0))
            amax = bits_to_f32(top)
            if qb == 32:
                d = amax / np.float32(127.0)
                dx[m, blk] = f16_round(d)
                inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
                tot = np.int32(0)
                for k in range(qb):
                    c = np.int32(_rint(xb[k] * inv))  # |x * inv| <= 127
                    cb[k] = c
                    tot += c
                if s1.shape[1]:
                    s1[m, 2 * blk] = f16_round(d * np.float32(tot))
                    s1[m, 2 * blk + 1] = np.float32(0.0)
            elif amax == 0:
                dx[m, blk] = 0
                for k in range(qb):
                    cb[k] = 0
            else:
                first = qb  # the first value of largest magnitude (its sign is the codes'): an index min
                for k in range(qb):
                    first = min(first, k if (f32_to_bits(xb[k]) & np.uint32(0x7FFFFFFF)) == top else qb)
                iscale = np.float32(-127.0) / xb[first]
                dx[m, blk] = np.float32(1.0) / iscale
                for k in range(qb):
                    cb[k] = np.int32(min(np.float32(127.0), _rint(iscale * xb[k])))  # |.| <= 127
        br = bs[m]
        for j in range(K // 16):  # (indexing the row: a slice per 16 codes cost a reference count each)
            s = np.int32(0)
            for k in range(16):
                s += np.int32(qr[16 * j + k])
            br[j] = s


def _source_tag() -> str:
    """Hash of the modules that generate the kernels' IR. Numba keys a cached closure by its cell values,
    so editing those modules recompiles the drivers (the cache index alone only tracks this file)."""
    h = hashlib.sha256()
    for mod in (ir_emit, matmul_ir, matmul_q, matmul_k, matmul_kquad, matmul_iq, matmul_neon, repack):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:16]


SOURCE_TAG = _source_tag()


def make_driver(fmt: int, cache: bool = True):
    """The driver for one format: a closure over the literal `fmt` (Numba caches closures per value).
    cache=False gives a fresh dispatcher whose assembly can be inspected (tests)."""
    tag = SOURCE_TAG
    # 8-row tiles where a pass takes 8 rows or two passes of 4 pay (x86); on NEON (4-row passes, a weight block
    # re-decoded per pass costs little next to the sdot work) tiles of 4: half the code to compile
    eight = max_rows() == 8 or "neon" not in host_features()

    def run_groups(y, xq, dx, bs, qs, sc, g0, g1):
        """y[:, 16*g0 : 16*g1] for row groups g0..g1-1 (see matmul._prepare_x for xq, dx, bs)."""
        if tag is None:  # never: makes the source tag part of the closure (and of the cache key)
            return
        facc = np.empty(MB * R, np.float64)  # (MB*16,) output accumulators of one row group
        M, N = y.shape
        NB, QB = qs.shape[1], qs.shape[2]
        SB = sc.shape[2]
        Kx = xq.shape[1]
        BS = Kx // NB
        nbx = dx.shape[1]
        nbs = bs.shape[1]
        xf = xq.reshape(-1)
        dxf = dx.reshape(-1)
        bsf = bs.reshape(-1)
        qsf = qs.reshape(-1)
        scf = sc.reshape(-1)
        for mt in range(0, M, MT):
            me = min(mt + MT, M)
            for g in range(g0, g1):
                m0 = mt
                while m0 < me:
                    rem = me - m0  # tiles of 8, 4, 2, 1 rows: the same per-row arithmetic in each
                    mb = MB if (eight and rem >= MB) else (4 if rem >= 4 else (2 if rem >= 2 else 1))
                    qo = g * NB * QB
                    so = g * NB * SB
                    xo = m0 * Kx
                    do = m0 * nbx
                    bo = m0 * nbs
                    if mb == 4:
                        qdot(fmt, 4, facc, xf, xo, Kx, dxf, do, nbx, bsf, bo, nbs, qsf, qo, scf, so, NB, QB, SB, BS)
                    elif mb == 2:
                        qdot(fmt, 2, facc, xf, xo, Kx, dxf, do, nbx, bsf, bo, nbs, qsf, qo, scf, so, NB, QB, SB, BS)
                    elif mb == 1:
                        qdot(fmt, 1, facc, xf, xo, Kx, dxf, do, nbx, bsf, bo, nbs, qsf, qo, scf, so, NB, QB, SB, BS)
                    elif eight:  # pruned at compile time without 8-row tiles
                        qdot(fmt, MB, facc, xf, xo, Kx, dxf, do, nbx, bsf, bo, nbs, qsf, qo, scf, so, NB, QB, SB, BS)
                    n0 = g * R
                    nr = min(R, N - n0)
                    for i in range(mb):
                        for r in range(nr):
                            y[m0 + i, n0 + r] = facc[i * R + r]
                    m0 += mb

    run_groups.__qualname__ = run_groups.__name__ = f"run_groups_{fmt}"
    return jit(run_groups) if cache else numba.njit(nogil=True)(run_groups)


def _split_template(tag):
    def run_chunks(y, xq, dx, bs, qs, sc, bounds):
        if tag is None:  # never: the source tag keys the cache (see make_driver)
            return
        for c in numba.prange(len(bounds) - 1):
            serial(y, xq, dx, bs, qs, sc, bounds[c], bounds[c + 1])  # noqa: F821 - bound per format below
    return run_chunks


def make_split_driver(serial, cache: bool = True):
    """`run(y, xq, dx, bs, qs, sc, bounds)`: serial(..., bounds[c], bounds[c+1]) for each chunk c in one
    prange loop (Numba's OpenMP workers: a ~2 µs hand-off, where a Python-level thread hand-off costs one
    GIL hand-over each way, ~40 µs on a VM). `serial` is bound as a global of a per-format copy of the
    function (a dispatcher in a closure cell would change the cache key every process)."""
    t = _split_template(SOURCE_TAG)
    name = f"{serial.py_func.__name__}_split"
    fn = types.FunctionType(t.__code__, dict(globals(), serial=serial), name, None, t.__closure__)
    fn.__qualname__ = name
    return numba.njit(cache=cache, nogil=True, parallel=True)(fn)


_DRIVERS: dict[int, object] = {}


def driver(fmt: int):
    """Compiled (lazily, cached on disk) driver `run(y, xq, dx, bs, qs, sc, g0, g1)` for a QuantType id."""
    d = _DRIVERS.get(fmt)
    if d is None:
        d = _DRIVERS[fmt] = make_driver(int(fmt))
    return d


_SPLIT_DRIVERS: dict[int, object] = {}


def split_driver(fmt: int):
    """Compiled (lazily, cached) `run(y, xq, dx, bs, qs, sc, bounds)` running driver(fmt) over the row-group
    chunks [bounds[c], bounds[c+1]) in parallel (see make_split_driver)."""
    d = _SPLIT_DRIVERS.get(fmt)
    if d is None:
        d = _SPLIT_DRIVERS[fmt] = make_split_driver(driver(fmt))
    return d


@jit
def _quantize_chunks(xq, dx, bs, s1, x, qb, c, bounds):
    lo, hi = bounds[c], bounds[c + 1]
    quantize_act(xq[lo:hi], dx[lo:hi], bs[lo:hi], s1[lo:hi], x[lo:hi], qb)  # s1 with 0 columns: unused


@numba.njit(cache=True, nogil=True, parallel=True)
def quantize_act_split(xq, dx, bs, s1, x, qb, bounds):
    """quantize_act over the row chunks [bounds[c], bounds[c+1]) in parallel."""
    for c in numba.prange(len(bounds) - 1):
        _quantize_chunks(xq, dx, bs, s1, x, qb, c, bounds)
