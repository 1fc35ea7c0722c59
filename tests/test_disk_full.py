"""A full disk, for real: small tmpfs mounts (root only) as the harness cache and as the
artifacts folder. A session that runs out of room ends 75 with the disk named as the cause
(env-blocked for the classifier), its summary stays valid (or is absent, never stale), and no
half-written cache entry is left for the next job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from contract import assert_valid

from specgate.ciside import classify

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def session(module: str, *args: str, env: dict[str, str], run_id: str = "") -> subprocess.CompletedProcess:
    """run_id: the run this session belongs to (a fresh one if empty, never the one nox handed down)."""
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("SPECGATE_RUN_ID", "BUILDKITE_JOB_ID", "BUILDKITE_BUILD_ID")}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO,
                          env={**inherited, **env, **({"SPECGATE_RUN_ID": run_id} if run_id else {})},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.vllm
def test_a_full_cache_disk_is_env_blocked_and_leaves_no_half_built_fixture(tmp_path):
    with tmpfs(tmp_path / "cache", "4m") as cache:
        proc = session("specgate.sessions.warm", "--model-source", "fixture",
                       env={"SPECGATE_CACHE_DIR": str(cache), "SPECGATE_ARTIFACTS": str(tmp_path / "artifacts")})
        assert proc.returncode == 75, proc.stdout[-3000:] + proc.stderr[-3000:]
        data = assert_valid(json.loads((tmp_path / "artifacts" / "warm_cache" / "summary.json").read_text()))
        assert data["status"] == "crashed" and data["exit_code"] == 75
        assert data["error"].startswith("env-blocked: disk full (No space left on device)"), data["error"]
        assert classify.explain(proc.stdout + proc.stderr)[0] == "env-blocked"
        left = sorted(p.name for p in (cache / "fixtures").iterdir())
        assert not [name for name in left if ".tmp" in name], left          # no build in progress left over
        assert all(not (cache / "fixtures" / name).is_dir() or (cache / "fixtures" / name / "specgate-digests.json")
                   .is_file() for name in left), left                         # every folder there is whole


def test_a_full_artifacts_disk_keeps_the_summary_valid_and_never_stale(tmp_path):
    """The older summary fills what room there is; the new run removes it to write its own."""
    with tmpfs(tmp_path / "artifacts", "64k") as artifacts:
        env = {"SPECGATE_ARTIFACTS": str(artifacts), "SPECGATE_CACHE_DIR": str(tmp_path / "cache")}
        assert session("specgate.sessions.caches", env=env, run_id="older-run").returncode == 0
        summary = artifacts / "cache" / "summary.json"
        old = json.loads(summary.read_text())
        filler = artifacts / "filler"
        with filler.open("wb", buffering=0) as f, pytest.raises(OSError, match="No space left"):
            while True:
                f.write(b"\0" * 1024)
        proc = session("specgate.sessions.caches", env=env, run_id="newer-run")
        data = assert_valid(json.loads(summary.read_text()))
        assert (old["run_id"], data["run_id"]) == ("older-run", "newer-run"), "the older summary stayed"
        assert (proc.returncode, data["status"], data["exit_code"]) == (0, "finished", 0), proc.stdout[-3000:]
        filler.unlink()
