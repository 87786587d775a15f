"""The local model store: names (``REPO[:QUANT]``), the choice of GGUF file in a repo, lookup, list and remove.

Models live in huggingface_hub's cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub), in
its layout: ``models--OWNER--NAME/{blobs/<etag>, snapshots/<commit>/<file> -> blob, refs/main}``, so a file pulled
by edgellm, ``hf download`` or llama.cpp is stored once. edgellm/model_pull.py fetches from the Hub; this module
never touches the network. edgellm's own record (``pulled.json`` in edgellm's cache dir) only says which stored
models edgellm pulled, for ``edgellm list``.

A model's name is ``REPO:TAG`` with TAG the quant tag of its file name (``gemma-3-1b-it-Q4_K_M.gguf`` -> Q4_K_M), or
``REPO`` when the name has none. Which file ``REPO[:QUANT]`` means is llama.cpp's rule (common/download.cpp
``find_best_model``): the first model file (not mmproj / imatrix) whose path matches ``QUANT[.-]``, ignoring case;
without QUANT, Q4_K_M, then Q8_0, then the first model file. A split model is its first shard plus the others.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from edgellm.errors import ModelNotFoundError
from edgellm.gguf_split import shard_name_info, shard_paths
from edgellm.user_cache import cache_dir

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")  # llama.cpp's choice when no quant is named, in order
NOT_MODEL_FILES = ("mmproj", "imatrix", "mtp-", "eagle3-")  # GGUF files in model repos that are not the model
_REPO = r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+"
_REF = re.compile(rf"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?(?P<repo>{_REPO})(?::(?P<tag>[A-Za-z0-9_.-]+))?$")
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
REGISTRY = "pulled.json"


@dataclass(frozen=True)
class HubRef:
    """``REPO[:QUANT]``: a Hugging Face model repo and an optional quant tag."""

    repo: str
    tag: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


@dataclass(frozen=True)
class StoredModel:
    """A model in the store: its name, where it came from, and its files (the first shard first)."""

    name: str
    files: tuple[Path, ...]
    source: str  # "pulled" (by edgellm) | "hf-cache" (by another tool) | "bundled"
    repo: str | None = None
    commit: str | None = None

    @property
    def path(self) -> str:
        return str(self.files[0])

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def parse_ref(text: str) -> HubRef | None:
    """``OWNER/NAME[:QUANT]`` (an ``hf.co/`` prefix allowed) as a HubRef; None if ``text`` is not one (a path)."""
    m = _REF.match(text.strip())
    if m is None or m["repo"].lower().endswith(".gguf") or ".." in m["repo"]:
        return None
    return HubRef(m["repo"], m["tag"])


# -- which file ----------------------------------------------------------------------------------------------
def gguf_tag(path: str) -> str | None:
    """The quant tag of a GGUF file name, upper-cased (llama.cpp's ``get_gguf_split_info``): the last ``-`` or
    ``.`` separated word before ``.gguf`` and any ``-0000i-of-0000n`` shard suffix."""
    stem = path[:-5] if path.lower().endswith(".gguf") else path
    info = shard_name_info(path)
    if info is not None:
        stem = info[0]
    m = _TAG.search(stem)
    return m[1].upper() if m else None


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(w in name for w in NOT_MODEL_FILES)


def _first_shard(path: str) -> bool:
    info = shard_name_info(path)
    return info is None or info[1] == 1 or info[2] == 1


def choose_files(paths: list[str], tag: str | None) -> list[str] | None:
    """The files of the model ``tag`` picks among a repo's ``paths`` (first shard first), or None."""
    models = [p for p in paths if is_model_file(p) and _first_shard(p)]
    for t in [tag] if tag else DEFAULT_TAGS:
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        hit = next((p for p in models if pattern.search(p)), None)
        if hit is not None:
            return model_files(hit)
    if not tag and models:
        return model_files(models[0])
    return None


def model_files(first: str) -> list[str]:
    """Every file of the model whose (first) file is ``first``: the shards of a split model, else itself."""
    info = shard_name_info(first)
    if info is None or info[2] == 1:
        return [first]
    return shard_paths(info[0], info[2])


def available_tags(paths: list[str]) -> list[str]:
    """The quant tags of the model files among ``paths`` (for an error message)."""
    return sorted({gguf_tag(p) or p for p in paths if is_model_file(p) and _first_shard(p)})


def model_name(repo: str, first: str) -> str:
    tag = gguf_tag(first)
    return f"{repo}:{tag}" if tag else repo


# -- the cache -------------------------------------------------------------------------------------------------
def hub_cache() -> Path:
    """huggingface_hub's cache directory, read from the environment now (as huggingface_hub does at import)."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_dir(repo: str) -> Path:
    return hub_cache() / ("models--" + repo.replace("/", "--"))


def _repo_of(folder: str) -> str | None:
    return folder[len("models--"):].replace("--", "/") if folder.startswith("models--") else None


def snapshots(storage: Path) -> list[str]:
    """The commits cached for a repo: the one refs/main names first, then other refs, then the rest (newest)."""
    snap = storage / "snapshots"
    if not snap.is_dir():
        return []
    order = []
    refs = storage / "refs"
    for ref in sorted(refs.iterdir(), key=lambda p: p.name != "main") if refs.is_dir() else []:
        try:
            order.append(ref.read_text().strip())
        except OSError:
            pass
    rest = sorted((p for p in snap.iterdir() if p.is_dir()), key=lambda p: -p.stat().st_mtime)
    order += [p.name for p in rest]
    return [c for i, c in enumerate(order) if c not in order[:i] and (snap / c).is_dir()]


def _snapshot_files(snap: Path) -> list[str]:
    """Relative paths of the files present (resolvable) in a snapshot, sorted."""
    return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())


def find_local(ref: HubRef) -> StoredModel | None:
    """The stored model ``ref`` names (all its shards present), without the network; None if not stored."""
    storage = repo_dir(ref.repo)
    for commit in snapshots(storage):
        snap = storage / "snapshots" / commit
        present = _snapshot_files(snap)
        files = choose_files(present, ref.tag)
        if files and all(f in present for f in files):
            return stored_model(ref.repo, commit, [snap / f for f in files])
    return None


def stored_model(repo: str, commit: str, files: list[Path]) -> StoredModel:
    name = model_name(repo, files[0].name)
    source = "pulled" if name in _registry() else "hf-cache"
    return StoredModel(name, tuple(files), source, repo, commit)


def stored_models() -> list[StoredModel]:
    """Every complete GGUF model in the Hugging Face cache (one entry per name; the newest commit wins)."""
    out: dict[str, StoredModel] = {}
    cache = hub_cache()
    for storage in sorted(cache.glob("models--*")) if cache.is_dir() else []:
        repo = _repo_of(storage.name)
        for commit in snapshots(storage):
            snap = storage / "snapshots" / commit
            present = _snapshot_files(snap)
            for first in (p for p in present if is_model_file(p) and _first_shard(p)):
                files = model_files(first)
                name = model_name(repo, first)
                if name not in out and all(f in present for f in files):
                    out[name] = stored_model(repo, commit, [snap / f for f in files])
    return list(out.values())


# -- edgellm's record of what it pulled --------------------------------------------------------------------------
def _registry_path() -> Path:
    return cache_dir() / REGISTRY


def _registry() -> dict:
    try:
        return json.loads(_registry_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_registry(reg: dict) -> None:
    path = _registry_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(reg, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # the record only labels `edgellm list`; a read-only cache dir loses nothing else


def record_pull(model: StoredModel) -> None:
    reg = _registry()
    reg[model.name] = {"repo": model.repo, "commit": model.commit, "files": [f.name for f in model.files]}
    _save_registry(reg)


# -- remove ----------------------------------------------------------------------------------------------------
def find_stored(name: str) -> StoredModel:
    """The stored model called ``name`` (a name from ``edgellm list``, or a repo holding one model)."""
    models = stored_models()
    hit = [m for m in models if m.name == name]
    if not hit and (ref := parse_ref(name)) is not None and ref.tag is None:
        hit = [m for m in models if m.repo == ref.repo]
        if len(hit) > 1:
            raise ModelNotFoundError(f"{name} holds several models ({', '.join(m.name for m in hit)}); name one")
    if not hit:
        raise ModelNotFoundError(f"no stored model is called {name!r} (`edgellm list` shows them)")
    return hit[0]


def remove(name: str) -> tuple[StoredModel, int]:
    """Delete a stored model's files from the cache (every commit's copy; blobs no other file uses); returns the
    model and the bytes freed. Raises ModelNotFoundError if there is no such model."""
    model = find_stored(name)
    storage = repo_dir(model.repo)
    rel = [f.relative_to(storage / "snapshots" / model.commit).as_posix() for f in model.files]
    blobs, freed = set(), 0
    for commit in snapshots(storage):
        for r in rel:
            p = storage / "snapshots" / commit / r
            if p.is_symlink() or p.is_file():
                if p.is_symlink():
                    blobs.add(Path(os.path.realpath(p)))
                else:
                    freed += p.stat().st_size
                p.unlink()
    in_use = {Path(os.path.realpath(p)) for p in (storage / "snapshots").rglob("*") if p.is_symlink()}
    for b in blobs - in_use:
        if b.is_file():
            freed += b.stat().st_size
            b.unlink()
    prune(storage)
    reg = _registry()
    if reg.pop(model.name, None) is not None:
        _save_registry(reg)
    return model, freed


def prune(storage: Path) -> None:
    """Remove empty snapshot folders, and the repo's folder when no snapshot holds a file any more."""
    snap = storage / "snapshots"
    for d in sorted((p for p in snap.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) if snap.is_dir() else []:
        if not any(d.iterdir()):
            d.rmdir()
    if not (snap.is_dir() and any(p.is_file() for p in snap.rglob("*"))):
        shutil.rmtree(storage, ignore_errors=True)


# -- what a stored model is ------------------------------------------------------------------------------------
def _listed_key(key: str) -> bool:
    return key.startswith("general.") or key.endswith(".context_length") or key == "tokenizer.chat_template"


def describe(model: StoredModel) -> dict:
    """Name, size, quant, architecture, context and kind of a stored model, from its first file's GGUF header
    (metadata only: no tensor table, no vocabulary kept). A damaged file gives {"error": ...} instead."""
    from edgellm.errors import EdgeLLMError
    from edgellm.gguf_file import read_metadata
    from edgellm.model_kind import model_kind

    d = {"name": model.name, "path": model.path, "files": len(model.files), "source": model.source,
         "size": model.size}
    try:
        meta = read_metadata(model.files[0], keep=_listed_key)
    except EdgeLLMError as e:
        return d | {"error": str(e)}
    arch = meta.get("general.architecture")
    return d | {"quant": _quant_name(meta.get("general.file_type")) or gguf_tag(model.files[0].name),
                "architecture": arch, "context_length": meta.get(f"{arch}.context_length"),
                "kind": model_kind(meta).kind}


def _quant_name(file_type) -> str | None:
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(int(file_type)).name
    except (TypeError, ValueError):
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")
