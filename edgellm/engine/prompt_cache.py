"""PromptCache: full KV blocks of the prefix tree kept on disk, so a restarted process skips a long prefix it has
computed before (a system prompt, a document) -- llama.cpp's --prompt-cache, block by block like vLLM's hashes.

One file per block, `<root>/<key>/<hash>-<w>.kvb`:
  key   the model file's identity (size, header bytes -- metadata and tensor table -- and samples of its tensor
        data), the KV stores' layout (dtype, block size, shapes), and a code tag (the kernels', quant's and the
        models' sources, their ISA, Numba and NumPy versions, FORMAT_VERSION): K/V computed otherwise differ
  hash  the chain hash of the block's tokens and of every token before it: a file is only valid after the same
        prefix
  w     1 if the file holds the sliding-window (slot-indexed) stores' rows too, else 0 (only global layers)
A file is MAGIC, a u32 header length, sha256(header + global rows), sha256(window rows), the JSON header (version,
key, hash, tokens, the stores' shapes and dtypes), the global (block-indexed) stores' rows, then the window stores'
rows if any: a block outside the next query's window is read without them. A bad file (corrupt, truncated,
foreign) is ignored and deleted, with one warning per cache.

Writes go through one background thread with a bounded queue (full: the blocks are not saved), as temp file +
fsync + rename. Before a write, the least recently used files under root are evicted until the new ones fit in
max_bytes (a chain's earlier blocks count as used later, so a chain is cut from its end); temp files count too.

The KV cache manager (engine/kv_cache_manager.py) decides what to save and load; this file only stores blocks.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import mmap
import os
import queue
import struct
import threading
import time
import weakref
from pathlib import Path

import numpy as np

log = logging.getLogger("edgellm.prompt_cache")

FORMAT_VERSION = 1
PROMPT_CACHE_GB = 1.0  # default bound of a cache directory
MAGIC = b"EDGEKVB\x01"
SUFFIX = ".kvb"
TMP = ".tmp-"  # temp files: .tmp-<pid>-<n>, renamed into place once complete
_HEAD = struct.Struct("<8sI32s32s")  # magic, header length, sha256(header + global rows), sha256(window rows)
_MAX_HEADER = 1 << 20
_SAMPLES, _SAMPLE_BYTES = 16, 4096  # tensor data read into the model identity
_QUEUE_BYTES = 64 << 20  # block rows waiting for the writer at most (a 1,000-token Gemma 3 270M prefix: 36 MB)
_OPEN: "weakref.WeakSet[PromptCache]" = weakref.WeakSet()


def model_identity(path: str, data_offset: int) -> str:
    """Hash of a GGUF file's size, header (metadata + tensor table: bytes before data_offset) and _SAMPLES
    evenly spread pieces of its tensor data (two random-weight models with one header differ there)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"{size}|{data_offset}|".encode())
    with open(path, "rb") as f:
        h.update(os.pread(f.fileno(), data_offset, 0))
        for i in range(_SAMPLES):
            h.update(os.pread(f.fileno(), _SAMPLE_BYTES, data_offset + (size - data_offset) * i // _SAMPLES))
    return h.hexdigest()


def code_tag() -> str:
    """Hash of what decides the K/V values besides the model: kernels, quant, models and the KV writer's code,
    the instruction set the kernels run, Numba's and NumPy's versions."""
    import numba

    from kernels_cpu._jit import host_features

    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256(f"{FORMAT_VERSION}|{numba.__version__}|{np.__version__}|".encode())
    h.update(",".join(sorted(host_features())).encode())
    files = [p for d in ("kernels_cpu", "quant", "edgellm/models") for p in sorted((root / d).glob("*.py"))]
    for p in files + [root / "edgellm/engine/kv_cache.py", root / "edgellm/engine/runner.py"]:
        h.update(p.read_bytes())
    return h.hexdigest()


def block_hashes(ids: list[int], n: int, bs: int) -> list[str]:
    """Chain hashes (hex) of the first n full blocks of ids: block i's hashes its tokens and block i - 1's hash."""
    out, prev = [], b""
    arr = np.asarray(ids[:n * bs], dtype="<i4")
    for i in range(n):
        prev = hashlib.sha256(prev + arr[i * bs:(i + 1) * bs].tobytes()).digest()[:16]
        out.append(prev.hex())
    return out


def _nbytes(arrays) -> int:
    return sum(a.nbytes for a in arrays if a is not None)


class PromptCache:
    """Blocks on disk under root/key: find / load on the engine thread, save / touch through the writer thread.

    layout: (shape, dtype str, slot-indexed) of each store's block rows, as PagedKVCache.block_stores() gives
    them. Construct with open(), which returns None (one warning) when the directory cannot be written."""

    def __init__(self, root: Path, key: str, layout: list[tuple[tuple, str, bool]], *, max_bytes: int):
        self.root, self.key, self.max_bytes = Path(root), key, int(max_bytes)
        self.dir = self.root / key[:32]
        self.layout = [(tuple(s), d, t) for s, d, t in layout]
        self.windowed = any(t for _, _, t in self.layout)
        self._lock = threading.Lock()  # guards _index and _pending (engine thread and writer thread)
        self._index: dict[str, bool] = {}  # block hash -> file holds the window stores' rows
        self._pending: set[str] = set()  # hashes queued for writing
        self._queued = 0  # bytes waiting in the queue
        self._q: queue.Queue = queue.Queue()
        self._warned: set[str] = set()
        self._closed = False
        self.counters = dict.fromkeys(("disk_read_bytes", "disk_written_bytes", "disk_written_blocks",
                                       "disk_dropped_blocks", "disk_bad_files", "disk_evicted_files"), 0)
        for p in self.dir.glob("*" + SUFFIX):
            name, _, w = p.stem.rpartition("-")
            if w in ("0", "1") and len(name) == 32 and self._index.get(name) is not True:
                self._index[name] = w == "1"
        # bytes of each store's block rows, of the global stores' together and of the window stores'
        sizes = [int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt, _ in self.layout]
        self._store_sizes = (sizes, sum(n for n, (_, _, t) in zip(sizes, self.layout) if not t),
                             sum(n for n, (_, _, t) in zip(sizes, self.layout) if t))
        self._rows = np.zeros(0, np.uint8)  # load_many's row buffer, reused (its pages stay mapped)
        self._thread = threading.Thread(target=self._write_loop, name="edgellm-prompt-cache", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    @classmethod
    def open(cls, root, key: str, layout, *, max_bytes: int) -> "PromptCache | None":
        """A cache under root (created if missing), or None with one warning if it cannot be written there."""
        d = Path(root).expanduser() / key[:32]
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe = d / f"{TMP}{os.getpid()}-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            log.warning("prompt cache off: cannot write %s (%s)", d, e)
            return None
        return cls(Path(root).expanduser(), key, layout, max_bytes=max_bytes)

    # -- engine thread --------------------------------------------------------------------------------------------
    def find(self, hashes: list[str]) -> list[bool]:
        """For the longest run of leading hashes with a file: whether each file holds the window stores too."""
        out = []
        with self._lock:
            for h in hashes:
                w = self._index.get(h)
                if w is None:
                    break
                out.append(w)
        return out

    def wants(self, h: str, windowed: bool) -> bool:
        """Whether a block with this hash (and window rows or not) would add to what is stored or queued."""
        with self._lock:
            have = self._index.get(h)
            return h not in self._pending and (have is None or (windowed and not have))

    def load(self, h: str, tokens: list[int], *, windowed: bool, rows: memoryview | None = None
             ) -> list[np.ndarray | None] | None:
        """The block's rows per store (window stores' only if `windowed`, else None), or None if the file is
        missing or bad (then it is forgotten and deleted; one warning per cache). Everything is checked first.
        rows: a writable buffer of the rows' bytes to read into (the arrays are views of it), else a new one."""
        with self._lock:
            w = self._index.get(h)
        if w is None:
            return None
        path = self._path(h, w)
        try:
            with open(path, "rb") as f:
                arrays, n = self._read(f, h, tokens, w, windowed, rows)
        except FileNotFoundError:  # evicted meanwhile (by another process sharing the directory)
            with self._lock:
                self._index.pop(h, None)
            return None
        except (OSError, ValueError) as e:
            self._bad(h, path, e)
            return None
        self.counters["disk_read_bytes"] += n
        return arrays

    def load_many(self, blocks: list[tuple[str, list[int], bool]]) -> list:
        """[load(h, tokens, windowed=w) for (h, tokens, w) in blocks], the rows read into one buffer this cache
        keeps: valid until the next load_many (a restored 1,000-token prompt of the default model is ~36 MB;
        fresh buffers per file cost a page fault per 4 KiB on every restore)."""
        _, g_size, w_size = self._store_sizes
        need = [g_size + (w_size if w else 0) for _, _, w in blocks]
        if self._rows.size < sum(need):  # huge-page advised: ~20 page faults instead of ~9,000 on its first use
            buf = mmap.mmap(-1, sum(need), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                buf.madvise(mmap.MADV_HUGEPAGE)
            self._rows = np.frombuffer(buf, np.uint8)
        out, off = [], 0
        for (h, tokens, w), n in zip(blocks, need):
            out.append(self.load(h, tokens, windowed=w, rows=memoryview(self._rows[off:off + n])))
            off += n
        return out

    def save(self, blocks: list[tuple[str, list[int], int]], export) -> None:
        """Queue blocks (hash, tokens, block id), in chain order, for writing, their rows copied now by
        export(block id) (PagedKVCache.export_block); those beyond the queue's byte bound are dropped (never
        waits, copies nothing for them)."""
        take, n = [], 0
        for h, toks, b in blocks:
            arrays = None if self._closed or self._queued + n > _QUEUE_BYTES else export(b)
            if arrays is None or self._queued + n + _nbytes(arrays) > _QUEUE_BYTES:
                self.counters["disk_dropped_blocks"] += len(blocks) - len(take)
                break
            take.append((h, toks, arrays))
            n += _nbytes(arrays)
        if take:
            with self._lock:
                self._pending.update(h for h, _, _ in take)
                self._queued += n
            self._q.put(("save", take))

    def touch(self, hashes: list[str]) -> None:
        """Mark blocks (a chain, in order) as just used (LRU order, kept across restarts in the files' times)."""
        if not self._closed:
            self._q.put(("touch", list(hashes)))

    def flush(self) -> None:
        """Wait until every queued job is written (returns, never hangs, should the writer have stopped)."""
        with self._q.all_tasks_done:
            while self._q.unfinished_tasks and self._thread.is_alive():
                self._q.all_tasks_done.wait(0.05)

    def close(self, *, flush: bool = True, timeout: float = 30.0) -> None:
        """Stop the writer: flush=True writes what is queued first (up to timeout s), else drops it. A write cut
        short leaves only a temp file, which is never read and is deleted by the next cache on this root."""
        if self._closed:
            return
        self._closed = True
        if not flush:
            self._drain()
        self._q.put(None)
        self._thread.join(timeout)
        _OPEN.discard(self)

    def stats(self) -> dict:
        with self._lock:
            n = len(self._index)
        return {"disk_files": n, **self.counters}

    # -- helpers --------------------------------------------------------------------------------------------------
    def _has_window(self, arrays) -> bool:
        """Whether block rows (one per store) include the window stores' (trivially, when there are none)."""
        return all(a is not None for a, (_, _, t) in zip(arrays, self.layout) if t)

    def _path(self, h: str, windowed: bool) -> Path:
        return self.dir / f"{h}-{int(windowed)}{SUFFIX}"

    def _warn(self, kind: str, msg: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(msg + " (further ones are not reported)", *args)

    def _bad(self, h: str, path: Path, err: Exception) -> None:
        self.counters["disk_bad_files"] += 1
        self._warn("bad", "prompt cache: ignoring %s: %s; recomputing", path, err)
        with self._lock:
            self._index.pop(h, None)
        self._q.put(("unlink", [path]))

    def _encode(self, h: str, tokens: list[int], arrays: list) -> list:
        """The buffers of one block file, in order."""
        meta = {"version": FORMAT_VERSION, "key": self.key, "hash": h, "tokens": [int(t) for t in tokens],
                "stores": [None if a is None else [list(a.shape), a.dtype.str] for a in arrays]}
        header = json.dumps(meta, separators=(",", ":")).encode()
        parts = [[np.ascontiguousarray(a).data for a, (_, _, t) in zip(arrays, self.layout) if a is not None and t == w]
                 for w in (False, True)]
        dg, dw = hashlib.sha256(header), hashlib.sha256()
        for d, ps in zip((dg, dw), parts):
            for x in ps:
                d.update(x)
        return [_HEAD.pack(MAGIC, len(header), dg.digest(), dw.digest()), header, *parts[0], *parts[1]]

    def _read(self, f, h: str, tokens: list[int], w: bool, windowed: bool, rows: memoryview | None
              ) -> tuple[list, int]:
        """Read and check a block file (w: its name says it holds window rows) into rows (a buffer of the rows'
        bytes; None: a new one) -> (rows per store, bytes read); ValueError says what is wrong."""
        sizes, g_size, w_size = self._store_sizes
        if windowed and not w:
            raise ValueError("holds no sliding-window rows")
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise ValueError("truncated")
        magic, n, dg, dw = _HEAD.unpack(head)
        if magic != MAGIC:
            raise ValueError("not a prompt cache block file")
        if n > _MAX_HEADER or os.fstat(f.fileno()).st_size != _HEAD.size + n + g_size + (w_size if w else 0):
            raise ValueError("wrong length (truncated?)")
        if rows is None:
            rows = memoryview(bytearray(g_size + (w_size if windowed else 0)))
        header = f.read(n)
        gdata, wdata = rows[:g_size], rows[g_size:g_size + (w_size if windowed else 0)]
        if len(header) != n or f.readinto(gdata) != g_size:
            raise ValueError("wrong length (truncated?)")
        d = hashlib.sha256(header)
        d.update(gdata)
        if d.digest() != dg:
            raise ValueError("checksum mismatch (corrupt)")
        if windowed and (f.readinto(wdata) != w_size or hashlib.sha256(wdata).digest() != dw):
            raise ValueError("checksum mismatch (corrupt)")
        meta = json.loads(header)
        if meta.get("version") != FORMAT_VERSION or meta.get("key") != self.key:
            raise ValueError("written by another model, KV layout or edgellm version")
        if meta.get("hash") != h or meta.get("tokens") != list(tokens):
            raise ValueError("holds another block")
        want = [None if t and not w else [list(shape), dt] for shape, dt, t in self.layout]
        if meta.get("stores") != want:
            raise ValueError(f"store layout {meta.get('stores')} != {want}")
        out, offs = [], {False: 0, True: 0}
        for size, (shape, dt, t) in zip(sizes, self.layout):
            if t and not windowed:
                out.append(None)
                continue
            buf = wdata if t else gdata
            out.append(np.frombuffer(buf, dtype=dt, count=size // np.dtype(dt).itemsize, offset=offs[t]).reshape(shape))
            offs[t] += size
        return out, _HEAD.size + n + len(gdata) + len(wdata)

    def _drain(self) -> None:
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            if job and job[0] == "save":
                self._done(job[1])
            self._q.task_done()

    def _done(self, items) -> None:
        """A save job left the queue (written or not)."""
        with self._lock:
            self._pending.difference_update(h for h, _, _ in items)
            self._queued -= sum(_nbytes(arrays) for _, _, arrays in items)

    # -- the writer thread ----------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        try:
            self._sweep_temp()
        except OSError as e:  # a directory under root removed while it was listed: the next cache sweeps
            log.debug("prompt cache: temp sweep stopped: %s", e)
        while True:
            job = self._q.get()
            if job is None:
                self._q.task_done()
                return
            kind, items = job
            try:
                if kind == "save":
                    self._write(items)
                elif kind == "touch":
                    self._set_times([self._path(h, w) for h in items if (w := self._index.get(h)) is not None])
                else:
                    for p in items:
                        p.unlink(missing_ok=True)
            except Exception as e:  # disk full, directory gone...: this job is lost, the cache goes on
                self._warn("write", "prompt cache: cannot write to %s: %s", self.dir, e)
            finally:
                if kind == "save":
                    self._done(items)
                self._q.task_done()

    def _write(self, items) -> None:
        files = [(h, self._encode(h, toks, arrays), self._has_window(arrays)) for h, toks, arrays in items]
        sizes = [sum(memoryview(p).nbytes for p in bufs) for _, bufs, _ in files]
        n = self._make_room(sizes)
        written = []
        for (h, bufs, w), size in zip(files[:n], sizes):
            tmp = self.dir / f"{TMP}{os.getpid()}-{threading.get_ident()}"
            try:
                with open(tmp, "wb") as f:
                    for p in bufs:
                        f.write(p)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._path(h, w))
            finally:
                tmp.unlink(missing_ok=True)
            with self._lock:
                old = self._index.get(h)
                self._index[h] = w
            if old is not None and old != w:
                self._path(h, old).unlink(missing_ok=True)
            written.append(self._path(h, w))
            self.counters["disk_written_bytes"] += size
            self.counters["disk_written_blocks"] += 1
        self.counters["disk_dropped_blocks"] += len(files) - n
        self._set_times(written)

    def _set_times(self, paths: list[Path]) -> None:
        """Mark a chain's files used now, its first block the most recently (evicted last)."""
        now = time.time_ns()
        for i, p in enumerate(paths):
            try:
                os.utime(p, ns=(now - i * 1000, now - i * 1000))
            except FileNotFoundError:
                pass

    def _make_room(self, sizes: list[int]) -> int:
        """Evict least recently used block files under root (every model's) until the first n new files fit
        within max_bytes; returns n (the leading files of the chain that fit)."""
        files = []
        for p in _files_under(self.root):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        total = sum(s for _, s, _ in files)
        n, need = 0, 0
        while n < len(sizes) and need + sizes[n] <= self.max_bytes:
            need += sizes[n]
            n += 1
        for _, size, p in sorted(f for f in files if f[2].suffix == SUFFIX):
            if total + need <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            self.counters["disk_evicted_files"] += 1
            if p.parent == self.dir:
                with self._lock:
                    h, _, w = p.stem.rpartition("-")
                    if self._index.get(h) == (w == "1"):
                        del self._index[h]
        while n and total + need > self.max_bytes:  # what remains is temp files of writers at work
            n -= 1
            need -= sizes[n]
        return n

    def _sweep_temp(self) -> None:
        """Delete temp files left by processes that no longer run (a write cut short)."""
        for p in _files_under(self.root, TMP):
            try:
                pid = int(p.name[len(TMP):].split("-")[0])
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError):
                p.unlink(missing_ok=True)
            except (OSError, PermissionError):
                pass


def _files_under(root: Path, prefix: str = "") -> list[Path]:
    """The files named prefix* one level below root (every model's cache directory); directories removed
    meanwhile (another process sharing root) are skipped."""
    out = []
    try:
        subdirs = [e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return out
    for d in subdirs:
        try:
            out.extend(Path(e.path) for e in os.scandir(d) if e.name.startswith(prefix))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return out


def open_prompt_cache(root, loaded, kv, *, max_bytes: int) -> PromptCache | None:
    """The prompt cache of a loaded model and its PagedKVCache under root (None, one warning: unwritable)."""
    stores = kv.block_stores()
    layout = [(a.shape[1:], a.dtype.str, t) for a, t in stores]
    data_offset = min((t.offset for t in loaded.gguf.tensors.values()), default=os.path.getsize(loaded.path))
    ident = f"{model_identity(loaded.path, data_offset)}|{kv.kv_dtype}|{kv.block_size}|{layout}|{code_tag()}"
    h = hashlib.sha256(ident.encode())
    return PromptCache.open(root, h.hexdigest(), layout, max_bytes=max_bytes)


@atexit.register
def _flush_all() -> None:
    """Interpreter exit: write what is queued (the writer threads are daemons)."""
    for c in list(_OPEN):
        c.close(flush=True, timeout=10.0)
