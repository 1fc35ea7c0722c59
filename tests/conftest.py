"""Shared by the harness's own tests: no test writes into the real artifacts/ folder, the
harness's caches or the user's HF cache.

For a run of the harness's tests (`-m 'not e2e'`, pyproject's addopts; never inside a
cpu_e2e or mutants session, which load this file too) XDG_CACHE_HOME points at a temporary
home, so the harness cache (XDG_CACHE_HOME/specgate) and the HF cache (.../huggingface)
of every process the tests start are temporary, whatever that process strips from its
environment. The temporary harness cache starts as a mirror of the real one: fixtures and
upstream release trees as hard links (their files are only ever replaced, never written in
place), the compile cache copied (torch may rewrite its files). The installers' caches stay
shared on purpose (UV_CACHE_DIR, PIP_CACHE_DIR). At the end the real caches' digest (every
path, size and mtime) must equal the one taken at the start, or the run fails, naming what
changed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

HERMETIC_VAR = "SPECGATE_TESTS_HOME"      # set by the run that made the temporary home
SIDE_FILES = (".lease", ".used", ".lock")


def _link(source: str, dest: str) -> None:
    try:
        os.link(source, dest)
    except OSError:          # another file system
        shutil.copy2(source, dest)


MIRRORED = {"fixtures": _link, "upstream": _link, "compile": shutil.copy2}
_STATE = pytest.StashKey[tuple[Path, dict[str, Path], dict[str, tuple[int, int]]]]()


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


def pytest_configure(config: pytest.Config) -> None:
    if "not e2e" not in (config.option.markexpr or "") or os.environ.get(HERMETIC_VAR):
        return          # an engine session, or a worker / nested run of a run that set this up
    real = _real_roots()
    home = Path(tempfile.mkdtemp(prefix="specgate-tests-home-"))
    _mirror(real, home / "specgate")
    xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    for name in ("SPECGATE_CACHE_DIR", "SPECGATE_COMPILE_CACHE_DIR", "HF_HOME", "HF_HUB_CACHE"):
        os.environ.pop(name, None)
    os.environ.update({"XDG_CACHE_HOME": str(home), HERMETIC_VAR: str(home),
                       "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(xdg / "uv")),
                       "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", str(xdg / "pip"))})
    config.stash[_STATE] = (home, real, _digest(real))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(_STATE, None)
    if state is None:
        return
    home, real, before = state
    after = _digest(real)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    shutil.rmtree(home, ignore_errors=True)
    if changed:
        shown = "\n  ".join(changed[:20]) + (f"\n  and {len(changed) - 20} more" if len(changed) > 20 else "")
        session.config.get_terminal_writer().line(
            f"\nFAILED hermetic: the tests changed {len(changed)} path(s) in the real caches:\n  {shown}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def isolated_artifacts(tmp_path_factory, monkeypatch):
    """Each test (and every session process it starts) writes its artifacts under a temporary
    folder, unless the test points SPECGATE_ARTIFACTS elsewhere itself."""
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path_factory.mktemp("artifacts")))
