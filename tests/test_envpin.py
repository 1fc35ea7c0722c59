"""Each session pins exactly its variables, nothing leaks between phases, secrets never show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specgate.contract import artifacts
from specgate.core import envpin
from specgate.core.manifest import load
from specgate.core.secrets import MASK
from specgate.sessions import pytestrun

REPO = Path(__file__).resolve().parent.parent
SESSIONS = ["tests", "warm_cache", "cpu_unit", "cpu_e2e"]
# What a user's shell might carry in: values that contradict the manifest.
HOSTILE = {"VLLM_CPU_KVCACHE_SPACE": "16", "VLLM_CPU_CI_ENV": "1", "HF_HUB_OFFLINE": "0", "OMP_NUM_THREADS": "64"}

DUMP_ENV_TEST = """
import json, os
def test_dump():
    with open(os.environ["DUMP_TO"], "w") as f:
        json.dump(dict(os.environ), f)
"""


def _run_session_pytest(tmp_path: Path, session: str, extra: dict[str, str | None] | None = None):
    """Run a real pytest child the way a session module does: nox's env (outer env plus the
    manifest's pins, None removing) and then specgate.sessions.pytestrun with the envcheck plugin."""
    manifest = load()
    (tmp_path / "test_dump.py").write_text(DUMP_ENV_TEST)
    outer = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")} | HOSTILE
    nox_env = {k: v for k, v in (outer | envpin.session_env(manifest, session)).items() if v is not None}
    nox_env |= {"SPECGATE_SESSION": session, "SPECGATE_ARTIFACTS": str(tmp_path / "artifacts"),
                "DUMP_TO": str(tmp_path / "env.json"), "PYTHONPATH": str(REPO)}
    for key, value in (extra or {}).items():
        nox_env.pop(key, None) if value is None else nox_env.__setitem__(key, value)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "specgate.sessions.envcheck", "-q",
                           "-p", "no:cacheprovider", str(tmp_path / "test_dump.py")],
                          cwd=tmp_path, env=nox_env, capture_output=True, text=True)
    return manifest, proc


@pytest.mark.parametrize("session", SESSIONS)
def test_pytest_process_sees_exactly_the_manifest(tmp_path, session):
    manifest, proc = _run_session_pytest(tmp_path, session)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads((tmp_path / "env.json").read_text())
    for name, want in envpin.session_env(manifest, session).items():
        assert seen.get(name) == want, f"{session}: {name}"
    record = json.loads((tmp_path / "artifacts" / session / "pytest-env.json").read_text())
    assert record["mismatches"] == []


def test_compile_mode_session_has_no_ci_env_even_if_the_shell_sets_it(tmp_path):
    _, proc = _run_session_pytest(tmp_path, "cpu_e2e")
    assert proc.returncode == 0
    assert "VLLM_CPU_CI_ENV" not in json.loads((tmp_path / "env.json").read_text())


def test_a_value_set_twice_with_two_values_stops_the_run(tmp_path):
    """If anything between the manifest and the test process changes a pinned value,
    the plugin refuses to run a single test."""
    _, proc = _run_session_pytest(tmp_path, "cpu_unit", extra={"VLLM_CPU_KVCACHE_SPACE": "16"})
    assert proc.returncode == 4  # pytest's usage error
    assert "VLLM_CPU_KVCACHE_SPACE: manifest says 1, process saw 16" in proc.stdout + proc.stderr
    assert not (tmp_path / "env.json").exists()


def test_the_online_phase_is_allowed_and_recorded(tmp_path):
    _, proc = _run_session_pytest(tmp_path, "cpu_unit", extra={"HF_HUB_OFFLINE": "0", "SPECGATE_ONLINE": "1"})
    assert proc.returncode == 0, proc.stdout
    record = json.loads((tmp_path / "artifacts" / "cpu_unit" / "pytest-env.json").read_text())
    assert record["phase"] == "online" and record["mismatches"] == []


def test_an_online_phase_that_re_pins_offline_is_caught(tmp_path):
    """The rerun asked for the online phase, but something re-pinned HF_HUB_OFFLINE=1 on the way."""
    _, proc = _run_session_pytest(tmp_path, "cpu_unit", extra={"SPECGATE_ONLINE": "1"})
    assert proc.returncode == 4
    assert "HF_HUB_OFFLINE: manifest says 0, process saw 1" in proc.stdout + proc.stderr


@pytest.mark.parametrize("session", SESSIONS)
def test_the_online_phase_reaches_every_session_s_test_process(session):
    manifest = load()
    online = envpin.session_env(manifest, session, {"SPECGATE_ONLINE": "1"})
    offline = envpin.session_env(manifest, session, {})
    assert online["HF_HUB_OFFLINE"] == "0" and online["SPECGATE_ONLINE"] == "1"
    assert offline["HF_HUB_OFFLINE"] == "1" and "SPECGATE_ONLINE" not in offline
    assert {k: v for k, v in online.items() if k not in manifest.online_env and k != "SPECGATE_ONLINE"} == \
        {k: v for k, v in offline.items() if k not in manifest.online_env}


def test_every_session_sets_or_removes_every_managed_variable():
    manifest = load()
    managed = manifest.managed_env_names()
    assert {"VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "OMP_NUM_THREADS"} <= managed
    for session in manifest.sessions:
        pinned = envpin.session_env(manifest, session)
        assert set(pinned) == managed
        assert pinned["VLLM_TARGET_DEVICE"] == "cpu"
    assert envpin.session_env(manifest, "cpu_unit")["VLLM_CPU_CI_ENV"] == "1"
    assert envpin.session_env(manifest, "cpu_e2e")["VLLM_CPU_CI_ENV"] is None


def test_secrets_are_masked_in_tables_and_scrubbed_from_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    monkeypatch.setenv("BUILDKITE_STEP_KEY", "cpu_unit")
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path))
    shown = envpin.effective_env(os.environ, {})
    assert shown["HF_TOKEN"] == MASK and "BUILDKITE_STEP_KEY" not in shown  # shown only when relevant
    table = envpin.format_table(shown)
    assert "hf_abcdefghijklmnop" not in table
    path = tmp_path / "demo.json"
    artifacts.write_json(path, {"log_tail": "auth header Bearer hf_abcdefghijklmnop failed", "step": "cpu_unit"})
    text = path.read_text()
    assert "hf_abcdefghijklmnop" not in text and "Bearer ***" in text and '"cpu_unit"' in text


def test_user_pip_settings_reach_uv_unless_uv_has_its_own():
    env = {"PIP_FIND_LINKS": "/opt/wheels", "PIP_EXTRA_INDEX_URL": "file:///a file:///b", "UV_INDEX_URL": "file:///u",
           "PIP_INDEX_URL": "file:///p"}
    assert envpin.installer_env(env) == {"UV_FIND_LINKS": "/opt/wheels", "UV_EXTRA_INDEX_URL": "file:///a file:///b"}


def test_child_env_removes_what_the_phase_unsets(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")
    env = pytestrun.child_env({"VLLM_CPU_CI_ENV": None, "HF_HUB_OFFLINE": "0"})
    assert "VLLM_CPU_CI_ENV" not in env and env["HF_HUB_OFFLINE"] == "0"
