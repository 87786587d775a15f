"""NumPy twins of ggml-cpu's float arithmetic (x86-64, AVX512 build, GCC) for the bit-exact kernel tests.

Each function repeats llama.cpp's operations in its order and rounding, vectorised over leading axes; fma32 is a
correctly rounded float32 fused multiply-add (the product is exact in double, the sum is rounded to odd in
double and then to float32, which avoids double rounding).
"""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

f32, f64 = np.float32, np.float64


def fma32(a, b, c) -> np.ndarray:
    """float32 a * b + c with one rounding."""
    a, b, c = np.broadcast_arrays(np.asarray(a, f32), np.asarray(b, f32), np.asarray(c, f32))
    p = a.astype(f64) * b.astype(f64)  # exact: 24 + 24 bits
    cc = c.astype(f64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + cc
        bb = s - p
        err = (p - (s - bb)) + (cc - bb)  # TwoSum: p + cc == s + err exactly
        odd = (np.atleast_1d(s).view(np.int64) & 1).reshape(s.shape) == 1
        inexact_even = (err != 0) & ~odd & np.isfinite(s)
        s = np.where(inexact_even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)  # round to odd
    return s.astype(f32)


def tree16(x) -> np.ndarray:
    """GCC's _mm512_reduce_add_ps over the last axis (16 lanes): halves added lane-wise, 16 -> 8 -> 4 -> 2 -> 1."""
    x = np.asarray(x, f32)
    t = x[..., 8:] + x[..., :8]
    t = t[..., 4:] + t[..., :4]
    t = t[..., 2:] + t[..., :2]
    return t[..., 0] + t[..., 1]


def vec_dot_f32(x, y) -> np.ndarray:
    """ggml_vec_dot_f32 over the last axis: 4 accumulators of 16 lanes (element i -> lane i % 64, fma over
    i // 64), sum[0] += sum[2], sum[1] += sum[3], sum[0] += sum[1], reduce_add; the n % 64 leftovers by scalar fma."""
    x, y = np.broadcast_arrays(np.asarray(x, f32), np.asarray(y, f32))
    n = x.shape[-1]
    main = n - n % 64
    acc = np.zeros(x.shape[:-1] + (64,), f32)
    for i in range(0, main, 64):
        acc = fma32(x[..., i:i + 64], y[..., i:i + 64], acc)
    s = tree16((acc[..., 0:16] + acc[..., 32:48]) + (acc[..., 16:32] + acc[..., 48:64]))
    for i in range(main, n):
        s = fma32(x[..., i], y[..., i], s)
    return s


def sgemm_dot(x, y) -> np.ndarray:
    """One output of llamafile's tinyBLAS<16, __m512> over the last axis (n % 16 == 0): one accumulator of 16
    lanes (element i -> lane i % 16, fma over i // 16), then reduce_add."""
    x, y = np.broadcast_arrays(np.asarray(x, f32), np.asarray(y, f32))
    n = x.shape[-1]
    assert n % 16 == 0
    acc = np.zeros(x.shape[:-1] + (16,), f32)
    for i in range(0, n, 16):
        acc = fma32(x[..., i:i + 16], y[..., i:i + 16], acc)
    return tree16(acc)


EXP_CONSTS = {k: f32(float.fromhex(v)) for k, v in dict(
    shift="0x1.8p23", log2e="0x1.715476p+0", ln2_hi="0x1.62e4p-1", ln2_lo="0x1.7f7d1cp-20", c1="0x1.ffffecp-1",
    c2="0x1.fffdb6p-2", c3="0x1.555e66p-3", c4="0x1.573e2ep-5", c5="0x1.0e4020p-7").items()}


def expf(x) -> np.ndarray:
    """ggml_v_expf (ggml-cpu/vec.h, AVX512F + AVX512DQ variant), element-wise."""
    c = EXP_CONSTS
    x = np.asarray(x, f32)
    with np.errstate(all="ignore"):
        z = fma32(x, c["log2e"], c["shift"])
        n = z - c["shift"]
        b = fma32(-n, c["ln2_lo"], fma32(-n, c["ln2_hi"], x))
        d = np.abs(n) > f32(192)
        u = b * b
        j = fma32(fma32(fma32(c["c5"], b, c["c4"]), u, fma32(c["c3"], b, c["c2"])), u, fma32(c["c1"], b, f32(1)))
        res = (j.astype(f64) * np.ldexp(1.0, np.where(d | np.isnan(n), 0, n).astype(np.int64))).astype(f32)  # scalef
        res = np.where(np.isnan(n), f32(np.nan), res)
        return np.where(d, np.where(n <= 0, f32(0), f32(np.inf)), res).astype(f32)


def tanhf(x) -> np.ndarray:
    """The C library's tanhf (ggml_vec_tanh_f32 calls it; glibc's is not correctly rounded), element-wise."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.tanhf.restype, libm.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
    x = np.asarray(x, f32)
    return np.array([libm.tanhf(float(v)) for v in x.reshape(-1)], f32).reshape(x.shape)


def libm_expf(x) -> np.ndarray:
    """The C library's expf (the scalar tails of ggml's softmax call it), element-wise."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    x = np.asarray(x, f32)
    return np.array([libm.expf(float(v)) for v in x.reshape(-1)], f32).reshape(x.shape)


def softmax_rows(s: np.ndarray, sinks=None) -> np.ndarray:
    """ggml_compute_forward_soft_max_f32 on rows of KV cells (masked cells -inf, row length % 16 == 0):
    e = expf(s - max); per 16 cells a reduce_add, summed in double; e * (float)(1 / sum). sinks (one per row,
    ggml_soft_max_add_sinks): max = MAX(max, sink), and the sum gains libm expf(sink - max)."""
    s = np.asarray(s, f32)
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, f32).reshape(m.shape))
    e = expf(s - m)
    part = tree16(e.reshape(e.shape[:-1] + (-1, 16)))
    total = np.zeros(s.shape[:-1], f64)
    for c in range(part.shape[-1]):
        total = total + part[..., c]
    if sinks is not None:
        total = total + libm_expf(np.asarray(sinks, f32).reshape(total.shape) - m[..., 0]).astype(f64)
    return e * (1.0 / total).astype(f32)[..., None]


def attention(q, k, v, positions, *, single: bool, window: int = 0, scale: float, softcap: float = 0.0,
              sinks=None):
    """llama.cpp's attention (F32 K/V cache, no flash attention) for query rows of one sequence whose K/V are
    (P, KVH, hd) / (P, KVH, vd) at positions 0..P-1: KQ by vec_dot_f32, scale, optional soft-cap, softmax over
    KV cells (the cache view padded to a multiple of 16 cells; soft-cap as ggml_scale, ggml_tanh, ggml_scale), P @ V by sgemm_dot (a batch of >= 2 tokens) or
    vec_dot_f32 (single=True: a one-token batch). sinks: (H,) per-head sink logits or None. Returns (T, H, vd)
    float32."""
    T, H, hd = q.shape
    P, KVH, vd = v.shape
    n_kv = -(-P // 64) * 64  # any multiple of 64 >= P gives the same result
    group = H // KVH
    out = np.empty((T, H, vd), f32)
    cells = np.arange(n_kv)
    for t in range(T):
        pos = int(positions[t])
        visible = (cells <= pos) & ((cells > pos - window) if window else True)
        for h in range(H):
            kk = np.zeros((n_kv, hd), f32)
            kk[:P] = k[:, h // group]
            x = vec_dot_f32(q[t, h][None, :], kk) * f32(scale)
            if softcap:
                x = tanhf(x * (f32(1) / f32(softcap))) * f32(softcap)
            p = softmax_rows(np.where(visible, x, -np.inf).astype(f32), None if sinks is None else sinks[h:h + 1])
            vv = np.zeros((n_kv, vd), f32)
            vv[:P] = v[:, h // group]
            out[t, h] = (vec_dot_f32 if single else sgemm_dot)(p[None, :], vv.T)
    return out
