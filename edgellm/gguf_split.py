"""Split GGUF models, as llama.cpp's ``gguf-split`` (and gguf-py's ``GGUFWriter(split_max_tensors=...)``) write them.

``NAME-00001-of-00003.gguf``, ``NAME-00002-of-00003.gguf``, ... are each a valid GGUF file holding a share of the
tensors. The first shard also holds the model's metadata, with ``split.no`` = 0, ``split.count`` = the number of
shards and ``split.tensors.count`` = the tensors of all shards; every other shard has ``split.no`` = its index.
The rules are llama.cpp's (src/llama-model-loader.cpp): the model is opened from its first shard, the others are
found by name next to it, each must carry its own index, no tensor may appear twice, and the shards together hold
exactly ``split.tensors.count`` tensors. Weights stay zero-copy: every tensor is a view of its own shard's memmap.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

from edgellm.errors import GGUFError

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
MAX_SHARDS = 65535  # split.count is a u16
SHARD_SUFFIX = "-{:05d}-of-{:05d}.gguf"  # 1-based shard number, shard count
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf$", re.IGNORECASE)


def shard_name_info(name: str) -> tuple[str, int, int] | None:
    """(prefix, 1-based shard number, shard count) of a shard's file name (or path); None for other names."""
    m = _SHARD_NAME.match(name)
    if m is None:
        return None
    return m["prefix"], int(m["no"]), int(m["count"])


def shard_paths(prefix: str, count: int) -> list[str]:
    """Paths (or names) of every shard of a split model, in order: ``prefix-00001-of-0000N.gguf``, ..."""
    return [prefix + SHARD_SUFFIX.format(i + 1, count) for i in range(count)]


def split_keys(meta: dict[str, Any], path: str) -> tuple[int, int, int | None] | None:
    """(split.no, split.count, split.tensors.count or None) of a shard, checked; None if the file is not split."""
    if SPLIT_COUNT not in meta and SPLIT_NO not in meta:
        return None
    count = _int_key(meta, SPLIT_COUNT, path, 1, MAX_SHARDS)
    if count == 1 and SPLIT_NO not in meta:
        return None
    no = _int_key(meta, SPLIT_NO, path, 0, count - 1)
    total = _int_key(meta, SPLIT_TENSORS, path, 0, 2**31 - 1) if SPLIT_TENSORS in meta else None
    return no, count, total


def _int_key(meta: dict, key: str, path: str, lo: int, hi: int) -> int:
    if key not in meta:
        raise GGUFError(f"{path}: split model metadata lacks {key!r}")
    v = meta[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise GGUFError(f"{path}: metadata key {key!r} must be an integer in [{lo}, {hi}], not {v!r}")
    return v


def join_split(first, read_one: Callable[[str], Any]):
    """One GGUFFile over every shard of the split model whose first shard was read as ``first`` (a GGUFFile;
    ``read_one`` reads another shard as one: edgellm/gguf_file.py calls this, so nothing of it is imported here).
    A single file comes back as it is. Raises GGUFError naming the file at fault."""
    keys = split_keys(first.metadata, first.path)
    if keys is None:
        return first
    no, count, total = keys
    if no != 0:
        named = shard_name_info(os.path.basename(first.path))
        which = shard_paths(named[0], count)[0] if named else SHARD_SUFFIX.format(1, count).join(("NAME", ""))
        raise GGUFError(f"{first.path}: this is shard {no + 1} of {count} of a split model; open its first shard, "
                        f"{which}")
    paths = _sibling_paths(first.path, no, count)
    if total is None:
        raise GGUFError(f"{first.path}: split model metadata lacks {SPLIT_TENSORS!r}")
    shards = [first]
    for i, p in enumerate(paths[1:], start=1):
        if not os.path.isfile(p):
            raise GGUFError(f"{p}: shard {i + 1} of {count} of the split model {os.path.basename(first.path)} "
                            f"is missing")
        g = read_one(p)
        got = split_keys(g.metadata, p)
        if got is None:
            raise GGUFError(f"{p}: not a shard of a split model (no split.* metadata), yet named as shard {i + 1} "
                            f"of {count} of {os.path.basename(first.path)}")
        if got[0] != i or got[1] != count:
            raise GGUFError(f"{p}: says it is shard {got[0] + 1} of {got[1]}, expected shard {i + 1} of {count} "
                            f"(shards of different models mixed up?)")
        if got[2] is not None and got[2] != total:
            raise GGUFError(f"{p}: split.tensors.count is {got[2]}, the first shard says {total} (shards of "
                            f"different models mixed up?)")
        shards.append(g)
    tensors = {}
    for i, g in enumerate(shards):
        for name, t in g.tensors.items():
            if name in tensors:
                raise GGUFError(f"{g.path}: tensor {name!r} is duplicated (also in "
                                f"{os.path.basename(paths[tensors[name].shard])})")
            tensors[name] = dataclasses.replace(t, shard=i)
    if len(tensors) != total:
        raise GGUFError(f"{first.path}: corrupted split model: split.tensors.count is {total} but its {count} "
                        f"shards hold {len(tensors)} tensors")
    meta = {k: v for k, v in first.metadata.items() if not k.startswith("split.")}  # as gguf-split --merge
    return dataclasses.replace(first, metadata=meta, tensors=tensors, shard_paths=tuple(paths),
                               shard_data=tuple(g.data for g in shards))


def _sibling_paths(path: str, no: int, count: int) -> list[str]:
    suffix = SHARD_SUFFIX.format(no + 1, count)
    if not path.endswith(suffix):
        raise GGUFError(f"{path}: split.no / split.count say shard {no + 1} of {count}, but the file name does not "
                        f"end in {suffix!r}, so the other shards cannot be found (keep the names gguf-split gave)")
    return shard_paths(path[:-len(suffix)], count)
