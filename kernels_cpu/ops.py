"""Element-wise ops: rmsnorm, rope (YaRN included), activations, and ggml's vectorised expf. Arithmetic follows
ggml's CPU ops operation for operation (sums in double, rope angles by repeated float32 multiplication, glibc's
cosf/sinf/powf, the fused multiply-adds GCC contracts), so results are bit-identical to llama.cpp's."""
from __future__ import annotations

import math

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from kernels_cpu._jit import jit, parallel_jit
from kernels_cpu.parallel import parallel_for

# Rows per thread from which the row-wise ops (rmsnorm, geglu, swiglu) split over the worker threads
# (prefill); decode rows stay on the calling thread. Rows are independent, so results do not change.
ROWS_PER_THREAD = 64

GELU_COEF_A = 0.044715
SQRT_2_OVER_PI = 0.7978845608028654


@jit(inline="always")
def _inv_rms(row, eps):
    # 1 / sqrt(mean(row^2) + eps) of a (D,) row as ggml_compute_forward_rms_norm_f32: float32 squares, double sum
    ss = 0.0  # float64 accumulator, as ggml_float
    for d in range(len(row)):
        ss += np.float64(row[d] * row[d])
    return np.float32(1.0) / np.float32(math.sqrt(np.float32(ss / len(row)) + eps))


@jit
def _rmsnorm(out, x, w, eps):
    # out, x: (T, D)  w: (D,)
    T, D = x.shape
    for t in range(T):
        scale = _inv_rms(x[t], eps)
        for d in range(D):
            out[t, d] = x[t, d] * scale * w[d]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMS-normalise each row of x (..., D) and multiply by w (D,)."""
    shape = x.shape
    x2 = np.ascontiguousarray(x.reshape(-1, shape[-1]), dtype=np.float32)
    out = np.empty_like(x2)
    _by_rows(_rmsnorm, out, (x2,), (np.ascontiguousarray(w, dtype=np.float32), np.float32(eps)))
    return out.reshape(shape)


@jit
def _residual_norm(h, x, y, w_post, w_next, eps, post, norm_next):
    # x (T, D) in place: x += rmsnorm(y, w_post) if post else y; then (norm_next) h (T, D) = rmsnorm(x, w_next).
    # The float operations of _rmsnorm and NumPy's x + y, in their order: bit-identical to the separate ops.
    T, D = x.shape
    for t in range(T):
        if post:
            scale = _inv_rms(y[t], eps)
            for d in range(D):
                x[t, d] = x[t, d] + y[t, d] * scale * w_post[d]
        else:
            for d in range(D):
                x[t, d] = x[t, d] + y[t, d]
        if norm_next:
            scale = _inv_rms(x[t], eps)
            for d in range(D):
                h[t, d] = x[t, d] * scale * w_next[d]


_NO_NORM = np.zeros(1, np.float32)


def residual_norm(x: np.ndarray, y: np.ndarray, w_post: np.ndarray | None, w_next: np.ndarray | None,
                  eps: float) -> np.ndarray | None:
    """The residual step between two blocks in one call: x += rmsnorm(y, w_post) (x += y when w_post is None),
    in place, then the next block's input rmsnorm(x, w_next) (None when w_next is None). x, y: (T, D) float32, x
    C-contiguous (the caller's residual stream); w_post, w_next: (D,). Bit-identical to the separate ops."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or x.ndim != 2:
        raise ValueError(f"residual_norm: x must be a C-contiguous float32 (T, D) array, got {x.dtype} {x.shape}")
    y = np.ascontiguousarray(y, dtype=np.float32).reshape(x.shape)
    h = np.empty_like(x) if w_next is not None else x  # (not written without w_next)
    wp = _NO_NORM if w_post is None else np.ascontiguousarray(w_post, dtype=np.float32)
    wn = _NO_NORM if w_next is None else np.ascontiguousarray(w_next, dtype=np.float32)
    _by_rows(_residual_norm, h, (x, y), (wp, wn, np.float32(eps), w_post is not None, w_next is not None))
    return h if w_next is not None else None


def _by_rows(kernel, out, row_args: tuple, args: tuple) -> None:
    """kernel(out, *row_args, *args) over row chunks of out / row_args (on several threads for many rows)."""
    n = out.shape[0]
    if n < 2 * ROWS_PER_THREAD:  # decode: straight to the kernel on the per-token path
        kernel(out, *row_args, *args)
        return
    twin = _ROW_SPLITS[kernel]

    def chunk(lo, hi, _scratch):
        kernel(out[lo:hi], *(a[lo:hi] for a in row_args), *args)

    parallel_for(chunk, n, ROWS_PER_THREAD, None, split=lambda bounds: twin(out, *row_args, *args, bounds))


@intrinsic
def fma32(typingctx, a, b, c):
    """float32 a * b + c with one rounding (llvm.fma.f32: vfmadd on FMA hosts)."""
    def codegen(context, builder, signature, args):
        f32, mod = ir.FloatType(), builder.module
        fn = mod.globals.get("llvm.fma.f32") or ir.Function(mod, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _pow2_f64(typingctx, n):
    """2.0**n as float64 for an int64 n in the normal range (built from the exponent bits)."""
    def codegen(context, builder, signature, args):
        bits = builder.shl(builder.add(args[0], ir.Constant(ir.IntType(64), 1023)), ir.Constant(ir.IntType(64), 52))
        return builder.bitcast(bits, ir.DoubleType())
    return types.float64(types.int64), codegen


# ggml_v_expf constants (ggml-cpu/vec.h, "adapted from arm limited optimized routine")
_F = np.float32
EXP_SHIFT = _F(float.fromhex("0x1.8p23"))
EXP_LOG2E = _F(float.fromhex("0x1.715476p+0"))
EXP_LN2_HI = _F(float.fromhex("0x1.62e4p-1"))
EXP_LN2_LO = _F(float.fromhex("0x1.7f7d1cp-20"))
EXP_C1 = _F(float.fromhex("0x1.ffffecp-1"))
EXP_C2 = _F(float.fromhex("0x1.fffdb6p-2"))
EXP_C3 = _F(float.fromhex("0x1.555e66p-3"))
EXP_C4 = _F(float.fromhex("0x1.573e2ep-5"))
EXP_C5 = _F(float.fromhex("0x1.0e4020p-7"))


@jit(inline="always")
def ggml_expf(x):
    """One lane of ggml_v_expf (the AVX512F+DQ variant ggml_vec_soft_max_f32 uses), operation for operation:
    n = round(x*log2e) by the 1.5*2^23 shift trick, b = x - n*ln2 in two fnmadds, a degree-5 polynomial in
    fmas, res = scalef(j, n) (= j*2^n rounded once, done exactly in double); lanes with |n| > 192 become
    0 (n <= 0) or inf. Branch-free (selects), so loops over it vectorize."""
    z = fma32(x, EXP_LOG2E, EXP_SHIFT)
    n = z - EXP_SHIFT
    b = fma32(-n, EXP_LN2_LO, fma32(-n, EXP_LN2_HI, x))
    u = b * b
    j = fma32(fma32(fma32(EXP_C5, b, EXP_C4), u, fma32(EXP_C3, b, EXP_C2)), u, fma32(EXP_C1, b, np.float32(1.0)))
    nc = min(max(n, np.float32(-192.0)), np.float32(192.0))  # in range for the exponent bits (NaN: selected away)
    r = np.float32(np.float64(j) * _pow2_f64(np.int64(nc)))
    r = np.float32(np.inf) if n > np.float32(192.0) else r
    r = np.float32(0.0) if n < np.float32(-192.0) else r
    return n if n != n else r  # NaN in, NaN out


@jit
def _expf_array(out, x):
    for i in range(x.size):
        out[i] = ggml_expf(x[i])


def expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf element-wise on a float32 array (for tests and NumPy callers)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _expf_array(out.reshape(-1), x.reshape(-1))
    return out


@jit
def _rope_tables(cos, sin, positions, base, scale, factors, mscale, ext_factor, corr_lo, corr_hi):
    # cos, sin: (T, n_dims/2)  positions: (T,)  factors: (n_dims/2,). ggml_rope_cache_init: theta_scale =
    # powf(base, -2.0f/n_dims); theta starts at (float)p and is multiplied by theta_scale once per pair;
    # cosf/sinf of freq_scale*theta/factor, times mscale (llvm.cos/sin.f32 call glibc's cosf/sinf, as llama.cpp's
    # build does). YaRN (ext_factor != 0, rope_yarn): pair i mixes the interpolated and extrapolated angles by
    # its ramp between the correction dims, and mscale grows by 1 + 0.1 ln(1/freq_scale) (GCC's fmas kept)
    half = cos.shape[1]
    theta_scale = np.float32(math.pow(base, np.float32(-2.0) / np.float32(2 * half)))
    if ext_factor != 0:
        mscale = mscale * fma32(np.float32(0.1), np.float32(math.log(np.float32(1.0) / scale)), np.float32(1.0))
    span = max(np.float32(0.001), corr_hi - corr_lo)
    for t in range(len(positions)):
        theta = np.float32(positions[t])
        for i in range(half):
            extrap = theta / factors[i]
            ang = scale * extrap
            if ext_factor != 0:  # rope_yarn_ramp(low, high, i0) with i0 / 2 = i
                y = (np.float32(i) - corr_lo) / span
                ramp = (np.float32(1.0) - min(np.float32(1.0), max(np.float32(0.0), y))) * ext_factor
                ang = fma32(ang, np.float32(1.0) - ramp, extrap * ramp)
            cos[t, i] = math.cos(ang) * mscale
            sin[t, i] = math.sin(ang) * mscale
            theta = theta * theta_scale


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple:
    """ggml_rope_yarn_corr_dims: the pair range (low, high) over which YaRN blends from extrapolated to
    interpolated angles, as float32 values (floor / ceil of n_dims ln(n_ctx_orig / (2 pi beta)) / (2 ln base))."""
    f = np.float32

    def dim(beta):
        return f(f(n_dims) * f(math.log(f(f(n_ctx_orig) / f(f(beta) * f(2) * f(math.pi)))))) / \
            f(f(2) * f(math.log(f(base))))
    return f(max(0.0, math.floor(dim(beta_fast)))), f(min(n_dims - 1.0, math.ceil(dim(beta_slow))))


def rope_tables(positions: np.ndarray, n_dims: int, base: float, scale: float = 1.0, *, factors=None,
                mscale: float = 1.0, yarn: tuple | None = None):
    """cos/sin tables (T, n_dims/2) as ggml_rope_cache_init computes them (float32 angle recurrence); factors
    (n_dims/2,) divide each pair's angle (LongRoPE frequency factors), mscale scales cos and sin. yarn: (ext_factor,
    n_ctx_orig, beta_fast, beta_slow) for YaRN scaling (scale = 1 / factor), None for none."""
    half = n_dims // 2
    cos = np.empty((len(positions), half), dtype=np.float32)
    sin = np.empty_like(cos)
    ff = np.ones(half, np.float32) if factors is None else np.ascontiguousarray(factors, dtype=np.float32)
    if ff.shape != (half,):
        raise ValueError(f"rope factors have shape {ff.shape}, expected ({half},)")
    ext, lo, hi = np.float32(0.0), np.float32(0.0), np.float32(0.0)
    if yarn is not None:
        ext_factor, n_ctx_orig, beta_fast, beta_slow = yarn
        ext = np.float32(ext_factor)
        lo, hi = yarn_corr_dims(n_dims, n_ctx_orig, base, beta_fast, beta_slow)
    _rope_tables(cos, sin, np.ascontiguousarray(positions, dtype=np.int64), np.float32(base), np.float32(scale),
                 ff, np.float32(mscale), ext, lo, hi)
    return cos, sin


@jit
def _apply_rope(x, cos, sin, neox):
    # x: (T, H, hd) in place; cos, sin: (T, half). ggml's rotate_pairs: x0*cos - x1*sin and x0*sin + x1*cos,
    # which GCC contracts to fma(x0, cos, -(x1*sin)) and fma(x0, sin, x1*cos) (checked against llama.cpp)
    T, H, _ = x.shape
    half = cos.shape[1]
    for t in range(T):
        for h in range(H):
            for i in range(half):
                i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
                c, s = cos[t, i], sin[t, i]
                x0, x1 = x[t, h, i0], x[t, h, i1]
                x[t, h, i0] = fma32(x0, c, -(x1 * s))
                x[t, h, i1] = fma32(x0, s, x1 * c)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, neox: bool) -> np.ndarray:
    """Rotate x (T, H, hd) in place by per-row tables (T, hd/2): NeoX halves or adjacent pairs."""
    cos, sin = np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32)
    if x.dtype == np.float32 and x.flags.c_contiguous:
        _apply_rope(x, cos, sin, neox)
    else:  # a strided view: rotate a contiguous copy and write it back
        y = np.ascontiguousarray(x, dtype=np.float32)
        _apply_rope(y, cos, sin, neox)
        x[...] = y
    return x


@jit
def _qk_norm_rope(q, k, cos, sin, wq, wk, eps, norm, neox):
    # q (T, H, hd), k (T, KVH, hd) in place: (norm) _rmsnorm of each head by wq / wk, then _apply_rope of each
    # head's first 2 * half dims (cos, sin: (T, half); half 0: none). The separate ops' kernels: bit-identical
    for x, w in ((q, wq), (k, wk)):
        if norm:
            heads = x.reshape(x.shape[0] * x.shape[1], x.shape[2])
            _rmsnorm(heads, heads, w, eps)  # in place: a head's scale is taken before its values are written
        _apply_rope(x, cos, sin, neox)


def qk_norm_rope(q: np.ndarray, k: np.ndarray, q_norm: np.ndarray | None, k_norm: np.ndarray | None, eps: float,
                 tables: tuple | None, *, neox: bool) -> None:
    """The per-head steps between the Q/K projections and attention, in one call, in place: rmsnorm of each head
    of q (T, H, hd) and k (T, KVH, hd) by q_norm / k_norm (hd,) (QK-norm; both None: none), then RoPE of each
    head's first 2 * half dims by tables = (cos, sin) (T, half) (None: none; half < hd / 2: partial rotary).
    q and k: C-contiguous float32 (the projections' fresh outputs). Bit-identical to rmsnorm then apply_rope."""
    for x in (q, k):
        if x.dtype != np.float32 or not x.flags.c_contiguous or x.ndim != 3 or len(x) != len(q):
            raise ValueError(f"qk_norm_rope: q, k must be C-contiguous float32 (T, heads, hd), got {x.dtype} {x.shape}")
    hd = q.shape[2]
    norm = q_norm is not None
    wq = np.ascontiguousarray(q_norm, dtype=np.float32) if norm else _NO_NORM
    wk = np.ascontiguousarray(k_norm, dtype=np.float32) if norm else _NO_NORM
    if norm and (k.shape[2] != hd or wq.shape != (hd,) or wk.shape != (hd,)):
        raise ValueError(f"qk_norm_rope: norm weights {wq.shape} / {wk.shape} for heads of {hd}, {k.shape[2]}")
    if tables is None:  # (T, 0): no pair turns
        cos = sin = np.zeros((len(q), 0), np.float32)
    else:
        cos, sin = (np.ascontiguousarray(t, dtype=np.float32) for t in tables)
        if cos.shape != sin.shape or cos.shape[0] != len(q) or 2 * cos.shape[1] > min(hd, k.shape[2]):
            raise ValueError(f"qk_norm_rope: rope tables {cos.shape} for q {q.shape}, k {k.shape}")
    if len(q):
        _by_rows(_qk_norm_rope, q, (k, cos, sin), (wq, wk, np.float32(eps), norm, neox))


def _gelu_table() -> np.ndarray:
    """ggml's GELU table: tanh-GELU of every f16 value, rounded to f16, as float32 (65536,).

    Bit-identical to ggml_table_gelu_f16 of the x86 build (checked entry by entry): ggml_gelu_f32 is
    0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))) in float32, where the compiler contracts
    1.0f + (GELU_COEF_A*x)*x into one fma and tanhf is glibc's (correctly rounded here). With NumPy's float32
    tanh (not correctly rounded) 234 entries were one f16 step off (negative x, where 1 + tanh cancels); without
    the fma, one.
    """
    f32 = np.float32
    with np.errstate(all="ignore"):  # NaN entries: AArch64's conversions flag signalling NaNs as invalid
        x = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
        ax = f32(GELU_COEF_A) * x
        inner = (ax.astype(np.float64) * x + 1.0).astype(f32)  # fma(a*x, x, 1) through float64 (exact product)
        z = f32(SQRT_2_OVER_PI) * x * inner
        t = np.tanh(z.astype(np.float64)).astype(f32)  # tanhf, correctly rounded
        y = f32(0.5) * x * (f32(1.0) + t)
        return y.astype(np.float16).astype(np.float32)


GELU_F16 = _gelu_table()


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    """int16 holding IEEE half bits -> float32 (LLVM fpext; F16C vcvtph2ps on x86)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def f32_to_f16_bits(typingctx, x):
    """float32 -> IEEE half bits (int16), rounded to nearest even (LLVM fptrunc: F16C vcvtps2ph on x86, fcvt on
    AArch64; vectorizes). Equal to NumPy's astype(float16) for every non-NaN input; a NaN stays a NaN (its payload may differ)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(types.float32), codegen


@intrinsic
def bits_to_f32(typingctx, bits):
    """uint32 bits -> float32 (LLVM bitcast; vectorizes)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def f32_to_bits(typingctx, x):
    """float32 -> its uint32 bits (LLVM bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@jit(inline="always")
def f16_round(v):
    """float32 v rounded to the nearest float16 value (ties to even), as float32 (inf past the f16 range)."""
    return f16_bits_to_f32(f32_to_f16_bits(np.float32(v)))


@jit
def f16_bits_array(x):
    """(n,) uint32 float32 bits -> (n,) uint16 f16 bits, rounded to nearest even as NumPy's astype(float16)
    (f32_to_f16_bits; a NaN stays a NaN)."""
    out = np.empty(x.shape[0], np.uint16)
    for i in range(x.shape[0]):
        out[i] = np.uint16(np.int64(f32_to_f16_bits(bits_to_f32(x[i]))) & 0xFFFF)
    return out


@jit
def _geglu(out, gate, up, table):
    # GELU(gate) * up with ggml's f16 table (GGML_GELU_FP16): the input rounded to f16 indexes the table, past
    # +-10 the GELU is 0 or the input (ggml_vec_gelu_f32). Branch-free over one flat loop: it vectorizes (the
    # f16 rounding is one conversion instruction, the lookup a gather)
    o, gf, uf = out.reshape(-1), gate.reshape(-1), up.reshape(-1)
    for i in range(gf.size):
        g = gf[i]
        y = table[np.int64(f32_to_f16_bits(g)) & 0xFFFF]
        y = g if g >= np.float32(10.0) else y
        y = np.float32(0.0) if g <= np.float32(-10.0) else y
        o[i] = y * uf[i]


@jit
def _swiglu(out, gate, up):
    # ggml_vec_swiglu_f32's vector loop: silu(g) = g / (1 + ggml_v_expf(-g)), times up (one flat loop: vectorizes)
    o, gf, uf = out.reshape(-1), gate.reshape(-1), up.reshape(-1)
    for i in range(gf.size):
        g = gf[i]
        o[i] = g / (np.float32(1.0) + ggml_expf(-g)) * uf[i]


@jit
def _swiglu_oai(out, gate, up, alpha, limit):
    # ggml_compute_forward_swiglu_oai_f32: x = min(gate, limit), y = clamp(up, -limit, limit),
    # x / (1 + expf(alpha * -x)) * (y + 1)
    T, F = gate.shape
    for t in range(T):
        for f in range(F):
            x = gate[t, f]
            if limit < x:
                x = limit
            y = up[t, f]
            y = -limit if y < -limit else (limit if limit < y else y)
            glu = x / (np.float32(1.0) + np.float32(math.exp(alpha * (-x))))
            out[t, f] = glu * (y + np.float32(1.0))


@jit
def _swiglu_rows(out, gate, up, alpha, limit):
    _swiglu(out, gate, up)  # (alpha and limit are swiglu_oai's)


# name -> compiled kernel(out, gate, up, alpha, limit) over (T, F) float32 rows: the gated activations of the
# MoE experts, for kernels that call them from compiled code (kernels_cpu.moe_ffn); the same arithmetic as
# swiglu / swiglu_oai below
GLU_KERNELS = {"swiglu": _swiglu_rows, "swiglu_oai": _swiglu_oai}


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """GELU(gate) * up for (T, F) float32 arrays."""
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    out = np.empty_like(gate)
    _by_rows(_geglu, out, (gate, np.ascontiguousarray(up, dtype=np.float32)), (GELU_F16,))
    return out


# prange twins of the row-wise kernels: the same kernel over row chunks [bounds[c], bounds[c+1])
@parallel_jit
def _rmsnorm_split(out, x, w, eps, bounds):
    for c in nb.prange(len(bounds) - 1):
        lo, hi = bounds[c], bounds[c + 1]
        _rmsnorm(out[lo:hi], x[lo:hi], w, eps)


@parallel_jit
def _geglu_split(out, gate, up, table, bounds):
    for c in nb.prange(len(bounds) - 1):
        lo, hi = bounds[c], bounds[c + 1]
        _geglu(out[lo:hi], gate[lo:hi], up[lo:hi], table)


@parallel_jit
def _swiglu_split(out, gate, up, bounds):
    for c in nb.prange(len(bounds) - 1):
        lo, hi = bounds[c], bounds[c + 1]
        _swiglu(out[lo:hi], gate[lo:hi], up[lo:hi])


@parallel_jit
def _swiglu_oai_split(out, gate, up, alpha, limit, bounds):
    for c in nb.prange(len(bounds) - 1):
        lo, hi = bounds[c], bounds[c + 1]
        _swiglu_oai(out[lo:hi], gate[lo:hi], up[lo:hi], alpha, limit)


@parallel_jit
def _residual_norm_split(h, x, y, w_post, w_next, eps, post, norm_next, bounds):
    for c in nb.prange(len(bounds) - 1):
        lo, hi = bounds[c], bounds[c + 1]
        _residual_norm(h[lo:hi], x[lo:hi], y[lo:hi], w_post, w_next, eps, post, norm_next)


@parallel_jit
def _qk_norm_rope_split(q, k, cos, sin, wq, wk, eps, norm, neox, bounds):
    for c in nb.prange(len(bounds) - 1):
        lo, hi = bounds[c], bounds[c + 1]
        _qk_norm_rope(q[lo:hi], k[lo:hi], cos[lo:hi], sin[lo:hi], wq, wk, eps, norm, neox)


_ROW_SPLITS = {_qk_norm_rope: _qk_norm_rope_split, _rmsnorm: _rmsnorm_split, _geglu: _geglu_split,
               _swiglu: _swiglu_split, _swiglu_oai: _swiglu_oai_split, _residual_norm: _residual_norm_split}


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SiLU(gate) * up for (T, F) float32 arrays."""
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    out = np.empty_like(gate)
    _by_rows(_swiglu, out, (gate, np.ascontiguousarray(up, dtype=np.float32)), ())
    return out


def swiglu_oai(gate: np.ndarray, up: np.ndarray, *, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    """gpt-oss's clamped SwiGLU for (T, F) float32 arrays: g = min(gate, limit), u = clamp(up, -limit, limit),
    g * sigmoid(alpha * g) * (u + 1) (llama.cpp's ggml_swiglu_oai with its alpha 1.702 and limit 7)."""
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    out = np.empty_like(gate)
    _by_rows(_swiglu_oai, out, (gate, np.ascontiguousarray(up, dtype=np.float32)), (np.float32(alpha),
                                                                                      np.float32(limit)))
    return out


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap), in place."""
    np.tanh(x / np.float32(cap), out=x)
    x *= np.float32(cap)
    return x
