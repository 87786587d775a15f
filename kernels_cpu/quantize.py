"""Numba kernels for the hot quantizers (Q8_0, Q4_0, and the scale searches of Q4_K / Q6_K).

`QUANTIZERS[qtype]`: float32 (n_rows, n_cols) -> uint8 (n_rows, row_bytes), used by convert/quantize_model.py;
a type missing here falls back to the NumPy reference (quant.formats.quantize).

Same float32 operations in the same order as the NumPy references (quant/formats.py, quant/kquants.py), so the
bytes are identical; tests/test_quantize.py checks that. Every int is cast to float32 before it meets a float
(Numba would promote float32 * int64 to float64). f16 rounding of the block scales stays in NumPy.
"""
from __future__ import annotations

import numpy as np

from kernels_cpu._jit import jit
from quant import kquants
from quant.types import FORMATS, QuantType

__all__ = ["QUANTIZERS"]

F0, F05, F1, F85, F127 = np.float32(0), np.float32(0.5), np.float32(1), np.float32(8.5), np.float32(127)
F01 = np.float32(0.1)
EPS = np.float32(1e-15)


@jit
def _q8_0(x, d, q):
    """x (nb, 32) f32 -> d (nb,) f32 (unrounded), q (nb, 32) int8."""
    for b in range(x.shape[0]):
        amax = F0
        for j in range(32):
            v = abs(x[b, j])
            if v > amax:
                amax = v
        dd = amax / F127
        d[b] = dd
        idd = F1 / dd if dd != F0 else F0
        for j in range(32):
            v = x[b, j] * idd
            a = abs(v)
            fl = np.float32(np.floor(a))
            r = fl + (F1 if a - fl >= F05 else F0)
            q[b, j] = np.int8(-r if v < 0 else r)


@jit
def _q4_0(x, d, q):
    """x (nb, 32) -> d (nb,) f32, q (nb, 32) uint8 in 0..15."""
    for b in range(x.shape[0]):
        amax = F0
        mx = F0
        for j in range(32):
            v = abs(x[b, j])
            if v > amax:
                amax = v
                mx = x[b, j]
        dd = mx / np.float32(-8)
        d[b] = dd
        idd = F1 / dd if dd != F0 else F0
        for j in range(32):
            v = np.float32(x[b, j] * idd) + F85
            t = np.int32(v) if v > 0 else 0  # trunc toward zero; v >= 0 in practice
            q[b, j] = 15 if t > 15 else t


def q8_0(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    d = np.empty(x.shape[0], np.float32)
    q = np.empty(x.shape, np.int8)
    _q8_0(x, d, q)
    return np.concatenate([d.astype("<f2").reshape(-1, 1).view(np.uint8), q.view(np.uint8)], axis=1)


def q4_0(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    d = np.empty(x.shape[0], np.float32)
    q = np.empty(x.shape, np.uint8)
    _q4_0(x, d, q)
    packed = (q[:, :16] & 0x0F) | (q[:, 16:] << 4)
    return np.concatenate([d.astype("<f2").reshape(-1, 1).view(np.uint8), packed], axis=1)


@jit
def _qkx2(x, w, nmax, rmin, rdelta, nstep, use_mad, scale_out, min_out, L, Laux):
    """make_qkx2_quants per row of x (N, n): scale_out (N,), min_out (N,) (= the_min), L (N, n) uint8."""
    n = x.shape[1]
    fnmax = np.float32(nmax)
    for r in range(x.shape[0]):
        mn = x[r, 0]
        mx = x[r, 0]
        sum_w = w[r, 0]
        sum_x = sum_w * x[r, 0]
        for i in range(1, n):
            if x[r, i] < mn:
                mn = x[r, i]
            if x[r, i] > mx:
                mx = x[r, i]
            sum_w += w[r, i]
            sum_x += w[r, i] * x[r, i]
        if mn > F0:
            mn = F0
        if mx == mn:
            for i in range(n):
                L[r, i] = 0
            scale_out[r] = F0
            min_out[r] = -mn
            continue
        iscale = fnmax / (mx - mn)
        scale = F1 / iscale
        best = F0
        for i in range(n):
            l = np.int32(np.rint(iscale * (x[r, i] - mn)))
            l = min(nmax, max(0, l))
            L[r, i] = l
            diff = scale * np.float32(l) + mn - x[r, i]
            diff = abs(diff) if use_mad else diff * diff
            best += w[r, i] * diff
        for s in range(nstep + 1):
            iscale = (rmin + rdelta * np.float32(s) + fnmax) / (mx - mn)
            sum_l = F0
            sum_l2 = F0
            sum_xl = F0
            for i in range(n):
                l = np.int32(np.rint(iscale * (x[r, i] - mn)))
                l = min(nmax, max(0, l))
                Laux[i] = l
                fl = np.float32(l)
                sum_l += w[r, i] * fl
                sum_l2 += w[r, i] * fl * fl
                sum_xl += w[r, i] * fl * x[r, i]
            D = sum_w * sum_l2 - sum_l * sum_l
            if D > F0:
                this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
                this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
                if this_min > F0:
                    this_min = F0
                    this_scale = sum_xl / sum_l2
                cur = F0
                for i in range(n):
                    diff = this_scale * np.float32(Laux[i]) + this_min - x[r, i]
                    diff = abs(diff) if use_mad else diff * diff
                    cur += w[r, i] * diff
                if cur < best:
                    for i in range(n):
                        L[r, i] = Laux[i]
                    best = cur
                    scale = this_scale
                    mn = this_min
        scale_out[r] = scale
        min_out[r] = -mn


def make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """Drop-in for kquants.make_qkx2_quants."""
    N, n = x.shape
    scale, mn = np.empty(N, np.float32), np.empty(N, np.float32)
    L, Laux = np.empty((N, n), np.uint8), np.empty(n, np.uint8)
    _qkx2(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w, np.float32), nmax, np.float32(rmin),
          np.float32(rdelta), nstep, use_mad, scale, mn, L, Laux)
    return scale, mn, L


@jit
def _qx(x, nmax, scale_out, L):
    """make_qx_quants (rmse_type 1, no quant weights) per row of x (N, n): scale_out (N,), L (N, n) int32."""
    n = x.shape[1]
    fnmax = np.float32(nmax)
    for r in range(x.shape[0]):
        amax = F0
        mx = F0
        for i in range(n):
            a = abs(x[r, i])
            if a > amax:
                amax = a
                mx = x[r, i]
        if amax < EPS:
            for i in range(n):
                L[r, i] = 0
            scale_out[r] = F0
            continue
        iscale = -fnmax / mx
        sumlx = F0
        suml2 = F0
        for i in range(n):
            l = np.int32(np.rint(iscale * x[r, i]))
            l = max(-nmax, min(nmax - 1, l))
            L[r, i] = l + nmax
            w = x[r, i] * x[r, i]
            fl = np.float32(l)
            sumlx += w * x[r, i] * fl
            suml2 += w * fl * fl
        scale = sumlx / suml2 if suml2 != F0 else F0
        best = scale * sumlx
        for s in range(-9, 10):
            if s == 0:
                continue
            iscale = -(fnmax + F01 * np.float32(s)) / mx
            sumlx = F0
            suml2 = F0
            for i in range(n):
                l = np.int32(np.rint(iscale * x[r, i]))
                l = max(-nmax, min(nmax - 1, l))
                w = x[r, i] * x[r, i]
                fl = np.float32(l)
                sumlx += w * x[r, i] * fl
                suml2 += w * fl * fl
            if suml2 > F0 and sumlx * sumlx > best * suml2:
                for i in range(n):
                    l = np.int32(np.rint(iscale * x[r, i]))
                    L[r, i] = nmax + max(-nmax, min(nmax - 1, l))
                scale = sumlx / suml2
                best = scale * sumlx
        scale_out[r] = scale


def make_qx_quants(x, nmax):
    """Drop-in for kquants.make_qx_quants."""
    N, n = x.shape
    scale, L = np.empty(N, np.float32), np.empty((N, n), np.int32)
    _qx(np.ascontiguousarray(x, np.float32), nmax, scale, L)
    return scale, L


def q4_k(x: np.ndarray) -> np.ndarray:
    return kquants.quantize_q4_k(x, make_qkx2_quants)


def q6_k(x: np.ndarray) -> np.ndarray:
    return kquants.quantize_q6_k(x, make_qx_quants)


def _rows(fn, qtype: QuantType):
    """Block kernel -> row kernel: float32 (n_rows, n_cols) -> uint8 (n_rows, row_bytes)."""
    fmt = FORMATS[qtype]

    def run(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        out = fn(x.reshape(-1, fmt.block_size))
        return out.reshape(*x.shape[:-1], x.shape[-1] // fmt.block_size * fmt.type_size)
    return run


QUANTIZERS = {
    QuantType.Q8_0: _rows(q8_0, QuantType.Q8_0),
    QuantType.Q4_0: _rows(q4_0, QuantType.Q4_0),
    QuantType.Q4_K: _rows(kquants.chunked(q4_k, 1 << 14), QuantType.Q4_K),
    QuantType.Q6_K: _rows(kquants.chunked(q6_k, 1 << 14), QuantType.Q6_K),
}
