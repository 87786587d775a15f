"""IQ4_NL, IQ4_XS and MXFP4 (quant/iquants.py): dequantization bit-exact with gguf.quants on random blocks,
quantization byte-equal to llama.cpp's own quantizer (golden bytes: tests/golden/make_iquant_golden.py) and,
for MXFP4, to gguf.quants; a model file using them is refused by name until the kernels have them."""
from __future__ import annotations

from pathlib import Path

import gguf
import gguf.quants as gq
import numpy as np
import pytest

from quant.formats import dequantize, quantize
from quant.types import FORMATS, WEIGHT_TYPES, QuantType

GOLDEN = np.load(Path(__file__).parent / "golden" / "iquant_golden.npz")
TYPES = {"IQ4_NL": QuantType.IQ4_NL, "IQ4_XS": QuantType.IQ4_XS, "MXFP4": QuantType.MXFP4}


@pytest.mark.parametrize("name", sorted(TYPES))
def test_dequantize_matches_gguf_on_random_blocks(name):
    t = TYPES[name]
    fmt = FORMATS[t]
    rng = np.random.default_rng(int(t))
    raw = rng.integers(0, 256, (200, fmt.type_size * 3), dtype=np.uint8)
    if t != QuantType.MXFP4:  # finite f16 scales (random bits give inf/NaN too: checked below with equal_nan)
        for b in range(3):
            raw[:, b * fmt.type_size:b * fmt.type_size + 2] = np.float16(rng.uniform(-2, 2, (200, 1))).view(np.uint8)
    with np.errstate(all="ignore"):
        want = gq.dequantize(raw, gguf.GGMLQuantizationType(int(t)))
        got = dequantize(raw, t)
        assert np.array_equal(got, want)
        wild = rng.integers(0, 256, (64, fmt.type_size), dtype=np.uint8)
        assert np.array_equal(dequantize(wild, t), gq.dequantize(wild, gguf.GGMLQuantizationType(int(t))),
                              equal_nan=True)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_quantize_equals_llamacpp_bytes(name):
    got = quantize(GOLDEN["x"], TYPES[name])
    want = GOLDEN[name]
    bad = np.flatnonzero((got != want).any(axis=1))
    assert got.shape == want.shape and not len(bad), f"{name}: rows {bad.tolist()} differ from llama.cpp's bytes"


def test_mxfp4_quantize_equals_gguf():
    x = GOLDEN["x"]
    assert np.array_equal(quantize(x, QuantType.MXFP4), gq.quantize(x, gguf.GGMLQuantizationType.MXFP4))


@pytest.mark.parametrize("name", sorted(TYPES))
def test_round_trip_error_is_that_of_a_4_bit_format(name):
    x = np.random.default_rng(1).standard_normal((16, 512)).astype(np.float32)
    err = np.abs(dequantize(quantize(x, TYPES[name]), TYPES[name]) - x).mean() / np.abs(x).mean()
    assert 0.02 < err < 0.15, err


def test_models_using_them_are_refused_by_name(tmp_path):
    """No matmul kernel reads them yet: the file reads (and requantizes), loading it for inference names the type."""
    from convert.quantize_model import quantize_model
    from edgellm.errors import UnsupportedQuantTypeError
    from edgellm.gguf_file import read_gguf
    from edgellm.loader import load_gguf
    from tiny_models import write_tiny_model

    assert not set(TYPES.values()) & WEIGHT_TYPES
    src = write_tiny_model(tmp_path / "f32.gguf", "llama")
    quantize_model(src, tmp_path / "iq.gguf", "IQ4_NL")
    assert read_gguf(tmp_path / "iq.gguf").tensors["blk.0.ffn_up.weight"].qtype == QuantType.IQ4_NL
    with pytest.raises(UnsupportedQuantTypeError, match="IQ4_NL.*cannot run yet"):
        load_gguf(str(tmp_path / "iq.gguf"))
