"""Repacked-weight cache: reuse, source records, and pruning of dead and least recently used entries."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from tiny_models import write_tiny_model

from edgellm import weight_cache as wc
from edgellm.gguf_file import read_gguf


def _load(path):
    g = read_gguf(path)
    names = [n for n, t in g.tensors.items() if len(t.shape) == 2]
    return wc.prepare_all(g, names), wc.cache_dir() / "weights" / wc._key(g, names)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EDGELLM_WEIGHT_CACHE", raising=False)
    monkeypatch.delenv("EDGELLM_WEIGHT_CACHE_GB", raising=False)
    return tmp_path / "cache" / "weights"


def _entries(folder) -> set[str]:
    return {p.stem for p in folder.glob("*.bin")}


def test_entry_records_its_source_and_is_reused(tmp_path, cache):
    m = write_tiny_model(tmp_path / "a.gguf", "llama", seed=1)
    w1, base = _load(m)
    meta = json.loads(base.with_suffix(".json").read_text())[wc.META]
    assert meta["path"] == os.path.realpath(m) and meta["size"] == os.path.getsize(m)
    built = base.with_suffix(".bin").stat().st_mtime_ns
    os.utime(base.with_suffix(".json"), (1, 1))  # pretend it was last used long ago
    w2, base2 = _load(m)
    assert base2 == base and base.with_suffix(".bin").stat().st_mtime_ns == built  # not rebuilt
    assert base.with_suffix(".json").stat().st_mtime > 1  # use recorded
    for n in w1:
        np.testing.assert_array_equal(w1[n].qs, w2[n].qs)


def test_entries_of_deleted_or_changed_models_are_pruned(tmp_path, cache):
    a = write_tiny_model(tmp_path / "a.gguf", "llama", seed=1)
    b = write_tiny_model(tmp_path / "b.gguf", "llama", seed=2)
    _, ea = _load(a)
    _, eb = _load(b)
    os.remove(a)
    with open(b, "ab") as f:  # b changed: its old entry can never be used again
        f.write(b"\0" * 32)
    c = write_tiny_model(tmp_path / "c.gguf", "qwen2", seed=3)
    _, ec = _load(c)  # a new entry prunes dead ones
    assert _entries(cache) == {ec.name}


def test_least_recently_used_entries_go_when_over_the_size_cap(tmp_path, cache, monkeypatch):
    paths = [write_tiny_model(tmp_path / f"{i}.gguf", "llama", seed=i) for i in range(3)]
    bases = []
    for i, p in enumerate(paths[:2]):
        _, e = _load(p)
        os.utime(e.with_suffix(".json"), (1000 + i, 1000 + i))  # entry 0 least recently used
        bases.append(e)
    size = bases[0].with_suffix(".bin").stat().st_size
    monkeypatch.setenv("EDGELLM_WEIGHT_CACHE_GB", str(2.5 * size / 2**30))  # room for two entries
    legacy = cache / "legacy000000000000000000"
    legacy.with_suffix(".bin").write_bytes(b"\0" * 16)
    legacy.with_suffix(".json").write_text("{}")  # no source record: kept while under the cap
    _, e2 = _load(paths[2])
    assert _entries(cache) == {bases[1].name, e2.name, legacy.name}
    assert wc.prune(cache, keep=e2.name, max_bytes=0) == [bases[1].name, legacy.name]  # least recent first
    assert _entries(cache) == {e2.name}  # the entry in use is never pruned


def test_stale_partial_files_are_removed(tmp_path, cache):
    cache.mkdir(parents=True)
    old, new = cache / "x.bin.1.part", cache / "y.bin.2.part"
    old.write_bytes(b"1")
    new.write_bytes(b"2")
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    wc.prune(cache)
    assert not old.exists() and new.exists()


def test_an_entry_pruned_before_it_is_read_is_repacked_in_memory(tmp_path, cache, monkeypatch):
    """Another process running other repacking code deletes the entry as dead right after it was built: the
    weights are repacked in memory instead of failing."""
    m = write_tiny_model(tmp_path / "a.gguf", "llama", seed=3)
    build = wc._build

    def build_then_pruned(g, names, fresh, base, progress):
        build(g, names, fresh, base, progress)
        for suffix in (".bin", ".json"):
            base.with_suffix(suffix).unlink()

    monkeypatch.setattr(wc, "_build", build_then_pruned)
    got, _ = _load(m)
    monkeypatch.setattr(wc, "_build", build)  # (not undo(): that would drop the cache fixture's environment too)
    want, _ = _load(m)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name].qs, want[name].qs)


def test_entries_are_read_into_memory_or_mapped(tmp_path, cache, monkeypatch):
    """By default an entry is read into (read-only, huge-page advised) process memory; EDGELLM_MMAP=1, or an entry
    over half of the memory available, maps the file instead. The weights are the same either way."""
    m = write_tiny_model(tmp_path / "a.gguf", "llama", seed=1)
    monkeypatch.delenv("EDGELLM_MMAP", raising=False)
    read, _ = _load(m)
    monkeypatch.setenv("EDGELLM_MMAP", "1")
    mapped, base = _load(m)
    monkeypatch.setenv("EDGELLM_MMAP", "0")
    monkeypatch.setattr(wc, "_available_memory", lambda: base.with_suffix(".bin").stat().st_size)
    big, _ = _load(m)  # twice the file would not fit in half of what is available
    for n in read:
        assert not isinstance(read[n].qs.base, np.memmap) and not read[n].qs.flags.writeable
        assert isinstance(mapped[n].qs.base, np.memmap) and isinstance(big[n].qs.base, np.memmap)
        np.testing.assert_array_equal(read[n].qs, mapped[n].qs)
        np.testing.assert_array_equal(read[n].sc, mapped[n].sc)


def test_cached_arrays_start_64_bytes_past_a_128_byte_boundary(tmp_path, cache, monkeypatch):
    """Every cached array, read or mapped, starts at 64 mod 128 in memory (streamed from 128-byte aligned starts the
    decode matmuls ran up to ~40% slower on the AVX2 path; see weight_cache.ALIGN_OFFSET)."""
    m = write_tiny_model(tmp_path / "a.gguf", "llama", seed=1)
    _load(m)  # builds the entry
    for mmap_env in ("0", "1"):
        monkeypatch.setenv("EDGELLM_MMAP", mmap_env)
        weights, _ = _load(m)
        starts = [a.ctypes.data % 128 for w in weights.values() for a in (w.qs, w.sc)]
        assert starts and set(starts) == {64}, (mmap_env, starts)
