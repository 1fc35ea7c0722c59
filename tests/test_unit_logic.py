"""cpu_unit's logic: causes for every non-pass, exit codes, attempts, redirects and the summary.

Results come from real pytest runs over small crafted test files; the end-to-end run
drives `python -m specgate.sessions.unit` over a crafted vLLM checkout, with a cache miss
fixed online by tests/hubserver.py. No vLLM engine starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from contract import read_valid
from hubserver import HubServer, Repo, hf_env

from specgate.contract import summary
from specgate.core import envpin
from specgate.core.manifest import REPO_ROOT, Redirect, load
from specgate.sessions import pytestrun
from specgate.sessions.unit import session as unit

REPO_ID = "acme/tiny-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TORCHVISION_RECORD = [{"package": "torchvision", "action": "removed", "reason": "failed to import beside torch+cpu"}]
SUMMARY_KEYS = {"upstream", "files", "files_run", "files_source", "drift", "notes", "redirects", "runs"}


def _outcome(outcome: str, cause: str | None = None, declared_by: str | None = None, nodeid: str = "t.py::x",
             attempt: int = 1) -> unit.Outcome:
    return unit.Outcome(pytestrun.TestResult(nodeid, outcome, "", "", 0.0), attempt, "main", cause, cause and "why",
                        declared_by)


# --------------------------------------------------------------------------- exit codes

@pytest.mark.parametrize("outcomes, code", [
    ([("passed", None, None)], 0),
    ([("passed", None, None), ("skipped", "env-blocked", unit.SKIP_DECLARES),
      ("skipped", unit.UPSTREAM_SKIP, unit.SKIP_DECLARES)], 0),
    ([("error", "env-blocked", "torch probe: torchvision removed")], 0),
    ([("error", "env-blocked", None)], 75),
    ([("failed", "cache-miss", None), ("failed", "transient", None), ("failed", "auth", None)], 75),
    ([("failed", "cache-miss", None), ("failed", "failure", None)], 1),
    ([("error", "failure", None), ("skipped", "env-blocked", unit.SKIP_DECLARES)], 1),
    ([("failed", "a-cause-nobody-knows", None)], 1),
    ([], 0),
])
def test_exit_code(outcomes, code):
    assert unit.exit_code([_outcome(*o) for o in outcomes]) == code


# --------------------------------------------------------------------------- causes, from real pytest results

CRAFTED = {
    "test_causes.py": f"""
        import pytest

        def test_passes():
            pass

        def test_asserts():
            assert 1 + 1 == 3, "arithmetic is broken"

        @pytest.mark.skip(reason="Requires CUDA")
        def test_needs_cuda():
            pass

        @pytest.mark.skip(reason="optional tests are run with --optional")
        def test_optional():
            pass

        def test_hub_file_not_cached():
            from huggingface_hub import hf_hub_download
            hf_hub_download("acme/not-cached", "config.json", revision="{COMMIT}")
    """,
    "test_vision.py": "import torchvision  # the collection error vLLM's minimax_m3 import causes here\n",
}


@pytest.fixture(scope="module")
def crafted_results(tmp_path_factory) -> dict[str, pytestrun.TestResult]:
    root = tmp_path_factory.mktemp("crafted")
    for name, text in CRAFTED.items():
        (root / name).write_text(textwrap.dedent(text))
    # torchvision as a venv without it shows it, even where a CPU build is installed
    (root / "torchvision.py").write_text("raise ModuleNotFoundError(\"No module named 'torchvision'\")\n")
    env = hf_env("http://127.0.0.1:9", root / "hf", HF_HUB_OFFLINE="1")
    env.pop("SPECGATE_SESSION", None)
    junit = root / "junit.xml"
    pytestrun.run_pytest([*unit.pytest_args(60, False, ["-q"]), *CRAFTED], junit, cwd=root, env=env)
    return {r.nodeid.split("::")[-1]: r for r in pytestrun.read_junit(junit)}


def test_every_non_pass_gets_a_cause_and_a_reason(crafted_results):
    assert set(crafted_results) == {"test_passes", "test_asserts", "test_needs_cuda", "test_optional",
                                    "test_hub_file_not_cached", "test_vision.py"}
    causes = {name: unit.explain(r, [], offline=True) for name, r in crafted_results.items()}
    assert causes["test_passes"] == (None, None, None)
    assert causes["test_asserts"][0] == "failure" and causes["test_asserts"][2] is None
    assert causes["test_needs_cuda"][0] == "env-blocked" and "CUDA" in causes["test_needs_cuda"][1]
    assert causes["test_needs_cuda"][2] == unit.SKIP_DECLARES
    assert causes["test_optional"] == (unit.UPSTREAM_SKIP, "optional tests are run with --optional",
                                       unit.SKIP_DECLARES)
    assert causes["test_hub_file_not_cached"][0] == "cache-miss"
    assert crafted_results["test_vision.py"].outcome == "error"  # a collection error, by file
    label, reason, declared = causes["test_vision.py"]
    assert label == "env-blocked" and "torchvision" in reason and declared is None
    for name, (label, reason, _) in causes.items():
        assert name == "test_passes" or (label and reason), name


def test_a_missing_module_is_declared_only_by_the_torch_probe_record(crafted_results):
    vision = crafted_results["test_vision.py"]
    _, _, declared = unit.explain(vision, TORCHVISION_RECORD)
    assert declared.startswith("torch probe: torchvision removed")
    other = [{"package": "torchaudio", "action": "removed", "reason": "x"}]
    assert unit.explain(vision, other)[2] is None
    assert unit.declaring_record("No module named 'torchvision_extra'", TORCHVISION_RECORD) is None


# --------------------------------------------------------------------------- attempts

def test_a_rerun_replaces_attempt_one_and_keeps_it_inside():
    first = [_outcome("passed", nodeid="a.py::ok"), _outcome("failed", "cache-miss", nodeid="a.py::hub"),
             _outcome("error", "cache-miss", nodeid="b.py")]  # b.py failed to collect on attempt 1
    second = [_outcome("passed", nodeid="a.py::hub", attempt=2), _outcome("passed", nodeid="b.py::t1", attempt=2),
              _outcome("failed", "transient", nodeid="b.py::t2", attempt=2)]
    final = unit.merge_attempts(first, second)
    assert [(o.nodeid, o.attempt) for o in final] == [
        ("a.py::ok", 1), ("a.py::hub", 2), ("b.py::t1", 2), ("b.py::t2", 2)]
    assert final[1].entry()["earlier"] == [
        {"attempt": 1, "nodeid": "a.py::hub", "outcome": "failed", "cause": "cache-miss", "reason": "why"}]
    assert final[3].earlier[0]["nodeid"] == "b.py"
    assert "earlier" not in final[0].entry()
    assert unit.exit_code(final) == 75


def test_merged_junit_keeps_the_attempt_of_every_test(tmp_path):
    runs = []
    for attempt, body in ((1, "def test_a(): pass\ndef test_b(): assert 0\n"), (2, "def test_b(): pass\n")):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        (folder / "test_m.py").write_text(body)
        junit = folder / "junit.xml"
        code = pytestrun.run_pytest(["-q", "-p", "no:cacheprovider", "test_m.py"], junit, cwd=folder,
                                    env={k: v for k, v in os.environ.items() if k != "SPECGATE_SESSION"})
        runs.append(unit.Run(unit.Group("main", ["test_m.py"], {}), attempt, code, 0.0, junit,
                             pytestrun.read_junit(junit), offline=attempt == 1))
    unit.merge_junit(runs, tmp_path / "junit.xml")
    from junitparser import JUnitXml

    merged = JUnitXml.fromfile(str(tmp_path / "junit.xml"))
    seen = [(case.name, case._elem.get("attempt"), suite.name) for suite in merged for case in suite]
    assert seen == [("test_a", "1", "cpu_unit attempt 1 (main)"), ("test_b", "1", "cpu_unit attempt 1 (main)"),
                    ("test_b", "2", "cpu_unit attempt 2 (main)")]


# --------------------------------------------------------------------------- redirects

NGRAM = "tests/v1/spec_decode/test_ngram.py::test_ngram_proposer"


def _plan(path: str | None, tests=(NGRAM,), checkpoint="facebook/opt-125m") -> unit.RedirectPlan:
    redirect = Redirect(checkpoint, "tiny-qwen3", tuple(tests), "reads max_model_len only")
    return unit.RedirectPlan(redirect, "fixture" if path else "hub", "fixture" if path else "cached", "", path,
                             list(tests))


def test_redirects_reach_only_declared_tests_and_only_when_applied(tmp_path):
    plans = [_plan("/fixtures/tiny-qwen3"), _plan(None, tests=["tests/x.py::test_cached"], checkpoint="acme/cached")]
    mapping = unit.redirect_map(plans)
    assert mapping == {NGRAM: {"facebook/opt-125m": "/fixtures/tiny-qwen3"}}
    [main] = unit.groups_for(["tests/v1/spec_decode/test_ngram.py", "tests/x.py"], mapping, tmp_path)
    assert main.env[unit.REDIRECT_VAR] is None  # removed even if the user set it: no undeclared redirect
    assert main.targets == ["tests/v1/spec_decode/test_ngram.py", "tests/x.py"] and main.redirect == mapping
    per_test = json.loads(Path(main.env[unit.REDIRECTS_MAP_VAR]).read_text())
    assert list(per_test) == [NGRAM]  # the plugin sets the variable around this test only
    assert json.loads(Path(per_test[NGRAM]).read_text()) == {"facebook/opt-125m": "/fixtures/tiny-qwen3"}
    assert [p.entry()["applied"] for p in plans] == [True, False]


def test_no_applied_redirect_means_one_plain_group(tmp_path):
    groups = unit.groups_for(["a.py"], unit.redirect_map([_plan(None)]), tmp_path)
    assert [(g.name, g.env, g.redirect) for g in groups] == [("main", {unit.REDIRECT_VAR: None}, None)]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.vllm
def test_vllm_reads_the_redirect_file_we_write(tmp_path):
    """vLLM's own maybe_model_redirect maps the declared checkpoint and nothing else."""
    fixture = tmp_path / "tiny-qwen3"
    fixture.mkdir()
    path = tmp_path / "redirect.json"
    path.write_text(unit.redirect_file_text({"facebook/opt-125m": str(fixture)}))
    code = ("from vllm.transformers_utils.utils import maybe_model_redirect as r\n"
            "print(r('facebook/opt-125m')); print(r('Qwen/Qwen3-0.6B'))")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", unit.REDIRECT_VAR: str(path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=tmp_path)
    assert out.stdout.split() == [str(fixture), "Qwen/Qwen3-0.6B"]


# --------------------------------------------------------------------------- summary and report

def test_summary_keys_and_the_human_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
    final = [_outcome("passed", nodeid="a.py::ok"),
             _outcome("skipped", "env-blocked", unit.SKIP_DECLARES, nodeid="a.py::cuda"),
             _outcome("failed", "failure", nodeid="a.py::bad")]
    pinned = pytestrun.child_env(envpin.session_env(load(), unit.SESSION))   # what the session process sees
    record = summary.begin(unit.SESSION, env=envpin.session_report(load(), unit.SESSION, pinned))
    record.update({"tests": [o.entry() for o in final], "redirects": [_plan("/fixtures/tiny-qwen3").entry()],
                   "degraded": TORCHVISION_RECORD})
    print(unit.report(record, unit.exit_code(final)))
    summary.finish(record, unit.exit_code(final))
    written = read_valid(tmp_path / "cpu_unit" / "summary.json")
    assert written["exit_code"] == 1
    assert written["counts"] == {"executed": 2, "passed": 1, "failed": 1, "errors": 0, "skipped": 1, "xfailed": 0}
    for test in written["tests"]:
        assert {"nodeid", "outcome", "cause", "reason", "attempt"} <= set(test)
        assert (test["cause"] is None) == (test["outcome"] == "passed")
        assert (test["reason"] is None) == (test["cause"] is None)
    assert written["redirects"][0]["applied"] and written["degraded"] == TORCHVISION_RECORD
    assert written["env"]["HF_HUB_OFFLINE"] == "1" and written["env"]["HF_TOKEN"] == "***"
    assert "hf_secret_value_123" not in (tmp_path / "cpu_unit" / "summary.json").read_text()
    shown = capsys.readouterr().out
    assert "2 executed, 1 passed, 1 failed, 0 errors, 1 skipped, 0 xfailed -> exit 1" in shown
    assert "a.py::bad" in shown and "a.py::cuda" in shown and "a.py::ok" not in shown
    assert "redirect facebook/opt-125m -> fixture tiny-qwen3: applied" in shown and "degraded: torchvision" in shown


# --------------------------------------------------------------------------- end to end

CHECKOUT = {
    ".buildkite/hardware_tests/cpu.yaml": """
        steps:
        - key: cpu-spec-decode-tests
          commands:
          - |
            bash run-cpu-test.sh 30m "
            pytest -x -v -s \\
            tests/v1/spec_decode/test_ngram.py \\
            tests/v1/test_misc.py
            unset VLLM_CPU_CI_ENV
            pytest -x -v -s tests/v1/e2e/test_cpu_spec_decode.py"
    """,
    "tests/__init__.py": "",
    "tests/v1/spec_decode/test_ngram.py": """
        import json, os

        def _redirects():
            path = os.environ.get("VLLM_MODEL_REDIRECT_PATH")
            return json.loads(open(path).read()) if path else {}

        def test_ngram_proposer():  # declared in the manifest: runs on the fixture
            folder = _redirects()["facebook/opt-125m"]
            assert os.path.isfile(os.path.join(folder, "config.json"))
            assert os.environ["HF_HUB_OFFLINE"] == "1"

        def test_same_checkpoint_undeclared():  # the same file, not declared: never redirected
            assert _redirects() == {}
    """,
    "tests/v1/test_misc.py": f"""
        import pytest

        def test_passes():
            pass

        @pytest.mark.skip(reason="Requires CUDA")
        def test_needs_cuda():
            pass

        def test_reads_the_hub():  # a cache miss offline; fixed by the online rerun
            from huggingface_hub import hf_hub_download
            hf_hub_download("{REPO_ID}", "config.json", revision="{COMMIT}")
    """,
}


@pytest.mark.vllm
def test_session_end_to_end_over_a_crafted_checkout(tmp_path):
    checkout = tmp_path / "vllm"
    for name, text in CHECKOUT.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(textwrap.dedent(text))
    user_redirect = tmp_path / "user-redirect.json"
    user_redirect.write_text(json.dumps({"facebook/opt-125m": "/somewhere/else"}))
    with HubServer([Repo(REPO_ID, COMMIT, {"config.json": b'{"model_type": "qwen3"}'})]) as hub:
        env = hf_env(hub.endpoint, tmp_path / "hf", SPECGATE_ARTIFACTS=str(tmp_path / "artifacts"),
                     SPECGATE_CACHE_DIR=str(tmp_path / "cache"), VLLM_MODEL_REDIRECT_PATH=str(user_redirect))
        env.pop("SPECGATE_SESSION", None)
        proc = subprocess.run([sys.executable, "-m", "specgate.sessions.unit", "--vllm-source-dir", str(checkout),
                               "--model-source", "auto"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              check=False)
        online_requests = hub.total_requests()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_valid(tmp_path / "artifacts" / "cpu_unit" / "summary.json")
    assert set(summary) >= SUMMARY_KEYS and summary["files_source"] == "upstream-pipeline"
    assert summary["files"] == ["tests/v1/spec_decode/test_ngram.py", "tests/v1/test_misc.py"]
    assert summary["drift"]["added"] == ["tests/v1/test_misc.py"] and len(summary["drift"]["removed"]) == 13
    assert summary["counts"] == {"executed": 4, "passed": 4, "failed": 0, "errors": 0, "skipped": 1, "xfailed": 0}
    tests = {t["nodeid"].split("::")[-1]: t for t in summary["tests"]}
    assert tests["test_ngram_proposer"]["redirect"]["facebook/opt-125m"] == summary["redirects"][0]["path"]
    assert tests["test_same_checkpoint_undeclared"]["redirect"] is None
    assert tests["test_needs_cuda"]["cause"] == "env-blocked" and "CUDA" in tests["test_needs_cuda"]["reason"]
    hub_test = tests["test_reads_the_hub"]
    assert hub_test["outcome"] == "passed" and hub_test["attempt"] == 2
    assert hub_test["earlier"][0]["cause"] == "cache-miss"
    assert online_requests > 0
    assert [(r["group"], r["attempt"]) for r in summary["runs"]] == [("main", 1), ("main", 2)]
    assert "drift vs manifest unit.files:" in proc.stdout and "rerunning 1 cache-miss test(s) online" in proc.stdout


def _session(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = hf_env("http://127.0.0.1:9", tmp_path / "hf", SPECGATE_ARTIFACTS=str(tmp_path / "artifacts"),
                 SPECGATE_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("SPECGATE_SESSION", None)
    proc = subprocess.run([sys.executable, "-m", "specgate.sessions.unit", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, check=False)
    summary = tmp_path / "artifacts" / "cpu_unit" / "summary.json"
    return proc, read_valid(summary) if summary.is_file() else None


def _crafted_checkout(tmp_path: Path, pipeline: str) -> Path:
    checkout = tmp_path / "vllm"
    for name, text in {**CHECKOUT, ".buildkite/hardware_tests/cpu.yaml": pipeline}.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(textwrap.dedent(text))
    return checkout


def test_bad_source_dir_is_one_line_and_exit_2(tmp_path):
    proc, summary = _session(tmp_path, "--vllm-source-dir", str(tmp_path / "nowhere"))
    assert proc.returncode == 2
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not a vLLM checkout" in errors[0]
    assert summary["exit_code"] == 2 and summary["tests"] == []


def test_missing_upstream_step_is_exit_1_unless_the_pinned_list_is_asked_for(tmp_path):
    checkout = _crafted_checkout(tmp_path, "steps:\n- key: cpu-kernel-tests\n  commands: ['pytest tests/k.py']\n")
    proc, summary = _session(tmp_path, "--vllm-source-dir", str(checkout))
    assert proc.returncode == 1 and "no step with key 'cpu-spec-decode-tests'" in summary["error"]
    assert "--pinned-files" in summary["error"] and summary["files"] == []
    # the pinned list is taken when asked for; here its files are absent from the crafted tree
    proc, summary = _session(tmp_path, "--vllm-source-dir", str(checkout), "--pinned-files")
    assert proc.returncode == 1 and summary["notes"] == [] and "13 listed test file(s) missing" in summary["error"]


def test_an_empty_shard_runs_nothing_and_says_so(tmp_path):
    checkout = _crafted_checkout(tmp_path, CHECKOUT[".buildkite/hardware_tests/cpu.yaml"])
    proc, summary = _session(tmp_path, "--vllm-source-dir", str(checkout), "--num-shards", "3", "--shard-id", "2")
    assert proc.returncode == 0 and "shard 2 of 3: no files to run" in proc.stdout
    assert summary["files_run"] == [] and summary["runs"] == [] and len(summary["files"]) == 2
    assert summary["shard"] == {"num_shards": 3, "shard_id": 2} and summary["counts"]["executed"] == 0
