"""Shared by the harness's own tests: no test writes into the real artifacts/ folder, the
harness's caches or the user's HF cache (tests/hermetic.py).

A run of the harness's tests (`-m 'not e2e'`, pyproject's addopts; never a cpu_e2e or mutants
session, which load this file too) runs against a temporary cache home, and fails, naming
them, if any path in the real caches changed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import hermetic
import pytest

_HOME = pytest.StashKey[hermetic.Home]()


def pytest_configure(config: pytest.Config) -> None:
    # An engine session runs `-m e2e`; every other run (`-m 'not e2e'`, the fast tier's
    # `-m 'not vllm'`, which deselects the e2e tests too) is checked.
    if (config.option.markexpr or "").strip() == "e2e" or os.environ.get(hermetic.HERMETIC_VAR):
        return          # an engine session, or a worker / nested run of a run that set this up
    config.stash[_HOME] = hermetic.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    home = session.config.stash.get(_HOME, None)
    if home is None:
        return
    changed = hermetic.finish(home)
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


@pytest.fixture(scope="session", autouse=True)
def python3_without_a_shim(tmp_path_factory):
    """`python3` in the scripts the tests run (the CI wrapper masks and classifies with it) is the
    interpreter PATH leads to, reached directly: a version manager's shim (pyenv's starts a dozen
    bash processes) costs ~0.1 s a call, 3 s of CPU in test_wrapper.py alone."""
    found = shutil.which("python3")
    if found is None:
        yield
        return
    real = subprocess.run([found, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                          check=True).stdout.strip()
    # exec, not a symlink: a venv's python finds its pyvenv.cfg from the path it is started by
    launcher = tmp_path_factory.mktemp("python3") / "python3"
    launcher.write_text(f'#!/bin/sh\nexec {shlex.quote(real)} "$@"\n')
    launcher.chmod(0o755)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{launcher.parent}{os.pathsep}{os.environ['PATH']}")
        yield
