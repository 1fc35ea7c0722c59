"""The real chain a Buildkite job runs, driven the way an agent drives it (tests/ci/agent.py):
pipeline command -> scripts/run-cpu-test.sh -> noxw.py -> nox -> session -> pytest ->
summary.json -> annotate.py -> buildkite-agent, then `nox -s gate` over the builds.

cpu_unit runs over a small stand-in vLLM checkout (VLLM_SOURCE_DIR: its own
.buildkite/hardware_tests/cpu.yaml and test files, a short-lived real pytest); warm_cache and
cpu_e2e are the real sessions on fixtures, cpu_e2e narrowed to one engine per shard with
PYTEST_ADDOPTS. A local fake hub (tests/hubserver.py) stands in where a hub is needed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from agent import SECRETS, Agent, agent_checkout
from contract import assert_valid
from hubserver import HubServer, Repo

REPO_ID = "acme/tiny-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ALPHA, BETA = "tests/v1/spec_decode/test_alpha.py", "tests/v1/spec_decode/test_beta.py"
CPU_YAML = f"""
steps:
- key: cpu-spec-decode-tests
  commands:
  - |
    bash run-cpu-test.sh 30m "
    pytest -x -v -s {ALPHA} {BETA}"
"""
PASSING = """
def test_one():
    pass

def test_two():
    pass
"""
ALPHA_TESTS = PASSING + """
def test_three():
    pass
"""
READS_THE_HUB = f"""
def test_one():
    pass

def test_reads_the_hub():  # offline: a cache miss; online: served by the local hub
    from huggingface_hub import hf_hub_download
    hf_hub_download("{REPO_ID}", "config.json", revision="{COMMIT}")
"""
A_REGRESSION = """
def test_one():
    pass

def test_acceptance_floor():
    acceptance_len, floor = 1.21, 1.5
    assert acceptance_len >= floor, f"acceptance length {acceptance_len} < floor {floor}"
"""
SLOW = """
import time

def test_one():
    pass

def test_slow():
    time.sleep(120)
"""
FLOORS = {ALPHA: 3, BETA: 2}   # passed tests per file in a clean run of the stand-in checkout


def stand_in_vllm(folder: Path, beta: str) -> Path:
    """A vLLM checkout as cpu_unit reads one: the pipeline step that lists the files, and the files."""
    for name, text in {".buildkite/hardware_tests/cpu.yaml": CPU_YAML, "tests/__init__.py": "",
                       ALPHA: ALPHA_TESTS, BETA: beta}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(textwrap.dedent(text))
    return folder


def manifest_with_stand_in_floors(checkout: Path, dest: Path) -> Path:
    """The real manifest, with the coverage floors of the stand-in checkout for cpu_unit."""
    text = (checkout / "manifest.toml").read_text()
    header = '[gate.coverage."0.32.0".cpu_unit]'
    start = text.index(header)
    end = text.find("\n[", start + len(header))
    floors = "\n".join(f'"{name}" = {count}' for name, count in FLOORS.items())
    dest.write_text(text[:start] + f"{header}\n{floors}\n" + (text[end:] if end != -1 else ""))
    return dest


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return agent_checkout(tmp_path_factory.mktemp("builds") / "specgate")


@pytest.fixture
def agent(checkout, tmp_path) -> Agent:
    hf_home = tmp_path / "hf"
    return Agent(checkout, tmp_path / "agent", {
        "HF_HOME": str(hf_home), "SPECGATE_RETRY_BACKOFF_S": "0.2", "SPECGATE_KILL_AFTER": "5s",
        "SPECGATE_MANIFEST": str(manifest_with_stand_in_floors(checkout, tmp_path / "manifest.toml")),
        "VLLM_SOURCE_DIR": str(stand_in_vllm(tmp_path / "vllm", PASSING)),
    })


@pytest.fixture
def hub():
    with HubServer([Repo(REPO_ID, COMMIT, {"config.json": b'{"model_type": "qwen3"}'})]) as server:
        yield server


def check_artifacts(job) -> None:
    """Every summary the job uploaded follows the contract, belongs to this job, and no
    planted secret reached an uploaded byte or the job's log."""
    summaries = list(job.uploaded.rglob("summary.json"))
    assert summaries, f"{job.step} uploaded no summary"
    for path in summaries:
        data = assert_valid(json.loads(path.read_text()))
        if data["session"] == job.step:
            assert data["run"]["job_id"] == job.job_id and data["run"]["build_id"] == job.build_id
            assert data["run"]["step_key"] == job.step and data["status"] != "running"
            if job.shard is not None:
                assert data["shard"] == {"num_shards": 2, "shard_id": job.shard}
    for path in job.uploaded.rglob("*"):
        if path.is_file():
            body = path.read_bytes()
            assert not [s for s in SECRETS if s.encode() in body], path
    assert not [s for s in SECRETS if s in job.output]


def unit_tests(job) -> dict[str, dict]:
    return {t["nodeid"]: t for t in job.summary("cpu_unit")["tests"]}


# --------------------------------------------------------------------------- builds

# What uv (the installer, shared on purpose) leaves in the temp dir: empty lock files of its builds.
UV_LOCK = re.compile(r"uv-[\w-]+\.lock")


@pytest.fixture
def job_tmpdir():
    """The agent's TMPDIR, empty, with a short path: vLLM binds its sockets two folders down."""
    path = Path(tempfile.mkdtemp(prefix="job-"))
    yield path
    shutil.rmtree(path)


def test_a_clean_build(agent, job_tmpdir):
    """warm_cache, both cpu_unit shards and both cpu_e2e shards (one real engine each) pass;
    every job leaves its own valid summary and annotation, no secret, and nothing in the temp
    dir (inductor's precompiled headers, vLLM's sockets and gloo files, pytest's tmp_path)."""
    build = agent.run_build(env={"TMPDIR": str(job_tmpdir)},
                            step_env={"cpu_e2e": {"PYTEST_ADDOPTS": "-k 'known_answer_baseline and not mimo'"}})
    assert [(j.step, j.outcome) for j in build.jobs] == [
        ("warm_cache", "passed"), ("cpu_unit", "passed"), ("cpu_unit", "passed"),
        ("cpu_e2e", "passed"), ("cpu_e2e", "passed")], [j.output[-3000:] for j in build.jobs if j.exit_status]
    for job in build.jobs:
        check_artifacts(job)
    units = build.of("cpu_unit")
    assert [sorted(unit_tests(j)) for j in units] == [[f"{ALPHA}::test_{n}" for n in ("one", "three", "two")],
                                                      [f"{BETA}::test_one", f"{BETA}::test_two"]]
    for job in build.of("cpu_e2e"):
        data = job.summary("cpu_e2e")
        assert data["exit_code"] == 0 and data["counts"]["executed"] == 1 and data["compile_backend"] == "inductor"
        [note] = job.annotations
        assert note["argv"][note["argv"].index("--style") + 1] == "success"
        assert "test_known_answer_baseline" in note["body"] and "1 passed" in note["body"]
    for job in units:
        [note] = job.annotations
        assert note["argv"][note["argv"].index("--style") + 1] == "success"
    assert [p.name for p in job_tmpdir.iterdir() if not UV_LOCK.fullmatch(p.name)] == []


def test_a_cache_miss_is_fixed_by_the_online_rerun(agent, hub, tmp_path):
    vllm = stand_in_vllm(tmp_path / "vllm-hub", READS_THE_HUB)
    build = agent.run_build(["cpu_unit"], env={"VLLM_SOURCE_DIR": str(vllm), "HF_ENDPOINT": hub.endpoint})
    assert build.passed and [j.exit_status for j in build.jobs] == [0, 0]
    beta = build.jobs[1]
    check_artifacts(beta)
    test = unit_tests(beta)[f"{BETA}::test_reads_the_hub"]
    assert test["outcome"] == "passed" and test["attempt"] == 2 and test["earlier"][0]["cause"] == "cache-miss"
    assert "rerunning 1 cache-miss test(s) online" in beta.output and hub.count("GET") > 0


def test_a_transient_503_is_fixed_by_one_retry(agent, hub, tmp_path):
    """The session's own online rerun meets seven 503s (more than huggingface_hub retries) and
    ends 75; the wrapper reruns the step online, where the test process sees the online env."""
    hub.fail(503, times=7)
    vllm = stand_in_vllm(tmp_path / "vllm-hub", READS_THE_HUB)
    build = agent.run_build(["cpu_unit"], env={"VLLM_SOURCE_DIR": str(vllm), "HF_ENDPOINT": hub.endpoint})
    beta = build.jobs[1]
    assert beta.outcome == "passed", beta.output[-4000:]
    assert "run-cpu-test: transient -> rerunning online" in beta.output
    data = beta.summary("cpu_unit")
    check_artifacts(beta)
    assert data["run"]["attempt"] == 2 and data["earlier_attempts"][0]["exit_code"] == 75
    assert f"{BETA}::test_reads_the_hub" in data["earlier_attempts"][0]["failed"]
    env_seen = json.loads((beta.uploaded / "artifacts" / "cpu_unit" / "pytest-env.json").read_text())
    assert env_seen["phase"] == "online" and env_seen["mismatches"] == []


def test_a_real_assertion_failure_fails_the_build_hard(agent, tmp_path):
    vllm = stand_in_vllm(tmp_path / "vllm-bad", A_REGRESSION)
    build = agent.run_build(["cpu_unit"], env={"VLLM_SOURCE_DIR": str(vllm)})
    beta = build.jobs[1]
    assert not build.passed and beta.exit_status == 1 and beta.outcome == "failed"   # not soft: 75 only
    assert "run-cpu-test: failure -> not rerunning" in beta.output
    check_artifacts(beta)
    test = unit_tests(beta)[f"{BETA}::test_acceptance_floor"]
    assert test["outcome"] == "failed" and test["cause"] == "failure" and "acceptance length 1.21" in test["reason"]
    [note] = beta.annotations
    assert "--style" in note["argv"] and note["argv"][note["argv"].index("--style") + 1] == "error"
    assert "test_acceptance_floor" in note["body"]


def job_processes(job_id: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("BUILDKITE_JOB_ID") == job_id:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_a_timeout_with_an_engine_running_leaves_no_process_and_says_timed_out(agent):
    """The wrapper's timeout fires while a vLLM engine process of the job is running. With the
    cpu_e2e venv left by the clean build, a warm shard's engines run from about 10 s to 70 s of
    the job (73 s in all on 2 cores), so 45 s lands among them; 75 s no longer did."""
    seen_engines: set[int] = set()

    def watch(proc, env):
        while proc.poll() is None:
            for p in job_processes(env["BUILDKITE_JOB_ID"]):
                try:
                    if "specgate.vllmside.engine" in p.cmdline():
                        seen_engines.add(p.pid)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.5)

    def shorter(step, command):
        assert "run-cpu-test.sh 60m" in command
        return command.replace("run-cpu-test.sh 60m", "run-cpu-test.sh 45s")

    build = agent.run_build(["cpu_e2e"], shards=[0], rewrite=shorter, while_running=watch)
    job = build.jobs[0]
    assert job.exit_status in (124, 137) and job.outcome == "failed", job.output[-3000:]
    assert seen_engines, f"no engine process was running when the timeout fired: {job.output[-3000:]}"
    deadline = time.monotonic() + 10
    while job_processes(job.job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not job_processes(job.job_id), [p.cmdline() for p in job_processes(job.job_id)]
    data = job.summary("cpu_e2e")
    assert_valid(data)
    assert data["run"]["job_id"] == job.job_id and data["status"] in ("killed", "running")
    [note] = job.annotations
    assert "timed out" in note["body"] and note["argv"][note["argv"].index("--style") + 1] == "error"


def test_a_crash_before_the_summary_never_shows_the_older_run(agent, tmp_path):
    """The first build leaves a green summary in the agent's checkout; in the next build the
    session process is SIGKILLed mid-run (as an OOM kill would): the annotation and the
    uploaded summary describe this job, not the older green one."""
    first = agent.run_build(["cpu_unit"])
    assert first.passed
    vllm = stand_in_vllm(tmp_path / "vllm-slow", SLOW)

    def kill_the_session(proc, env):
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            for p in job_processes(env["BUILDKITE_JOB_ID"]):
                try:
                    if p.cmdline()[1:3] == ["-m", "pytest"] and BETA in " ".join(p.cmdline()):
                        p.parent().kill()   # the session module, while its pytest runs the slow test
                        return
                except (psutil.NoSuchProcess, IndexError):
                    pass
            time.sleep(0.2)

    build = agent.run_build(["cpu_unit"], env={"VLLM_SOURCE_DIR": str(vllm)}, while_running=kill_the_session)
    beta = build.jobs[1]
    assert beta.outcome == "failed" and beta.exit_status == 1, beta.output[-3000:]
    data = beta.summary("cpu_unit")
    assert_valid(data)
    assert data["run"]["job_id"] == beta.job_id and data["status"] == "killed" and data["exit_code"] == 1
    [note] = beta.annotations
    assert note["argv"][note["argv"].index("--style") + 1] == "error" and "killed" in note["body"]
    assert "All 2 tests passed" not in note["body"] and "2 passed" not in note["body"]


ENV_BLOCKED = """
def test_one():
    pass

def test_needs_cuda():   # a missing piece of environment nothing declares: incomplete, 75
    raise AssertionError("Torch not compiled with CUDA enabled")
"""


def test_the_gate_over_several_builds(agent, hub, tmp_path):
    """Clean builds graduate cpu_unit; a hard failure in the window, a pass that needed a rerun,
    or a run that exited 75 keeps soft_fail, each named in the evidence. (--runs 3 and 1 keep
    the number of builds small; the rule is the same for the manifest's 5.)"""
    def gate(runs: int) -> tuple[int, dict]:
        out = tmp_path / "gate-artifacts"
        proc = subprocess.run(["python3", "scripts/noxw.py", "-s", "gate", "--", "--history", str(agent.store),
                               "--step", "cpu_unit", "--runs", str(runs)], cwd=agent.checkout,
                              env={**agent.env, "SPECGATE_ARTIFACTS": str(out)}, capture_output=True, text=True,
                              timeout=600)
        verdict = json.loads((out / "gate" / "summary.json").read_text())
        assert_valid(verdict)
        return proc.returncode, verdict

    def build_with(name: str, beta: str, **env: str):
        return agent.run_build(["cpu_unit"], env={"VLLM_SOURCE_DIR": str(stand_in_vllm(tmp_path / name, beta)), **env})

    for _ in range(3):
        assert agent.run_build(["cpu_unit"]).passed
    code, verdict = gate(3)
    assert code == 0 and [(t["nodeid"], t["outcome"]) for t in verdict["tests"]] == [("gate::cpu_unit", "passed")]

    failing = build_with("bad", A_REGRESSION)
    assert not failing.passed
    code, verdict = gate(3)
    assert code == 1 and f"build {failing.number} " in verdict["tests"][0]["reason"]

    rerun = build_with("hub", READS_THE_HUB, HF_ENDPOINT=hub.endpoint)
    assert rerun.passed
    code, verdict = gate(1)
    assert code == 1 and "test_reads_the_hub" in verdict["tests"][0]["reason"]

    blocked = build_with("blocked", ENV_BLOCKED)
    assert [j.outcome for j in blocked.jobs] == ["passed", "soft_failed"]
    code, verdict = gate(1)
    reason = verdict["tests"][0]["reason"]
    assert code == 1 and "75" in reason and f"build {blocked.number} " in reason
