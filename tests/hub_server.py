"""A stand-in Hugging Face Hub for tests: repos held in memory, served over HTTP on 127.0.0.1
through the endpoints huggingface_hub 2.x calls, with the Hub's headers.

    GET  /api/models/{repo}[/revision/{rev}][?blobs=true]   model info (sha, siblings; with
                                                            blobs: size, blobId, lfs sha256)
    HEAD/GET /{repo}/resolve/{rev}/{path}    git files: 200 with X-Repo-Commit, ETag = the git
                                             blob id, Content-Length, ranges; LFS files: 302 to
                                             the CDN with X-Repo-Commit, X-Linked-Etag = the
                                             SHA-256, X-Linked-Size
    GET  (CDN, another port) /lfs/{sha256}   the bytes, Range requests answered with 206

Errors carry the Hub's X-Error-Code (RepoNotFound, GatedRepo, RevisionNotFound,
EntryNotFound), which huggingface_hub turns into its typed errors. The CDN is another origin,
as the real one is, so the client must not send it the token.

Faults, per LFS file (by SHA-256): `corrupt` (bytes flipped, same length), `cut` (the first
response ends after N bytes, then the connection closes), `stall` (N bytes, then nothing until
`release` is set or the client goes). Every request is logged in `log`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".model", ".onnx", ".png")


def git_blob_id(data: bytes) -> str:
    """The git object id of a file (what the Hub gives as the ETag of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or len(data) > 10 << 20


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch / tag -> commit
    gated: bool = False


@dataclass
class Request:
    server: str  # "hub" | "cdn"
    method: str
    path: str
    range: str | None
    authorized: bool


class HubServer:
    def __init__(self, token: str = "hf_test_token"):
        self.repos: dict[str, Repo] = {}
        self.token = token
        self.log: list[Request] = []
        self.corrupt: set[str] = set()
        self.cut: dict[str, int] = {}  # sha256 -> bytes sent before the first response closes
        self.stall: dict[str, int] = {}  # sha256 -> bytes sent before it hangs
        self.release = threading.Event()
        self._blobs: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.hub = _serve(self, "hub")
        self.cdn = _serve(self, "cdn")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.hub.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self.cdn.server_address[1]}"

    def add(
        self,
        repo_id: str,
        files: dict[str, bytes | Path],
        *,
        refs: tuple[str, ...] = ("main",),
        gated: bool = False,
    ) -> str:
        """A commit of `files` (path -> bytes or a file to read); `refs` point to it. Returns
        its 40-hex commit id."""
        data = {p: (v.read_bytes() if isinstance(v, Path) else v) for p, v in files.items()}
        repo = self.repos.setdefault(repo_id, Repo())
        repo.gated = repo.gated or gated
        h = hashlib.sha1(repo_id.encode() + str(len(repo.commits)).encode())
        for p in sorted(data):
            h.update(p.encode() + hashlib.sha256(data[p]).digest())
        commit = h.hexdigest()
        repo.commits[commit] = data
        for ref in refs:
            repo.refs[ref] = commit
        for p, b in data.items():
            if is_lfs(p, b):
                self._blobs[hashlib.sha256(b).hexdigest()] = b
        return commit

    def add_folder(
        self, repo_id: str, folder: Path, extra: dict[str, bytes] | None = None, **kw
    ) -> str:
        files: dict[str, bytes | Path] = {
            p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()
        }
        return self.add(repo_id, {**files, **(extra or {})}, **kw)

    def requests(self, server: str | None = None, method: str | None = None) -> list[Request]:
        with self._lock:
            return [
                r
                for r in self.log
                if (server is None or r.server == server) and (method is None or r.method == method)
            ]

    def fetched(self) -> list[str]:
        """The SHA-256 of each file body the CDN sent (one per GET)."""
        return [r.path.rsplit("/", 1)[-1] for r in self.requests("cdn", "GET")]

    def close(self) -> None:
        self.release.set()
        for s in (self.hub, self.cdn):
            s.shutdown()
            s.server_close()


def _serve(hub: HubServer, kind: str) -> ThreadingHTTPServer:
    class Handler(_Handler):
        server_kind = kind
        state = hub

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


class _Handler(BaseHTTPRequestHandler):
    server_kind: str
    state: HubServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    def _route(self, body: bool) -> None:
        url = urlparse(self.path)
        auth = self.headers.get("Authorization")
        with self.state._lock:
            self.state.log.append(
                Request(
                    self.server_kind,
                    self.command,
                    url.path,
                    self.headers.get("Range"),
                    auth is not None,
                )
            )
        if self.server_kind == "cdn":
            return self._cdn(url.path, body)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            rev = parts[5] if len(parts) >= 6 and parts[4] == "revision" else "main"
            return self._info("/".join(parts[2:4]), rev, "blobs" in parse_qs(url.query))
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        self._error(404, "EntryNotFound", "no such endpoint")

    def _authorized(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {self.state.token}"

    def _commit(self, repo_id: str, rev: str) -> tuple[Repo, str] | None:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        commit = repo.refs.get(rev, rev if rev in repo.commits else None)
        if commit is None:
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            return None
        return repo, commit

    def _info(self, repo_id: str, rev: str, blobs: bool) -> None:
        found = self._commit(repo_id, rev)
        if found is None:
            return
        repo, commit = found
        siblings = []
        for path, data in sorted(repo.commits[commit].items()):
            entry: dict = {"rfilename": path}
            if blobs:
                entry.update(size=len(data), blobId=git_blob_id(data))
                if is_lfs(path, data):
                    sha = hashlib.sha256(data).hexdigest()
                    entry["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": 134}
            siblings.append(entry)
        payload = {
            "_id": commit[:24],
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "siblings": siblings,
        }
        self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def _resolve(self, repo_id: str, rev: str, path: str, body: bool) -> None:
        found = self._commit(repo_id, rev)
        if found is None:
            return
        repo, commit = found
        if repo.gated and not self._authorized():
            return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
        data = repo.commits[commit].get(path)
        if data is None:
            return self._error(404, "EntryNotFound", "Entry not found", commit)
        if is_lfs(path, data):
            sha = hashlib.sha256(data).hexdigest()
            text = b"Found. Redirecting"
            self._send(
                302,
                text if body else b"",
                {
                    "Location": f"{self.state.cdn_url}/lfs/{sha}?X-Amz-Signature=test",
                    "X-Repo-Commit": commit,
                    "ETag": f'"{sha}"',
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(len(data)),
                },
                length=len(text),
            )
            return
        name = path.rsplit("/", 1)[-1]
        self._bytes(
            data,
            body,
            {
                "X-Repo-Commit": commit,
                "ETag": f'"{git_blob_id(data)}"',
                "Content-Disposition": f'inline; filename="{name}"',
            },
        )

    def _cdn(self, path: str, body: bool) -> None:
        sha = path.rsplit("/", 1)[-1]
        data = self.state._blobs.get(sha)
        if data is None:
            return self._send(404, b"NoSuchKey", {})
        if sha in self.state.corrupt:
            data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
        self._bytes(data, body, {"ETag": f'"{sha}"'}, sha)

    def _bytes(self, data: bytes, body: bool, headers: dict, sha: str | None = None) -> None:
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[len("bytes=") : -1])
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        chunk = data[start:]
        headers.update({"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"})
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(chunk)))
        self.end_headers()
        if not body:
            return
        limit = None
        if sha is not None and sha in self.state.cut:
            limit = self.state.cut.pop(sha)  # once: the retry gets the rest
        elif sha is not None and sha in self.state.stall:
            limit = self.state.stall[sha]
        if limit is None:
            self.wfile.write(chunk)
            return
        self.wfile.write(chunk[:limit])
        self.wfile.flush()
        if sha in self.state.stall:
            deadline = time.monotonic() + 60
            while not self.state.release.wait(0.1) and time.monotonic() < deadline:
                pass
        self.close_connection = True

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(status, json.dumps({"error": message}).encode(), headers)

    def _send(self, status: int, body: bytes, headers: dict, length: int | None = None) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)
