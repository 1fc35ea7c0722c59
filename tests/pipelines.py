"""What the pipeline tests share: reading a step's commands as the agent runs them, Buildkite's
glob syntax, and validation against Buildkite's published schema."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def commands(step: dict) -> list[str]:
    text = step.get("command") or "\n".join(step.get("commands", []))
    return [line for line in text.splitlines() if line.strip()]


def interpolated(line: str) -> str:
    """What Buildkite's upload-time interpolation leaves for the agent's shell."""
    return line.replace("$$", "$")


def glob_regex(pattern: str) -> re.Pattern:
    """Buildkite's glob syntax: * and ? stop at /, ** does not; the whole path must match."""
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    special = {"**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(special.get(part, re.escape(part)) for part in parts))


def validate_for_buildkite(path: Path) -> subprocess.CompletedProcess:
    """check-jsonschema's bundled copy of Buildkite's published schema (no download: any
    request would go to a proxy that refuses)."""
    offline = {**os.environ, "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.buildkite", str(path)],
                          capture_output=True, text=True, env=offline, timeout=120)
