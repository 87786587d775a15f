"""A loopback Hugging Face Hub for tests: the HTTP calls huggingface_hub (2.x) makes for a pull, and faults.

What huggingface_hub calls (read from its source: hf_api.py model_info / list_repo_tree / get_paths_info,
file_download.py get_hf_file_metadata / http_get / hf_hub_download) and what this server answers:
  GET  /api/models/{repo}[/revision/{rev}][?blobs=true]  model info: sha, siblings (rfilename; with blobs: size,
                                                         blobId, lfs {sha256, size, pointerSize}), tags
  GET  /api/models/{repo}/tree/{rev}[/{path}]            the file tree (type, oid, size, path, lfs)
  POST /api/models/{repo}/paths-info/{rev}               the same entries for the form's ``paths``
  GET  /api/models/{repo}/refs                           branches (llama.cpp's newer downloader asks for them)
  HEAD|GET /{repo}/resolve/{rev}/{path}                  LFS files: 302 to the CDN with X-Repo-Commit,
                                                         X-Linked-Etag (the sha256), X-Linked-Size, ETag; other
                                                         files: 200 with ETag (git blob sha1) and the bytes
  HEAD|GET {cdn}/blobs/{sha256}                          the bytes, with Range requests (206, Content-Range)
The CDN listens on a second port: another origin, as on the real Hub, so huggingface_hub stops following the
redirect at the 302 and reads the file's metadata from it. Errors carry X-Error-Code (RepoNotFound,
RevisionNotFound, EntryNotFound) as the Hub's do. Faults: ``advertise`` a wrong sha256 for a file; ``cut`` the
next GETs of a file halfway (``mode="close"``: the connection ends early, ``"reset"``: a TCP reset). Every request
is logged as a Request (method, path, Range header, whether it carried a token).
"""
from __future__ import annotations

import hashlib
import io
import json
import socket
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlparse


class Request(NamedTuple):
    method: str
    path: str
    range: str | None  # the Range header
    auth: bool  # an Authorization header was sent


@dataclass
class HubFile:
    data: bytes
    lfs: bool = True
    advertised_sha256: str | None = None  # a lie in the metadata (else the bytes' sha256)

    @property
    def sha256(self) -> str:
        return self.advertised_sha256 or hashlib.sha256(self.data).hexdigest()

    @property
    def git_sha1(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()


@dataclass
class HubRepo:
    commit: str
    files: dict[str, HubFile] = field(default_factory=dict)


class FakeHub:
    """Two threaded HTTP servers on 127.0.0.1 (the Hub and its CDN); use as a context manager."""

    def __init__(self):
        self.repos: dict[str, HubRepo] = {}
        self.log: list[Request] = []
        self.cuts: dict[str, list[str]] = {}  # sha256 -> modes of the next GETs to cut
        self._lock = threading.Lock()
        self._hub = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, cdn=False))
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, cdn=True))
        self.url = f"http://127.0.0.1:{self._hub.server_port}"
        self.cdn_url = f"http://127.0.0.1:{self._cdn.server_port}"
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self._hub, self._cdn)]

    def __enter__(self) -> "FakeHub":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for s in (self._hub, self._cdn):
            s.shutdown()
            s.server_close()

    # -- content and faults ---------------------------------------------------------------------------------
    def add_repo(self, repo: str, files: dict[str, bytes | str | Path], *, lfs: bool = True) -> HubRepo:
        """A repo whose files are bytes or paths of files to serve; the commit is derived from the content."""
        h = hashlib.sha1(repo.encode())
        entries = {}
        for name, content in files.items():
            data = content if isinstance(content, bytes) else Path(content).read_bytes()
            entries[name] = HubFile(data, lfs=lfs and not name.endswith(".md"))
            h.update(name.encode() + hashlib.sha256(data).digest())
        self.repos[repo] = HubRepo(h.hexdigest(), entries)
        return self.repos[repo]

    def advertise(self, repo: str, name: str, sha256: str) -> None:
        self.repos[repo].files[name].advertised_sha256 = sha256

    def cut(self, repo: str, name: str, *modes: str) -> None:
        """Cut the next len(modes) GETs of the file halfway, each as its mode says ("close" | "reset")."""
        self.cuts[self.repos[repo].files[name].sha256] = list(modes)

    def requests(self, method: str | None = None, contains: str = "") -> list[Request]:
        with self._lock:
            return [r for r in self.log if (method is None or r[0] == method) and contains in r[1]]

    def record(self, entry) -> None:
        with self._lock:
            self.log.append(entry)

    def next_cut(self, sha: str) -> str | None:
        with self._lock:
            modes = self.cuts.get(sha)
            return modes.pop(0) if modes else None

    def blob(self, sha: str) -> HubFile | None:
        for r in self.repos.values():
            for f in r.files.values():
                if f.sha256 == sha:
                    return f
        return None

    # -- JSON bodies ---------------------------------------------------------------------------------------------
    def model_info(self, repo: str, blobs: bool) -> dict:
        r = self.repos[repo]
        siblings = []
        for name, f in sorted(r.files.items()):
            s = {"rfilename": name}
            if blobs:
                s |= {"size": len(f.data), "blobId": f.git_sha1}
                if f.lfs:
                    s["lfs"] = {"sha256": f.sha256, "size": len(f.data), "pointerSize": 134}
            siblings.append(s)
        return {"_id": r.commit[:24], "id": repo, "modelId": repo, "author": repo.split("/")[0], "sha": r.commit,
                "private": False, "gated": False, "disabled": False, "downloads": 0, "likes": 0,
                "tags": ["gguf"], "library_name": "gguf", "siblings": siblings,
                "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z"}

    def tree_entry(self, name: str, f: HubFile) -> dict:
        e = {"type": "file", "oid": f.git_sha1, "size": len(f.data), "path": name}
        if f.lfs:
            e["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
        return e


def _handler(hub: FakeHub, *, cdn: bool):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._route("HEAD")

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        # -- plumbing -----------------------------------------------------------------------------------------
        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, method: str = "GET") -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)

        def _json(self, obj, method: str, status: int = 200, headers: dict | None = None) -> None:
            self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})},
                       method)

        def _error(self, status: int, code: str, method: str, commit: str | None = None) -> None:
            headers = {"X-Error-Code": code, "X-Error-Message": code}
            if commit:
                headers["X-Repo-Commit"] = commit
            self._json({"error": code}, method, status, headers)

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            hub.record(Request(method, path, self.headers.get("Range"), "Authorization" in self.headers))
            if self.command == "POST":
                length = int(self.headers.get("Content-Length") or 0)
                self._form = parse_qs(self.rfile.read(length).decode())
            if cdn:
                return self._cdn(method, path)
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api(method, "/".join(parts[2:4]), parts[4:], parse_qs(url.query))
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(method, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
            self._send(404, b"not found", method=method)

        def _repo(self, repo: str, rev: str | None, method: str) -> HubRepo | None:
            r = hub.repos.get(repo)
            if r is None:
                self._error(401, "RepoNotFound", method)  # the Hub says 401 for a missing repo to anonymous users
                return None
            if rev not in (None, "main", r.commit):
                self._error(404, "RevisionNotFound", method)
                return None
            return r

        # -- the Hub API ------------------------------------------------------------------------------------------
        def _api(self, method: str, repo: str, rest: list[str], query: dict) -> None:
            if rest == ["refs"]:
                r = self._repo(repo, None, method)
                if r:
                    self._json({"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": r.commit}],
                                "tags": [], "converts": []}, method)
                return
            rev = rest[1] if len(rest) >= 2 and rest[0] in ("revision", "tree", "paths-info") else None
            r = self._repo(repo, rev, method)
            if r is None:
                return
            if not rest or rest[0] == "revision":
                blobs = query.get("blobs", ["false"])[0].lower() == "true"
                return self._json(hub.model_info(repo, blobs), method)
            if rest[0] == "tree":
                prefix = "/".join(rest[2:])
                items = [hub.tree_entry(n, f) for n, f in sorted(r.files.items()) if n.startswith(prefix)]
                return self._json(items, method)
            if rest[0] == "paths-info" and method == "POST":
                wanted = self._form.get("paths", [])
                return self._json([hub.tree_entry(n, r.files[n]) for n in wanted if n in r.files], method)
            self._send(404, b"not found", method=method)

        def _resolve(self, method: str, repo: str, rev: str, name: str) -> None:
            r = self._repo(repo, rev, method)
            if r is None:
                return
            f = r.files.get(name)
            if f is None:
                return self._error(404, "EntryNotFound", method, r.commit)
            common = {"X-Repo-Commit": r.commit, "Accept-Ranges": "bytes"}
            if not f.lfs:
                return self._send(200, f.data, {**common, "ETag": f'"{f.git_sha1}"'}, method)
            body = b"Found. Redirecting to the CDN"
            self._send(302, body, {**common, "Location": f"{hub.cdn_url}/blobs/{f.sha256}?name={name}",
                                   "ETag": f'"{f.sha256}"', "X-Linked-Etag": f'"{f.sha256}"',
                                   "X-Linked-Size": len(f.data)}, method)

        # -- the CDN ----------------------------------------------------------------------------------------------
        def _cdn(self, method: str, path: str) -> None:
            sha = path.rsplit("/", 1)[-1]
            f = hub.blob(sha)
            if f is None or not path.startswith("/blobs/"):
                return self._send(404, b"no such blob", method=method)
            data, total = f.data, len(f.data)
            start, status, headers = 0, 200, {"Accept-Ranges": "bytes", "ETag": f'"{sha}"',
                                              "Content-Type": "application/octet-stream"}
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, _, b = rng[len("bytes="):].partition("-")
                start, end = int(a), (int(b) if b else total - 1)
                if start >= total:
                    return self._send(416, b"", {"Content-Range": f"bytes */{total}"}, method)
                data = data[start:end + 1]
                status = 206
                headers["Content-Range"] = f"bytes {start}-{start + len(data) - 1}/{total}"
            mode = hub.next_cut(sha) if method == "GET" else None
            if mode is None:
                return self._send(status, data, headers, method)
            self.send_response(status)  # the full length is promised, half of it is sent, then the line is cut
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            if mode == "reset":  # RST instead of FIN: the client reads ECONNRESET
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.rfile.close()
                self.wfile.close()
                self.connection.close()  # the last reference: the socket closes now, with a reset
                self.rfile, self.wfile = io.BytesIO(), io.BytesIO()  # for http.server's flush and close after us
            else:
                self.connection.shutdown(socket.SHUT_RDWR)

    return Handler
