"""warm_cache against a real hub-like HTTP server: concurrent runs share one download,
a SIGKILLed run leaves nothing mistaken for complete, a warm cache costs no network,
transient errors are retried and auth/failure are not, and the exit codes and
summary follow the model source."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from contract import read_valid
from hubserver import ConnectionGuard, HubServer, Repo, closed_endpoint, hf_env, write_manifest

from specgate.contract.summary import begin as begin_record
from specgate.contract.summary import finish as finish_record
from specgate.core import cli, envpin
from specgate.core.manifest import REPO_ROOT, load
from specgate.sessions import pytestrun
from specgate.sessions.warm import session as warm
from specgate.vllmside import fixtures, sources

REPO_ID = "acme/tiny-model"
OTHER_ID = "acme/unit-only"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
MODEL = os.urandom(1_000_000)
FILES = {"config.json": b'{"model_type": "qwen3"}', "tokenizer.json": b'{"v": 1}' * 100, "model.safetensors": MODEL}
SUMMARY_KEYS = {"session", "model_mode", "suites", "checkpoints", "fixtures", "env", "exit_code", "finished_at"}
# One warm_cache run on a given manifest and model source, in its own process.
RUN = ("import sys; from specgate.sessions.warm import session as warm; from specgate.contract import summary; "
       "from specgate.core.manifest import load; "
       "r = summary.begin('warm_cache'); c = warm.run(load(sys.argv[1]), None, sys.argv[2], r, backoff_s=0.05); "
       "summary.finish(r, c); sys.exit(c)")


@pytest.fixture
def hub():
    with HubServer([Repo(REPO_ID, COMMIT, dict(FILES)), Repo(OTHER_ID, OTHER_COMMIT, {"config.json": b"{}"})]) as s:
        yield s


@pytest.fixture
def case(tmp_path, monkeypatch, hub):
    """An isolated HF home, artifacts folder and manifest, with the hub server as endpoint.
    Fixtures come from the harness cache as usual (content-addressed, built once under a lock)."""
    for name in [k for k in os.environ if k.startswith(("HF_", "HUGGINGFACE"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as the session pins it
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    path = write_manifest(tmp_path, {REPO_ID: {"revision": COMMIT, "suites": ["cpu_e2e"]},
                                     OTHER_ID: {"revision": OTHER_COMMIT, "suites": ["cpu_unit"]}})
    fixtures.ensure_all(load(path))
    return tmp_path, path


def cache(tmp: Path) -> Path:
    return tmp / "home" / "hub"


def summary(tmp: Path, folder: str = "artifacts") -> dict:
    return read_valid(tmp / folder / "warm_cache" / "summary.json")


def run_here(tmp: Path, manifest: Path, suites: list[str] | None, mode: str) -> int:
    """warm_cache in this process, on the case's own HF cache (huggingface_hub fixes its
    default cache folder at first import, so an in-process run names it)."""
    record = begin_record("warm_cache", env=envpin.session_report(load(manifest), "warm_cache"))
    code = warm.run(load(manifest), suites, mode, record, cache_dir=cache(tmp), backoff_s=0.01)
    finish_record(record, code)
    return code


def statuses(data: dict) -> dict[str, str]:
    return {c["repo_id"]: c["status"] for c in data["checkpoints"]}


def spawn(tmp: Path, manifest: Path, mode: str, name: str, endpoint: str) -> subprocess.Popen:
    env = hf_env(endpoint, tmp / "home", HF_HUB_OFFLINE="1", SPECGATE_ARTIFACTS=str(tmp / name))
    return subprocess.Popen([sys.executable, "-c", RUN, str(manifest), mode], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.vllm
def test_four_concurrent_runs_download_each_file_once(case, hub):
    tmp, manifest = case
    hub.throttle.chunk, hub.throttle.delay_s = 32 * 1024, 0.1  # ~3 s for the model: the runs overlap
    procs = [spawn(tmp, manifest, "hub", f"run{i}", hub.endpoint) for i in range(4)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outputs
    for name in FILES:
        assert hub.count("GET", "get", name, REPO_ID) == 1, name
        assert hub.count("HEAD", "head", name, REPO_ID) == 1, name
    assert hub.count("GET", "tree", repo_id=REPO_ID) == 1
    results = [statuses(summary(tmp, f"run{i}"))[REPO_ID] for i in range(4)]
    assert sorted(results) == ["cached", "cached", "cached", "downloaded"]
    assert any("another warm_cache is fetching it; waiting" in out for out in outputs), outputs
    snap = sources.snapshot(REPO_ID, COMMIT, cache(tmp))
    assert snap.path is not None and (snap.path / "model.safetensors").read_bytes() == MODEL


@pytest.mark.vllm
def test_sigkill_mid_download_leaves_nothing_mistaken_for_complete(case, hub):
    tmp, manifest = case
    hub.throttle.chunk, hub.throttle.delay_s = 16 * 1024, 0.05  # ~3 s for the model
    proc = spawn(tmp, manifest, "hub", "killed", hub.endpoint)
    deadline = time.monotonic() + 60
    while hub.bytes_sent(REPO_ID, "model.safetensors") == 0:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    time.sleep(1.0)
    sent = hub.bytes_sent(REPO_ID, "model.safetensors")
    time.sleep(1.0)
    assert hub.bytes_sent(REPO_ID, "model.safetensors") == sent < len(MODEL), "the download outlived its warm_cache"

    snap = sources.snapshot(REPO_ID, COMMIT, cache(tmp))
    assert snap.path is None and "model.safetensors" in snap.reason
    manifest_obj = load(manifest)
    assert sources.resolve(manifest_obj, REPO_ID, "hub", cache_dir=cache(tmp)).status == "missing"
    fetch = f"from huggingface_hub import snapshot_download as d; d({REPO_ID!r}, revision={COMMIT!r})"
    offline = subprocess.run(
        [sys.executable, "-c", fetch],
        env=hf_env(hub.endpoint, tmp / "home", HF_HUB_OFFLINE="1"), capture_output=True, text=True)
    assert offline.returncode != 0, offline.stdout  # nor does huggingface_hub's own offline lookup take it

    hub.throttle.delay_s = 0
    again = spawn(tmp, manifest, "hub", "again", hub.endpoint)
    out = again.communicate(timeout=120)[0]
    assert again.returncode == 0, out
    assert statuses(summary(tmp, "again"))[REPO_ID] == "downloaded"
    snap = sources.snapshot(REPO_ID, COMMIT, cache(tmp))
    assert (snap.path / "model.safetensors").read_bytes() == MODEL


@pytest.mark.vllm
def test_warm_cache_opens_no_connection(case, hub):
    tmp, manifest = case
    assert run_here(tmp, manifest, None, "hub") == 0
    before = hub.total_requests()
    with ConnectionGuard() as guard:
        started = time.monotonic()
        code = run_here(tmp, manifest, None, "hub")
        elapsed = time.monotonic() - started
    assert code == 0 and elapsed < 3.0
    assert guard.events == []  # no socket connect, no child process
    assert hub.total_requests() == before
    assert set(statuses(summary(tmp)).values()) == {"cached"}


@pytest.mark.vllm
def test_transient_503_is_retried_and_succeeds(case, hub, capsys):
    tmp, manifest = case
    hub.fail(503, kind="get", filename="model.safetensors", times=1)
    assert run_here(tmp, manifest, None, "hub") == 0
    out = capsys.readouterr().out
    assert "transient" in out and "retrying" in out
    assert hub.count("GET", "get", "model.safetensors") == 2
    assert statuses(summary(tmp))[REPO_ID] == "downloaded"


@pytest.mark.vllm
def test_transient_errors_stop_after_the_bounded_attempts(case, hub, capsys):
    tmp, manifest = case
    hub.fail(503, kind="get", filename="model.safetensors", times=100)
    assert run_here(tmp, manifest, ["cpu_e2e"], "hub") == 75
    assert hub.count("GET", "get", "model.safetensors") == warm.ATTEMPTS
    assert f"(after {warm.ATTEMPTS} attempts)" in capsys.readouterr().out


@pytest.mark.vllm
def test_401_is_auth_and_not_retried(case, hub, capsys):
    tmp, manifest = case
    hub.fail(401, kind="tree", times=100)
    assert run_here(tmp, manifest, ["cpu_e2e"], "hub") == 75
    assert hub.count("GET", "tree") == 1
    line = next(printed for printed in capsys.readouterr().out.splitlines()
                if printed.startswith(f"missing: {REPO_ID}"))
    assert "auth" in line and "set HF_TOKEN and accept the licence at https://huggingface.co/acme/tiny-model" in line


@pytest.mark.vllm
def test_404_is_failure_and_not_retried(case, hub, capsys):
    tmp, manifest = case
    hub.fail(404, kind="tree", times=100)
    assert run_here(tmp, manifest, ["cpu_e2e"], "hub") == 75
    assert hub.count("GET", "tree") == 1
    line = next(printed for printed in capsys.readouterr().out.splitlines()
                if printed.startswith(f"missing: {REPO_ID}"))
    assert "failure" in line


@pytest.mark.vllm
def test_hub_mode_with_unreachable_hub_exits_75_quickly(case, monkeypatch, capsys):
    tmp, manifest = case
    monkeypatch.setenv("HF_ENDPOINT", closed_endpoint())
    started = time.monotonic()
    assert run_here(tmp, manifest, None, "hub") == 75
    assert time.monotonic() - started < 10
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("missing: ")]
    assert len(lines) == 2 and all("hub unreachable" in line for line in lines), lines
    data = summary(tmp)
    assert set(data) >= SUMMARY_KEYS and data["exit_code"] == 75 and data["model_mode"] == "hub"
    assert set(statuses(data).values()) == {"missing"}
    junit = pytestrun.read_junit(tmp / "artifacts" / "warm_cache" / "junit.xml")
    assert len(junit) == 2 and all(r.outcome == "failed" and "hub unreachable" in r.message for r in junit)


@pytest.mark.vllm
def test_auto_mode_falls_back_to_fixtures_and_exits_0(case, monkeypatch, capsys):
    tmp, manifest = case
    monkeypatch.setenv("HF_ENDPOINT", closed_endpoint())
    monkeypatch.setenv("HF_TOKEN", "hf_notarealtoken_123456")
    assert run_here(tmp, manifest, None, "auto") == 0
    out = capsys.readouterr().out
    assert f"fixture: {REPO_ID}: hub unreachable" in out
    data = summary(tmp)
    assert set(data) >= SUMMARY_KEYS and data["exit_code"] == 0 and data["model_mode"] == "auto"
    rows = {c["repo_id"]: c for c in data["checkpoints"]}
    assert rows[REPO_ID]["source"] == "fixture" and rows[REPO_ID]["fixture"] == "tiny-qwen3"
    assert Path(rows[REPO_ID]["path"]).is_dir() and rows[REPO_ID]["size_bytes"] > 0
    assert data["env"]["HF_TOKEN"] == "***" and "hf_notarealtoken_123456" not in json.dumps(data)


@pytest.mark.vllm
def test_auto_mode_uses_the_cached_hub_snapshot(case, hub):
    tmp, manifest = case
    assert run_here(tmp, manifest, None, "auto") == 0
    rows = {c["repo_id"]: c for c in summary(tmp)["checkpoints"]}
    assert rows[REPO_ID]["source"] == "hub" and rows[REPO_ID]["status"] == "downloaded"
    assert rows[REPO_ID]["size_bytes"] == sum(len(v) for v in FILES.values())


@pytest.mark.vllm
def test_fixture_mode_uses_no_network(case, hub):
    tmp, manifest = case
    with ConnectionGuard() as guard:
        assert run_here(tmp, manifest, None, "fixture") == 0
    assert guard.events == [] and hub.total_requests() == 0
    data = summary(tmp)
    assert data["model_mode"] == "fixture" and set(statuses(data).values()) == {"fixture"}


@pytest.mark.vllm
def test_suites_select_checkpoints_and_unknown_suite_exits_2(case, hub, capsys):
    tmp, manifest = case
    assert run_here(tmp, manifest, ["cpu_unit"], "hub") == 0
    assert list(statuses(summary(tmp))) == [OTHER_ID]
    with pytest.raises(cli.BadInput, match="unknown suite nightly"):
        warm.run(load(manifest), ["cpu_unit", "nightly"], "hub", {})


def test_cli_unknown_suite_exits_2():
    proc = subprocess.run([sys.executable, "-m", "specgate.sessions.warm", "--suites", "nosuch"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert [line for line in proc.stdout.splitlines() if line.startswith("error:")] == [
        f"error: unknown suite nosuch (known: {', '.join(sorted(warm.known_suites(load())))})"]


@pytest.mark.vllm
def test_gated_checkpoint_without_token_asks_for_one_without_network(case, hub, capsys):
    tmp, _ = case
    manifest = write_manifest(tmp, {REPO_ID: {"revision": COMMIT, "suites": ["cpu_e2e"], "gated": True}})
    assert run_here(tmp, manifest, None, "hub") == 75
    assert hub.total_requests() == 0
    line = next(printed for printed in capsys.readouterr().out.splitlines()
                if printed.startswith(f"missing: {REPO_ID}"))
    assert "gated and no HF token is set" in line and "set HF_TOKEN and accept the licence" in line


@pytest.mark.vllm
def test_unpinned_checkpoint_is_never_fetched(case, hub, capsys):
    """Only pinned commits are fetched: even a reachable hub serving the repo is not asked."""
    tmp, _ = case
    manifest = write_manifest(tmp, {REPO_ID: {"revision": "unpinned", "unpinned_reason": "commit unknown",
                                              "suites": ["cpu_e2e"]}})
    assert run_here(tmp, manifest, None, "hub") == 75
    assert hub.total_requests() == 0
    line = next(printed for printed in capsys.readouterr().out.splitlines()
                if printed.startswith(f"missing: {REPO_ID}"))
    assert "no pinned revision in the manifest (commit unknown)" in line
    assert run_here(tmp, manifest, None, "auto") == 0
    assert statuses(summary(tmp))[REPO_ID] == "fixture"


@pytest.mark.vllm
def test_cli_hub_mode_on_the_real_manifest_without_a_hub_exits_75(tmp_path):
    """The real entry point and manifest, as `nox -s warm_cache -- --model-source hub` runs
    it on a machine where the hub cannot be reached."""
    env = hf_env(closed_endpoint(), tmp_path / "home", HF_HUB_OFFLINE="1", SPECGATE_ARTIFACTS=str(tmp_path / "a"))
    proc = subprocess.run([sys.executable, "-m", "specgate.sessions.warm", "--model-source", "hub",
                           "--suites", "cpu_unit"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 75, proc.stdout + proc.stderr
    expected = [c.repo_id for c in load().checkpoints_for(["cpu_unit"])]
    missing = [line for line in proc.stdout.splitlines() if line.startswith("missing: ")]
    assert [line.split(":")[1].strip() for line in missing] == expected
    assert all("hub unreachable" in line for line in missing)
    data = summary(tmp_path, "a")
    assert set(data) >= SUMMARY_KEYS and data["exit_code"] == 75 and data["suites"] == ["cpu_unit"]
    assert set(data["fixtures"]) == set(load().fixtures)


# --------------------------------------------------------------------------- damaged hub files

def cached_file(tmp: Path, name: str) -> Path:
    """The blob a cached snapshot file links to (what a bad disk or a killed writer damages)."""
    return (sources.repo_folder(REPO_ID, cache(tmp)) / "snapshots" / COMMIT / name).resolve()


def flip_a_byte(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage, name, why", [
    (flip_a_byte, "model.safetensors", "its sha256 is not the listed"),
    (flip_a_byte, "tokenizer.json", "its git blob id is not the listed"),
    (lambda path: os.truncate(path, path.stat().st_size // 2), "model.safetensors",
     "500000 bytes, the hub listed 1000000"),
])
@pytest.mark.vllm
def test_a_damaged_cached_file_is_fetched_again(case, hub, capsys, damage, name, why):
    """A file that passed once (stamped), then was damaged in place: the next warm_cache sees
    its stamp no longer fits, hashes it, removes it and downloads it again."""
    tmp, manifest = case
    assert run_here(tmp, manifest, ["cpu_e2e"], "hub") == 0       # downloads
    assert run_here(tmp, manifest, ["cpu_e2e"], "hub") == 0       # verifies and stamps
    assert hub.count("GET", "get", name, REPO_ID) == 1
    damage(cached_file(tmp, name))
    capsys.readouterr()
    assert run_here(tmp, manifest, ["cpu_e2e"], "hub") == 0
    out = capsys.readouterr().out
    assert f"cache-corrupt: {REPO_ID}@{COMMIT[:12]}: {name}: {why}" in out and "fetching again" in out, out
    assert hub.count("GET", "get", name, REPO_ID) == 2
    assert statuses(summary(tmp))[REPO_ID] == "downloaded"
    assert cached_file(tmp, name).read_bytes() == FILES[name]


@pytest.mark.parametrize("mode", ["hub", "auto"])
@pytest.mark.vllm
def test_a_damaged_file_with_the_hub_unreachable_is_cache_corrupt_and_leaves_nothing_corrupt(
        case, hub, monkeypatch, mode):
    """Offline, the damage cannot be repaired: exit 75, cause cache-corrupt naming the file, in
    auto mode too (the job had the checkpoint; a silent switch to its fixture would hide that).
    The damaged file is gone, so the next job meets a plain cache miss, never the bad bytes."""
    tmp, manifest = case
    assert run_here(tmp, manifest, ["cpu_e2e"], "hub") == 0
    flip_a_byte(cached_file(tmp, "model.safetensors"))
    monkeypatch.setenv("HF_ENDPOINT", closed_endpoint())
    assert run_here(tmp, manifest, ["cpu_e2e"], mode) == 75
    [entry] = summary(tmp)["tests"]
    assert entry["outcome"] == "failed" and entry["cause"] == "cache-corrupt", entry
    assert "model.safetensors: its sha256 is not the listed" in entry["reason"] and "hub unreachable" in entry["reason"]
    snap = sources.snapshot(REPO_ID, COMMIT, cache(tmp))
    assert snap.path is None and "model.safetensors" in snap.reason
    assert run_here(tmp, manifest, ["cpu_e2e"], mode) == (75 if mode == "hub" else 0)
    [entry] = summary(tmp)["tests"]
    assert entry["cause"] != "cache-corrupt"
