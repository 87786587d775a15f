"""Element-wise ops: rmsnorm, rope, activations. Arithmetic follows ggml's CPU ops (sums in double,
rope angles by repeated float32 multiplication) so results track llama.cpp closely."""
from __future__ import annotations

import math

import numba as nb
import numpy as np

GELU_COEF_A = 0.044715
SQRT_2_OVER_PI = 0.7978845608028654


@nb.njit(cache=True, nogil=True)
def _rmsnorm(out, x, w, eps):
    # out, x: (T, D)  w: (D,)
    T, D = x.shape
    for t in range(T):
        ss = 0.0  # float64 accumulator, as ggml_float
        for d in range(D):
            ss += np.float64(x[t, d] * x[t, d])  # float32 square, double sum: ggml_compute_forward_rms_norm_f32
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(ss / D) + eps))
        for d in range(D):
            out[t, d] = x[t, d] * scale * w[d]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMS-normalise each row of x (..., D) and multiply by w (D,)."""
    shape = x.shape
    x2 = np.ascontiguousarray(x.reshape(-1, shape[-1]), dtype=np.float32)
    out = np.empty_like(x2)
    _rmsnorm(out, x2, np.ascontiguousarray(w, dtype=np.float32), np.float32(eps))
    return out.reshape(shape)


def rope_tables(positions: np.ndarray, n_dims: int, base: float, scale: float = 1.0):
    """cos/sin tables (T, n_dims/2) as ggml_rope_cache_init computes them (float32 angle recurrence)."""
    theta_scale = np.float32(base) ** np.float32(-2.0 / n_dims)
    theta = positions.astype(np.float32)
    cos = np.empty((len(positions), n_dims // 2), dtype=np.float32)
    sin = np.empty_like(cos)
    for i in range(n_dims // 2):
        ang = np.float32(scale) * theta
        cos[:, i] = np.cos(ang)
        sin[:, i] = np.sin(ang)
        theta = theta * theta_scale
    return cos, sin


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, neox: bool) -> np.ndarray:
    """Rotate x (T, H, hd) in place by per-row tables (T, hd/2): NeoX halves or adjacent pairs."""
    c, s = cos[:, None, :], sin[:, None, :]
    half = cos.shape[1]
    if neox:
        x0, x1 = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = x0 * c - x1 * s
        x[..., half:2 * half] = x0 * s + x1 * c
    else:
        x0, x1 = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = x0 * c - x1 * s
        x[..., 1:2 * half:2] = x0 * s + x1 * c
    return x


def _gelu_table() -> np.ndarray:
    """ggml's GELU table: tanh-GELU of every f16 value, rounded to f16, as float32 (65536,).

    Bit-identical to ggml_table_gelu_f16 of the x86 build (checked entry by entry): ggml_gelu_f32 is
    0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))) in float32, where the compiler contracts
    1.0f + (GELU_COEF_A*x)*x into one fma and tanhf is glibc's (correctly rounded here). With NumPy's float32
    tanh (not correctly rounded) 234 entries were one f16 step off (negative x, where 1 + tanh cancels); without
    the fma, one.
    """
    x = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    f32 = np.float32
    with np.errstate(all="ignore"):
        ax = f32(GELU_COEF_A) * x
        inner = (ax.astype(np.float64) * x + 1.0).astype(f32)  # fma(a*x, x, 1) through float64 (exact product)
        z = f32(SQRT_2_OVER_PI) * x * inner
        t = np.tanh(z.astype(np.float64)).astype(f32)  # tanhf, correctly rounded
        y = f32(0.5) * x * (f32(1.0) + t)
    return y.astype(np.float16).astype(np.float32)


GELU_F16 = _gelu_table()


@nb.njit(cache=True, nogil=True)
def _geglu(out, gate, gate_f16, up, table):
    # GELU(gate) * up with ggml's f16 table (GGML_GELU_FP16): the input rounded to f16 (bits in gate_f16)
    # indexes the table
    T, F = gate.shape
    for t in range(T):
        for f in range(F):
            g = gate[t, f]
            if g <= np.float32(-10.0):
                y = np.float32(0.0)
            elif g >= np.float32(10.0):
                y = g
            else:
                y = table[gate_f16[t, f]]
            out[t, f] = y * up[t, f]


@nb.njit(cache=True, nogil=True)
def _swiglu(out, gate, up):
    T, F = gate.shape
    for t in range(T):
        for f in range(F):
            g = gate[t, f]
            out[t, f] = g / (np.float32(1.0) + np.float32(math.exp(-g))) * up[t, f]


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """GELU(gate) * up for (T, F) float32 arrays."""
    out = np.empty_like(gate)
    _geglu(out, gate, gate.astype(np.float16).view(np.uint16), up, GELU_F16)
    return out


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SiLU(gate) * up for (T, F) float32 arrays."""
    out = np.empty_like(gate)
    _swiglu(out, gate, up)
    return out


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap), in place."""
    np.tanh(x / np.float32(cap), out=x)
    x *= np.float32(cap)
    return x
