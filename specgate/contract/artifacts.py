"""Artifacts: atomic writes, summary.json, and the human summary at the end."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from specgate.core.manifest import REPO_ROOT
from specgate.core.secrets import redact, redact_data


def artifacts_dir(session: str) -> Path:
    root = Path(os.environ.get("SPECGATE_ARTIFACTS", REPO_ROOT / "artifacts"))
    path = root / session
    path.mkdir(parents=True, exist_ok=True)
    return path


def clear_earlier_outputs(session: str, keep: str = "summary.json") -> None:
    """Remove what earlier runs left in the session's folder, `keep` (this run's summary,
    already begun) aside: a JUnit file, log or chart an earlier run wrote and this one does not
    (upstream's stand-in run, a mutant not chosen this time, floors not asked for) must not be
    uploaded as this run's."""
    for entry in artifacts_dir(session).iterdir():
        if entry.name == keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def write_atomic(path: Path, text: str, *, scrub: bool = True) -> None:
    """Write via a temporary file in the same folder and rename: readers see the old
    file or the new one, never half of one. Secret values are scrubbed on the way."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(redact(text) if scrub else text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT, also where a library wraps it (safetensors' SafetensorError says it in words)."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL or "No space left on device" in str(exc)


def write_json(path: Path, data: Any) -> None:
    """Secrets are scrubbed from the data's strings, so masking never breaks the JSON."""
    clean = redact_data(json.loads(json.dumps(data, default=str)))
    write_atomic(path, json.dumps(clean, indent=2, sort_keys=False) + "\n", scrub=False)


def scrub_tree(folder: Path) -> list[Path]:
    """Mask secrets in every file under folder that a writer outside this module produced
    (pytest's own JUnit XML, a child's log); returns the files it rewrote."""
    files = [Path(top, name) for top, _, names in os.walk(folder) for name in names]  # symlinks not followed
    return [path for path in sorted(files) if not path.is_symlink() and scrub_file(path)]


def scrub_file(path: Path) -> bool:
    """Rewrite one text file with its secrets masked; True if it held any."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if redact(text) == text:
        return False
    try:
        write_atomic(path, text)
    except OSError as exc:
        if not disk_full(exc):
            raise
        path.unlink()       # no room for the masked copy: a secret must not stay behind
    return True


def write_junit(session: str, cases: list[tuple[str, str | None, float]]) -> Path:
    """JUnit XML for a session that runs no pytest: one case per (name, failure message or
    None, seconds), so CI shows its checks beside the test sessions' (junitparser builds it)."""
    from junitparser import Failure, JUnitXml, TestCase, TestSuite

    suite = TestSuite(session)
    for name, failure, seconds in cases:
        case = TestCase(name, classname=session, time=seconds)
        if failure:
            case.result = [Failure(failure)]
        suite.add_testcase(case)
    xml = JUnitXml()
    xml.add_testsuite(suite)
    path = artifacts_dir(session) / "junit.xml"
    write_atomic(path, '<?xml version="1.0" encoding="utf-8"?>\n' + xml.tostring().decode())
    return path


def format_rows(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain fixed-width table for the terminal."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
