"""Repacked-weight cache: the kernels' layout of every matrix, written once to the user cache and then read
into memory (or memory-mapped: see in_memory), so a warm start repacks nothing and resident memory stays near the
model size (the GGUF's own pages are then only touched for embedding rows).

Keyed by the GGUF's path, size and mtime and by the repacking code's hash; `EDGELLM_WEIGHT_CACHE=0` turns
it off (weights are then repacked in memory at every start). Each entry records its source; when a new entry
is written, entries that can never be used again (source file gone or changed, older repacking code) are
deleted, and then the least recently used ones while the cache exceeds `EDGELLM_WEIGHT_CACHE_GB` (default 8).
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

# Each array starts 64 bytes past a 128-byte boundary: cache-line aligned, but never 128-byte aligned. Streamed
# from 128-byte aligned starts (every array after a size that is a multiple of 128, i.e. almost all), decode
# matmuls ran slower on the Zen 4 test VM: forced AVX2, 2 threads, one row, Q4_K 65536x2048 2.38 -> 1.82 ms,
# Q6_K 6.76 -> 5.83, Q8_0 131072x640 2.69 -> 2.47, llama-1b's output head 11.3 -> 6.4 ms; AVX-512 0-4% (any
# start that is not a multiple of 128 did as well; the hardware prefetchers pair lines in 128-byte blocks).
ALIGN, ALIGN_OFFSET = 128, 64
META = "__source__"  # index key of an entry's source record (tensor names never start with "__")
DEFAULT_MAX_GB = 8.0
# entry layout: 2 = a 3-D expert tensor is one entry, its experts' codes and scales stacked; 3 = arrays at
# ALIGN_OFFSET past an ALIGN boundary
FORMAT = 3


def _code_tag() -> str:
    """The repacking code and the layouts it chose for this target (some differ per vector width, e.g. with a
    forced EDGELLM_ISA): a cached weight is only reused where it was made the same way."""
    import kernels_cpu.repack as rp

    h = hashlib.sha256(Path(rp.__file__).read_bytes())
    h.update(repr(sorted((int(q), lay.planes) for q, lay in rp.LAYOUTS.items())).encode())
    return h.hexdigest()[:12]


def _source(g: GGUFFile) -> dict:
    st = os.stat(g.path)
    return {"path": os.path.realpath(g.path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "code": _code_tag()}


def _key(g: GGUFFile, names: list[str]) -> str:
    src = _source(g)
    h = hashlib.sha256(f"{src['path']}|{src['size']}|{src['mtime_ns']}|{src['code']}|{FORMAT}".encode())
    for p in g.paths[1:]:  # a split model's other shards
        st = os.stat(p)
        h.update(f"|{os.path.realpath(p)}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update("|".join(names).encode())
    return h.hexdigest()[:24]


def _release_pages(g: GGUFFile, name: str) -> None:
    """Drop the raw tensor's pages from this process (they were read once, for repacking)."""
    t = g.tensors[name]
    mm = getattr(g.shard_data[t.shard] if t.shard else g.data, "_mmap", None)  # the tensor's own file
    if mm is None or not hasattr(mm, "madvise"):
        return
    start = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, t.offset + t.n_bytes - start)
    except (OSError, ValueError):
        pass


EXPERT = "#"  # "blk.0.ffn_up_exps.weight#3": expert 3's matrix of a 3-D (n_expert, N, K) tensor


def matrix_source(g: GGUFFile, name: str):
    """(tensor info, (N, K) shape, raw (N, row_bytes) bytes) of a matrix name: a 2-D tensor, or one expert's
    slice `name#e` of a 3-D expert tensor (zero-copy views of the GGUF memmap)."""
    base, _, e = name.partition(EXPERT)
    t = g.tensors[base]
    raw = g.tensor_bytes(base)
    if not e:
        return t, tuple(t.shape), raw
    n = t.shape[1]
    return t, tuple(t.shape[1:]), raw[int(e) * n:(int(e) + 1) * n]


def _is_stack(g: GGUFFile, name: str) -> bool:
    """A 3-D (n_expert, N, K) tensor, prepared as one ExpertStack."""
    return EXPERT not in name and len(g.tensors[name].shape) == 3


def _expert_raw(g: GGUFFile, name: str) -> np.ndarray:
    """The raw bytes of a 3-D expert tensor as (E, N, row_bytes)."""
    t = g.tensors[name]
    return g.tensor_bytes(name).reshape(t.shape[0], t.shape[1], -1)


def prepare_all(g: GGUFFile, names: list[str], *, progress: bool = False) -> dict:
    """PreparedWeight per matrix name (see matrix_source), or ExpertStack per 3-D expert tensor name, from the
    cache when possible (building it on first use)."""
    from kernels_cpu import prepare_weight
    from kernels_cpu.matmul import PreparedWeight
    from kernels_cpu.moe_matmul import ExpertStack

    def fresh(name):
        if _is_stack(g, name):
            return ExpertStack.from_weights([fresh(f"{name}{EXPERT}{e}") for e in range(g.tensors[name].shape[0])])
        t, shape, raw = matrix_source(g, name)
        return prepare_weight(raw, t.qtype, shape)

    if os.environ.get("EDGELLM_WEIGHT_CACHE", "1") == "0":
        return {n: fresh(n) for n in names}
    base = cache_dir() / "weights" / _key(g, names)
    index_path, data_path = base.with_suffix(".json"), base.with_suffix(".bin")
    if not (index_path.is_file() and data_path.is_file()):
        try:
            _build(g, names, fresh, base, progress)
        except OSError:  # read-only or full cache dir: repack in memory
            return {n: fresh(n) for n in names}
    else:
        try:
            os.utime(index_path)  # last use, for least-recently-used pruning
        except OSError:
            pass
    try:
        index = json.loads(index_path.read_text())
        data = _read(data_path, progress) if in_memory(data_path) else _mapped(data_path)
    except (OSError, ValueError):  # pruned meanwhile by a process running other repacking code (it saw a dead entry)
        return {n: fresh(n) for n in names}
    out = {}
    for name in names:
        e = index[name]
        qs, sc = (data[off:off + int(np.prod(shape)) * np.dtype(dt).itemsize].view(dt).reshape(shape)
                  for off, shape, dt in (e["qs"], e["sc"]))
        if _is_stack(g, name):
            t = g.tensors[name]
            out[name] = ExpertStack(t.qtype, tuple(t.shape[1:]), qs, sc, _expert_raw(g, name))
        else:
            t, shape2, raw = matrix_source(g, name)
            out[name] = PreparedWeight(t.qtype, shape2, qs, sc, raw)
    return out


def in_memory(data_path: Path) -> bool:
    """Whether an entry is read into process memory (the default) rather than memory-mapped: there it sits on
    transparent huge pages (_read), and decode streams the weights from them 10-20% faster than from a file
    mapping's 4 KiB pages, whose TLB misses each cost a page walk (a nested one on a VM): qwen3moe-1b tg64 53 ->
    62 t/s on the Zen 4 test VM. Mapped instead with EDGELLM_MMAP=1, or when the entry is over half of the memory
    available (pages are then faulted in as read, and the OS can drop them)."""
    if os.environ.get("EDGELLM_MMAP", "0") == "1":
        return False
    avail = _available_memory()
    return avail is not None and data_path.stat().st_size <= avail // 2


def _available_memory() -> int | None:
    """MemAvailable in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read(data_path: Path, progress: bool) -> np.ndarray:
    """The entry's file read into one array (read(), not through a mapping: the file's pages stay in the page
    cache, outside this process's resident memory); one anonymous mapping advised for huge pages, so every
    weight, the small per-layer ones too, sits on them."""
    from tqdm import tqdm

    size = data_path.stat().st_size
    buf = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    data = np.frombuffer(buf, np.uint8, count=size)
    view = memoryview(buf)
    with open(data_path, "rb", buffering=0) as f, tqdm(total=size, unit="B", unit_scale=True, leave=False,
                                                        disable=not progress, desc="loading weights") as bar:
        got = 0
        while got < size:
            n = f.readinto(view[got:got + (64 << 20)])
            if not n:
                raise OSError(f"{data_path}: cut short")
            got += n
            bar.update(n)
    data.flags.writeable = False  # as the mapping's pages
    return data


def _mapped(data_path: Path) -> np.ndarray:
    """The entry's file as a read-only mapping."""
    data = np.memmap(data_path, dtype=np.uint8, mode="r")
    data._mmap.madvise(mmap.MADV_SEQUENTIAL)  # matmuls stream each weight front to back
    return data


def _write(f, arr: np.ndarray) -> list:
    """Append arr at the next offset that is ALIGN_OFFSET past an ALIGN boundary; its (offset, shape, dtype) index
    record."""
    f.write(b"\0" * ((ALIGN_OFFSET - f.tell()) % ALIGN))
    rec = [f.tell(), list(arr.shape), arr.dtype.str]
    f.write(np.ascontiguousarray(arr).tobytes())
    return rec


def _build(g: GGUFFile, names: list[str], fresh, base: Path, progress: bool) -> None:
    from tqdm import tqdm

    base.parent.mkdir(parents=True, exist_ok=True)
    tmp = base.with_suffix(f".bin.{os.getpid()}.part")
    index: dict = {META: _source(g)}
    total = sum(g.tensor_bytes(n.partition(EXPERT)[0]).nbytes for n in names)
    with open(tmp, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, disable=not progress, leave=False,
                                    desc="preparing weights (first run only)") as bar:
        for name in names:
            if _is_stack(g, name):  # expert by expert (bounded memory): the codes back to back, then the scales
                scs = []
                n_exp = g.tensors[name].shape[0]
                for e in range(n_exp):
                    pw = fresh(f"{name}{EXPERT}{e}")
                    if e == 0:
                        qs_rec = _write(f, pw.qs)  # aligned start; the other experts' codes follow unpadded
                    else:
                        f.write(np.ascontiguousarray(pw.qs).tobytes())
                    scs.append(np.ascontiguousarray(pw.sc))
                    del pw
                qs_rec[1] = [n_exp] + qs_rec[1]
                index[name] = {"qs": qs_rec, "sc": _write(f, np.stack(scs))}
            else:
                pw = fresh(name)
                index[name] = {"qs": _write(f, pw.qs), "sc": _write(f, pw.sc)}
                del pw
            _release_pages(g, name.partition(EXPERT)[0])
            bar.update(g.tensor_bytes(name.partition(EXPERT)[0]).nbytes)
    os.replace(tmp, base.with_suffix(".bin"))
    base.with_suffix(".json").write_text(json.dumps(index))
    prune(base.parent, keep=base.name)


def _max_bytes() -> float:
    try:
        return float(os.environ.get("EDGELLM_WEIGHT_CACHE_GB", DEFAULT_MAX_GB)) * 2**30
    except ValueError:
        return DEFAULT_MAX_GB * 2**30


def _dead(meta: dict | None) -> bool:
    """True when an entry can never be used again: its source GGUF is gone or changed, or it was made by
    other repacking code. Entries without a source record (older versions) are only pruned by size."""
    if not meta:
        return False
    try:
        st = os.stat(meta["path"])
    except OSError:
        return True
    return st.st_size != meta["size"] or st.st_mtime_ns != meta["mtime_ns"] or meta["code"] != _code_tag()


def prune(folder: Path, *, keep: str = "", max_bytes: float | None = None) -> list[str]:
    """Delete dead cache entries, then the least recently used ones while the entries (other than `keep`)
    and `keep` exceed max_bytes (default: $EDGELLM_WEIGHT_CACHE_GB). Also removes partial files of builds
    that died more than a day ago. Returns the deleted entry names. Deleting a file another process has
    memory-mapped is safe on POSIX (its pages stay until unmapped); errors leave the entry in place."""
    import time

    limit = _max_bytes() if max_bytes is None else max_bytes
    entries = []  # (last use, name, bytes)
    deleted = []

    def remove(name: str) -> None:
        try:
            for suffix in (".bin", ".json"):
                (folder / name).with_suffix(suffix).unlink(missing_ok=True)
            deleted.append(name)
        except OSError:
            pass

    for idx in folder.glob("*.json"):
        name = idx.stem
        try:
            meta = json.loads(idx.read_text()).get(META)
            size = (folder / name).with_suffix(".bin").stat().st_size
            used = idx.stat().st_mtime
        except (OSError, ValueError, AttributeError):
            continue
        if name != keep and _dead(meta):
            remove(name)
        else:
            entries.append((used, name, size))
    total = sum(sz for _, _, sz in entries)
    for used, name, size in sorted(entries):  # least recently used first
        if total <= limit:
            break
        if name == keep:
            continue
        remove(name)
        total -= size
    for part in folder.glob("*.part"):
        try:
            if time.time() - part.stat().st_mtime > 86400:
                part.unlink()
        except OSError:
            pass
    return deleted
