"""IQ4_NL, IQ4_XS and MXFP4 (quant/iquants.py): dequantization bit-exact with gguf.quants on random blocks,
quantization byte-equal to llama.cpp's own quantizer (golden bytes: tests/golden/make_iquant_golden.py) and,
for MXFP4, to gguf.quants; a model quantized to them runs (kernels_cpu/matmul_iq.py) like its dequantized twin."""
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


def _reference_run(run):
    """A stand-in for kernels_cpu.matmul._run: the IQ4 / MXFP4 weights dequantized by quant.formats and multiplied
    in float64 with the kernels' own quantized activations (other types: the kernels)."""
    def ref(out, act, pw):
        if pw.qtype not in TYPES.values():
            return run(out, act, pw)
        xq, dx, _ = act
        n, k = pw.shape
        x_hat = xq.astype(np.float64) * np.repeat(dx.astype(np.float64), k // dx.shape[1], axis=1)  # (M, K)
        out[:] = x_hat @ dequantize(pw.raw, pw.qtype).reshape(n, k).astype(np.float64).T
    return ref


@pytest.mark.parametrize("arch,ftype,qtype", [("llama", "IQ4_NL", QuantType.IQ4_NL),
                                               ("llama", "IQ4_XS", QuantType.IQ4_XS),
                                               ("qwen3moe", "MXFP4_MOE", QuantType.MXFP4)])
def test_quantized_model_runs_like_its_dequantized_twin(tmp_path, monkeypatch, arch, ftype, qtype):
    """`edgellm quantize` to the format, then the model runs on the fused kernels (MXFP4: the expert tensors). Its
    logits equal, tightly, a forward whose IQ4 / MXFP4 matmuls are the dequantize reference (same activation
    codes), and, loosely, those of the same weights dequantized to F32 (a float forward: the difference is what
    8-bit activations cost)."""
    import sys

    from convert.quantize_model import quantize_model
    from edgellm import LLM
    from edgellm.gguf_file import read_gguf
    from tiny_models import write_tiny_model

    assert set(TYPES.values()) <= WEIGHT_TYPES
    monkeypatch.setenv("EDGELLM_WEIGHT_CACHE", "0")  # repacked in memory: no shared cache entry to race over
    src = write_tiny_model(tmp_path / "f32.gguf", arch)
    quantize_model(src, tmp_path / "q.gguf", ftype)
    name = "blk.0.ffn_up_exps.weight" if qtype == QuantType.MXFP4 else "blk.0.ffn_up.weight"
    assert read_gguf(tmp_path / "q.gguf").tensors[name].qtype == qtype
    quantize_model(tmp_path / "q.gguf", tmp_path / "deq.gguf", "F32", allow_requantize=True)
    tokens = [1, 17, 99, 3, 250, 42, 7, 300]
    llm = LLM(str(tmp_path / "q.gguf"), ctx_size=64, progress=False)
    got = llm.logits(tokens)
    mm = sys.modules["kernels_cpu.matmul"]
    run = mm._run
    monkeypatch.setattr(mm, "_run", _reference_run(run))
    ref = llm.logits(tokens)
    monkeypatch.setattr(mm, "_run", run)
    scale = np.abs(ref).max()
    tight = np.abs(got - ref).max() / scale
    float_twin = LLM(str(tmp_path / "deq.gguf"), ctx_size=64, progress=False).logits(tokens)
    loose = np.abs(got - float_twin).max() / scale
    print(f"{ftype}: max |diff| / max |logit|: {tight:.2e} (reference matmuls), {loose:.2e} (F32 twin)")
    assert tight < 1e-3, f"{ftype}: {tight:.2e} from the dequantize reference forward"
    assert loose < 5e-2, f"{ftype}: {loose:.2e} from the F32 twin"
