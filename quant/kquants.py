"""NumPy reference quantizers for the k-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (no importance matrix).

They follow llama.cpp's `quantize_row_qN_K_ref` (ggml-quants.c), which is what `llama_model_quantize` runs when
no imatrix is given: the same float32 operations in the same order, so the bytes are equal to llama.cpp's.

Vectorized across sub-blocks, sequential along a sub-block: every sum over a sub-block's 16 or 32 elements
is accumulated element by element (`_seqsum`), because float32 addition order changes the last bit and the
scale searches compare such sums. Rounding is `nearest_int` (float32 round-half-even, as `np.rint`).

Each quantizer maps (n_blocks, 256) float32 -> (n_blocks, type_size) uint8 (layouts: see quant/formats.py).
"""
from __future__ import annotations

import numpy as np

f32 = np.float32
GROUP_MAX_EPS = f32(1e-15)

__all__ = ["KQUANTS", "chunked", "make_qkx2_quants", "make_qx_quants", "make_q3_quants", "quantize_q4_k",
           "quantize_q6_k"]


def _seqsum(a: np.ndarray) -> np.ndarray:
    """(N, n) -> (N,) float32 sum accumulated left to right (C's `for (i...) s += a[i]`)."""
    s = a[:, 0].copy()
    for i in range(1, a.shape[1]):
        s += a[:, i]
    return s


def _nearest(v: np.ndarray) -> np.ndarray:
    """ggml nearest_int: float32 round half to even, as int32."""
    return np.rint(v).astype(np.int32)


def _f16_round(v: np.ndarray) -> np.ndarray:
    """float32 -> f16 -> float32 (GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v)))."""
    return v.astype(np.float16).astype(f32)


def _abs_argmax_signed(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, n) -> (amax, max): largest |x| and its signed value (first one on ties, as C's strict `>`)."""
    idx = np.abs(x).argmax(axis=1)
    mx = x[np.arange(x.shape[0]), idx]
    return np.abs(mx), mx


# ----------------------------------------------------------------------------------------------------------------
# Scale searches (one row = one sub-block)
# ----------------------------------------------------------------------------------------------------------------


def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                     use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric scale + min search. x, w: (N, n) float32. Returns (scale (N,), the_min (N,), L (N, n) uint8)."""
    mn = np.minimum.reduce(x, axis=1)
    mx = np.maximum.reduce(x, axis=1)
    sum_w = _seqsum(w)
    sum_x = _seqsum(w * x)
    mn = np.where(mn > 0, f32(0), mn).astype(f32)
    flat = mx == mn
    rng = np.where(flat, f32(1), mx - mn).astype(f32)
    xm = x - mn[:, None]  # (N, n)
    iscale = f32(nmax) / rng
    scale = f32(1) / iscale
    L = np.clip(_nearest(iscale[:, None] * xm), 0, nmax)

    def err(sc, lv, m):
        diff = sc[:, None] * lv.astype(f32) + m[:, None] - x
        diff = np.abs(diff) if use_mad else diff * diff
        return _seqsum(w * diff)

    best = err(scale, L, mn)
    for step in range(nstep + 1):
        # C reuses `min` after a better candidate was taken: later steps start from the new min
        rng = np.where(flat, f32(1), mx - mn).astype(f32)
        xm = x - mn[:, None]
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / rng
        la = np.clip(_nearest(iscale[:, None] * xm), 0, nmax)
        lf = la.astype(f32)
        wl = w * lf
        sum_l = _seqsum(wl)
        sum_l2 = _seqsum(wl * lf)
        sum_xl = _seqsum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_min = np.where(pos, f32(0), this_min).astype(f32)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale).astype(f32)
            cur = err(this_scale, la, this_min)
        take = ok & (cur < best) & ~flat
        L = np.where(take[:, None], la, L)
        best = np.where(take, cur, best)
        scale = np.where(take, this_scale, scale)
        mn = np.where(take, this_min, mn)
    L = np.where(flat[:, None], 0, L)
    scale = np.where(flat, f32(0), scale).astype(f32)
    return scale, (-mn).astype(f32), L.astype(np.uint8)


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric scale search with weights x*x (rmse_type 1, no quant weights). Returns (scale (N,), L (N, n))."""
    amax, mx = _abs_argmax_signed(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, f32(1), mx).astype(f32)
    w = x * x

    def attempt(iscale):
        l = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1)
        lf = l.astype(f32)
        return l, _seqsum(w * x * lf), _seqsum(w * lf * lf)

    l, sumlx, suml2 = attempt(f32(-nmax) / mx)
    L = l + nmax
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0)).astype(f32)
        best = scale * sumlx
        for s in range(-9, 10):
            if s == 0:
                continue
            l, sumlx, suml2 = attempt(-(f32(nmax) + f32(0.1) * f32(s)) / mx)
            take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(take[:, None], l + nmax, L)
            scale = np.where(take, sumlx / suml2, scale).astype(f32)
            best = np.where(take, scale * sumlx, best).astype(f32)
    L = np.where(zero[:, None], 0, L)
    scale = np.where(zero, f32(0), scale).astype(f32)
    return scale, L


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric search with coordinate-descent refinement (do_rmse). Returns (scale (N,), L (N, n) in 0..2*nmax-1)."""
    N, n = x.shape
    amax, mx = _abs_argmax_signed(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, f32(1), mx).astype(f32)
    iscale = f32(-nmax) / mx
    L = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1)
    lf = L.astype(f32)
    w = x * x
    sumlx = _seqsum(w * x * lf)
    suml2 = _seqsum(w * lf * lf)
    active = np.ones(N, dtype=bool)
    wx = w * x
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(5):
            changed = np.zeros(N, dtype=bool)
            for i in range(n):
                li = L[:, i].astype(f32)
                slx = sumlx - wx[:, i] * li
                sl2 = suml2 - w[:, i] * li * li
                new_l = np.clip(_nearest(x[:, i] * sl2 / slx), -nmax, nmax - 1)
                nf = new_l.astype(f32)
                slx2 = slx + wx[:, i] * nf
                sl22 = sl2 + w[:, i] * nf * nf
                take = (active & (slx > 0) & (new_l != L[:, i]) & (sl22 > 0)
                        & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22))
                L[:, i] = np.where(take, new_l, L[:, i])
                sumlx = np.where(take, slx2, sumlx).astype(f32)
                suml2 = np.where(take, sl22, suml2).astype(f32)
                changed |= take
            active &= changed
            if not active.any():
                break
        scale = np.where(suml2 > 0, sumlx / suml2, f32(0)).astype(f32)
    L = np.where(zero[:, None], 0, L + nmax)
    scale = np.where(zero, f32(0), scale).astype(f32)
    return scale, L


# ----------------------------------------------------------------------------------------------------------------
# Packing helpers
# ----------------------------------------------------------------------------------------------------------------


def _pack_crumbs(L: np.ndarray) -> np.ndarray:
    """(nb, 256) 2-bit values -> (nb, 64): per 128-half, byte l = L[l] | L[l+32]<<2 | L[l+64]<<4 | L[l+96]<<6."""
    nb = L.shape[0]
    q = L.astype(np.uint8).reshape(nb, 2, 4, 32)
    out = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)  # (nb, 2, 32)
    return out.reshape(nb, 64)


def _pack_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """(nb, 8) 6-bit scales and mins -> (nb, 12) bytes of Q4_K / Q5_K (inverse of formats.k_scale_min)."""
    out = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, :4]
    out[:, 4:8] = lm[:, :4]
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    out[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return out


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(f32).astype("<f2").reshape(-1, 1).view(np.uint8)


# ----------------------------------------------------------------------------------------------------------------
# Block quantizers: (nb, 256) float32 -> (nb, type_size) uint8
# ----------------------------------------------------------------------------------------------------------------


def _qk_scales_mins(x: np.ndarray, nmax: int, rmin: float, nstep: int, search=None):
    """Q4_K / Q5_K first pass: per 32-element sub-block scale and min, 6-bit packed. Returns
    (scales12 (nb, 12), d16 (nb,), dmin16 (nb,), L (nb, 256)) with d/dmin already rounded to f16."""
    nb = x.shape[0]
    xs = x.reshape(nb * 8, 32)
    av_x = np.sqrt(_seqsum(xs * xs) / f32(32)).astype(f32)
    w = av_x[:, None] + np.abs(xs)
    scales, mins, L = (search or make_qkx2_quants)(xs, w, nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1), f32(0))
    max_min = np.maximum(mins.max(axis=1), f32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0)).astype(f32)
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0)).astype(f32)
    ls = np.minimum(_nearest(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    d = _f16_round(max_scale / f32(63))
    dmin = _f16_round(max_min / f32(63))
    # second pass: re-quantize against the rounded scales
    dl = d[:, None] * ls.astype(f32)  # (nb, 8)
    ml = dmin[:, None] * lm.astype(f32)
    L = L.reshape(nb, 8, 32).astype(np.int32)
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest((x.reshape(nb, 8, 32) + ml[:, :, None]) / dl[:, :, None]), 0, nmax)
    L = np.where((dl != 0)[:, :, None], l2, L).reshape(nb, 256)
    return _pack_k_scales(ls, lm), d, dmin, L


def quantize_q4_k(x: np.ndarray, search=None) -> np.ndarray:
    """search: a drop-in for make_qkx2_quants (the Numba kernel in kernels_cpu/quantize.py)."""
    nb = x.shape[0]
    scales12, d, dmin, L = _qk_scales_mins(x, 15, -1.0, 20, search)
    q = L.astype(np.uint8).reshape(nb, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales12, qs], axis=1)


def _q_q5_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    scales12, d, dmin, L = _qk_scales_mins(x, 31, -0.5, 15)
    q = L.astype(np.uint8).reshape(nb, 4, 2, 32)
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(nb, 128)
    hi = (q >> 4) & 1  # (nb, 4 groups, 2 halves, 32)
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)  # bit 2g + half
    qh = (hi << shifts[None, :, :, None]).sum(axis=(1, 2), dtype=np.uint8)  # (nb, 32)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales12, qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray, search=None) -> np.ndarray:
    """search: a drop-in for make_qx_quants (the Numba kernel in kernels_cpu/quantize.py)."""
    nb = x.shape[0]
    scales, L = (search or make_qx_quants)(x.reshape(nb * 16, 16), 32)
    scales = scales.reshape(nb, 16)
    max_abs, max_scale = _abs_argmax_signed(scales)
    zero = max_abs < GROUP_MAX_EPS
    max_scale = np.where(zero, f32(1), max_scale).astype(f32)
    iscale = f32(-128) / max_scale
    d = _f16_round(f32(1) / iscale)
    sc = np.minimum(127, _nearest(iscale[:, None] * scales)).astype(np.int8)  # (nb, 16)
    dl = d[:, None] * sc.astype(f32)
    L = L.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest(x.reshape(nb, 16, 16) / dl[:, :, None]), -32, 31) + 32
    L = np.where((dl != 0)[:, :, None], l2, L).reshape(nb, 2, 4, 32).astype(np.uint8)
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)
    out[zero] = 0
    return out


def _q_q3_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    scales, L = make_q3_quants(x.reshape(nb * 16, 16), 4)
    scales = scales.reshape(nb, 16)
    amax, max_scale = _abs_argmax_signed(scales)
    nz = max_scale != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(nz, f32(-32) / np.where(nz, max_scale, f32(1)), f32(0)).astype(f32)
    l = (np.clip(_nearest(iscale[:, None] * scales).astype(np.int8), -32, 31) + 32).astype(np.uint8)
    l = np.where(nz[:, None], l, 0).astype(np.uint8)  # (nb, 16) in 0..63
    sc12 = np.zeros((nb, 12), dtype=np.uint8)
    sc12[:, :8] = (l[:, :8] & 0xF) | ((l[:, 8:] & 0xF) << 4)
    hi = (l >> 4).reshape(nb, 4, 4)  # [j // 4, j % 4]
    sc12[:, 8:] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    with np.errstate(divide="ignore"):
        d = _f16_round(np.where(nz, f32(1) / np.where(nz, iscale, f32(1)), f32(0)).astype(f32))
    dl = d[:, None] * (l.astype(np.int32) - 32).astype(f32)
    dl = np.where(nz[:, None], dl, f32(0))
    L = L.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest(x.reshape(nb, 16, 16) / dl[:, :, None]), -4, 3) + 4
    L = np.where((dl != 0)[:, :, None], l2, L).reshape(nb, 256)
    high = (L > 3).reshape(nb, 8, 32).astype(np.uint8)  # bit j // 32 of hmask[j % 32]
    hmask = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    L = np.where(L > 3, L - 4, L)
    return np.concatenate([hmask, _pack_crumbs(L), sc12, _f16_bytes(d)], axis=1)


def _q_q2_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    xs = x.reshape(nb * 16, 16)
    scales, mins, L = make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale = np.maximum(scales.max(axis=1), f32(0))
    max_min = np.maximum(mins.max(axis=1), f32(0))
    with np.errstate(divide="ignore"):
        isc = np.where(max_scale > 0, f32(15) / max_scale, f32(0)).astype(f32)
        imn = np.where(max_min > 0, f32(15) / max_min, f32(0)).astype(f32)
    lsc = (_nearest(isc[:, None] * scales) & 0xFF).astype(np.uint8)
    lmn = (_nearest(imn[:, None] * mins) & 0xFF).astype(np.uint8)
    sc = lsc | (lmn << 4)
    d = _f16_round(np.where(max_scale > 0, max_scale / f32(15), f32(0)).astype(f32))
    dmin = _f16_round(np.where(max_min > 0, max_min / f32(15), f32(0)).astype(f32))
    dl = d[:, None] * (sc & 0xF).astype(f32)
    ml = dmin[:, None] * (sc >> 4).astype(f32)
    L = L.reshape(nb, 16, 16).astype(np.int32)
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest((x.reshape(nb, 16, 16) + ml[:, :, None]) / dl[:, :, None]), 0, 3)
    L = np.where((dl != 0)[:, :, None], l2, L).reshape(nb, 256)
    return np.concatenate([sc, _pack_crumbs(L), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


_BLOCKS_PER_CALL = 2048  # bounds the (n_sub, 32) temporaries to a few MB


def chunked(fn, blocks_per_call: int = _BLOCKS_PER_CALL):
    """Block quantizer -> the same on at most `blocks_per_call` blocks per call (bounds the temporaries)."""
    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=f32)
        if x.shape[0] <= blocks_per_call:
            return fn(x)
        return np.concatenate([fn(x[i:i + blocks_per_call]) for i in range(0, x.shape[0], blocks_per_call)])
    run.__name__ = fn.__name__
    return run


# GGML type id -> block quantizer (quant.formats registers these under QuantType)
KQUANTS = {10: chunked(_q_q2_k), 11: chunked(_q_q3_k), 12: chunked(quantize_q4_k), 13: chunked(_q_q5_k),
           14: chunked(quantize_q6_k)}
