"""Shared by the harness's own tests: no test writes into the real artifacts/ folder, and the
fast tier leaves the user's caches (specgate's and Hugging Face's) as it found them."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated_artifacts(tmp_path_factory, monkeypatch):
    """Each test (and every session process it starts) writes its artifacts under a temporary
    folder, unless the test points SPECGATE_ARTIFACTS elsewhere itself."""
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path_factory.mktemp("artifacts")))


# --------------------------------------------------------------- hermetic: the user's caches stay as they were

def _caches() -> list[Path]:
    """The harness's cache and the user's Hugging Face cache, as a session would find them."""
    from huggingface_hub import constants

    from specgate.paths import cache_root

    return [cache_root(), Path(constants.HF_HUB_CACHE)]


def _digest(roots: list[Path]) -> dict[str, tuple[int, int]]:
    """Every file and folder under roots: (size, mtime_ns)."""
    seen = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in dirs + files:
                path = os.path.join(folder, name)
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    seen[path] = (st.st_size, st.st_mtime_ns)
    return seen


def _hermetic(config: pytest.Config) -> bool:
    """The fast tier (nox -s tests) only: cpu_e2e's tests (-m e2e) and tests/ci fill real caches."""
    return (not hasattr(config, "workerinput") and config.option.markexpr != "e2e"
            and not any("tests/ci" in str(arg) for arg in config.args))


def pytest_sessionstart(session: pytest.Session) -> None:
    if _hermetic(session.config):
        session.config.stash[_BEFORE] = _digest(_caches())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    after = _digest(_caches())
    changed = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"the tests wrote into the user's caches ({len(changed)} path(s)); tests must use their own:",
                 *changed[:20]]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[dict]()
