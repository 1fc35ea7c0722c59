"""Where the harness keeps what outlives a run (shared by sessions, safe under locks)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The harness cache: upstream trees, fixtures, compile caches. SPECGATE_CACHE_DIR overrides."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specgate"
    path = Path(os.environ.get("SPECGATE_CACHE_DIR", default))
    path.mkdir(parents=True, exist_ok=True)
    return path
