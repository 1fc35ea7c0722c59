"""`python -m specgate.gate` on synthetic histories of cpu_unit and cpu_e2e summaries."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from specgate import gate, pytestrun

REPO = Path(__file__).resolve().parent.parent
START = datetime(2026, 11, 1, 6, 0, tzinfo=timezone.utc)
UNIT_TESTS = ["tests/v1/spec_decode/test_ngram.py::test_ngram_proposer",
              "tests/v1/spec_decode/test_eagle_draft_attn_metadata.py::test_metadata[2]"]
E2E_TESTS = ["tests/e2e/test_spec_decode.py::test_acceptance[eagle3-tiny-qwen3]",
             "tests/e2e/test_spec_decode.py::test_acceptance[ngram-tiny-qwen3]"]


def unit_summary(day: int, *, exit_code: int = 0, version: str = "0.32.0", **outcomes) -> dict:
    """A cpu_unit summary; outcomes maps a test index ('t0', 't1') to (outcome, cause, reason)."""
    tests = []
    for index, nodeid in enumerate(UNIT_TESTS):
        outcome, cause, reason = outcomes.get(f"t{index}", ("passed", None, None))
        tests.append({"nodeid": nodeid, "outcome": outcome, "cause": cause, "reason": reason})
    tests.append({"nodeid": "tests/v1/worker/test_gpu_batch_ordering.py::test_cuda_graphs", "outcome": "skipped",
                  "cause": None, "reason": "requires CUDA"})
    return {"session": "cpu_unit", "vllm_version": version, "exit_code": exit_code,
            "finished_at": (START + timedelta(days=day)).isoformat(), "tests": tests}


def e2e_summary(day: int, *, exit_code: int = 0, version: str = "0.32.0", skip_reason: str | None = "env-blocked: "
                "torchvision is not importable (No module named 'torchvision')") -> dict:
    results = [{"test": t, "method": t.split("[")[1].split("-")[0], "outcome": "passed", "skip_reason": None,
                "acceptance_len": 3.9, "threshold": 3.5} for t in E2E_TESTS]
    results.append({"test": "tests/e2e/test_spec_decode.py::test_acceptance[mtp-qwen3_5]", "method": "mtp",
                    "outcome": "skipped", "skip_reason": skip_reason, "acceptance_len": None, "threshold": 2.0})
    return {"session": "cpu_e2e", "vllm_version": version, "exit_code": exit_code,
            "finished_at": (START + timedelta(days=day, hours=1)).isoformat(), "results": results}


def write_history(root: Path, summaries: list[dict]) -> Path:
    """One folder per build, as downloaded artifacts land: <build>/artifacts/<session>/summary.json.
    Build folders are named so that their alphabetical order is not their time order."""
    history = root / "history"
    for index, summary in enumerate(summaries):
        folder = history / f"build-{(7 * index) % 11:02d}-{index}" / "artifacts" / summary["session"]
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps(summary))
    return history


def clean_history(days: int = 5) -> list[dict]:
    return [s for day in range(days) for s in (unit_summary(day), e2e_summary(day))]


@pytest.fixture(autouse=True)
def artifacts_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "artifacts"
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(root))
    return root


def run_gate(tmp_path: Path, summaries: list[dict], *args: str) -> tuple[int, str]:
    history = write_history(tmp_path, summaries)
    code = gate.main(["--history", str(history), *args])
    return code, history


def written(artifacts_root: Path) -> dict:
    return json.loads((artifacts_root / "gate" / "summary.json").read_text())


def test_five_clean_runs_graduate(tmp_path, capsys, artifacts_root):
    code, _ = run_gate(tmp_path, clean_history())
    out = capsys.readouterr().out
    assert code == 0, out
    assert "cpu_unit: may drop soft_fail: the last 5 runs are clean, none flaky, every skip explained" in out
    assert "cpu_e2e: may drop soft_fail" in out
    assert out.count(" clean ") >= 10  # the evidence table shows every run of the window
    summary = written(artifacts_root)
    assert summary["session"] == "gate" and summary["graduates"] is True and summary["exit_code"] == 0
    assert [s["consecutive_clean"] for s in summary["steps"]] == [5, 5]
    assert [len(s["window"]) for s in summary["steps"]] == [5, 5]


def test_a_recent_failure_blocks(tmp_path, capsys, artifacts_root):
    history = clean_history(6)
    history[-2] = unit_summary(5, exit_code=1, t1=("failed", "failure", "failure: AssertionError: assert 3 == 4"))
    code, _ = run_gate(tmp_path, history)
    out = capsys.readouterr().out
    assert code == 1
    assert "cpu_unit: keep soft_fail: only 0 consecutive clean run(s), 5 needed: the run of 2026-11-06T06:00:00+00:00" in out
    assert "has exit 1, 1 test(s) with cause failure" in out
    assert "cpu_e2e: may drop soft_fail" in out  # steps are judged on their own
    assert written(artifacts_root)["steps"][0]["graduates"] is False
    junit = {r.nodeid.split("::")[-1]: r for r in pytestrun.read_junit(artifacts_root / "gate" / "junit.xml")}
    assert junit["cpu_unit may drop soft_fail"].outcome == "failed"
    assert junit["cpu_e2e may drop soft_fail"].outcome == "passed"


def test_a_failure_cause_blocks_even_with_exit_0(tmp_path, capsys):
    history = clean_history()
    history[4] = unit_summary(2, exit_code=0, t0=("failed", "failure", "failure: TypeError: propose()"))
    code, _ = run_gate(tmp_path, history, "--step", "cpu_unit")
    assert code == 1
    assert "only 2 consecutive clean run(s)" in capsys.readouterr().out


def test_an_old_failure_outside_the_window_does_not_block(tmp_path, capsys):
    history = [unit_summary(0, exit_code=1, t0=("failed", "failure", "failure: crashed"))]
    history += [unit_summary(day) for day in range(1, 6)]
    code, _ = run_gate(tmp_path, history, "--step", "cpu_unit")
    assert code == 0, capsys.readouterr().out


def test_a_flaky_test_blocks(tmp_path, capsys):
    history = clean_history()
    # Failed once on an environment cause (exit 75, so the run itself is clean) and passed elsewhere.
    history[4] = unit_summary(2, exit_code=75, t0=("failed", "env-blocked", "env-blocked: Triton CPU backend missing"))
    code, _ = run_gate(tmp_path, history)
    out = capsys.readouterr().out
    assert code == 1
    assert f"cpu_unit: keep soft_fail: flaky: {UNIT_TESTS[0]} passed and failed on vLLM 0.32.0" in out


def test_pass_and_fail_on_different_vllm_versions_is_not_flaky(tmp_path, capsys):
    history = [unit_summary(day, version="0.32.0") for day in range(3)]
    history += [unit_summary(day, version="0.33.0", exit_code=75,
                             t0=("failed", "env-blocked", "env-blocked: torchvision is not importable"))
                for day in range(3, 5)]
    code, _ = run_gate(tmp_path, history, "--step", "cpu_unit")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(note: 2 of them exited 75, which fails the build once soft_fail is gone)" in out


def test_an_unexplained_skip_blocks(tmp_path, capsys):
    history = clean_history()
    history[3] = e2e_summary(1, skip_reason="  ")
    code, _ = run_gate(tmp_path, history)
    out = capsys.readouterr().out
    assert code == 1
    assert ("cpu_e2e: keep soft_fail: unexplained skip: tests/e2e/test_spec_decode.py::test_acceptance[mtp-qwen3_5] "
            "skipped without a reason") in out
    assert "cpu_unit: may drop soft_fail" in out


def test_too_few_runs(tmp_path, capsys):
    code, _ = run_gate(tmp_path, clean_history(4))
    out = capsys.readouterr().out
    assert code == 1
    assert "cpu_unit: keep soft_fail: only 4 run(s) in the history, 5 needed" in out
    assert run_gate(tmp_path / "fewer", clean_history(4), "--runs", "4")[0] == 0


def test_other_sessions_are_ignored(tmp_path, capsys):
    extra = [{"session": "gate", "exit_code": 1, "finished_at": START.isoformat(), "steps": []},
             {"session": "warm_cache", "exit_code": 75}]
    code, _ = run_gate(tmp_path, clean_history() + extra)
    assert code == 0, capsys.readouterr().out


@pytest.mark.parametrize("content,message", [
    ('{"session": "cpu_unit", "tests": [', "not readable JSON"),
    ('["cpu_unit"]', "not a JSON object"),
    ('{"session": "cpu_unit", "finished_at": "2026-11-09T06:00:00+00:00", "tests": []}', "exit_code must be an integer"),
    ('{"session": "cpu_e2e", "exit_code": 0, "finished_at": "yesterday", "results": []}', "is not an ISO time"),
    ('{"session": "cpu_e2e", "exit_code": 0, "finished_at": "2026-11-09T06:00:00", "results": [{"outcome": "passed"}]}',
     "'results' must be a list of objects with 'test' and 'outcome'"),
])
def test_a_malformed_summary_exits_2_naming_the_file(tmp_path, capsys, content, message):
    history = write_history(tmp_path, clean_history())
    bad = history / "build-99" / "cpu_unit" / "summary.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(content)
    assert gate.main(["--history", str(history)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"error: {bad}: ") and message in out[0]


def test_a_missing_folder_exits_2(tmp_path, capsys):
    assert gate.main(["--history", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().out.strip() == f"error: history folder {tmp_path / 'nowhere'} does not exist"


def test_as_a_module_with_the_default_history(tmp_path, artifacts_root):
    """`python -m specgate.gate` reads SPECGATE_ARTIFACTS/history by default."""
    write_history(artifacts_root, clean_history(2))
    env = {"SPECGATE_ARTIFACTS": str(artifacts_root), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "specgate.gate", "--runs", "2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"== gate: summary written to {artifacts_root / 'gate' / 'summary.json'} -> exit 0 ==" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "specgate.gate", "--runs", "0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--runs must be at least 1" in proc.stderr
