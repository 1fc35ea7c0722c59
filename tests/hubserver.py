"""A real HTTP server on 127.0.0.1 that serves small model repositories the way
the Hugging Face hub does for huggingface_hub 2.4's snapshot_download:

- GET  /api/models/{repo}/tree/{rev}?recursive=...   file listing (commit revisions)
- GET  /api/models/{repo}[/revision/{rev}]            repo info with sha and siblings
- HEAD /{repo}/resolve/{rev}/{file}                   X-Repo-Commit, ETag, Content-Length
- GET  /{repo}/resolve/{rev}/{file}                   the bytes (optionally throttled)

Errors carry the hub's X-Error-Code header so huggingface_hub raises the same
exception types it raises against the real hub. Tests point HF_ENDPOINT at
`server.endpoint`, read `server.count(...)`, and call `server.fail(...)` to
answer 429/503/401/404 on demand.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote, urlsplit

from localserver import LocalServer

from specgate.core import manifest as specgate_manifest

LFS_SUFFIXES = (".safetensors", ".bin")
ERROR_CODES = {401: "GatedRepo", 403: "GatedRepo", 404: "RevisionNotFound"}


@dataclass
class Repo:
    repo_id: str
    commit: str
    files: dict[str, bytes]

    @staticmethod
    def git_oid(data: bytes) -> str:
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)

    def etag(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(name) else self.git_oid(data)

    def tree(self) -> list[dict]:
        entries = []
        for name, data in sorted(self.files.items()):
            entry = {"type": "file", "path": name, "size": len(data), "oid": self.git_oid(data)}
            if self.is_lfs(name):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return entries


@dataclass
class Fault:
    status: int
    kind: str | None        # "tree", "info", "head", "get" or None for any
    filename: str | None    # for head/get: only this file
    remaining: int          # how many requests still get the error


@dataclass
class Throttle:
    chunk: int = 16 * 1024
    delay_s: float = 0.0


@dataclass
class Stats:
    requests: Counter = field(default_factory=Counter)    # (method, kind, repo_id, filename) -> n
    bytes_sent: Counter = field(default_factory=Counter)  # (repo_id, filename) -> bytes written


class HubServer(LocalServer):
    """Start with `with HubServer([Repo(...)]) as hub:`; the port is chosen by the OS."""

    def __init__(self, repos: list[Repo]):
        self.repos = {r.repo_id: r for r in repos}
        self.stats = Stats()
        self.faults: list[Fault] = []
        self.throttle = Throttle()
        self.lock = threading.Lock()
        super().__init__(_handler(self))

    @property
    def endpoint(self) -> str:
        return self.origin

    def fail(self, status: int, *, kind: str | None = None, filename: str | None = None, times: int = 1) -> None:
        with self.lock:
            self.faults.append(Fault(status, kind, filename, times))

    def count(self, method: str | None = None, kind: str | None = None, filename: str | None = None,
              repo_id: str | None = None) -> int:
        """Requests seen so far; each given argument narrows the count."""
        wanted = (method, kind, repo_id, filename)
        with self.lock:
            return sum(n for key, n in self.stats.requests.items()
                       if all(w is None or w == k for w, k in zip(wanted, key, strict=True)))

    def total_requests(self) -> int:
        return self.count()

    def bytes_sent(self, repo_id: str, filename: str) -> int:
        with self.lock:
            return self.stats.bytes_sent[(repo_id, filename)]

    def _record(self, method: str, kind: str, repo: Repo | None, filename: str | None) -> int | None:
        """Count the request; return the status of a matching injected fault, if any."""
        with self.lock:
            self.stats.requests[(method, kind, repo.repo_id if repo else None, filename)] += 1
            for fault in self.faults:
                if fault.remaining > 0 and fault.kind in (None, kind) and fault.filename in (None, filename):
                    fault.remaining -= 1
                    return fault.status
        return None


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def do_HEAD(self) -> None:
            self._dispatch("HEAD")

        def do_GET(self) -> None:
            self._dispatch("GET")

        def _dispatch(self, method: str) -> None:
            path = unquote(urlsplit(self.path).path)
            if path.startswith("/api/models/"):
                self._api(method, path[len("/api/models/"):])
            elif "/resolve/" in path:
                self._resolve(method, path.lstrip("/"))
            else:
                self._send(404, b"", {"X-Error-Code": "RepoNotFound"})

        def _repo(self, rest: str) -> tuple[Repo | None, str]:
            for repo_id, repo in hub.repos.items():
                if rest == repo_id or rest.startswith(repo_id + "/"):
                    return repo, rest[len(repo_id):].lstrip("/")
            return None, rest

        def _api(self, method: str, rest: str) -> None:
            repo, tail = self._repo(rest)
            kind = "tree" if tail.startswith("tree/") else "info"
            status = hub._record(method, kind, repo, None)
            if repo is None:
                return self._send(401, b"", {"X-Error-Code": "RepoNotFound"})
            if status is not None:
                return self._error(status, repo)
            revision = tail.split("/")[1] if "/" in tail else "main"
            if revision not in (repo.commit, "main"):
                return self._send(404, b"", {"X-Error-Code": "RevisionNotFound"})
            if kind == "tree":
                body = repo.tree()
            else:
                body = {"id": repo.repo_id, "sha": repo.commit,
                        "siblings": [{"rfilename": name} for name in sorted(repo.files)]}
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        def _resolve(self, method: str, rest: str) -> None:
            repo, tail = self._repo(rest)
            _, revision, filename = (tail.split("/", 2) + ["", ""])[:3]
            kind = "head" if method == "HEAD" else "get"
            status = hub._record(method, kind, repo, filename)
            if repo is None:
                return self._send(401, b"", {"X-Error-Code": "RepoNotFound"})
            if status is not None:
                return self._error(status, repo)
            if revision not in (repo.commit, "main"):
                return self._send(404, b"", {"X-Error-Code": "RevisionNotFound"})
            if filename not in repo.files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit})
            data = repo.files[filename]
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.etag(filename)}"',
                       "Content-Type": "application/octet-stream"}
            if method == "HEAD":
                return self._send(200, b"", headers, length=len(data))
            self._send(200, data, headers, counted=(repo.repo_id, filename))

        def _error(self, status: int, repo: Repo) -> None:
            headers = {"Retry-After": "0"} if status in (429, 503) else {}
            if status in ERROR_CODES:
                headers["X-Error-Code"] = ERROR_CODES[status]
                if status in (401, 403):
                    headers["X-Error-Message"] = f"Access to model {repo.repo_id} is restricted."
            self._send(status, b"", headers)

        def _send(self, status: int, body: bytes, headers: dict[str, str], *,
                  length: int | None = None, counted: tuple[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            if not body:
                return
            step = hub.throttle.chunk if counted else len(body)
            try:
                for start in range(0, len(body), step):
                    self.wfile.write(body[start:start + step])
                    self.wfile.flush()
                    if counted:
                        with hub.lock:
                            hub.stats.bytes_sent[counted] += len(body[start:start + step])
                        if hub.throttle.delay_s:
                            time.sleep(hub.throttle.delay_s)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

    return Handler


# ---------------------------------------------------------------------------
# Helpers for tests that point huggingface_hub and specgate at this server.
# ---------------------------------------------------------------------------

def hf_env(endpoint: str, hf_home: Path, **extra: str) -> dict[str, str]:
    """A child environment: the given endpoint and HF_HOME, no token, no telemetry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def closed_endpoint() -> str:
    """An http endpoint on 127.0.0.1 where nothing listens: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _toml(value) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)  # str, int, float, bool: the same spelling in TOML


def write_manifest(folder: Path, checkpoints: dict[str, dict], fixture: str = "tiny-qwen3") -> Path:
    """A small valid manifest: the real sessions, gate, online env and unit table, the given checkpoints
    (repo_id -> {revision, suites[, gated]}), each standing in with `fixture` copied
    from the real manifest."""
    real = specgate_manifest.load()
    gate = tomllib.loads(real.path.read_text(encoding="utf-8"))["gate"]
    lines = ["schema = 1", f"gate = {_toml(gate)}"]   # an inline table, before the first [table]
    for name, spec in real.sessions.items():
        target = folder / spec.constraints
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
        lines += [f"[sessions.{name}]", f"constraints = {_toml(spec.constraints)}", f"[sessions.{name}.env]"]
        lines += [f"{k} = {_toml(v)}" for k, v in spec.env.items()]
    lines += ["[online.env]", *(f"{k} = {_toml(v)}" for k, v in real.online_env.items())]
    unit = real.unit
    lines += ["[unit]", f"pipeline = {_toml(unit.pipeline)}", f"step_key = {_toml(unit.step_key)}",
              f"timeout_s = {unit.timeout_s}", f"files = {_toml(list(unit.files))}"]
    for repo_id, spec in checkpoints.items():
        lines += [f"[checkpoints.{json.dumps(repo_id)}]", f"fixture = {_toml(fixture)}",
                  *(f"{k} = {_toml(v)}" for k, v in spec.items())]
    chosen = real.fixtures[fixture]
    lines += [f"[fixtures.{fixture}]", f"kind = {_toml(chosen.kind)}",
              *(f"{k} = {_toml(v)}" for k, v in chosen.params.items())]
    path = folder / "manifest.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class ConnectionGuard:
    """Records every socket connect and subprocess start in this process while active,
    through a real audit hook (sys.addaudithook; installed once, never removed)."""

    _active: list[list[tuple]] = []

    def __init__(self) -> None:
        self.events: list[tuple] = []

    @classmethod
    def _hook(cls, event: str, args: tuple) -> None:
        if cls._active and event in ("socket.connect", "subprocess.Popen"):
            cls._active[-1].append((event, args[1]))  # the address, or the argv

    def __enter__(self) -> ConnectionGuard:
        if not getattr(ConnectionGuard, "_installed", False):
            sys.addaudithook(ConnectionGuard._hook)
            ConnectionGuard._installed = True
        ConnectionGuard._active.append(self.events)
        return self

    def __exit__(self, *exc) -> None:
        ConnectionGuard._active.pop()
