#!/usr/bin/env python3
"""Run nox from a private venv pinned by constraints/harness.txt: `python3 scripts/noxw.py [nox args]`.

The venv (.venv-nox) is created on first use and rebuilt only when the
constraints change, so a fresh machine needs nothing but Python >= 3.11.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints" / "harness.txt"
VENV = ROOT / ".venv-nox"
STAMP = VENV / "harness.sha256"


def ensure_venv() -> Path:
    digest = hashlib.sha256(CONSTRAINTS.read_bytes()).hexdigest()
    if STAMP.is_file() and STAMP.read_text() == digest:
        return VENV / "bin" / "nox"
    venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    subprocess.run([VENV / "bin" / "python", "-m", "pip", "install", "--quiet", "-r", CONSTRAINTS], check=True)
    STAMP.write_text(digest)
    return VENV / "bin" / "nox"


if __name__ == "__main__":
    # Not dead code: this script is started by whatever python3 is on PATH, before any venv
    # exists, so requires-python (which ruff reads as the minimum) is not yet enforced.
    if sys.version_info < (3, 11):  # noqa: UP036
        sys.exit("error: Python >= 3.11 is required")
    nox = ensure_venv()
    os.chdir(ROOT)
    # nox finds this uv as its own; a session that imports nox as a library (the bench's
    # version record and uv timing) finds it only through $UV, nox's documented override.
    if (VENV / "bin" / "uv").is_file():
        os.environ.setdefault("UV", str(VENV / "bin" / "uv"))
    os.execv(nox, [str(nox), *sys.argv[1:]])
