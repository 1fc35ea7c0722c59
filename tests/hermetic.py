"""The hermetic run of the harness's tests (tests/conftest.py calls it): a temporary cache home
that mirrors the real harness cache, and the check that the real caches did not change.

XDG_CACHE_HOME points at a temporary home, so the harness cache (XDG_CACHE_HOME/specgate) and
the HF cache (.../huggingface) of every process the tests start are temporary, whatever that
process strips from its environment. The temporary harness cache starts as a mirror of the
real one: fixtures and upstream release trees as hard links (their files are only ever
replaced, never written in place), the compile cache copied (torch may rewrite its files). The
installers' caches stay shared on purpose (UV_CACHE_DIR, PIP_CACHE_DIR). At the end the real
caches' digest (every path, size and mtime) must equal the one taken at the start.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specgate.core import build

HERMETIC_VAR = "SPECGATE_TESTS_HOME"      # set by the run that made the temporary home
SIDE_FILES = (".lease", ".used", ".lock")


def _link(source: str, dest: str) -> None:
    try:
        os.link(source, dest)
    except OSError:          # another file system
        shutil.copy2(source, dest)


MIRRORED = {"fixtures": _link, "upstream": _link, "compile": shutil.copy2}


def _real_roots() -> dict[str, Path]:
    """The caches the tests must not touch, as this environment names them."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    hf_home = Path(os.environ.get("HF_HOME", xdg / "huggingface"))
    return {"specgate": Path(os.environ.get("SPECGATE_CACHE_DIR", xdg / "specgate")),
            "compile": Path(os.environ["SPECGATE_COMPILE_CACHE_DIR"]) if os.environ.get("SPECGATE_COMPILE_CACHE_DIR")
            else xdg / "specgate" / "compile",
            "hf": Path(os.environ.get("HF_HUB_CACHE", hf_home / "hub")), "hf_home": hf_home}


def _digest(roots: dict[str, Path]) -> dict[str, tuple[int, int]]:
    found = {}
    for root in dict.fromkeys(roots.values()):
        for folder, _, files in os.walk(root):
            found[folder] = (-1, 0)
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                found[path] = (st.st_size, st.st_mtime_ns)
    return found


def _mirror(real: dict[str, Path], dest: Path) -> None:
    for kind, copy in MIRRORED.items():
        source = real["compile"] if kind == "compile" else real["specgate"] / kind
        if not source.is_dir():
            continue
        for entry in source.iterdir():
            skip = entry.name.startswith(".") or entry.name.endswith(SIDE_FILES) or entry.name.startswith("checkout-")
            if entry.is_dir() and not skip:
                shutil.copytree(entry, dest / kind / entry.name, symlinks=True, copy_function=copy)


@dataclass
class Home:
    path: Path                              # the temporary cache home
    real: dict[str, Path]                   # the caches it stands in for
    before: dict[str, tuple[int, int]]      # their digest when it was made


def start() -> Home:
    """Make the temporary home, mirror the real harness cache into it, point this process
    (and so every child) at it, and take the real caches' digest."""
    real = _real_roots()
    home = Path(tempfile.mkdtemp(prefix="specgate-tests-home-"))
    _mirror(real, home / "specgate")
    xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    for name in ("SPECGATE_CACHE_DIR", "SPECGATE_COMPILE_CACHE_DIR", "HF_HOME", "HF_HUB_CACHE"):
        os.environ.pop(name, None)
    os.environ.update({"XDG_CACHE_HOME": str(home), HERMETIC_VAR: str(home),
                       "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(xdg / "uv")),
                       "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", str(xdg / "pip"))})
    return Home(home, real, _digest(real))


def finish(home: Home) -> list[str]:
    """Remove the temporary home; the real paths whose size or mtime changed since `start`."""
    after = _digest(home.real)
    shutil.rmtree(home.path, ignore_errors=True)
    return sorted(p for p in home.before.keys() | after.keys() if home.before.get(p) != after.get(p))


def env_without(*prefixes: str) -> dict[str, str]:
    """This environment without the variables that start with `prefixes`, but the build record
    (SPECGATE_BUILD), which names the vLLM this interpreter imports: a session process started
    without it digests vLLM's installed files again, half a second of CPU each."""
    return {k: v for k, v in os.environ.items() if k == build.RECORD_VAR or not k.startswith(prefixes)}
