"""quant/formats.py is bit-exact with gguf-py's reference (gguf.quants) on random blocks."""
from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest

from quant.errors import QuantTypeError
from quant.formats import (
    dequantize,
    dequantize_rows,
    k_scale_min,
    q3_k_scales,
    quantize,
    supported_dequant_types,
    supported_quant_types,
)
from quant.types import FORMATS, QuantType

# Byte offsets of the f16 scale fields inside one block (made finite so NaN/inf do not pollute comparisons).
F16_FIELDS: dict[QuantType, tuple[int, ...]] = {
    QuantType.Q4_0: (0,),
    QuantType.Q4_1: (0, 2),
    QuantType.Q5_0: (0,),
    QuantType.Q5_1: (0, 2),
    QuantType.Q8_0: (0,),
    QuantType.Q2_K: (80, 82),
    QuantType.Q3_K: (108,),
    QuantType.Q4_K: (0, 2),
    QuantType.Q5_K: (0, 2),
    QuantType.Q6_K: (208,),
}
FLOAT_TYPES = (QuantType.F32, QuantType.F16, QuantType.BF16)
GGUF_DEQUANT_TYPES = FLOAT_TYPES + tuple(F16_FIELDS)
QUANT_TYPES = FLOAT_TYPES + (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0)

# (leading shape, blocks per row)
SHAPES = [((), 1), ((1,), 1), ((7,), 3), ((2, 3), 4), ((), 300)]


def random_blocks(rng: np.random.Generator, qtype: QuantType, lead: tuple[int, ...], n_blocks: int) -> np.ndarray:
    """Random bytes (*lead, n_blocks * type_size) with finite random f16 scales."""
    ts = FORMATS[qtype].type_size
    data = rng.integers(0, 256, size=(*lead, n_blocks, ts), dtype=np.uint8)  # (*lead, n_blocks, ts)
    for off in F16_FIELDS.get(qtype, ()):
        scale = (rng.standard_normal((*lead, n_blocks, 1)) * 10.0 ** rng.integers(-6, 2, (*lead, n_blocks, 1)))
        data[..., off:off + 2] = scale.astype("<f2").view(np.uint8)
    return data.reshape(*lead, n_blocks * ts)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", GGUF_DEQUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("lead,n_blocks", SHAPES)
def test_dequantize_matches_gguf(qtype, lead, n_blocks):
    rng = np.random.default_rng(int(qtype) * 1000 + n_blocks)
    data = random_blocks(rng, qtype, lead, n_blocks)
    got = dequantize(data, qtype)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(int(qtype)))
    assert got.dtype == np.float32
    assert got.shape == (*lead, n_blocks * FORMATS[qtype].block_size) == want.shape
    np.testing.assert_array_equal(bits(got), bits(want))


def test_dequantize_q8_k_formula():
    rng = np.random.default_rng(8)
    n = 5
    d = rng.standard_normal((n, 1)).astype("<f4")  # (n, 1)
    qs = rng.integers(-128, 128, (n, 256), dtype=np.int8)  # (n, 256)
    bsums = qs.reshape(n, 16, 16).sum(-1, dtype=np.int16)  # (n, 16)
    data = np.concatenate([d.view(np.uint8), qs.view(np.uint8), bsums.astype("<i2").view(np.uint8)], axis=-1)
    assert data.shape == (n, FORMATS[QuantType.Q8_K].type_size)
    np.testing.assert_array_equal(bits(dequantize(data, QuantType.Q8_K)), bits(d * qs.astype(np.float32)))


def test_dequantize_accepts_gguf_enum_and_int():
    rng = np.random.default_rng(0)
    data = random_blocks(rng, QuantType.Q4_K, (2,), 2)
    ref = dequantize(data, QuantType.Q4_K)
    np.testing.assert_array_equal(dequantize(data, gguf.GGMLQuantizationType.Q4_K), ref)
    np.testing.assert_array_equal(dequantize(data, 12, n_elements=512), ref)


def test_dequantize_rows():
    rng = np.random.default_rng(1)
    raw = random_blocks(rng, QuantType.Q6_K, (10,), 2)  # (10, 2 * 210)
    rows = np.array([3, 0, 9, 3, -1])
    got = dequantize_rows(raw, QuantType.Q6_K, rows)
    assert got.shape == (5, 512)
    np.testing.assert_array_equal(got, dequantize(raw, QuantType.Q6_K)[rows])


def test_k_scale_min_matches_gguf():
    rng = np.random.default_rng(2)
    scales = rng.integers(0, 256, (50, 12), dtype=np.uint8)
    sc, m = k_scale_min(scales)
    want_sc, want_m = gguf.quants.Q4_K.get_scale_min(scales)
    np.testing.assert_array_equal(sc, want_sc)
    np.testing.assert_array_equal(m, want_m)
    sc3, m3 = k_scale_min(scales.reshape(5, 10, 12))  # leading axes are kept
    assert sc3.shape == m3.shape == (5, 10, 8)
    np.testing.assert_array_equal(sc3.reshape(50, 8), sc)


def test_q3_k_scales_layout():
    # scale i = low4 | high2 << 4, minus 32; set scale 13 (low nibble: byte 5 high; high bits: byte 9 bits 6-7)
    scales = np.zeros(12, dtype=np.uint8)
    scales[5] = 0xA0
    scales[9] = 0b11 << 6
    want = np.full(16, -32, dtype=np.int8)
    want[13] = (0xA | 0x30) - 32
    np.testing.assert_array_equal(q3_k_scales(scales), want)


def test_unknown_type_raises_named_error():
    data = np.zeros((2, 34), dtype=np.uint8)
    with pytest.raises(QuantTypeError, match="unknown quant type"):
        dequantize(data, 99)
    with pytest.raises(QuantTypeError, match="IQ2_XXS"):
        dequantize(data, gguf.GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(QuantTypeError, match="Q8_1"):
        dequantize(np.zeros((1, 40), np.uint8), QuantType.Q8_1)
    with pytest.raises(QuantTypeError, match="Q8_K"):  # k-quant weights have quantizers (kquants.py)
        quantize(np.zeros((1, 256), np.float32), QuantType.Q8_K)


def test_bad_lengths_raise_value_error():
    with pytest.raises(ValueError, match="multiple"):
        dequantize(np.zeros((3, 35), dtype=np.uint8), QuantType.Q8_0)
    with pytest.raises(ValueError, match="expected 64"):
        dequantize(np.zeros((3, 34), dtype=np.uint8), QuantType.Q8_0, n_elements=64)
    with pytest.raises(ValueError, match="multiple"):
        quantize(np.zeros((2, 48), dtype=np.float32), QuantType.Q4_0)


def quant_inputs(rng: np.random.Generator, k: int) -> np.ndarray:
    """(3, 6, k) float32: normal rows, outliers, a zero row, constant / tied rows, tiny and half-way values."""
    x = rng.standard_normal((3, 6, k)).astype(np.float32)
    x[0, 1] *= 1e-3
    x[0, 2, ::17] = rng.standard_normal(len(range(0, k, 17))) * 100  # outliers
    x[1, 0] = 0.0  # zero row
    x[1, 1] = -2.5  # constant row
    x[1, 2] = np.tile(np.array([1.0, -1.0, 0.5, -0.5], np.float32), k // 4)  # ties of |max|, half-way quants
    x[1, 3] = np.arange(k, dtype=np.float32) - k / 2  # many exactly representable steps
    x[2, 0] *= 1e-30  # tiny scales (subnormal / zero in f16)
    x[2, 1, :: 5] = 0.0
    return x


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 256])
def test_quantize_matches_gguf(qtype, k):
    rng = np.random.default_rng(int(qtype) * 10 + k)
    x = quant_inputs(rng, k)
    got = quantize(x, qtype)
    want = np.ascontiguousarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qtype)))).view(np.uint8)
    assert got.dtype == np.uint8
    assert got.shape == (3, 6, k // FORMATS[qtype].block_size * FORMATS[qtype].type_size) == want.shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(quantize(x[0, 0], qtype), want[0, 0])  # 1-D input


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_quantize_float_specials_match_gguf(qtype):
    rng = np.random.default_rng(3)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-45, 7e4, -1e5, 3.4e38,
                        1.00390625, 1.01171875, 65504.0], dtype=np.float32)
    payload_nans = np.array([0x7F800001, 0xFFC12345, 0x7FFFFFFF, 0xFF80FFFF], dtype=np.uint32).view(np.float32)
    random_bits = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([special, payload_nans, random_bits])
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.ascontiguousarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qtype)))).view(np.uint8)
    got = quantize(x, qtype)  # must not warn: overflow to inf is the defined result
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_round_trip_error_is_small(qtype):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    y = dequantize(quantize(x, qtype), qtype)
    bits_per_weight = {QuantType.Q4_0: 4, QuantType.Q4_1: 4, QuantType.Q5_0: 5, QuantType.Q5_1: 5}.get(qtype, 8)
    assert np.abs(y - x).max() < 8 * 2.0 ** -bits_per_weight


def test_registries_cover_the_brief():
    iquants = {QuantType.IQ4_NL, QuantType.IQ4_XS, QuantType.MXFP4}  # tests/test_iquants.py
    assert set(GGUF_DEQUANT_TYPES) | {QuantType.Q8_K} | iquants == set(supported_dequant_types())
    kquants = {QuantType.Q2_K, QuantType.Q3_K, QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K}  # tests/test_quantize.py
    assert set(QUANT_TYPES) | kquants | iquants == set(supported_quant_types())
