"""Repacked-weight cache: the kernels' layout of every matrix, written once to the user cache and then
memory-mapped, so a warm start repacks nothing and resident memory stays near the model size (the GGUF's
own pages are then only touched for embedding rows).

Keyed by the GGUF's path, size and mtime and by the repacking code's hash; `EDGELLM_WEIGHT_CACHE=0` turns
it off (weights are then repacked in memory at every start).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import numpy as np

from edgellm.gguf_file import GGUFFile
from edgellm.model_path import cache_dir

ALIGN = 64


def _code_tag() -> str:
    import kernels_cpu.repack as rp

    return hashlib.sha256(Path(rp.__file__).read_bytes()).hexdigest()[:12]


def _key(g: GGUFFile, names: list[str]) -> str:
    st = os.stat(g.path)
    h = hashlib.sha256(f"{os.path.realpath(g.path)}|{st.st_size}|{st.st_mtime_ns}|{_code_tag()}".encode())
    h.update("|".join(names).encode())
    return h.hexdigest()[:24]


def _release_pages(g: GGUFFile, name: str) -> None:
    """Drop the raw tensor's pages from this process (they were read once, for repacking)."""
    mm = getattr(g.data, "_mmap", None)
    t = g.tensors[name]
    if mm is None or not hasattr(mm, "madvise"):
        return
    start = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, t.offset + t.n_bytes - start)
    except (OSError, ValueError):
        pass


def prepare_all(g: GGUFFile, names: list[str], *, progress: bool = False) -> dict:
    """PreparedWeight per tensor name, from the cache when possible (building it on first use)."""
    from kernels_cpu import prepare_weight
    from kernels_cpu.matmul import PreparedWeight

    def fresh(name):
        t = g.tensors[name]
        return prepare_weight(g.tensor_bytes(name), t.qtype, t.shape)

    if os.environ.get("EDGELLM_WEIGHT_CACHE", "1") == "0":
        return {n: fresh(n) for n in names}
    base = cache_dir() / "weights" / _key(g, names)
    index_path, data_path = base.with_suffix(".json"), base.with_suffix(".bin")
    if not (index_path.is_file() and data_path.is_file()):
        try:
            _build(g, names, fresh, base, progress)
        except OSError:  # read-only or full cache dir: repack in memory
            return {n: fresh(n) for n in names}
    index = json.loads(index_path.read_text())
    data = np.memmap(data_path, dtype=np.uint8, mode="r")
    data._mmap.madvise(mmap.MADV_SEQUENTIAL)  # matmuls stream each weight front to back
    out = {}
    for name in names:
        e = index[name]
        t = g.tensors[name]
        qs, sc = (data[off:off + int(np.prod(shape)) * np.dtype(dt).itemsize].view(dt).reshape(shape)
                  for off, shape, dt in (e["qs"], e["sc"]))
        out[name] = PreparedWeight(t.qtype, tuple(t.shape), qs, sc, g.tensor_bytes(name))
    return out


def _build(g: GGUFFile, names: list[str], fresh, base: Path, progress: bool) -> None:
    from tqdm import tqdm

    base.parent.mkdir(parents=True, exist_ok=True)
    tmp = base.with_suffix(f".bin.{os.getpid()}.part")
    index = {}
    total = sum(g.tensors[n].n_bytes for n in names)
    with open(tmp, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, disable=not progress, leave=False,
                                    desc="preparing weights (first run only)") as bar:
        for name in names:
            pw = fresh(name)
            entry = {}
            for part in ("qs", "sc"):
                arr = np.ascontiguousarray(getattr(pw, part))
                pad = (-f.tell()) % ALIGN
                f.write(b"\0" * pad)
                entry[part] = (f.tell(), list(arr.shape), arr.dtype.str)
                f.write(arr.tobytes())
            index[name] = entry
            del pw
            _release_pages(g, name)
            bar.update(g.tensors[name].n_bytes)
    os.replace(tmp, base.with_suffix(".bin"))
    base.with_suffix(".json").write_text(json.dumps(index))
