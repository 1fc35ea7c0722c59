"""Drift (specgate.ciside.drift, specgate.sessions.e2e.review) on cpu_e2e summaries as the session writes them
(tests/histories.py), and once through the cpu_e2e session's step with pytest's engine run
replaced by the JUnit XML and records an engine run leaves behind."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from contract import assert_valid, read_valid
from histories import (
    BASE_ENGINE,
    EAGLE3,
    EAGLE3_ENGINE,
    HOST,
    INPUTS,
    e2e_job,
    eagle3_entry,
    engine_row,
    write_history,
)

from specgate.ciside import drift, history
from specgate.contract import exitcodes
from specgate.core import cli, manifest
from specgate.sessions import lifecycle, pytestrun
from specgate.sessions.e2e import session
from specgate.sessions.e2e.planning import Settings

MANIFEST = manifest.load()
SPEC, GATE = MANIFEST.drift, MANIFEST.gate
SESSION_INPUTS = drift.inputs_digest(asdict(Settings.parse(MANIFEST)))   # what the session stamps here


def runs_in(tmp_path: Path, summaries: list[dict]) -> list[history.Run]:
    folder = write_history(tmp_path, summaries)
    return history.read(history.Source(folder=folder))["cpu_e2e"]


def eagle3_of(record: dict) -> dict:
    return next(t for t in record["tests"] if t["nodeid"] == EAGLE3)


def checked(tmp_path: Path, current: dict, past: list[dict]) -> dict:
    current["drift"] = drift.check(current, runs_in(tmp_path, past), SPEC, GATE, "folder history")
    assert_valid(current)
    return current["drift"]


# --------------------------------------------------------------------------- the required pair

def test_a_0_3_drop_in_eagle3_acceptance_on_an_unchanged_fixture_is_a_regression(tmp_path):
    past = [e2e_job(n) for n in range(1, 6)]                                 # eagle3 at 1.85, five clean builds
    current = e2e_job(6, acceptance_len=1.55, rates=(0.35, 0.15, 0.05))     # above the 1.5 floor
    found = checked(tmp_path, current, past)
    entry = eagle3_of(current)
    assert (entry["outcome"], entry["cause"]) == ("failed", "regression")
    assert entry["reason"].startswith("regression: acceptance length 1.550 is 0.300 below 1.850, the median of "
                                      "the last 5 clean run(s) (tolerance 0.15)")
    assert entry["reason"].endswith("; draft position 1 acceptance rate 0.344 is 0.156 below 0.500, the median of "
                                    "the last 5 clean run(s) (tolerance 0.1) (this run vLLM 0.32.0; baseline "
                                    "vLLM 0.32.0)")
    assert found["regressions"] == [EAGLE3] and found["clean_runs"] == 5
    [result] = found["results"]
    assert result["verdict"] == "regression" and result["median_acceptance_len"] == 1.85 and result["runs"] == 5
    assert result["position_rates"] == [0.3438, 0.1562, 0.0469] and result["median_position_rates"] == [0.5, 0.25,
                                                                                                          0.0938]


def test_the_same_numbers_with_no_history_pass(tmp_path, monkeypatch):
    """Through the session's own hook (specgate.sessions.e2e.review.review) and its options."""
    monkeypatch.delenv("SPECGATE_HISTORY", raising=False)
    monkeypatch.delenv("BUILDKITE_API_TOKEN", raising=False)
    current = e2e_job(6, acceptance_len=1.55, rates=(0.35, 0.15, 0.05))
    assert review(current, []) == exitcodes.OK
    entry = eagle3_of(current)
    assert (entry["outcome"], entry["cause"], entry["reason"]) == ("passed", None, None)
    assert current["drift"]["checked"] is False and current["drift"]["why"].startswith("no history: pass --history")
    past = write_history(tmp_path, [e2e_job(n, inputs=SESSION_INPUTS) for n in range(1, 6)])
    again = e2e_job(6, acceptance_len=1.55, rates=(0.35, 0.15, 0.05))
    assert review(again, ["--history", str(past)]) == exitcodes.FAILURE
    assert eagle3_of(again)["cause"] == "regression" and again["drift"]["checked"] is True


def review(record: dict, argv: list[str]) -> int:
    from specgate.sessions.e2e import review as e2e_history

    args = cli.parse(session.build_parser(), argv)
    return e2e_history.review(lifecycle.Context("cpu_e2e", MANIFEST, args, record), asdict(Settings.parse(MANIFEST)))


# --------------------------------------------------------------------------- what is compared with what

def test_a_drop_within_the_tolerance_passes(tmp_path):
    current = e2e_job(6, acceptance_len=1.72, rates=(0.45, 0.19, 0.08))
    found = checked(tmp_path, current, [e2e_job(n) for n in range(1, 6)])
    assert eagle3_of(current)["outcome"] == "passed" and found["regressions"] == []
    assert found["results"][0]["verdict"] == "ok"


def test_a_draft_position_can_regress_while_the_mean_holds(tmp_path):
    current = e2e_job(6, acceptance_len=1.73, rates=(0.38, 0.25, 0.1))      # 0.12 lower: within 0.15
    checked(tmp_path, current, [e2e_job(n) for n in range(1, 6)])
    entry = eagle3_of(current)
    assert entry["cause"] == "regression"
    assert entry["reason"] == ("regression: draft position 1 acceptance rate 0.375 is 0.125 below 0.500, the "
                               "median of the last 5 clean run(s) (tolerance 0.1) (this run vLLM 0.32.0; "
                               "baseline vLLM 0.32.0)")


def test_the_median_forgives_one_odd_run_and_only_the_last_n_count(tmp_path):
    past = [e2e_job(n, acceptance_len=2.5, rates=(0.9, 0.4, 0.2)) for n in range(1, 4)]   # older, outside the window
    past += [e2e_job(n) for n in (4, 5, 7, 8)] + [e2e_job(6, acceptance_len=1.2, rates=(0.1, 0.05, 0.05))]
    current = e2e_job(9, acceptance_len=1.8, rates=(0.48, 0.23, 0.09))
    found = checked(tmp_path, current, past)
    assert found["results"][0]["median_acceptance_len"] == 1.85 and found["regressions"] == []


def test_runs_that_were_not_clean_are_no_baseline(tmp_path):
    past = [e2e_job(n) for n in range(1, 3)]
    past += [e2e_job(n, acceptance_len=1.2, rates=(0.1, 0.05, 0.05), exit_code=1) for n in range(3, 8)]
    current = e2e_job(8, acceptance_len=1.55, rates=(0.35, 0.15, 0.05))
    found = checked(tmp_path, current, past)
    assert found["clean_runs"] == 2 and found["results"][0]["runs"] == 2
    assert found["regressions"] == [EAGLE3]


def test_the_current_build_is_not_its_own_baseline(tmp_path):
    """Another shard of this build, already uploaded, never counts as history."""
    past = [e2e_job(n) for n in range(1, 6)]
    same_build = e2e_job(6, acceptance_len=1.55, rates=(0.35, 0.15, 0.05))
    found = checked(tmp_path, e2e_job(6, acceptance_len=1.55, rates=(0.35, 0.15, 0.05)), past + [same_build])
    assert found["clean_runs"] == 5 and found["regressions"] == [EAGLE3]


def test_a_pr_build_is_compared_with_the_base_branch_whatever_its_version(tmp_path):
    """eagle3 1.85 on main (0.32.0), 1.55 on a PR's build (0.33.0.dev1): a regression naming both versions."""
    past = [e2e_job(n) for n in range(1, 6)]
    current = e2e_job(6, acceptance_len=1.55, rates=(0.35, 0.15, 0.05), version="0.33.0.dev1")
    checked(tmp_path, current, past)
    entry = eagle3_of(current)
    assert (entry["outcome"], entry["cause"]) == ("failed", "regression")
    assert "1.550 is 0.300 below 1.850" in entry["reason"]
    assert entry["reason"].endswith("(this run vLLM 0.33.0.dev1; baseline vLLM 0.32.0)")


@pytest.mark.parametrize("change,why", [
    ({"host": {**HOST, "cpu_model": "AMD EPYC 9654"}},
     ("5 clean run(s) with this model identity ran on 1 other host(s), not Intel(R) Xeon(R) Processor, 2 cores, "
     "avx2 avx512f: not compared")),
    ({"host": {**HOST, "isa": ["avx2"]}}, "ran on 1 other host(s)"),
    ({"host": {**HOST, "cores": 64}}, "ran on 1 other host(s)"),
])
def test_another_host_is_incomparable_and_says_so(tmp_path, change, why):
    past = [e2e_job(n, **change) for n in range(1, 6)]
    current = e2e_job(6, acceptance_len=1.55, rates=(0.35, 0.15, 0.05))
    current["drift"] = drift.check(current, runs_in(tmp_path, past), SPEC, GATE, "folder history")
    assert eagle3_of(current)["outcome"] == "passed"
    [result] = current["drift"]["results"]
    assert result["verdict"] == "incomparable" and why in result["note"]
    assert current["drift"]["incomparable"] == [f"{EAGLE3}: {result['note']}"]


@pytest.mark.parametrize("change", [
    {"revision": "01ea8cfc4a954c8b + 0000000000000000"},   # a rebuilt draft fixture
    {"inputs": "000000000000"},                            # other prompts or engine settings
])
def test_another_model_identity_has_no_history(tmp_path, change):
    current = e2e_job(6, acceptance_len=1.55, rates=(0.35, 0.15, 0.05), **change)
    found = checked(tmp_path, current, [e2e_job(n) for n in range(1, 6)])
    assert eagle3_of(current)["outcome"] == "passed"
    assert found["results"][0]["verdict"] == "no-history" and found["regressions"] == []


def test_model_identity_names_revisions_engines_and_inputs():
    [entry] = [eagle3_entry(1.85)]
    drift.stamp([entry], INPUTS)
    assert entry[drift.IDENTITY] == (f"01ea8cfc4a954c8b + e407518638f5dde6 | {BASE_ENGINE} / {EAGLE3_ENGINE} | "
                                     f"inputs {INPUTS}")
    skipped = {"nodeid": "x", "revision": "r", "engines": None}
    drift.stamp([skipped], INPUTS)
    assert drift.IDENTITY not in skipped   # a test that started no engine has nothing to compare
    settings = asdict(Settings.parse(MANIFEST))
    assert drift.inputs_digest(settings) == drift.inputs_digest(dict(reversed(list(settings.items()))))
    assert drift.inputs_digest({**settings, "max_tokens": 47}) != drift.inputs_digest(settings)


def test_an_engine_slowdown_is_a_warning_not_a_failure(tmp_path):
    current = e2e_job(6, init_s=25.0)
    current["engines"][1]["generate_s"] = 1.4     # 2.8x a 0.5 s median, but sub-second medians are noise
    found = checked(tmp_path, current, [e2e_job(n) for n in range(1, 6)])
    assert eagle3_of(current)["outcome"] == "passed" and found["regressions"] == []
    assert found["warnings"] == [
        (f"engine [{BASE_ENGINE}]: start (compile included) took 25.0 s, 2.5x the median 10.0 s of the last 5 clean "
        "run(s) (warning above 1.5x)"),
        (f"engine [{EAGLE3_ENGINE}]: start (compile included) took 25.0 s, 2.5x the median 10.0 s of the last 5 clean "
        "run(s) (warning above 1.5x)")]
    assert {(t["metric"], t["verdict"]) for t in found["timings"]} == {("init_s", "slower"), ("generate_s", "ok")}
    assert "  warning: engine [" in drift.describe(found)


def test_position_rates_come_from_the_speculative_engines_counters():
    entry = eagle3_entry(1.85)
    rows = [engine_row(BASE_ENGINE, "none"), engine_row(EAGLE3_ENGINE, "eagle3", (0.5, 0.25, 0.1))]
    assert drift.position_rates(entry, rows) == [0.5, 0.25, 0.0938]
    assert drift.position_rates(entry, [engine_row(EAGLE3_ENGINE, "eagle3", ())]) is None    # no drafts
    assert drift.position_rates(entry, rows[:1]) is None


# --------------------------------------------------------------------------- through the session's step

def _engine_run_output(junit: Path, records: Path, acceptance_len: float, rates: tuple[float, ...]) -> None:
    """What `pytest -m e2e tests/e2e` leaves behind for the eagle3 V1 test: its JUnit case and
    what it recorded (the test's row and the two engine rows)."""
    junit.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="1">'
        '<testcase classname="tests.e2e.test_spec_decode" name="test_v1_matches_baseline[eagle3-v1]" '
        'file="tests/e2e/test_spec_decode.py" time="0.52"/></testsuite></testsuites>')
    row = {k: v for k, v in eagle3_entry(acceptance_len).items()
           if k not in ("nodeid", "outcome", "cause", "reason", "time_s")}
    lines = [{"kind": "engine", **engine_row(BASE_ENGINE, "none")},
             {"kind": "engine", **engine_row(EAGLE3_ENGINE, "eagle3", rates)},
             {"kind": "test", "test": EAGLE3, **row}]
    records.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.vllm   # resolves the plan: builds the fixtures on a cold cache
@pytest.mark.parametrize("with_history", [False, True])
def test_the_session_fails_a_regression_only_when_it_has_history(tmp_path, monkeypatch, capsys, with_history):
    """`nox -s cpu_e2e -- --model-source fixture -k eagle3-v1 [--history DIR]` on this machine, its
    engine run replayed: the drift hook runs inside the real step, on the real merge."""
    for var in ("SPECGATE_HISTORY", "BUILDKITE_API_TOKEN", "BUILDKITE_BUILD_ID", "BUILDKITE_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    artifacts = tmp_path / "artifacts"
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(artifacts))
    here = {"host": drift_host(), "inputs": SESSION_INPUTS}
    past = write_history(tmp_path, [e2e_job(n, **here) for n in range(1, 6)])

    def replay(args, junit, *, cwd, env=None, log=None):
        _engine_run_output(junit, Path(env["SPECGATE_E2E_RECORDS"]), 1.55, (0.35, 0.15, 0.05))
        return 0

    monkeypatch.setattr(pytestrun, "run_pytest", replay)
    argv = ["--model-source", "fixture", *(["--history", str(past)] if with_history else []), "-k", "eagle3-v1"]
    code = lifecycle.run("cpu_e2e", session.build_parser(), session.step, argv)
    out = capsys.readouterr().out
    record = read_valid(artifacts / "cpu_e2e" / "summary.json")
    entry = eagle3_of(record)
    assert entry[drift.IDENTITY].endswith(f"| inputs {here['inputs']}")
    assert (artifacts / "cpu_e2e" / "acceptance.svg").is_file()
    if with_history:
        assert code == 1 and record["exit_code"] == 1, out
        assert (entry["outcome"], entry["cause"]) == ("failed", "regression")
        assert record["counts"]["failed"] == 1 and record["drift"]["regressions"] == [EAGLE3]
        assert f"  regression: {EAGLE3}: acceptance length 1.550 is 0.300 below 1.850" in out
    else:
        assert code == 0 and record["exit_code"] == 0, out
        assert entry["outcome"] == "passed" and record["drift"]["checked"] is False
        assert "drift: not checked: no history" in out


def drift_host() -> dict:
    from specgate.contract import summary

    return summary.host()
