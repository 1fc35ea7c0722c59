"""`nox -s gate` (specgate.sessions.gate) on synthetic histories of cpu_unit and cpu_e2e summaries
(tests/histories.py: schema-checked as built, passing the real manifest's coverage floors
unless a test says otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from contract import assert_valid, read_valid
from histories import NGRAM, VERSION, build, clean_history, entry, job, passing, vllm_build, write_history

from specgate.contract import summary
from specgate.core import manifest
from specgate.sessions import pytestrun
from specgate.sessions.gate import session as gate

REPO = Path(__file__).resolve().parent.parent
GATE = manifest.load().gate


@pytest.fixture(autouse=True)
def artifacts_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "artifacts"
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(root))
    for var in ("BUILDKITE_BUILD_ID", "BUILDKITE_JOB_ID", "SPECGATE_RUN_ID", "SPECGATE_ATTEMPT"):
        monkeypatch.delenv(var, raising=False)
    return root


def run_gate(tmp_path: Path, capsys, summaries: list[dict], *args: str) -> tuple[int, str]:
    history = write_history(tmp_path, summaries)
    code = gate.main(["--history", str(history), *args])
    return code, capsys.readouterr().out


def written(artifacts_root: Path) -> dict:
    record = json.loads((artifacts_root / "gate" / "summary.json").read_text())
    assert_valid(record)
    return record


def blockers(artifacts_root: Path, step: str) -> list[str]:
    return next(s for s in written(artifacts_root)["steps"] if s["step"] == step)["blockers"]


def test_five_clean_builds_graduate(tmp_path, capsys, artifacts_root):
    code, out = run_gate(tmp_path, capsys, clean_history())
    assert code == 0, out
    for step in gate.STEPS:
        assert (f"{step}: may drop soft_fail: the last 5 runs are clean (all shards finished with exit 0, "
                f"coverage kept), none flaky, p90 wall 300 s under the {GATE.budget_s[step]} s budget, "
                "every skip explained") in out
    rows = [line for line in out.splitlines() if line.startswith(("cpu_unit ", "cpu_e2e "))]
    assert len(rows) == 10 and all(" 2/2 " in row and " 0,0 " in row and row.endswith("clean") for row in rows)
    assert rows[0].split()[1:3] == ["build", "5"]   # newest first
    record = written(artifacts_root)
    assert record["session"] == "gate" and record["status"] == "finished" and record["exit_code"] == 0
    assert [(t["nodeid"], t["outcome"], t["cause"], t["reason"]) for t in record["tests"]] == [
        ("gate::cpu_unit", "passed", None, None), ("gate::cpu_e2e", "passed", None, None)]
    unit = record["steps"][0]
    assert unit["runs_in_history"] == 5 and unit["p90_wall_s"] == 300.0 and unit["budget_s"] == 1800
    assert [run["run"] for run in unit["window"]] == [f"build {n}" for n in (5, 4, 3, 2, 1)]
    assert all(run["clean"] and len(run["shards"]) == 2 for run in unit["window"])
    junit = {r.nodeid.split("::")[-1]: r.outcome for r in pytestrun.read_junit(artifacts_root / "gate" / "junit.xml")}
    assert junit == {"cpu_unit may drop soft_fail": "passed", "cpu_e2e may drop soft_fail": "passed"}


def test_shards_of_one_build_count_once(tmp_path, capsys, artifacts_root):
    code, out = run_gate(tmp_path, capsys, clean_history(builds=3, shards=4))
    assert code == 1
    assert "  - not enough evidence: 3 run(s) in the history, 5 needed" in out
    assert blockers(artifacts_root, "cpu_unit") == ["not enough evidence: 3 run(s) in the history, 5 needed"]
    assert run_gate(tmp_path / "fewer", capsys, clean_history(builds=3, shards=4), "--runs", "3")[0] == 0


def test_runs_needed_come_from_the_manifest(tmp_path, capsys, artifacts_root):
    assert GATE.runs == 5
    code, _ = run_gate(tmp_path, capsys, clean_history(builds=6))
    assert code == 0 and written(artifacts_root)["runs_needed"] == 5


def test_a_missing_shard_blocks(tmp_path, capsys, artifacts_root):
    history = [s for s in clean_history() if not (s["session"] == "cpu_e2e" and s["run"]["build_number"] == "4"
                                                  and s["shard"]["shard_id"] == 1)]
    code, out = run_gate(tmp_path, capsys, history)
    assert code == 1
    assert "cpu_unit: may drop soft_fail" in out     # steps are judged on their own
    [blocker] = blockers(artifacts_root, "cpu_e2e")
    assert blocker.startswith("build 4 (2026-11-05T07:00:00+00:00) not clean: shard(s) 1 of 2 missing")
    assert " 1/2 " in next(line for line in out.splitlines() if line.startswith("cpu_e2e   build 4"))


def test_a_run_that_exited_75_blocks_and_is_listed(tmp_path, capsys, artifacts_root):
    history = [s for s in clean_history() if not (s["session"] == "cpu_unit" and s["run"]["build_number"] in ("2", "4")
                                          and s["shard"]["shard_id"] == 0)]
    history += [job("cpu_unit", n, shards=2, exit_code=75) for n in (2, 4)]
    code, out = run_gate(tmp_path, capsys, history)
    assert code == 1
    found = blockers(artifacts_root, "cpu_unit")
    assert "exited 75 (environment or cache incomplete, green today only by soft_fail): build 4, build 2" in found
    assert any(b.startswith("build 4 ") and "not clean: shard 0 exited 75" in b for b in found)
    assert " 75,0 " in next(line for line in out.splitlines() if line.startswith("cpu_unit  build 4"))


def test_a_run_that_executed_nothing_blocks(tmp_path, capsys, artifacts_root):
    skipped = [entry(f"{NGRAM}::test_{i}", "skipped", "env-blocked", "requires CUDA") for i in range(3)]
    history = clean_history()[4:] + [job("cpu_unit", 1, tests=skipped), job("cpu_e2e", 1, tests=[])]
    code, _ = run_gate(tmp_path, capsys, history)
    assert code == 1
    for step in gate.STEPS:
        [blocker] = blockers(artifacts_root, step)
        assert "not clean: executed no test; below the coverage floor" in blocker


def test_a_lost_file_blocks(tmp_path, capsys, artifacts_root):
    history = clean_history()
    lost = [t for t in passing("cpu_unit") if not t["nodeid"].startswith(NGRAM)]
    fewer = [t for t in passing("cpu_unit") if t["nodeid"] != f"{NGRAM}::test_0"]
    history += [job("cpu_unit", 6, tests=lost), job("cpu_unit", 7, tests=fewer)]
    code, _ = run_gate(tmp_path, capsys, history)
    assert code == 1
    assert blockers(artifacts_root, "cpu_unit") == [
        f"build 7 (2026-11-08T06:00:00+00:00) not clean: below the coverage floor (passed/floor): {NGRAM} 1/2",
        f"build 6 (2026-11-07T06:00:00+00:00) not clean: below the coverage floor (passed/floor): {NGRAM} 0/2"]


def test_a_vllm_version_without_floors_is_not_judged_and_does_not_graduate(tmp_path, capsys, artifacts_root):
    code, _ = run_gate(tmp_path, capsys, clean_history() + build(6, steps=("cpu_unit",), version="0.33.0"))
    assert code == 1
    [blocker] = blockers(artifacts_root, "cpu_unit")
    assert blocker == ('build 6 not judged: no floors recorded for vLLM 0.33.0 '
                       '(manifest [gate.coverage."0.33.0".cpu_unit]; record them with nox -s gate -- --record)')
    [unit] = [s for s in json.loads((artifacts_root / "gate" / "summary.json").read_text())["steps"]
              if s["step"] == "cpu_unit"]
    assert unit["window"][0]["mark"] == "not judged" and unit["window"][0]["clean"] is True


def test_record_writes_the_floors_of_a_version_without_them_from_its_runs(tmp_path, capsys, artifacts_root):
    """Two 0.33.0 builds, one with a test fewer in the ngram file: the floor is the fewer."""
    fewer = [t for t in passing("cpu_unit") if t["nodeid"] != f"{NGRAM}::test_1"]
    runs = [job("cpu_unit", 6, version="0.33.0"), job("cpu_unit", 7, version="0.33.0", tests=fewer)]
    code, out = run_gate(tmp_path, capsys, clean_history() + runs, "--step", "cpu_unit", "--record")
    assert code == 1   # recording floors judges nothing: those runs stay not judged
    text = (artifacts_root / "gate" / "floors.toml").read_text()
    assert text.startswith("# from 2 run(s) without a problem: build 7, build 6\n"
                           '[gate.coverage."0.33.0".cpu_unit]\n')
    floors = dict(line.rsplit(" = ", 1) for line in text.splitlines()[2:])
    expected = GATE.floors(VERSION, "cpu_unit")
    assert floors[f'"{NGRAM}"'] == str(expected[NGRAM] - 1) and len(floors) == len(expected)
    assert "floors: 1 table(s) in" in out


def test_a_test_that_passed_only_after_a_rerun_in_the_session_is_a_flake(tmp_path, capsys, artifacts_root):
    tests = passing("cpu_unit")
    tests[0] = entry(tests[0]["nodeid"], earlier=[{"attempt": 1, "nodeid": tests[0]["nodeid"], "outcome": "error",
                                                    "cause": "cache-miss", "reason": "cache-miss: opt-125m"}])
    code, out = run_gate(tmp_path, capsys, clean_history() + [job("cpu_unit", 6, tests=tests)])
    assert code == 1
    assert blockers(artifacts_root, "cpu_unit") == [f"flaky: {tests[0]['nodeid']} passed only after a rerun (build 6)"]
    assert f"  - flaky: {tests[0]['nodeid']} passed only after a rerun (build 6)" in out


def test_a_test_that_passed_only_after_a_wrapper_rerun_is_a_flake(tmp_path, capsys, artifacts_root):
    nodeid = f"{NGRAM}::test_1"
    earlier = [{"attempt": 1, "status": "finished", "exit_code": 1, "failed": [nodeid]}]
    code, _ = run_gate(tmp_path, capsys, clean_history() + [job("cpu_unit", 6, earlier_attempts=earlier)])
    assert code == 1
    assert blockers(artifacts_root, "cpu_unit") == [f"flaky: {nodeid} passed only after a rerun (build 6)"]


def test_a_retried_buildkite_job_counts_once_and_its_earlier_failure_is_a_flake(tmp_path, capsys, artifacts_root):
    nodeid = f"{NGRAM}::test_0"
    first = [t if t["nodeid"] != nodeid else entry(nodeid, "failed", "failure", "failure: AssertionError")
             for i, t in enumerate(passing("cpu_unit")) if i % 2 == 0]
    history = clean_history() + build(6, steps=("cpu_unit",))
    history.append(job("cpu_unit", 6, shards=2, shard=0, exit_code=1, tests=first, retry=0))
    history = [s for s in history if not (s["run"]["build_number"] == "6" and s["shard"]["shard_id"] == 0
                                          and s["exit_code"] == 0)]
    history.append(job("cpu_unit", 6, shards=2, shard=0, retry=1))
    code, out = run_gate(tmp_path, capsys, history)
    assert code == 1
    assert blockers(artifacts_root, "cpu_unit") == [f"flaky: {nodeid} passed only after a rerun (build 6)"]
    assert " 2/2 " in next(line for line in out.splitlines() if line.startswith("cpu_unit  build 6"))


def test_the_same_test_passing_and_failing_on_one_version_is_a_flake(tmp_path, capsys, artifacts_root):
    nodeid = f"{NGRAM}::test_0"
    tests = [t if t["nodeid"] != nodeid else entry(nodeid, "failed", "env-blocked", "env-blocked: no Triton")
             for t in passing("cpu_unit")]
    code, _ = run_gate(tmp_path, capsys, clean_history() + [job("cpu_unit", 6, exit_code=75, tests=tests)])
    assert code == 1
    found = blockers(artifacts_root, "cpu_unit")
    assert f"flaky: {nodeid} both passed and failed on vLLM 0.32.0 (build {vllm_build('0.32.0')['id']})" in found


def test_two_builds_sharing_a_version_string_are_two_builds_not_a_flake(tmp_path, capsys, artifacts_root):
    """A PR's changed vLLM that still says 0.32.0 fails a test the release passes: that is the
    change's failure, never a flake of the release (which the version string alone made it)."""
    nodeid = f"{NGRAM}::test_0"
    tests = [t if t["nodeid"] != nodeid else entry(nodeid, "failed", "failure", "AssertionError")
             for t in passing("cpu_unit")]
    changed = vllm_build("0.32.0", sha256="f" * 64)
    code, _ = run_gate(tmp_path, capsys, clean_history() + [job("cpu_unit", 6, exit_code=1, tests=tests,
                                                                 vllm=changed)])
    assert code == 1
    assert not [b for b in blockers(artifacts_root, "cpu_unit") if b.startswith("flaky")]


def test_passing_and_failing_on_different_versions_is_not_a_flake(tmp_path, capsys, artifacts_root):
    nodeid = f"{NGRAM}::test_0"
    tests = [t if t["nodeid"] != nodeid else entry(nodeid, "failed", "env-blocked", "env-blocked: no Triton")
             for t in passing("cpu_unit")]
    history = clean_history() + [job("cpu_unit", 6, exit_code=75, version="0.33.0", tests=tests)]
    code, _ = run_gate(tmp_path, capsys, history)
    assert code == 1   # the 0.33.0 run exited 75 and has no floors, but nothing is flaky
    found = blockers(artifacts_root, "cpu_unit")
    assert not [b for b in found if "flaky" in b] and len(found) == 2


def test_a_p90_wall_time_over_the_budget_blocks(tmp_path, capsys, artifacts_root):
    budget = GATE.budget_s["cpu_e2e"]
    history = clean_history() + build(6, steps=("cpu_e2e",), wall=budget + 100)
    code, out = run_gate(tmp_path, capsys, history)
    assert code == 1
    assert blockers(artifacts_root, "cpu_e2e") == [f"p90 wall time {budget + 100} s is not under the {budget} s budget"]
    assert "cpu_unit: may drop soft_fail" in out


def test_the_p90_forgives_one_slow_run_in_ten(tmp_path, capsys, artifacts_root):
    budget = GATE.budget_s["cpu_e2e"]
    history = clean_history(builds=9) + build(10, steps=("cpu_e2e",), wall=budget + 100)
    code, out = run_gate(tmp_path, capsys, history, "--runs", "10", "--step", "cpu_e2e")
    assert code == 0, out
    assert written(artifacts_root)["steps"][0]["p90_wall_s"] == 300.0


def test_an_unexplained_skip_blocks(tmp_path, capsys, artifacts_root):
    tests = passing("cpu_e2e")
    tests[-1]["reason"] = "  "
    code, _ = run_gate(tmp_path, capsys, clean_history() + [job("cpu_e2e", 6, tests=tests)])
    assert code == 1
    assert blockers(artifacts_root, "cpu_e2e") == [
        f"unexplained skip: {tests[-1]['nodeid']} skipped without a reason (build 6)"]


@pytest.mark.parametrize("status,exit_code,shown", [
    ("running", None, "shard 1 never finished (status running)"),
    ("crashed", 1, "shard 1 crashed"),
    ("killed", 143, "shard 1 killed"),
])
def test_a_shard_that_did_not_finish_blocks(tmp_path, capsys, artifacts_root, status, exit_code, shown):
    history = clean_history() + [job("cpu_unit", 6, shards=2, shard=0),
                                 job("cpu_unit", 6, shards=2, shard=1, status=status, exit_code=exit_code or 0)]
    code, _ = run_gate(tmp_path, capsys, history, "--step", "cpu_unit")
    assert code == 1
    [blocker] = blockers(artifacts_root, "cpu_unit")
    assert blocker.startswith("build 6 (") and f"not clean: {shown}" in blocker


def test_runs_without_a_build_id_are_each_their_own_run(tmp_path, capsys, artifacts_root):
    local = [job("cpu_unit", None, run_id=f"local-{n}") for n in range(5)]
    code, out = run_gate(tmp_path, capsys, local, "--step", "cpu_unit")
    assert code == 0, out
    assert sorted(run["run"] for run in written(artifacts_root)["steps"][0]["window"]) == [
        f"run local-{n}" for n in range(5)]


def test_other_sessions_are_ignored(tmp_path, capsys):
    extra = [{"session": "gate", "exit_code": 1, "steps": []}, {"session": "warm_cache", "exit_code": 75}]
    code, out = run_gate(tmp_path, capsys, clean_history() + extra)
    assert code == 0, out


def test_the_gate_reads_what_the_sessions_write(tmp_path, capsys, monkeypatch, artifacts_root):
    """Summaries from specgate.contract.summary itself, under Buildkite's job variables."""
    history = tmp_path / "history"
    for number in range(1, 6):
        for shard in range(2):
            monkeypatch.setenv("SPECGATE_ARTIFACTS", str(history / f"{number}-{shard}"))
            monkeypatch.setenv("BUILDKITE_BUILD_ID", f"0190-{number}")
            monkeypatch.setenv("BUILDKITE_BUILD_NUMBER", str(number))
            monkeypatch.setenv("BUILDKITE_JOB_ID", f"job-{number}-{shard}")
            record = summary.begin("cpu_unit")
            record["shard"] = {"num_shards": 2, "shard_id": shard}
            record["vllm_version"] = VERSION   # whatever this venv has installed
            record["tests"] = [t for i, t in enumerate(passing("cpu_unit")) if i % 2 == shard]
            read_valid(summary.finish(record, 0))
    for var in ("BUILDKITE_BUILD_ID", "BUILDKITE_BUILD_NUMBER", "BUILDKITE_JOB_ID"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(artifacts_root))
    code = gate.main(["--history", str(history), "--step", "cpu_unit"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert [run["run"] for run in written(artifacts_root)["steps"][0]["window"]] == [
        f"build {n}" for n in (5, 4, 3, 2, 1)]


def _single_error_line(out: str) -> str:
    [line] = [line for line in out.splitlines() if line.startswith("error: ")]
    return line


@pytest.mark.parametrize("content,message", [
    ('{"session": "cpu_unit", "tests": [', "not readable JSON"),
    ('["cpu_unit"]', "not a JSON object"),
    ('{"session": "cpu_unit", "exit_code": 0, "finished_at": "2026-11-09T06:00:00+00:00", "tests": []}',
     "does not follow summary.schema.json: $: 'schema' is a required property"),
])
def test_a_malformed_summary_exits_2_naming_the_file(tmp_path, capsys, artifacts_root, content, message):
    history = write_history(tmp_path, clean_history())
    bad = history / "build-99" / "cpu_unit" / "summary.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(content)
    assert gate.main(["--history", str(history)]) == 2
    line = _single_error_line(capsys.readouterr().out)
    assert line.startswith(f"error: {bad}: ") and message in line
    assert written(artifacts_root)["exit_code"] == 2


@pytest.mark.parametrize("change,message", [
    (lambda s: s.update(status="done"), "$.status: 'done' is not one of"),
    (lambda s: s["counts"].pop("executed"), "$.counts: 'executed' is a required property"),
    (lambda s: s.update(finished_at="yesterday"), "$.finished_at"),
    (lambda s: s["tests"][0].update(outcome="flaky"), "$.tests[0].outcome: 'flaky' is not one of"),
    (lambda s: s["shard"].update(shard_id=-1), "$.shard.shard_id: -1 is less than the minimum of 0"),
])
def test_a_summary_that_breaks_the_schema_exits_2_naming_the_file(tmp_path, capsys, change, message):
    bad = job("cpu_e2e", 6)
    change(bad)
    code, out = run_gate(tmp_path, capsys, clean_history() + [bad])
    assert code == 2
    line = _single_error_line(out)
    assert line.startswith(f"error: {tmp_path / 'history'}/") and "/cpu_e2e/summary.json: " in line
    assert "does not follow summary.schema.json: " in line and message in line


def test_a_history_folder_that_does_not_exist_is_bad_input(tmp_path, capsys):
    assert gate.main(["--history", str(tmp_path / "nowhere")]) == 2
    assert _single_error_line(capsys.readouterr().out) == f"error: history folder {tmp_path / 'nowhere'} does not exist"


@pytest.mark.parametrize("args,message", [
    (["--runs", "0"], "argument --runs: must be at least 1"),
    (["--step", "warm_cache"], "argument --step: invalid choice: 'warm_cache'"),
    (["-k", "ngram"], "unrecognized arguments: -k ngram (this session runs no pytest)"),
])
def test_bad_options_exit_2(capsys, args, message):
    assert gate.main(args) == 2
    assert message in _single_error_line(capsys.readouterr().out)


def test_a_fresh_clone_has_no_history_which_is_not_enough_evidence(tmp_path):
    """`python -m specgate.sessions.gate` as `nox -s gate` runs it, with the default (absent) history."""
    root = tmp_path / "fresh" / "artifacts"
    env = {"SPECGATE_ARTIFACTS": str(root), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "specgate.sessions.gate"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert (f"no history: {root / 'history'} does not exist (put past builds' artifacts there, "
            "or pass --history DIR)") in proc.stdout
    assert "(no cpu_unit or cpu_e2e runs in the history)" in proc.stdout
    for step in gate.STEPS:
        assert f"{step}: keep soft_fail:\n  - not enough evidence: 0 run(s) in the history, 5 needed" in proc.stdout
    record = written(root)
    assert record["history_found"] is False and record["exit_code"] == 1
    assert [t["outcome"] for t in record["tests"]] == ["failed", "failed"]


def test_a_step_without_a_budget_cannot_graduate(tmp_path, capsys, monkeypatch, artifacts_root):
    text = (REPO / "manifest.toml").read_text()
    assert "\ncpu_e2e = 3600" in text
    (tmp_path / "manifest.toml").write_text(text.replace("\ncpu_e2e = 3600", "\n", 1))
    monkeypatch.setenv("SPECGATE_MANIFEST", str(tmp_path / "manifest.toml"))
    code, out = run_gate(tmp_path, capsys, clean_history())
    assert code == 1 and "cpu_unit: may drop soft_fail" in out
    assert blockers(artifacts_root, "cpu_e2e") == ["no timeout budget declared for cpu_e2e (manifest [gate.budget_s])"]


def test_without_jsonschema_a_broken_summary_still_exits_2_naming_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonschema", None)   # import jsonschema raises ImportError
    bad = job("cpu_unit", 6)
    del bad["counts"]
    code, out = run_gate(tmp_path, capsys, clean_history() + [bad])
    assert code == 2
    line = _single_error_line(out)
    assert line.startswith(f"error: {tmp_path / 'history'}/")
    assert line.endswith("/cpu_unit/summary.json: does not follow summary.schema.json: KeyError: 'counts'")
