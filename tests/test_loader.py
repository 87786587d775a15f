"""GGUF reading, config and validation; every bad input gives a named error (API) and exit 2 (CLI)."""
from __future__ import annotations

import gc
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader

from edgellm.errors import ContextOverflowError, GGUFError, UnsupportedModelError, UnsupportedQuantTypeError
from edgellm.gguf_file import read_gguf
from edgellm.loader import load_gguf
from timing import scaled


def _cli(*args, timeout=scaled(300)):
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



def _held(path: str) -> tuple[int, int]:
    """(open file descriptors, memory maps) of `path` in this process."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:  # the listing's own descriptor, gone by now
            pass
    with open("/proc/self/maps") as f:
        return fds, sum(path in line for line in f)


def test_a_model_let_go_leaves_no_descriptor_or_map_of_its_file(tiny_model, tmp_path):
    """An app that loads models one after another (or the fuzz test, thousands) must not run out of descriptors
    or keep old models mapped: once shut down and collected, nothing of the file stays open (the pread path's
    descriptors were never closed: one leaked per model, 286 in one emulated test run)."""
    from edgellm import LLM, SamplingParams

    path = str(tmp_path / "own.gguf")  # a file of this test's own: other tests' models keep theirs open
    shutil.copyfile(tiny_model("llama"), path)
    for _ in range(3):
        llm = LLM(path, ctx_size=64, progress=False)
        llm.generate("hello", SamplingParams(max_tokens=2, temperature=0))  # the embedding rows come by pread
        assert _held(path)[0] >= 1
        llm.shutdown()
        del llm
        gc.collect()
        assert _held(path) == (0, 0)
    g = read_gguf(path)
    g.read_rows("token_embd.weight", np.array([1, 2]))
    del g
    gc.collect()
    assert _held(path) == (0, 0)


# --- metadata schema: every key edgellm reads is checked for type, length and range before use -----------------

def _fuzz_base(tiny_model, arch="llama"):
    import gguf_fuzzer as F

    return F.BaseFile.read(tiny_model(arch), {"tokenizer.chat_template": (F.T.STRING, F.CHATML)})


def _load_all(path):
    """What a first command does: load, then build the tokenizer from the loaded (checked) metadata."""
    from edgellm.tokenizer import Tokenizer

    lm = load_gguf(path)
    return lm, Tokenizer.from_metadata(lm.metadata)


def test_token_type_scalar_is_a_named_error(tiny_model, tmp_path):
    """Issue 17's fuzz finding: a scalar where the token-type array belongs gave IndexError in Tokenizer."""
    import gguf_fuzzer as F

    bad = tmp_path / "scalar.gguf"
    bad.write_bytes(_fuzz_base(tiny_model).with_value("tokenizer.ggml.token_type", F.T.UINT32, 1))
    with pytest.raises(GGUFError, match="'tokenizer.ggml.token_type' must be an array of integers"):
        _load_all(str(bad))
    r = _cli("generate", "--model", str(bad), "--prompt", "hi")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


# (key, GGUF type, value, element type, what the message says); the key is named in every message
BAD_VALUES = [
    ("general.architecture", "UINT32", 7, None, "must be a string"),
    ("general.alignment", "UINT32", 48, None, "must be a power of two"),
    ("general.alignment", "STRING", "32", None, "must be an integer"),
    ("general.name", "ARRAY", ["a", "b"], "STRING", "must be a string"),
    ("llama.block_count", "ARRAY", [2, 2], "UINT32", "must be an integer"),
    ("llama.block_count", "UINT32", 0, None, "out of range"),
    ("llama.block_count", "UINT64", 2**40, None, "out of range"),
    ("llama.context_length", "FLOAT32", 256.0, None, "must be an integer"),
    ("llama.embedding_length", "INT32", -256, None, "out of range"),
    ("llama.feed_forward_length", "ARRAY", [512], "UINT32", "has 1 elements, expected 2"),
    ("llama.attention.head_count", "UINT32", 0, None, "out of range"),
    ("llama.attention.head_count", "BOOL", True, None, "must be an integer"),
    ("llama.attention.head_count_kv", "UINT32", 8, None, "out of range"),
    ("llama.attention.head_count_kv", "UINT32", 3, None, "does not divide the head count"),
    ("llama.attention.head_count", "UINT32", 3, None, "'llama.attention.head_count_kv' = 2 does not divide"),
    ("llama.attention.key_length", "UINT32", 63, None, "head size"),
    ("llama.attention.layer_norm_rms_epsilon", "FLOAT32", float("nan"), None, "must be finite"),
    ("llama.attention.layer_norm_rms_epsilon", "FLOAT32", 0.0, None, "out of range"),
    ("llama.attention.layer_norm_rms_epsilon", "STRING", "1e-5", None, "must be a float"),
    ("llama.rope.freq_base", "FLOAT32", float("inf"), None, "must be finite"),
    ("llama.rope.freq_base", "FLOAT32", -1.0, None, "out of range"),
    ("llama.rope.scaling.factor", "FLOAT32", -2.0, None, "out of range"),
    ("llama.attention.sliding_window", "INT32", -1, None, "out of range"),
    ("llama.final_logit_softcapping", "FLOAT32", float("nan"), None, "must be finite"),
    ("tokenizer.ggml.model", "ARRAY", [1], "INT32", "must be a string"),
    ("tokenizer.ggml.tokens", "STRING", "<unk>", None, "must be an array of strings"),
    ("tokenizer.ggml.tokens", "ARRAY", [1, 2, 3], "INT32", "must be an array of strings"),
    ("tokenizer.ggml.tokens", "ARRAY", ["a"] * 511, "STRING", "has 511 elements, expected 512"),
    ("tokenizer.ggml.scores", "ARRAY", [0.0] * 100, "FLOAT32", "has 100 elements, expected 512"),
    ("tokenizer.ggml.scores", "ARRAY", ["x"] * 512, "STRING", "must be an array of floats"),
    ("tokenizer.ggml.scores", "ARRAY", [float("nan")] * 512, "FLOAT32", "non-finite"),
    ("tokenizer.ggml.token_type", "ARRAY", [1.5] * 512, "FLOAT32", "must be an array of integers"),
    ("tokenizer.ggml.token_type", "ARRAY", [6] * 512, "INT32", "as a byte"),
    ("tokenizer.ggml.merges", "UINT32", 3, None, "must be an array of strings"),
    ("tokenizer.ggml.pre", "UINT8", 1, None, "must be a string"),
    ("tokenizer.ggml.bos_token_id", "STRING", "1", None, "must be an integer"),
    ("tokenizer.ggml.eos_token_id", "ARRAY", [2, 2], "UINT32", "must be an integer"),
    ("tokenizer.ggml.add_bos_token", "UINT8", 1, None, "must be a bool"),
    ("tokenizer.ggml.add_space_prefix", "STRING", "yes", None, "must be a bool"),
    ("tokenizer.chat_template", "ARRAY", ["{{ x }}"], "STRING", "must be a string"),
    ("tokenizer.chat_template", "STRING", "x" * ((1 << 20) + 1), None, "longer than"),
]


@pytest.mark.parametrize("key,vtype,value,etype,message", BAD_VALUES,
                         ids=[f"{k}={str(v)[:12]}" for k, _, v, _, _ in BAD_VALUES])
def test_bad_metadata_value_named_error(tiny_model, tmp_path, key, vtype, value, etype, message):
    import gguf_fuzzer as F

    path = tmp_path / "bad.gguf"
    path.write_bytes(_fuzz_base(tiny_model).with_value(key, F.T[vtype], value, etype and F.T[etype]))
    with pytest.raises(GGUFError) as e:
        _load_all(str(path))
    text = str(e.value)
    assert key in text and message in text and "\n" not in text, text


def test_per_layer_head_counts(tiny_model, tmp_path):
    """Head counts may be one per layer (all equal is what the models run); the KV bound applies layer by layer."""
    import gguf_fuzzer as F

    base = _fuzz_base(tiny_model)
    path = tmp_path / "per_layer.gguf"
    for value, outcome in (([4, 4], None), ([4, 8], UnsupportedModelError), ([4, 1], GGUFError), ([4], GGUFError)):
        path.write_bytes(base.with_value("llama.attention.head_count", F.T.ARRAY, value, F.T.INT64))
        if outcome is None:
            assert load_gguf(str(path)).config.n_heads == 4
        else:
            with pytest.raises(outcome, match="head_count"):
                load_gguf(str(path))


def test_huge_counts_refused_before_allocation(tiny_model, tmp_path):
    import tracemalloc

    import gguf_fuzzer as F

    base = _fuzz_base(tiny_model)
    cases = {"tokens": F.huge_count_of(base, "tokenizer.ggml.tokens", 2**36),
             "scores": F.huge_count_of(base, "tokenizer.ggml.scores", 2**40),
             "string": F.huge_count_of(base, "general.name", 2**62),
             "block_count": base.with_value("llama.block_count", F.T.UINT32, 2**31 - 1)}
    for name, data in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        tracemalloc.start()
        try:
            with pytest.raises(GGUFError):
                load_gguf(str(path))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20, f"{name}: {peak >> 20} MB allocated before refusing the file"


def test_deeply_nested_arrays_refused(tiny_model, tmp_path):
    import gguf_fuzzer as F

    base = _fuzz_base(tiny_model)
    nested = struct.pack("<IQ", F.T.ARRAY, 1) * 5000 + struct.pack("<IQ", F.T.UINT8, 0)  # would recurse 5000 deep
    raw = struct.pack("<Q", 4) + b"deep" + struct.pack("<I", F.T.ARRAY) + nested
    path = tmp_path / "deep.gguf"
    path.write_bytes(base.build(base.kv + [F.Entry("deep", raw, 12)]))
    with pytest.raises(GGUFError, match="nested deeper"):
        load_gguf(str(path))


def _tensor_entry(base, name):
    i = next(i for i, t in enumerate(base.tensors) if t.name == name)
    return i, base.tensors[i]


@pytest.mark.parametrize("what", ["dims_overflow", "unaligned", "overlap", "repeated", "no_dims"])
def test_tensor_table_corruption_named_error(tiny_model, tmp_path, what):
    import gguf_fuzzer as F

    base = _fuzz_base(tiny_model)
    i, t = _tensor_entry(base, "blk.0.attn_norm.weight")
    raw = bytearray(t.raw)
    tensors = list(base.tensors)
    if what == "dims_overflow":  # 2**32 * 2**32 elements: wrapped to 0 bytes in int64
        raw[t.count_at:t.count_at + 4] = struct.pack("<I", 2)
        raw[t.count_at + 4:t.count_at + 12] = struct.pack("<Q", 2**32)
        raw[t.count_at + 12:t.count_at + 12] = struct.pack("<Q", 2**32)
        tensors[i] = F.Entry(t.name, bytes(raw), t.type_at + 8, t.count_at)
    elif what in ("unaligned", "overlap"):
        (off,) = struct.unpack_from("<Q", raw, t.type_at + 4)
        struct.pack_into("<Q", raw, t.type_at + 4, off + (4 if what == "unaligned" else 32))
        tensors[i] = F.Entry(t.name, bytes(raw), t.type_at, t.count_at)
    elif what == "repeated":
        tensors.insert(i, t)
    else:
        raw[t.count_at:t.count_at + 12] = struct.pack("<I", 0)
        tensors[i] = F.Entry(t.name, bytes(raw), t.type_at - 8, t.count_at)
    path = tmp_path / f"{what}.gguf"
    path.write_bytes(base.build(tensors=tensors))
    with pytest.raises(GGUFError, match=t.name.replace(".", r"\.")):
        load_gguf(str(path))


def test_repeated_metadata_key_named_error(tiny_model, tmp_path):
    base = _fuzz_base(tiny_model)
    path = tmp_path / "twice.gguf"
    path.write_bytes(base.build(base.kv + [base.kv[3]]))
    with pytest.raises(GGUFError, match="appears twice"):
        load_gguf(str(path))


def test_tensor_shape_against_hyperparameters(tiny_model, tmp_path):
    import gguf_fuzzer as F

    path = tmp_path / "ffn.gguf"
    path.write_bytes(_fuzz_base(tiny_model).with_value("llama.feed_forward_length", F.T.UINT32, 256))
    with pytest.raises(GGUFError, match="ffn_gate.weight' has shape"):
        load_gguf(str(path))


def test_out_of_range_special_ids_fall_back_as_llama_cpp(tiny_model, tmp_path, caplog):
    import gguf_fuzzer as F

    path = tmp_path / "ids.gguf"
    path.write_bytes(_fuzz_base(tiny_model).with_value("tokenizer.ggml.bos_token_id", F.T.UINT32, 512))
    with caplog.at_level("WARNING", logger="edgellm"):
        lm, tok = _load_all(str(path))
    assert tok.bos_id == 1  # llama.cpp's default for an SPM vocabulary
    assert "tokenizer.ggml.bos_token_id" not in lm.metadata and "bos_token_id" in caplog.text


def test_schema_covers_every_key_the_readers_read(tiny_model):
    """Record each key the loader, the tokenizer and the chat template look up: every one is in the schema."""
    from edgellm.chat_template import ChatTemplate
    from edgellm.loader import config_from_metadata
    from edgellm.metadata_schema import KEYS, CheckedMetadata
    from edgellm.tokenizer import Tokenizer

    class Recording(CheckedMetadata):
        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        read: set[str] = set()
        lm = load_gguf(tiny_model(arch))
        meta = Recording(lm.metadata, lm.metadata.scopes)
        config_from_metadata(meta, lm.gguf.tensors)
        tok = Tokenizer.from_metadata(meta)
        ChatTemplate.from_metadata(meta, bos_token="<s>", eos_token="</s>")
        ChatTemplate.from_metadata(Recording({**meta, "tokenizer.chat_template": "x"}, meta.scopes),
                                   bos_token="<s>", eos_token="</s>")
        assert tok.vocab_size > 0
        schema = {k.name.format(arch=arch) for k in KEYS}
        assert read - schema == set(), f"{arch}: keys read but not in the schema"
        assert {"tokenizer.ggml.token_type", f"{arch}.block_count", "tokenizer.chat_template"} <= read
