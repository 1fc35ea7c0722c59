"""The hermetic check of every run of the harness's tests (tests/conftest.py, tests/hermetic.py),
run on itself: a nested pytest run over copies of both and one probe test, against a stand-in
for the real harness cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hermetic import HERMETIC_VAR

PROBE = '''
import os
from pathlib import Path

from specgate.core.paths import cache_root


def test_probe():
    real = Path(os.environ["PROBE_REAL"])
    mirrored = cache_root() / "fixtures" / "tiny-x" / "model.safetensors"
    original = real / "fixtures" / "tiny-x" / "model.safetensors"
    assert cache_root() != real and os.stat(mirrored).st_ino == os.stat(original).st_ino
    assert not (cache_root() / "fixtures" / "tiny-x.lease").exists()      # side files stay behind
    (cache_root() / "fixtures" / "tiny-x.used").touch()                    # the temporary cache's: allowed
    if os.environ.get("PROBE_WRITE"):
        (real / "fixtures" / "tiny-x.used").touch()
'''


def nested_run(tmp_path: Path, write: bool) -> subprocess.CompletedProcess:
    real = tmp_path / "real"
    (real / "fixtures" / "tiny-x").mkdir(parents=True, exist_ok=True)
    (real / "fixtures" / "tiny-x" / "model.safetensors").write_bytes(b"weights")
    (real / "fixtures" / "tiny-x.lease").write_bytes(b"")
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    for helper in ("conftest.py", "hermetic.py"):
        shutil.copy(Path(__file__).with_name(helper), suite / helper)
    (suite / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != HERMETIC_VAR}
    env.update(SPECGATE_CACHE_DIR=str(real), PROBE_REAL=str(real), PROBE_WRITE="1" if write else "")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not e2e",
                           "--rootdir", str(suite), str(suite)], env=env, capture_output=True, text=True, timeout=120)


def test_a_run_that_writes_only_its_own_cache_passes(tmp_path):
    proc = nested_run(tmp_path, write=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hermetic" not in proc.stdout


def test_a_write_into_the_real_cache_fails_the_run_and_names_the_path(tmp_path):
    proc = nested_run(tmp_path, write=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    assert "FAILED hermetic: the tests changed 1 path(s) in the real caches" in proc.stdout
    assert str(tmp_path / "real" / "fixtures" / "tiny-x.used") in proc.stdout


def test_this_run_is_hermetic():
    """This very run: its harness cache and HF home are the temporary ones."""
    from specgate.core.paths import cache_root

    home = Path(os.environ[HERMETIC_VAR])
    assert cache_root() == home / "specgate" and os.environ["XDG_CACHE_HOME"] == str(home)
    assert "HF_HOME" not in os.environ and "SPECGATE_CACHE_DIR" not in os.environ
