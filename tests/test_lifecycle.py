"""The one session lifecycle (specgate.sessions.lifecycle) in real processes, with real signals:
a summary that is never stale, never half-written and always says how the run ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hermetic
import psutil
import pytest
from contract import read_valid

from specgate.contract import exitcodes, summary
from specgate.core import cli

REPO = Path(__file__).resolve().parent.parent
TOKEN = "hf_PLANTEDlifecycle0123456789"
# A session module in miniature: the real lifecycle around a step chosen by argv[1].
SESSION = '''
import os, subprocess, sys, tempfile, time
from specgate.contract import artifacts, processes
from specgate.core import cli
from specgate.sessions import lifecycle

def step(ctx):
    what = ctx.args.what
    ctx.record["mine"] = "kept"
    if what == "pass":
        ctx.record["tests"] = [{"nodeid": "t.py::a", "outcome": "passed", "cause": None, "reason": None, "time_s": 0.1}]
        return 0
    if what == "empty":
        return 0
    if what == "crash":
        raise RuntimeError("a harness bug")
    if what.startswith("litter"):   # as torch._dynamo's import does, and a temp file of its own
        os.makedirs(os.path.join(tempfile.gettempdir(), "torchinductor_user"))
        tempfile.mkstemp()
        subprocess.run([sys.executable, "-c", "import tempfile; print('child temp', tempfile.gettempdir())"])
        print("given", processes.given_tempdir(), "own", os.path.dirname(tempfile.gettempdir()), flush=True)
        if what == "litter-crash":
            raise RuntimeError("a harness bug")
        return 0
    if what == "leak":   # a child writes the token raw into a log under artifacts
        (artifacts.artifacts_dir("tests") / "child.log").write_text("Bearer " + sys.argv[-1])
        ctx.record["tests"] = [{"nodeid": "t.py::a", "outcome": "passed", "cause": None, "reason": None, "time_s": 0}]
        return 0
    if what == "hang":   # a child and a grandchild in a session of its own, then wait
        subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                          "subprocess.Popen(['sleep', '300'], start_new_session=True); time.sleep(300)"])
        print("ready", flush=True)
        time.sleep(300)
    if what == "stubborn":   # a child that outlasts SIGTERM, so ending the tree takes its grace period
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                  "signal.SIG_IGN); print('child ready', flush=True); time.sleep(300)"],
                                 stdout=subprocess.PIPE, text=True)
        child.stdout.readline()   # its SIGTERM is ignored from here on
        print("ready", flush=True)
        time.sleep(300)

p = cli.parser("tests", "lifecycle test", pytest=False)
p.add_argument("what")
p.add_argument("token", nargs="?")
lifecycle.main("tests", p, step)
'''


@pytest.fixture
def run(tmp_path):
    script = tmp_path / "session.py"
    script.write_text(SESSION)

    def start(*args: str, **env: str) -> subprocess.Popen:
        full = hermetic.env_without("BUILDKITE_", "SPECGATE_")
        full.update(SPECGATE_ARTIFACTS=str(tmp_path / "artifacts"), **env)
        return subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, env=full, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    return start


def finished(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def wait_for_line(proc: subprocess.Popen, wanted: str) -> None:
    for line in proc.stdout:
        if line.strip() == wanted:
            return
    pytest.fail(f"the session ended before printing {wanted!r}")


def record(tmp_path: Path) -> dict:
    return read_valid(tmp_path / "artifacts" / "tests" / "summary.json")


def test_a_pass_records_the_contract(run, tmp_path):
    code, out = finished(run("pass"))
    data = record(tmp_path)
    assert code == 0 and data["status"] == "finished" and data["exit_code"] == 0 and data["mine"] == "kept"
    assert data["counts"] == {"executed": 1, "passed": 1, "failed": 0, "errors": 0, "skipped": 0, "xfailed": 0}
    assert data["host"]["cores"] == os.cpu_count() and data["vllm_version"] and data["torch_version"]
    assert "== tests: finished, 1 passed (executed 1)" in out and "-> exit 0 (pass)" in out


def test_what_an_earlier_run_left_is_not_shown_as_this_runs(run, tmp_path):
    """An earlier run's JUnit file, log or folder (upstream's stand-in run, a mutant not chosen
    this time) would be uploaded beside this run's summary as if this run had written it."""
    earlier = tmp_path / "artifacts" / "tests"
    (earlier / "upstream-hub-cache" / "models--org--m").mkdir(parents=True)
    (earlier / "junit-upstream.xml").write_text("<testsuite failures='1'/>")
    finished(run("pass"))
    assert sorted(p.name for p in earlier.iterdir()) == ["summary.json"]
    assert record(tmp_path)["status"] == "finished"


def test_an_empty_run_is_a_failure_not_a_pass(run, tmp_path):
    code, out = finished(run("empty"))
    data = record(tmp_path)
    assert code == 1 and data["exit_code"] == 1 and "executed no test" in data["error"]


def test_a_crash_is_recorded_as_crashed(run, tmp_path):
    code, out = finished(run("crash"))
    data = record(tmp_path)
    assert code == 1 and data["status"] == "crashed" and data["error"] == "RuntimeError: a harness bug"
    assert "Traceback" in out


def test_bad_input_is_one_line_and_exit_2(run, tmp_path):
    code, out = finished(run("pass", "x", "--bogus"))
    data = record(tmp_path)
    assert code == 2 and data["status"] == "finished" and data["exit_code"] == 2
    assert "error: nox -s tests -- unrecognized arguments: --bogus (this session runs no pytest)" in out


@pytest.mark.parametrize("what", ["litter", "litter-crash"])
def test_what_the_session_process_leaves_in_its_temp_dir_goes_with_it(run, tmp_path, what):
    """A session that builds a fixture imports torch._dynamo, which makes <temp dir>/torchinductor_<user>
    at import: that goes, however the step ends. Children keep the temp dir TMPDIR names."""
    temp = tmp_path / "temp"
    temp.mkdir()
    code, out = finished(run(what, TMPDIR=str(temp)))
    assert record(tmp_path)["status"] == ("finished" if what == "litter" else "crashed"), out
    assert f"child temp {temp}\n" in out
    assert f"given {temp} own {temp}\n" in out   # a pytest child's folder goes in the given one, not in the session's
    assert not list(temp.iterdir())


def test_a_stopped_session_says_killed_and_takes_its_tree_with_it(run, tmp_path):
    (tmp_path / "artifacts" / "tests").mkdir(parents=True)
    (tmp_path / "artifacts" / "tests" / "summary.json").write_text(json.dumps({"status": "finished", "exit_code": 0}))
    proc = run("hang")
    wait_for_line(proc, "ready")
    running = record(tmp_path)
    assert running["status"] == "running" and running["exit_code"] is None  # the older summary is gone
    tree = psutil.Process(proc.pid).children(recursive=True)
    deadline = time.monotonic() + 10
    while len(tree) < 2 and time.monotonic() < deadline:   # the grandchild may take a moment
        time.sleep(0.1)
        tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 2
    proc.send_signal(signal.SIGTERM)
    code, out = finished(proc)
    data = record(tmp_path)
    assert code == 128 + signal.SIGTERM and data["status"] == "killed" and data["error"] == "stopped by SIGTERM"
    gone, alive = psutil.wait_procs(tree, timeout=5)
    assert not alive, f"left running: {alive}"


def test_a_second_stop_during_the_cleanup_still_leaves_a_killed_summary(run, tmp_path):
    """A job's timeout signals the whole process group, so nox forwards a SIGTERM of its own while
    the session is still ending its children: that second stop must not cut the cleanup short
    and leave summary.json saying "running"."""
    proc = run("stubborn")
    wait_for_line(proc, "ready")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)   # inside end_tree's grace period for the child that ignores SIGTERM
    proc.send_signal(signal.SIGTERM)
    code, out = finished(proc)
    data = record(tmp_path)
    assert code == 128 + signal.SIGTERM and data["status"] == "killed" and data["error"] == "stopped by SIGTERM", out
    assert "Traceback" not in out


def test_an_agent_environment_leaves_the_summary_intact_and_no_secret_in_artifacts(run, tmp_path):
    agent = {"BUILDKITE_BUILD_ID": "0190-build", "BUILDKITE_JOB_ID": "0190-job", "BUILDKITE_STEP_KEY": "cpu_unit",
             "BUILDKITE_BUILD_AUTHOR": "Qwen", "TOKENIZERS_PARALLELISM": "false", "HF_TOKEN": TOKEN,
             "BUILDKITE_AGENT_ACCESS_TOKEN": "bkagent-secret-0123456789"}
    code, out = finished(run("leak", TOKEN, **agent))
    data = record(tmp_path)
    assert code == 0 and data["session"] == "tests" and data["run_id"] == "0190-build/0190-job"
    assert data["run"]["step_key"] == "cpu_unit" and data["env"].get("TOKENIZERS_PARALLELISM") in (None, "false")
    for path in (tmp_path / "artifacts").rglob("*"):
        if path.is_file():
            body = path.read_bytes()
            assert TOKEN.encode() not in body and b"bkagent-secret" not in body, path
    assert TOKEN not in out


def test_pytest_arguments_follow_nox_convention():
    p = cli.parser("tests", "x")
    args = cli.parse(p, ["-k", "classify and not slow", "-v", "tests/test_secrets.py"])
    assert args.pytest_args == ["-k", "classify and not slow", "-v", "tests/test_secrets.py"]
    p = cli.parser("cpu_unit", "x", shards=True, model_source=True)
    args = cli.parse(p, ["--model-source", "fixture", "-k", "ngram", "--num-shards=2", "--", "--model-source"])
    assert (args.model_source, args.num_shards, args.pytest_args) == ("fixture", 2, ["-k", "ngram", "--model-source"])
    with pytest.raises(cli.BadInput, match="invalid choice"):
        cli.parse(p, ["--model-source", "cloud"])


def test_exit_codes_combine_to_the_most_severe():
    assert exitcodes.worst() == 0 and exitcodes.worst(0, 75, 2) == 2 and exitcodes.worst(75, 1) == 1
    assert exitcodes.worst(0, -9) == 1 and exitcodes.worst(75, 0) == 75
    assert [exitcodes.from_pytest(c) for c in range(6)] == [0, 1, 1, 1, 2, 1]


def test_a_wrapper_rerun_of_the_same_job_keeps_the_earlier_attempt(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path))
    job = {"BUILDKITE_BUILD_ID": "b", "BUILDKITE_JOB_ID": "j"}
    first = summary.begin("cpu_unit", environ=job)
    first["tests"] = [{"nodeid": "t.py::a", "outcome": "failed", "cause": "cache-miss", "reason": "offline",
                       "time_s": 1.0}]
    summary.finish(first, 75)
    second = summary.begin("cpu_unit", environ={**job, summary.ATTEMPT_VAR: "2"})
    assert second["run"]["attempt"] == 2
    assert second["earlier_attempts"] == [{"attempt": 1, "status": "finished", "exit_code": 75, "failed": ["t.py::a"]}]
    other_job = summary.begin("cpu_unit", environ={"BUILDKITE_BUILD_ID": "b", "BUILDKITE_JOB_ID": "k",
                                                   summary.ATTEMPT_VAR: "2"})
    assert other_job["earlier_attempts"] == []
