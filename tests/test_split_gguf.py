"""Split GGUF models (NAME-00001-of-00003.gguf, as gguf-split / gguf-py's GGUFWriter write them) load as one
model from the first shard: the same tensors, zero-copy from each shard's own map, llama.cpp's golden logits;
a missing or mismatched shard is a named error naming the file; info and quantize work on them."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiny_models import tiny_spec, write_spec
from timing import scaled

GOLDEN = Path(__file__).parent / "golden"
REPO_ROOT = Path(__file__).resolve().parents[1]


def golden_spec(case: str):
    meta = json.loads((GOLDEN / f"{case}.json").read_text())
    writer = dict(meta["writer"])
    return meta, tiny_spec(writer.pop("arch"), **writer)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny llama of the golden file tiny_llama.json, whole and in 3 shards (8 tensors each at most)."""
    d = tmp_path_factory.mktemp("split")
    meta, spec = golden_spec("tiny_llama")
    for sub in ("whole", "shards"):
        (d / sub).mkdir()
    whole = write_spec(d / "whole" / "tiny-llama.gguf", spec)
    first = write_spec(d / "shards" / "tiny-llama.gguf", spec, split_max_tensors=8)
    assert hashlib.sha256(whole.read_bytes()).hexdigest() == meta["model_file"]["sha256"], "tiny model writer changed"
    return {"whole": whole, "first": first, "meta": meta, "dir": d / "shards"}


def shards(first: Path) -> list[Path]:
    return [first.with_name(f"tiny-llama-0000{i}-of-00003.gguf") for i in (1, 2, 3)]


def copy_shards(models, dst: Path) -> list[Path]:
    dst.mkdir()
    return [Path(shutil.copy(p, dst / p.name)) for p in shards(models["first"])]


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True,
                          timeout=scaled(600), cwd=str(REPO_ROOT))


def test_shards_are_what_gguf_split_writes(models):
    from edgellm.gguf_file import read_metadata

    first, *rest = shards(models["first"])
    assert first == models["first"] and all(p.is_file() for p in rest)
    keys = [{k: v for k, v in read_metadata(p).items() if k.startswith("split.")} for p in shards(first)]
    assert keys == [{"split.no": i, "split.count": 3, "split.tensors.count": 21} for i in range(3)]
    assert "general.architecture" in read_metadata(first) and "general.architecture" not in read_metadata(rest[0])


def test_split_model_reads_as_the_whole_model_zero_copy(models):
    from edgellm.gguf_file import read_gguf

    whole, split = read_gguf(models["whole"]), read_gguf(models["first"])
    assert split.paths == tuple(str(p) for p in shards(models["first"])) and whole.paths == (str(models["whole"]),)
    assert list(split.metadata) == list(whole.metadata)  # split.* dropped, as gguf-split --merge does
    assert set(split.tensors) == set(whole.tensors)
    assert {t.shard for t in split.tensors.values()} == {0, 1, 2}
    rows = np.array([0, 7, 511])
    for name, t in split.tensors.items():
        view = split.tensor_bytes(name)
        assert np.shares_memory(view, split.shard_data[t.shard])  # a view of its own shard's memmap
        np.testing.assert_array_equal(view, whole.tensor_bytes(name))
        np.testing.assert_array_equal(split.read_tensor_copy(name), whole.read_tensor_copy(name))
    np.testing.assert_array_equal(split.read_rows("token_embd.weight", rows), whole.read_rows("token_embd.weight", rows))


def test_split_model_logits_equal_the_whole_and_llamacpps(models):
    from edgellm import LLM

    meta = models["meta"]
    want = np.load(GOLDEN / meta["logits_file"])["logits"]  # llama.cpp's, on the whole file
    got_whole = LLM(str(models["whole"]), ctx_size=64, progress=False).logits(meta["tokens"])
    got = LLM(str(models["first"]), ctx_size=64, progress=False).logits(meta["tokens"])
    np.testing.assert_array_equal(got, got_whole)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-3


def test_weight_cache_key_covers_every_shard(models, tmp_path):
    import os

    from edgellm.gguf_file import read_gguf
    from edgellm.weight_cache import _key

    first, second, third = copy_shards(models, tmp_path / "m")
    names = sorted(read_gguf(first).tensors)
    before = _key(read_gguf(first), names)
    os.utime(third, ns=(0, 12345))  # another shard changed, the first did not
    assert _key(read_gguf(first), names) != before


def test_llamacpp_loads_the_same_shards(models):
    """llama.cpp's own loader takes the shards for the same model (optional: needs llama-cpp-python)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (PYTHONPATH=/opt/llama_avx512)")
    tokens = models["meta"]["tokens"]

    def logits(path):
        m = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False)
        m.eval(tokens)
        return np.array(m.scores[:len(tokens)])

    np.testing.assert_array_equal(logits(models["first"]), logits(models["whole"]))


def test_missing_shard_is_a_named_error(models, tmp_path):
    from edgellm.errors import GGUFError
    from edgellm.gguf_file import read_gguf

    first, second, third = copy_shards(models, tmp_path / "m")
    third.unlink()
    with pytest.raises(GGUFError, match=rf"^{third}: shard 3 of 3 of the split model {first.name} is missing$"):
        read_gguf(first)
    r = cli("info", "-m", str(first))
    assert r.returncode == 2 and r.stderr.strip() == f"edgellm: error: {third}: shard 3 of 3 of the split model " \
                                                    f"{first.name} is missing"


def test_mismatched_shards_are_named_errors(models, tmp_path):
    from edgellm.errors import GGUFError
    from edgellm.gguf_file import read_gguf

    first, second, third = copy_shards(models, tmp_path / "swap")
    tmp = second.read_bytes()
    second.write_bytes(third.read_bytes())
    third.write_bytes(tmp)
    with pytest.raises(GGUFError, match=rf"^{second}: says it is shard 3 of 3, expected shard 2 of 3"):
        read_gguf(first)
    with pytest.raises(GGUFError, match=rf"^{third}: this is shard 2 of 3 of a split model; open its first shard, "
                                        rf"{first.name}$"):
        read_gguf(third)
    other = tmp_path / "other"
    other.mkdir()
    o_first = write_spec(other / "tiny-llama.gguf", tiny_spec("llama", n_layer=3), split_max_tensors=8)
    mixed = copy_shards(models, tmp_path / "mixed")
    shutil.copy(o_first.with_name("tiny-llama-00002-of-00004.gguf"), mixed[1])  # another model's shard 2 (of 4)
    with pytest.raises(GGUFError, match=rf"^{mixed[1]}: says it is shard 2 of 4, expected shard 2 of 3"):
        read_gguf(mixed[0])
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(models["first"], renamed)
    with pytest.raises(GGUFError, match=r"does not end in '-00001-of-00003.gguf'"):
        read_gguf(renamed)
    assert "error" in cli("info", "-m", str(third)).stderr and cli("info", "-m", str(third)).returncode == 2


def test_tensor_count_and_duplicates_are_checked(models, tmp_path):
    import gguf

    from edgellm.errors import GGUFError
    from edgellm.gguf_file import read_gguf

    def write(path: Path, no: int, count: int, total: int, tensors: dict):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_uint16("split.no", no)
        w.add_uint16("split.count", count)
        w.add_int32("split.tensors.count", total)
        for n, a in tensors.items():
            w.add_tensor(n, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    a = np.ones(32, np.float32)
    d = tmp_path / "dup"
    d.mkdir()
    write(d / "m-00001-of-00002.gguf", 0, 2, 2, {"x": a})
    write(d / "m-00002-of-00002.gguf", 1, 2, 2, {"x": a})
    with pytest.raises(GGUFError, match=r"m-00002-of-00002.gguf: tensor 'x' is duplicated \(also in m-00001"):
        read_gguf(d / "m-00001-of-00002.gguf")
    write(d / "m-00002-of-00002.gguf", 1, 2, 2, {"y": a, "z": a})
    with pytest.raises(GGUFError, match=r"split.tensors.count is 2 but its 2 shards hold 3 tensors"):
        read_gguf(d / "m-00001-of-00002.gguf")
    write(d / "m-00002-of-00002.gguf", 1, 2, 3, {"y": a})
    with pytest.raises(GGUFError, match=r"m-00002-of-00002.gguf: split.tensors.count is 3, the first shard says 2"):
        read_gguf(d / "m-00001-of-00002.gguf")


def test_metadata_only_first_shard(tmp_path):
    """gguf-split --no-tensor-first-split (gguf-py: small_first_shard): the first shard holds no tensor."""
    from edgellm.gguf_file import read_gguf

    _, spec = golden_spec("tiny_llama")
    first = write_spec(tmp_path / "m.gguf", spec, split_max_tensors=12, small_first_shard=True)
    g = read_gguf(first)
    assert len(g.paths) == 3 and {t.shard for t in g.tensors.values()} == {1, 2} and len(g.tensors) == 21


def test_info_and_quantize_on_a_split_model(models, tmp_path):
    r = cli("info", "-m", str(models["first"]), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["tensors"] == 21 and info["files"] == 3 and info["path"] == str(models["first"])
    outs = {}
    for name, src in (("split", models["first"]), ("whole", models["whole"])):
        outs[name] = tmp_path / f"{name}-q8.gguf"
        r = cli("quantize", str(src), str(outs[name]), "--type", "Q8_0", "--threads", "1")
        assert r.returncode == 0, r.stderr
    # one output file, byte for byte what quantizing the whole model gives (no split.* keys carried over)
    assert outs["split"].read_bytes() == outs["whole"].read_bytes()
