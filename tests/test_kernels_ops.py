"""Element-wise ops of kernels_cpu.ops against llama.cpp's (ggml-cpu) arithmetic."""
from __future__ import annotations

import hashlib
from pathlib import Path

import ggml_ref
import numpy as np
import pytest

from kernels_cpu.ops import GELU_F16, apply_rope, expf, f16_bits_array, geglu, rope_tables, swiglu

# sha256 of ggml_table_gelu_f16 (libggml-cpu of llama-cpp-python 0.3.36, x86-64) at the finite f16 inputs, read
# from the library after ggml_cpu_init(); non-finite inputs never index the table (ggml_vec_geglu_f32 handles
# |x| >= 10 apart and a NaN gives NaN either way)
GGML_GELU_F16_SHA256 = "6be7bd8fd6b8a8fb4b704136976fc0173a0d12de047f1322f1e97fb20723bef7"


def _finite_f16() -> np.ndarray:
    return np.isfinite(np.arange(65536, dtype=np.uint16).view(np.float16))


def test_gelu_table_is_ggmls():
    with np.errstate(over="ignore", invalid="ignore"):
        bits = GELU_F16.astype(np.float16).view(np.uint16)
    assert hashlib.sha256(bits[_finite_f16()].tobytes()).hexdigest() == GGML_GELU_F16_SHA256
    # entries where a float32 tanh without the fma llama.cpp's build uses is one f16 step off (1 + tanh cancels)
    for idx, want in ((48965, 0xAC06), (49159, 0xA9A9), (49695, 0x9A21), (49865, 0x93A2)):
        assert bits[idx] == want, (idx, hex(bits[idx]))


def test_geglu_uses_table_and_cutoffs():
    gate = np.float32([[-12.0, -10.0, -3.0605469, 0.5, 9.99, 10.0, 12.5]])
    up = np.float32([[2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    got = geglu(gate, up)
    idx = gate.astype(np.float16).view(np.uint16)
    want = GELU_F16[idx] * up
    want[0, :2] = 0.0  # x <= -10: 0
    want[0, 5:] = gate[0, 5:] * up[0, 5:]  # x >= 10: x * up
    np.testing.assert_array_equal(got, want)



def test_geglu_every_f16_neighbourhood_equals_the_table_twin():
    """The vectorized GEGLU (f16 rounding by conversion instruction, branch-free cut-offs) equals its NumPy twin
    bit for bit on every finite f16 value and both float32 neighbours (the rounding edges), random values, +-inf
    and NaN, in one row, a few rows and a row-split batch; the twin rounds with NumPy's astype(float16)."""
    rng = np.random.default_rng(5)
    with np.errstate(all="ignore"):
        h = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
        h = h[np.isfinite(h)]
        g = np.concatenate([h, np.nextafter(h, np.float32(np.inf)), np.nextafter(h, np.float32(-np.inf)),
                            rng.standard_normal(60_000).astype(np.float32) * 8,
                            np.float32([np.inf, -np.inf, np.nan, -np.nan])])
    rng.shuffle(g[:-4])
    for rows in (1, 3, 200):
        n = g.size // rows * rows
        gate = np.ascontiguousarray(np.concatenate([g[-4:], g[:n - 4]]).reshape(rows, -1))
        up = rng.standard_normal(gate.shape).astype(np.float32)
        with np.errstate(all="ignore"):
            idx = gate.astype(np.float16).view(np.uint16)
            want = (np.where(gate <= -10, 0, np.where(gate >= 10, gate, GELU_F16[idx])) * up).astype(np.float32)
        got = geglu(gate, up)
        nan = np.isnan(want)
        assert nan.sum() >= 2
        np.testing.assert_array_equal(got[~nan], want[~nan])
        assert np.isnan(got[nan]).all()


def test_f16_bits_rounds_like_numpy():
    """The kernels' float32 -> f16 rounding (geglu's table index) equals NumPy's astype(float16): random bit
    patterns, every f16 value and the float32 neighbours of every halfway point (ties to even), subnormals,
    overflow, inf; a NaN stays a NaN."""
    rng = np.random.default_rng(3)
    h = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.uint32).astype(np.int64)
    near = np.concatenate([h + d for d in (-1, 0, 1, 0xFFF, 0x1000, 0x1001)]) % 2**32
    bits = np.concatenate([rng.integers(0, 2**32, 2_000_000), near]).astype(np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = bits.view(np.float32).astype(np.float16).view(np.uint16)
    got = f16_bits_array(bits)
    nan = np.isnan(bits.view(np.float32))
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all() and nan.sum() > 1000

# --- ggml_v_expf and rope: bit-exact against llama.cpp (tests/golden/attention_ops.npz, make_attention_golden.py)

GOLDEN = np.load(Path(__file__).parent / "golden" / "attention_ops.npz")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def test_expf_is_ggmls():
    x, want = GOLDEN["expf_x"], GOLDEN["expf_y"]
    np.testing.assert_array_equal(_bits(expf(x)), _bits(want))
    np.testing.assert_array_equal(_bits(ggml_ref.expf(x)), _bits(want))
    # ggml_vec_soft_max_f32's sum: a reduce_add per 16 lanes, added in double
    part = ggml_ref.tree16(want.reshape(-1, 4, 16)).astype(np.float64)
    np.testing.assert_array_equal(((part[:, 0] + part[:, 1]) + part[:, 2]) + part[:, 3], GOLDEN["expf_sum"])


def test_expf_matches_numpy_twin_everywhere():
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.uniform(-120, 100, 100_000), -rng.exponential(2.0, 100_000),
                        rng.normal(0, 1e-3, 10_000)]).astype(np.float32)
    edges = np.float32([-np.inf, np.inf, 0.0, -0.0, 88.72, 88.73, -87.33, -103.97, -104.0, -150.0])
    x = np.concatenate([x, edges, np.nextafter(edges, np.float32(0))])
    np.testing.assert_array_equal(_bits(expf(x)), _bits(ggml_ref.expf(x)))
    assert np.isnan(expf(np.float32([np.nan])))[0]
    y = x[100_000:110_000]  # softmax inputs (<= 0, not subnormal results): ~2 ulp from exp
    np.testing.assert_allclose(expf(y), np.exp(y.astype(np.float64)), rtol=3e-7)


def test_swiglu_is_ggmls_vector_loop():
    """ggml_vec_swiglu_f32: silu(g) = g / (1 + ggml_v_expf(-g)), times up; the same per row whatever the batch
    (and the prefill split over threads), and within float tolerance of float64 math."""
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((200, 1024)) * 4).astype(np.float32)
    u = rng.standard_normal((200, 1024)).astype(np.float32)
    g[0, :6] = [0.0, -0.0, 90.0, -90.0, np.inf, -np.inf]
    with np.errstate(invalid="ignore"):  # -inf / (1 + inf): NaN, as in ggml
        want = g / (np.float32(1.0) + ggml_ref.expf(-g)) * u
        ref = g.astype(np.float64) / (1.0 + np.exp(-g.astype(np.float64))) * u
    got = swiglu(g, u)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(swiglu(g[7:8], u[7:8])), _bits(got[7:8]))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-6, atol=1e-30)


def test_rope_is_ggmls():
    pos = GOLDEN["rope_pos"]
    for layer, base in ((0, 10000.0), (5, 1e6)):  # Gemma 3: local layers base 1e4, global 1e6
        cos, sin = rope_tables(pos, 256, base)
        x = GOLDEN[f"rope_in_{layer}"].copy()[:, None, :]  # (R, 1, 256)
        apply_rope(x, cos, sin, neox=True)
        np.testing.assert_array_equal(_bits(x[:, 0]), _bits(GOLDEN[f"rope_out_{layer}"]))


def test_rope_fma_order():
    # rotate_pairs' x0*cos - x1*sin / x0*sin + x1*cos as GCC contracts them: fma(x0, cos, -(x1*sin)), fma(x0, sin,
    # x1*cos); strided input works too
    rng = np.random.default_rng(8)
    x = rng.normal(size=(5, 3, 32)).astype(np.float32)
    cos, sin = rope_tables(np.arange(5) * 37, 32, 10000.0)
    for neox in (True, False):
        got = apply_rope(x.copy(), cos, sin, neox=neox)
        i0, i1 = (np.arange(16), np.arange(16) + 16) if neox else (np.arange(0, 32, 2), np.arange(1, 32, 2))
        c, s = cos[:, None, :], sin[:, None, :]
        want = x.copy()
        want[..., i0] = ggml_ref.fma32(x[..., i0], c, -(x[..., i1] * s))
        want[..., i1] = ggml_ref.fma32(x[..., i0], s, x[..., i1] * c)
        np.testing.assert_array_equal(got, want)
        big = np.zeros((5, 3, 64), np.float32)
        big[..., ::2] = x
        np.testing.assert_array_equal(apply_rope(big[..., ::2], cos, sin, neox=neox), want)


@pytest.mark.parametrize("rows", [1, 3, 300])  # 300: split over the threads
@pytest.mark.parametrize("post,nxt", [(True, True), (True, False), (False, True), (False, False)])
def test_residual_norm_is_the_separate_ops(rows, post, nxt):
    """x += rmsnorm(y, w_post) (or y), then rmsnorm(x, w_next), in one call: bit for bit the separate ops."""
    from kernels_cpu.ops import residual_norm, rmsnorm

    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 640)) * 3).astype(np.float32)
    y = (rng.standard_normal((rows, 640)) * 40).astype(np.float32)
    y[0, :7] = [0, 1e-30, -1e-30, 1e30, -1e30, 7, -7]
    wp, wn = (rng.standard_normal(640).astype(np.float32) for _ in range(2))
    want_x = x + (rmsnorm(y, wp, 1e-6) if post else y)
    want_h = rmsnorm(want_x, wn, 1e-6)
    h = residual_norm(x, y, wp if post else None, wn if nxt else None, 1e-6)
    np.testing.assert_array_equal(x, want_x)
    if nxt:
        np.testing.assert_array_equal(h, want_h)
    else:
        assert h is None
