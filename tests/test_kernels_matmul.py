"""Fused dequantizing matmul (kernels_cpu.matmul) against the NumPy reference dequantizer.

Two references per case: a tight one that applies the kernels' activation quantization (int8 per 32 or
per 256, like llama.cpp; for Q4_1 / Q5_1 also Q8_1's f16 block sums in the min term) and then computes
x_hat @ W.T in float64, and a loose one, plain x @ W.T, with the error bound that activation rounding allows
(sum_k |w_k| * dx_k / 2, plus the f16 rounding of the Q8_1 sums).
"""
from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from kernels_cpu import _jit, get_rows, matmul, matmul_many, prepare_weight
from kernels_cpu.matmul import _S8_WEIGHTS, _prepare_x, split_min_macs
from kernels_cpu.matmul_driver import make_driver, quantize_act
from kernels_cpu.repack import LAYOUTS
from quant.formats import dequantize
from quant.types import FORMATS
from quant.types import QuantType as Q

# f16 scale fields per block (set finite and small so NaN/inf never reach the comparison)
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
              Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
              Q.MXFP4: ()}
E8M0_FIELDS = {Q.MXFP4: 0}  # byte offset of the block's E8M0 exponent (kept near 2^0 so that nothing overflows)
FLOATS = (Q.F32, Q.F16, Q.BF16)
ALL_TYPES = FLOATS + tuple(F16_FIELDS)
PRIORITY = (Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.MXFP4, Q.IQ4_XS)


def random_weight(qt: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row_bytes) uint8: random codes over their full range with random finite f16 scales."""
    if qt in FLOATS:
        w = rng.standard_normal((n, k)).astype(np.float32)
        if qt == Q.F16:
            w = w.astype(np.float16)
        elif qt == Q.BF16:
            w = (w.view(np.uint32) >> 16).astype(np.uint16)
        return w.view(np.uint8).reshape(n, -1)
    fmt = FORMATS[qt]
    nb = k // fmt.block_size
    raw = rng.integers(0, 256, (n, nb, fmt.type_size), dtype=np.uint8)
    for off in F16_FIELDS[qt]:
        d = (rng.uniform(0.25, 1.0, (n, nb)) * rng.choice([-1, 1], (n, nb)) * 0.05).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(n, nb, 2)
    if qt in E8M0_FIELDS:
        raw[:, :, E8M0_FIELDS[qt]] = rng.integers(118, 130, (n, nb))  # 2^-10 .. 2^1
    return raw.reshape(n, -1)


def act_twin(x: np.ndarray, qb: int) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of quantize_act (llama.cpp's quantize_row_q8_0 / q8_K): (x_hat (M, K), |dx| per element),
    both float64."""
    M, K = x.shape
    xb = x.reshape(M, K // qb, qb).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)  # (M, K/qb, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        if qb == 32:
            d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)  # f16 scale
            inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
            q = np.rint(xb * inv)
        else:
            vmax = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)  # signed value of max |x|
            iscale = np.float32(-127) / vmax
            d = np.where(amax > 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
            q = np.where(amax > 0, np.minimum(np.float32(127), np.rint(iscale * xb)), 0)
    x_hat = (q.astype(np.float64) * d.astype(np.float64)).reshape(M, K)
    return x_hat, np.abs(np.broadcast_to(d, xb.shape)).reshape(M, K).astype(np.float64)


@pytest.mark.parametrize("qb, dtype", [(32, np.int8), (32, np.int16), (256, np.int8), (256, np.int16)])
def test_quantize_act_codes_round_half_to_even(qb, dtype):
    """quantize_act's codes and sums of 16 are the twin's (np.rint: ties to even, as llama.cpp's x86
    quantize_row_q8_0 (_mm256_round_ps) and quantize_row_q8_K (nearest_int)), on blocks whose scaled values land
    exactly on ties, and zero blocks."""
    rng = np.random.default_rng(qb)
    M, K = 3, 512
    x = np.clip(rng.standard_normal((M, K)) * 30, -100, 100).astype(np.float32)
    ties = np.float32([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 125.5, -126.5])
    x[:, 0], x[:, 1:9] = -127, ties  # block 0: amax 127 (qb 32: inv = 1; qb 256: iscale = -127/-127 = 1)
    x[1, K - qb:] = 0
    xq, dx = np.empty((M, K), dtype), np.empty((M, K // qb), np.float32)
    bs = np.empty((M, K // 16), np.int32)
    quantize_act(xq, dx, bs, np.zeros((M, 0), np.float32), x, qb)
    xb = x.reshape(M, K // qb, qb)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        if qb == 32:
            scaled = xb * np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        else:
            scaled = xb * (np.float32(-127) / np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1))
    assert np.all(scaled[:, 0, 1:9] == ties)  # the ties reach the rounding as ties
    q = np.where(amax > 0, np.minimum(np.float32(127), np.rint(scaled)), 0)
    np.testing.assert_array_equal(xq, q.reshape(M, K))
    np.testing.assert_array_equal(bs, q.reshape(M, K // 16, 16).sum(-1))


def q8_1_sum_twin(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's block_q8_1 sums (Q4_1 / Q5_1 activations) per 32-block: (s, dx*sum(q)) (M, K/32) float64,
    s = f16(d * sum(q)) with the unrounded d = amax/127 (quantize_row_q8_1), dx*sum(q) what x_hat sums to."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32).astype(np.float32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = amax / np.float32(127)
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).sum(-1).astype(np.float32)
    s = (d * q).astype(np.float16).astype(np.float64)
    return s, d.astype(np.float16).astype(np.float64) * q


def check(qt: Q, n: int, k: int, ms, rng, raw=None) -> None:
    raw = random_weight(qt, n, k, rng) if raw is None else raw
    w = dequantize(raw, qt).reshape(n, k).astype(np.float64)  # (N, K)
    pw = prepare_weight(raw, qt, (n, k))
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = matmul(x, pw)
        assert y.shape == (m, n) and y.dtype == np.float32
        qb = LAYOUTS[qt].act_block
        x_hat, dx = act_twin(x, qb) if qb else (x.astype(np.float64), np.zeros((m, k)))
        tight = x_hat @ w.T
        s_err = 0.0
        if qt in (Q.Q4_1, Q.Q5_1):  # the min term is m * s with the f16 block sum s, not m * sum(x_hat)
            mins = raw.reshape(n, k // 32, -1)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
            s, dxq = q8_1_sum_twin(x)
            tight += (s - dxq) @ mins.T
            s_err = np.abs(s - dxq) @ np.abs(mins).T
        tol = 1e-5 * (np.abs(x_hat) @ np.abs(w).T) + 1e-30
        np.testing.assert_array_less(np.abs(y - tight), tol, err_msg=f"{qt.name} {n}x{k} M={m} (tight)")
        loose = x.astype(np.float64) @ w.T
        bound = tol + 1.0001 * ((0.5 * dx) @ np.abs(w).T + s_err)
        np.testing.assert_array_less(np.abs(y - loose), bound, err_msg=f"{qt.name} {n}x{k} M={m} (loose)")


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
def test_matmul_matches_reference(qt):
    rng = np.random.default_rng(int(qt))
    bs = FORMATS[qt].block_size
    kb = 256 if bs == 256 else 32  # one block
    check(qt, 37, kb, [1, 2, 3, 4, 5, 6, 7, 9], rng)  # N not a multiple of 16, K one block
    check(qt, 16, 3 * kb, [1, 8, 37], rng)  # several blocks, a prefill M (tiles of 4 + remainder)
    if qt in FLOATS:
        check(qt, 5, 40, [1, 3], rng)  # K not a multiple of 32 (zero-padded)


DOT_GOLDEN = np.load(Path(__file__).parent / "golden" / "dot_golden.npz")


@pytest.mark.parametrize("qt", tuple(F16_FIELDS), ids=lambda q: q.name)
def test_matmul_close_to_llama_cpp_dot(qt):
    """llama.cpp's own quantize_row_q8_* + ggml_vec_dot_* outputs (tests/golden/make_dot_golden.py): equal within
    float32 summation-order tolerance (llama.cpp sums 8 SIMD lanes, we sum one accumulator per row), and the
    same outputs for M = 1 (decode) as in the batch."""
    w, x, y = (DOT_GOLDEN[f"{qt.name}_{a}"] for a in "wxy")
    n, k = w.shape[0], x.shape[1]
    pw = prepare_weight(w, qt, (n, k))
    got = matmul(x, pw)
    one = np.concatenate([matmul(x[i:i + 1], pw) for i in range(len(x))])
    np.testing.assert_array_equal(one, got)
    x_hat, _ = act_twin(x, LAYOUTS[qt].act_block)
    mag = np.abs(x_hat) @ np.abs(dequantize(w, qt).reshape(n, k).astype(np.float64)).T
    err = np.abs(got.astype(np.float64) - y)
    assert (err <= 1e-5 * mag + 1e-30).all(), f"{qt.name}: max err / magnitude {np.max(err / (mag + 1e-30)):.2e}"


def exact_case(qt: Q, n: int, k: int, rng):
    """Weights and activations whose float arithmetic is exact: f16 scales (and mins) of +-1, activations that
    are integers with |max| 127 in every block, so the activation codes are the values and every scale is 1;
    the output is then the exact integer dot product (< 2^24), whatever the summation order."""
    fmt = FORMATS[qt]
    nb = k // fmt.block_size
    raw = rng.integers(0, 256, (n, nb, fmt.type_size), dtype=np.uint8)
    for off in F16_FIELDS[qt]:
        raw[:, :, off:off + 2] = np.float16(1.0).reshape(1).view(np.uint8)
    if qt in (Q.Q4_K, Q.Q5_K):  # 6-bit scales / mins: keep them small so that sums stay below 2^24
        raw[:, :, 4:16] &= np.uint8(0x33)
    if qt in E8M0_FIELDS:
        raw[:, :, E8M0_FIELDS[qt]] = 128  # 2^0
    if qt == Q.IQ4_XS:  # sub-block scales ls - 32 in -4..3 (ls = 28..35), so that sums stay below 2^24
        ls = rng.integers(28, 36, (n, nb, 8)).astype(np.uint16)
        raw[:, :, 4:8] = ((ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)).astype(np.uint8)
        sh = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype(np.uint16)
        raw[:, :, 2:4] = sh[..., None].view(np.uint8)
    raw = raw.reshape(n, -1)
    qb = LAYOUTS[qt].act_block
    x = rng.integers(-127, 128, (3, k)).astype(np.float32)
    blocks = x.reshape(3, k // qb, qb)
    blocks[:, :, 0] = -127.0  # |max| 127 per block: codes = values (q8_K: vmax = -127 -> iscale = 1)
    return raw, x


@pytest.mark.parametrize("qt", tuple(F16_FIELDS), ids=lambda q: q.name)
def test_integer_block_dot_products_exact(qt):
    """With unit scales the kernels must return the exact integer dot product: fails if any element, sub-block
    scale, min or code offset is dropped or misapplied (a float tolerance could hide that)."""
    rng = np.random.default_rng(500 + int(qt))
    k = 512 if FORMATS[qt].block_size == 256 else 96
    raw, x = exact_case(qt, 37, k, rng)
    w = dequantize(raw, qt).reshape(37, k).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    assert np.abs(want).max() < 2 ** 24 and np.all(want == np.rint(want))
    if qt in (Q.Q4_1, Q.Q5_1):  # the min term uses Q8_1's f16 block sum s = f16(d * sum(codes)): exact below 2048
        sums = x.reshape(3, k // 32, 32).sum(-1)
        assert np.abs(sums).max() < 2048
    got = matmul(x, prepare_weight(raw, qt, (37, k)))
    np.testing.assert_array_equal(got.astype(np.float64), want)


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
def test_get_rows_bit_exact(qt):
    rng = np.random.default_rng(100 + int(qt))
    k = 256 if FORMATS[qt].block_size == 256 else 64
    raw = random_weight(qt, 21, k, rng)
    pw = prepare_weight(raw, qt, (21, k))
    ids = np.array([3, 0, 20, 3, -1])
    ref = dequantize(raw, qt).reshape(21, k)[ids]
    got = get_rows(pw, ids)
    assert got.dtype == np.float32 and got.shape == (5, k)
    np.testing.assert_array_equal(got.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    assert get_rows(pw, np.array([], np.int64)).shape == (0, k)
    with pytest.raises(ValueError):
        get_rows(pw, np.array([21]))


@pytest.mark.parametrize("qt", PRIORITY + (Q.F16,), ids=lambda q: q.name)
def test_batch_invariance(qt):
    """A row's result is bit-identical whatever the batch (M = 1, 8, 37; serial or threaded)."""
    rng = np.random.default_rng(7)
    k = 512
    n = max(48, split_min_macs() // (37 * k) + 16)  # M=37 takes the threaded path
    pw = prepare_weight(random_weight(qt, n, k, rng), qt, (n, k))
    x = rng.standard_normal((37, k)).astype(np.float32)
    y37 = matmul(x, pw)
    y8 = matmul(x[:8], pw)
    for i in range(8):
        y1 = matmul(x[i:i + 1], pw)
        np.testing.assert_array_equal(y1[0], y8[i])
        np.testing.assert_array_equal(y1[0], y37[i])
    np.testing.assert_array_equal(matmul(x[5:30], pw), y37[5:30])
    out = np.empty((37, n), np.float32)
    assert matmul(x, pw, out) is out
    np.testing.assert_array_equal(out, y37)


def test_bad_shapes_raise():
    rng = np.random.default_rng(1)
    raw = random_weight(Q.Q8_0, 8, 64, rng)  # (8, 68)
    with pytest.raises(ValueError, match="shape"):
        prepare_weight(raw, Q.Q8_0, (8, 96))
    with pytest.raises(ValueError, match="shape"):
        prepare_weight(raw, Q.Q8_0, (9, 64))
    with pytest.raises(ValueError):
        prepare_weight(raw, Q.Q8_0, (8, 60))  # K not a whole number of blocks
    with pytest.raises(ValueError, match="uint8"):
        prepare_weight(raw.view(np.int8), Q.Q8_0, (8, 64))
    with pytest.raises(ValueError, match="Q8_K"):
        prepare_weight(raw, Q.Q8_K, (8, 64))
    with pytest.raises(ValueError):
        prepare_weight(raw, 999, (8, 64))
    with pytest.raises(ValueError):
        prepare_weight(random_weight(Q.Q4_K, 4, 256, rng), Q.Q4_K, (4, 128))
    pw = prepare_weight(raw.reshape(-1), Q.Q8_0, (8, 64))  # flat bytes are accepted
    with pytest.raises(ValueError, match="x has shape"):
        matmul(np.zeros((2, 32), np.float32), pw)
    with pytest.raises(ValueError, match="out"):
        matmul(np.zeros((2, 64), np.float32), pw, np.zeros((2, 9), np.float32))
    assert matmul(np.zeros((0, 64), np.float32), pw).shape == (0, 8)


def test_matmul_many_equals_separate_calls():
    """One input, weights of every activation kind (per-32 codes, Q8_1 sums, per-256 codes, float): the shared
    quantized activations give each weight exactly its own matmul's output; a mismatched K raises."""
    rng = np.random.default_rng(5)
    k = 512
    types = (Q.Q5_0, Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.F16, Q.Q5_0)
    ws = [prepare_weight(random_weight(qt, n, k, rng), qt, (n, k)) for qt, n in zip(types, (64, 16, 32, 48, 16, 32, 4096))]
    for m in (1, 8, 0):
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = matmul_many(x, ws)
        assert len(got) == len(ws)
        for y, pw in zip(got, ws):
            np.testing.assert_array_equal(y, matmul(x, pw))
    assert matmul_many(x, []) == []
    with pytest.raises(ValueError, match="x has shape"):
        matmul_many(np.zeros((2, k), np.float32), [ws[0], prepare_weight(random_weight(Q.Q8_0, 8, 64, rng), Q.Q8_0, (8, 64))])


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_activation_quantization_twin(qt):
    """Activation codes and scales are exactly the NumPy twin's (llama.cpp's rounding and f16 scales)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 512)) * 4).astype(np.float32)
    x[1, :256] = 0  # all-zero blocks
    x[2, 300] = -50.0  # a negative extreme (Q8_K takes the sign of the largest-magnitude value)
    x[0, [260, 270]] = 60.0, -60.0  # ties of |x| (the first one sets the sign of codes and scale alike)
    x[2, [20, 30]] = -60.0, 60.0
    pw = prepare_weight(random_weight(qt, 16, 512, rng), qt, (16, 512))
    xq, dx, bs = _prepare_x(x, pw)
    qb = LAYOUTS[qt].act_block
    x_hat, _ = act_twin(x, qb)
    np.testing.assert_array_equal(xq.astype(np.float64) * np.repeat(dx, qb, axis=1).astype(np.float64), x_hat)
    np.testing.assert_array_equal(bs, xq.reshape(3, -1, 16).sum(-1))
    assert np.abs(xq).max() <= 127
    if qt == Q.Q8_0:  # scales are f16 values
        np.testing.assert_array_equal(dx.astype(np.float16).astype(np.float32), dx)


def test_f16_round_matches_numpy():
    from kernels_cpu.ops import f16_round

    v = np.concatenate([np.float32([0, 1, 65504, 65519, 65520, 1e6, 6e-8, 2.9e-8, 3e-5, 6.1e-5, -3.3]),
                        np.random.default_rng(0).standard_normal(2000).astype(np.float32) * 10.0 ** np.arange(-7, 3)[
                            np.random.default_rng(1).integers(0, 10, 2000)]]).astype(np.float32)
    got = np.array([f16_round(a) for a in v], np.float32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, v.astype(np.float16).astype(np.float32))


X86 = platform.machine() in ("x86_64", "AMD64")


# Q8_0: its quads (where the host has vpdpbusd) in 8-row slices by the widening form of vpdpbusd, or its pairs
@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("feats", [pytest.param({"avx2"}, marks=pytest.mark.skipif(
    not X86, reason="x86 intrinsics cannot be compiled for this CPU")), set()], ids=["avx2", "generic"])
def test_portable_ir_paths(monkeypatch, feats, qt):
    """The AVX2 and target-independent forms of the packed multiply-add (for the table-lookup formats: vpshufb
    and |w| x sign(x, w) by vpmaddubsw; a select tree and widening multiplies) give the same results."""
    rng = np.random.default_rng(11)
    raw = random_weight(qt, 20, 256, rng)
    codes_at = {Q.IQ4_NL: 2, Q.IQ4_XS: 8, Q.MXFP4: 1}  # row 0: code 0 everywhere (IQ4: -127), scales kept
    if qt in codes_at:
        raw.reshape(20, -1, FORMATS[qt].type_size)[0, :, codes_at[qt]:] = 0
    pw = prepare_weight(raw, qt, (20, 256))
    x = rng.standard_normal((5, 256)).astype(np.float32)
    x[4] = np.where(np.arange(256) % 3, -60.0, 60.0)  # codes +-127
    ref = matmul(x, pw)
    monkeypatch.setattr(_jit, "_host_features", frozenset(feats))
    run = make_driver(int(qt), cache=False)
    xq, dx, bs = _prepare_x(x, pw)
    y = np.empty_like(ref)
    run(y, xq, dx, bs, pw.qs, pw.sc, 0, pw.qs.shape[0])
    np.testing.assert_array_equal(y, ref)


# The activation form besides int16, with the formats it serves: int8 codes (the unsigned-weight form, vpmaddubsw)
# for all but Q8_0 and the formats that take int8 codes whatever the flags (the table-lookup formats; the quad
# vectors of the k-quants on x86, of the 32-block nibble formats on x86 and of Q8_0 where vpdpbusd exists).
FORM_CASES = [("ACT_S8", np.int8, q) for q in F16_FIELDS if q != Q.Q8_0 and q not in _S8_WEIGHTS]


@pytest.mark.parametrize("flag,dtype,qt", FORM_CASES, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("feats", [None, set()], ids=["host", "generic"])
def test_activation_forms_equal_int16_path(monkeypatch, flag, dtype, qt, feats):
    """Each activation form gives exactly the int16 form's outputs (all are exact integer sums), on the host's
    instructions and in the portable form, with extreme codes, scales and activations, for every M tile size."""
    import sys

    mm = sys.modules["kernels_cpu.matmul"]  # the module (the package exports the function under that name)
    rng = np.random.default_rng(40 + int(qt))
    k = 512 if FORMATS[qt].block_size == 256 else 192
    raw = random_weight(qt, 40, k, rng)
    raw[0] = 255  # row 0: every code and sub-block scale at its maximum (no int16 sum may saturate)
    for off in F16_FIELDS[qt]:
        raw.reshape(40, k // FORMATS[qt].block_size, -1)[0, :, off:off + 2] = np.float16(0.01).reshape(1).view(np.uint8)
    pw = prepare_weight(raw, qt, (40, k))
    x = (rng.standard_normal((11, k)) * 3).astype(np.float32)  # 11 rows: tiles of 8, 2 and 1
    x[3, :32] = 0  # an all-zero block
    x[4] = np.where(np.arange(k) % 2, -60.0, 60.0)  # codes +-127 everywhere (the u8 ends 1 / 255)
    x[5] = -60.0
    monkeypatch.setattr(mm, "ACT_S8", False)
    ref = matmul(x, pw)
    monkeypatch.setattr(mm, flag, True)
    xq, dx, bs = _prepare_x(x, pw)
    assert xq.dtype == dtype
    if feats is not None:
        monkeypatch.setattr(_jit, "_host_features", frozenset(feats))
    run = make_driver(int(qt), cache=False)
    y = np.empty_like(ref)
    run(y, xq, dx, bs, pw.qs, pw.sc, 0, pw.qs.shape[0])
    np.testing.assert_array_equal(y, ref)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 assembly check")
def test_q8_0_gemv_uses_packed_multiply_add():
    feats = _jit.host_features()
    if "avx2" not in feats:
        pytest.skip("no AVX2")
    run = make_driver(int(Q.Q8_0), cache=False)
    pw = prepare_weight(random_weight(Q.Q8_0, 16, 64, np.random.default_rng(0)), Q.Q8_0, (16, 64))
    x = np.ones((1, 64), np.float32)
    xq, dx, bs = _prepare_x(x, pw)
    run(np.empty((1, 16), np.float32), xq, dx, bs, pw.qs, pw.sc, 0, 1)
    asm = run.inspect_asm(run.signatures[0])
    assert any(op in asm for op in ("vpmaddwd", "vpdpbusd", "vpdpwssd")), "no packed integer multiply-add"
    assert "vpmuldq" not in asm
