"""`edgellm pull REPO[:QUANT]`: fetch a GGUF model from the Hugging Face Hub into huggingface_hub's cache.

Through huggingface_hub (its token, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, cache layout and lock files):
  1. ``HfApi.model_info(repo, files_metadata=True)``: the commit and every file's size and LFS sha256;
  2. the file(s) the quant tag picks (edgellm/model_store.py, llama.cpp's rule; every shard of a split model);
  3. per file, ``get_hf_file_metadata`` (HEAD .../resolve/<commit>/<file>: ETag, size, the CDN location), then
     ``http_get`` into ``blobs/<etag>.incomplete`` -- resumed with a Range request after a cut connection, within
     this pull (a few tries with back-off) and by the next pull after an interruption -- then the size and sha256
     are checked against the Hub's metadata before the blob takes its final name (a mismatch deletes it: nothing
     half-written is ever a model in the store);
  4. ``hf_hub_download`` (the blob is there, so it only links ``snapshots/<commit>/<file>``), and refs/main.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from edgellm.errors import ChecksumMismatchError, EdgeLLMError, ModelDownloadError, ModelNotFoundError
from edgellm.model_store import (HubRef, StoredModel, available_tags, choose_files, hub_cache, prune, record_pull,
                                 repo_dir, stored_model)

ATTEMPTS = 5  # downloads of one file in one pull (each resumes where the last stopped)
BACKOFF_S = 1.0  # wait before try k+1: BACKOFF_S * 2**k seconds, at most 8
_TRANSIENT = frozenset({"TransportError", "ConnectionError", "ChunkedEncodingError", "Timeout"})


def endpoint() -> str:
    """The Hub's URL: ``HF_ENDPOINT`` now, else huggingface_hub's."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``--offline``, which sets it) now, or as huggingface_hub read it at import."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE") \
        or constants.is_offline_mode()


def offline_error(ref: HubRef | str) -> ModelNotFoundError:
    return ModelNotFoundError(f"{ref} is not pulled and edgellm is offline (--offline / HF_HUB_OFFLINE); "
                              f"with a network, run: edgellm pull {ref}")


def pull(ref: HubRef, *, progress: bool = True) -> StoredModel:
    """Fetch the model ``ref`` names (all shards), checked; returns it as stored. Files already stored are not
    fetched again. Raises ModelNotFoundError (no such repo / quant, offline), ModelDownloadError (network, disk),
    ChecksumMismatchError (bad bytes: deleted)."""
    if is_offline():
        raise offline_error(ref)
    from huggingface_hub import HfApi

    ep = endpoint()
    info = _hub(lambda: HfApi(endpoint=ep, library_name="edgellm").model_info(ref.repo, files_metadata=True), ref)
    siblings = {s.rfilename: s for s in info.siblings or []}
    files = choose_files(list(siblings), ref.tag)
    if files is None:
        tags = available_tags(list(siblings))
        what = f"no GGUF file for quant {ref.tag!r}" if ref.tag else "no GGUF model file"
        raise ModelNotFoundError(f"{ref.repo} has {what}" + (f"; it has: {', '.join(tags)}" if tags else ""))
    missing = [f for f in files if f not in siblings]
    if missing:
        raise ModelNotFoundError(f"{ref.repo} lists {files[0]} but not its shard {missing[0]}")
    storage = repo_dir(ref.repo)
    paths = [_fetch(ref, info.sha, siblings[f], storage, ep, progress, i, len(files)) for i, f in enumerate(files)]
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(info.sha)
    model = stored_model(ref.repo, info.sha, paths)
    record_pull(model)
    return dataclasses.replace(model, source="pulled")


def _hub(call, ref: HubRef):
    """Run a Hub API call; its failures as named one-line errors."""
    from huggingface_hub import errors as hf

    try:
        return call()
    except hf.GatedRepoError:
        raise ModelNotFoundError(f"{ref.repo} is gated: accept its terms on the Hub, then log in "
                                 f"(`hf auth login` or HF_TOKEN)") from None
    except hf.RepositoryNotFoundError:
        raise ModelNotFoundError(f"no model repo {ref.repo} on {endpoint()} (if it is private or gated, log in: "
                                 f"`hf auth login` or HF_TOKEN)") from None
    except hf.RevisionNotFoundError:
        raise ModelNotFoundError(f"{ref.repo}: revision not found on {endpoint()}") from None
    except hf.OfflineModeIsEnabled:
        raise offline_error(ref) from None
    except hf.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise ModelDownloadError(f"the Hub answered HTTP {status} for {ref.repo}: {_first_line(e)}") from None
    except Exception as e:
        if _transient(e):
            raise ModelDownloadError(f"cannot reach the Hugging Face Hub at {endpoint()} ({type(e).__name__}); "
                                     f"check the network, then run: edgellm pull {ref}") from None
        raise


def _fetch(ref: HubRef, commit: str, sibling, storage: Path, ep: str, progress: bool, i: int, n: int) -> Path:
    """One file of the model into the cache: its snapshot path."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.utils import WeakFileLock

    name = sibling.rfilename
    size = sibling.lfs.size if sibling.lfs else sibling.size
    pointer = storage / "snapshots" / commit / name
    if pointer.is_file() and (size is None or pointer.stat().st_size == size):
        return pointer
    meta = _hub(lambda: get_hf_file_metadata(hf_hub_url(ref.repo, name, revision=commit, endpoint=ep),
                                             endpoint=ep), ref)
    if not meta.etag or not meta.commit_hash:
        raise ModelDownloadError(f"{ep} does not answer like a Hugging Face Hub (no ETag / X-Repo-Commit for "
                                 f"{name}); check HF_ENDPOINT")
    size = size if size is not None else meta.size
    blob = storage / "blobs" / meta.etag
    if not blob.is_file():
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock = hub_cache() / ".locks" / storage.name / f"{meta.etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(lock):  # the lock huggingface_hub takes for this blob
            if not blob.is_file():
                part = blob.with_name(f"{meta.etag}.incomplete")  # huggingface_hub 0.x's resumable-download name
                desc = f"pulling {name}" + (f" ({i + 1}/{n})" if n > 1 else "")
                _download(ref, meta.location, ep, part, size, desc, progress)
                _verify(ref, part, name, size, sibling, storage, progress)
                os.replace(part, blob)
    link = _hub(lambda: hf_hub_download(ref.repo, name, revision=commit, cache_dir=str(hub_cache()), endpoint=ep),
                ref)
    return Path(link)


def _download(ref: HubRef, url: str, ep: str, part: Path, size: int | None, desc: str, progress: bool) -> None:
    """GET ``url`` into ``part``, resuming from its length; a few tries with back-off on network errors."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(library_name="edgellm")
    if urlparse(url).netloc != urlparse(ep).netloc:
        headers.pop("authorization", None)  # a CDN's signed URL: the token stays on the Hub
    bar = _bar_class(desc, progress)
    for attempt in range(ATTEMPTS):
        have = part.stat().st_size if part.is_file() else 0
        if size is not None and have > size:
            part.unlink()
            have = 0
        if size is not None:
            _check_space(part.parent, size - have)
        try:
            with part.open("ab") as f:
                http_get(url, f, resume_size=have, headers=headers, expected_size=size, tqdm_class=bar)
            return
        except Exception as e:
            if not _transient(e):
                if isinstance(e, OSError):
                    raise ModelDownloadError(f"cannot write {part}: {e.strerror or e}") from None
                raise
            if attempt + 1 == ATTEMPTS:
                raise ModelDownloadError(f"download of {ref} kept failing ({type(e).__name__}: {_first_line(e)}); "
                                         f"run the pull again to resume ({_mib(part)} MiB kept)") from None
            time.sleep(min(BACKOFF_S * 2 ** attempt, 8.0))


def _verify(ref: HubRef, part: Path, name: str, size: int | None, sibling, storage: Path, progress: bool) -> None:
    """The downloaded bytes against the Hub's size and sha256 (git blob sha1 for a non-LFS file); a mismatch
    deletes them and raises ChecksumMismatchError."""
    got_size = part.stat().st_size
    if sibling.lfs is not None:
        want, algo = sibling.lfs.sha256, "sha256"
        digest = _sha256(part, desc=f"checking {name}", progress=progress)
    else:
        want, algo = sibling.blob_id, "git sha1"
        digest = hashlib.sha1(b"blob %d\0" % got_size + part.read_bytes()).hexdigest()
    if (size is not None and got_size != size) or (want and digest != want.lower()):
        part.unlink(missing_ok=True)
        prune(storage)
        problem = (f"has {got_size} bytes, the Hub says {size}" if size is not None and got_size != size
                   else f"has {algo} {digest[:16]}..., the Hub says {want[:16]}...")
        raise ChecksumMismatchError(f"{name} from {ref.repo} {problem}; it was deleted, nothing was stored "
                                    f"(run the pull again; if it persists the file on the Hub is damaged)")


def _sha256(path: Path, *, desc: str, progress: bool) -> str:
    from tqdm import tqdm

    h = hashlib.sha256()
    with path.open("rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=desc,
                                    disable=not progress, leave=False, file=sys.stderr) as bar:
        while block := f.read(8 << 20):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def _bar_class(desc: str, enabled: bool):
    """A tqdm class for huggingface_hub's http_get: our label, shown only when ``enabled``."""
    from tqdm import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kw):
            kw.update(desc=desc, disable=not enabled, file=sys.stderr, dynamic_ncols=True)
            super().__init__(*args, **kw)

    return Bar


def _check_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if need > free:
        raise ModelDownloadError(f"not enough disk space in {folder}: the download needs {need / 2**20:.0f} MiB "
                                 f"more, {free / 2**20:.0f} MiB are free")


def _transient(e: BaseException) -> bool:
    """A network failure worth another try: an httpx / requests transport error, or huggingface_hub's
    'consistency check' OSError (no errno) when a body ended short."""
    if isinstance(e, EdgeLLMError):
        return False
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & _TRANSIENT) or (isinstance(e, OSError) and e.errno is None)


def _mib(path: Path) -> str:
    return f"{path.stat().st_size / 2**20:.1f}" if path.is_file() else "0"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
