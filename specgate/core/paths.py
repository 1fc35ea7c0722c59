"""Where the harness keeps what outlives a run (shared by sessions, safe under locks)."""

from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path


def cache_root() -> Path:
    """The harness cache: upstream trees, fixtures, compile caches. SPECGATE_CACHE_DIR overrides."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specgate"
    path = Path(os.environ.get("SPECGATE_CACHE_DIR", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def tree_size(path: Path) -> int:
    """Bytes of every file under path (symlinks as links), or of path itself if a file."""
    if not path.is_dir():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with suppress(OSError):       # removed while we walked
                total += os.lstat(os.path.join(root, name)).st_size
    return total
