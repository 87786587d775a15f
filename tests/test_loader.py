"""GGUF reading, config and validation; every bad input gives a named error (API) and exit 2 (CLI)."""
from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader

from edgellm.errors import ContextOverflowError, GGUFError, UnsupportedModelError, UnsupportedQuantTypeError
from edgellm.gguf_file import read_gguf
from edgellm.loader import load_gguf


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_reader_matches_gguf_reference(tiny_model, arch):
    path = tiny_model(arch)
    ours, ref = read_gguf(path), GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        if hasattr(got, "tolist") and not isinstance(got, np.ndarray):  # StringArray
            got = got.tolist()
        if isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, np.asarray(want))
        else:
            assert got == want, key
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.offset == t.data_offset and mine.n_bytes == t.n_bytes
        assert mine.shape == tuple(int(d) for d in reversed(t.shape))
        assert int(mine.qtype) == int(t.tensor_type)
        np.testing.assert_array_equal(ours.tensor_bytes(t.name).reshape(-1), t.data.reshape(-1).view(np.uint8))


def test_default_model_config(default_model):
    lm = load_gguf(default_model)
    c = lm.config
    assert (c.arch, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == ("gemma3", 640, 18, 4, 1, 256)
    assert c.sliding_window == 512 and c.tied_output
    assert [i for i, s in enumerate(c.swa_layers) if not s] == [5, 11, 17]  # every 6th layer is global
    assert c.rope_base == 1e6 and c.rope_base_local == 1e4


def _corrupt(src: str, dst, fn) -> str:
    data = bytearray(open(src, "rb").read())
    data = fn(data)
    with open(dst, "wb") as f:
        f.write(data)
    return str(dst)


def _patch_tensor_type(data: bytearray, name: str, new_type: int) -> bytearray:
    key = struct.pack("<Q", len(name)) + name.encode()
    i = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, i)
    struct.pack_into("<I", data, i + 4 + 8 * n_dims, new_type)
    return data


def _rename_arch(data: bytearray, new: bytes) -> bytearray:
    key = b"general.architecture"
    i = data.index(key) + len(key) + 4  # value type u32
    (n,) = struct.unpack_from("<Q", data, i)
    assert len(new) == n
    data[i + 8:i + 8 + n] = new
    return data


BAD_FILES = {
    "truncated_header": (lambda d: d[:200], GGUFError),
    "truncated_data": (lambda d: d[:-1000], GGUFError),
    "wrong_magic": (lambda d: b"GGML" + d[4:], GGUFError),
    "bad_version": (lambda d: d[:4] + struct.pack("<I", 7) + d[8:], GGUFError),
    "unknown_arch": (lambda d: _rename_arch(d, b"zzzzz"), UnsupportedModelError),
    "unsupported_quant": (lambda d: _patch_tensor_type(d, "output_norm.weight", 16), UnsupportedQuantTypeError),
    "unknown_quant_id": (lambda d: _patch_tensor_type(d, "output_norm.weight", 250), UnsupportedQuantTypeError),
    "empty": (lambda d: b"", GGUFError),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_named_error(tiny_model, tmp_path, case):
    fn, err = BAD_FILES[case]
    path = _corrupt(tiny_model("llama"), tmp_path / f"{case}.gguf", fn)
    with pytest.raises(err):
        load_gguf(path)


def test_tensor_offset_past_end(tiny_model, tmp_path):
    def move(d):
        key = struct.pack("<Q", len("output_norm.weight")) + b"output_norm.weight"
        i = d.index(key) + len(key)
        (n_dims,) = struct.unpack_from("<I", d, i)
        struct.pack_into("<Q", d, i + 4 + 8 * n_dims + 4, len(d) * 2)
        return d

    path = _corrupt(tiny_model("llama"), tmp_path / "offset.gguf", move)
    with pytest.raises(GGUFError, match="past the end"):
        load_gguf(path)


@pytest.mark.parametrize("case", ["truncated_data", "wrong_magic", "unknown_arch", "unsupported_quant"])
def test_bad_file_cli_one_line_exit_2(tiny_model, tmp_path, case):
    fn, _ = BAD_FILES[case]
    path = _corrupt(tiny_model("llama"), tmp_path / f"{case}.gguf", fn)
    for cmd in (["info", "--model", path], ["generate", "--model", path, "--prompt", "hi"]):
        r = _cli(*cmd)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("edgellm: error:"), r.stderr
        assert "Traceback" not in r.stderr


def test_missing_file_cli(tmp_path):
    r = _cli("info", "--model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2 and "not found" in r.stderr and r.stderr.count("\n") == 1


def test_prompt_longer_than_context(tiny_model):
    from edgellm import LLM, SamplingParams

    llm = LLM(tiny_model("llama"), ctx_size=16, progress=False)
    with pytest.raises(ContextOverflowError):
        llm.generate("hello world " * 20, SamplingParams(max_tokens=4))
    r = _cli("generate", "--model", tiny_model("llama"), "--ctx-size", "16", "--prompt", "hello world " * 20)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "context" in r.stderr, r.stderr
