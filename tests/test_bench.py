"""The bench's statistics, verdicts, report writer and readers (no nox run here)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from specgate.contract import summary
from specgate.core.manifest import load
from specgate.sessions.bench import report as benchreport
from specgate.sessions.bench import session as bench

REPO = Path(__file__).resolve().parent.parent


def sample(seconds: float, problem: str | None = None) -> bench.Sample:
    return bench.Sample(seconds, 0 if problem is None else 1, "bench/logs/x.log", problem)


# --------------------------------------------------------------------------- statistics

def test_median_of_odd_and_even_counts():
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert bench.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError):
        bench.median([])


def test_interleaved_alternates_the_sides():
    calls = []

    def step(name):
        return lambda index: calls.append((name, index)) or sample(1.0)

    samples = bench.interleaved(3, {"A": step("A"), "B": step("B")})
    assert calls == [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2)]
    assert [len(v) for v in samples.values()] == [3, 3]


def test_interleaved_stops_at_the_first_problem():
    calls = []

    def step(name, bad_at):
        return lambda i: calls.append((name, i)) or sample(1.0, "broke" if i == bad_at else None)

    samples = bench.interleaved(3, {"A": step("A", 99), "B": step("B", 1)})
    assert calls == [("A", 0), ("B", 0), ("A", 1), ("B", 1)]
    assert bench.first_problem(samples["A"], samples["B"]) == "broke"


def test_timed_figure_is_the_median_or_says_why_not():
    figure = bench.timed_figure("x_s", [sample(3.0), sample(10.0), sample(4.0)], command="c")
    assert (figure.value, figure.samples, figure.reason, figure.detail) == (
        4.0, [3.0, 10.0, 4.0], None, {"command": "c"})
    broken = bench.timed_figure("x_s", [sample(3.0), sample(1.0, "x exited 2 (log: artifacts/bench/logs/x.log)")])
    assert broken.value is None and broken.reason.startswith("x exited 2")
    assert bench.timed_figure("x_s", []).reason == "no run"


def test_ratio_figure_needs_both_sides():
    top, bottom = bench.Figure("a_s", "s", 12.0), bench.Figure("b_s", "s", 10.0)
    assert bench.ratio_figure("r", top, bottom).value == 1.2
    missing = bench.ratio_figure("r", top, bench.Figure.missing("b_s", "s", "b exited 2"))
    assert missing.value is None and missing.reason == "b_s not measured: b exited 2"


# --------------------------------------------------------------------------- goals and report

def test_goal_verdicts():
    goal = bench.Goal("r", 1.10, "ratio small")
    assert goal.verdict({"r": bench.Figure("r", "x", 1.10)})["verdict"] == "met"
    assert goal.verdict({"r": bench.Figure("r", "x", 1.11)})["verdict"] == "not met"
    missing = goal.verdict({"r": bench.Figure.missing("r", "x", "cpu_unit exited 2")})
    assert (missing["verdict"], missing["reason"], missing["value"]) == ("not measured", "cpu_unit exited 2", None)
    assert goal.verdict({})["reason"] == "not selected (--only)"


def test_goals_cover_the_issues_targets():
    assert {(g.figure, g.limit) for g in bench.GOALS} == {
        ("cpu_unit_overhead_ratio", 1.10), ("warm_cache_noop_s", 3.0), ("e2e_warm_cold_ratio", 0.6),
        ("e2e_vs_upstream_ratio", 0.8), ("e2e_warm_s", 90.0), ("e2e_cold_s", 180.0), ("engine_start_warm_s", 4.0),
        ("tests_pytest_s", 120.0), ("fresh_clone_ci_s", 300.0), ("classify_35mb_s", 2.0),
        ("e2e_sampling_cost_ratio", 1.5), ("e2e_engine_starts", 8.0), ("tests_fast_pytest_s", 60.0),
        ("gate_fresh_s", 480.0)}
    produced = {"cpu_unit_overhead_ratio", "warm_cache_noop_s", "e2e_warm_cold_ratio", "e2e_cold_s", "e2e_warm_s",
                "e2e_vs_upstream_ratio", "engine_start_warm_s", "tests_pytest_s", "fresh_clone_ci_s",
                "classify_35mb_s", "e2e_sampling_cost_ratio", "e2e_engine_starts", "tests_fast_pytest_s",
                "gate_fresh_s"}
    assert {g.figure for g in bench.GOALS} <= produced
    assert len({g.figure for g in bench.GOALS}) == len(bench.GOALS), "one goal per figure"


def test_upstream_retry_pattern_is_read_from_its_script(tmp_path):
    script = tmp_path / "run-cpu-test.sh"
    script.write_text("set -e\nOFFLINE_RETRY_PATTERN='a\\.b|Invalid (x)'\nrun_test() {\n")
    assert bench.upstream_retry_pattern(script) == "a\\.b|Invalid (x)"
    script.write_text("echo nothing\n")
    with pytest.raises(ValueError, match="sets no OFFLINE_RETRY_PATTERN"):
        bench.upstream_retry_pattern(script)


def _report(figures):
    args = SimpleNamespace(runs=3, skip_pip=True)
    machine = bench.machine_info()
    return bench.build_report(figures, selected=["warm_noop", "e2e_cache"], args=args,
                              command="nox -s bench -- --skip-pip", machine=machine,
                              version_info={"vllm": "0.32.0", "torch": "2.13.0+cpu", "python": "3.11.7",
                                            "nox": "2026.10.20", "uv": "0.13.9"},
                              load={"warm_noop": {"start": {"loadavg_1m": 0.5, "other_torch_processes": 0},
                                                  "end": {"loadavg_1m": 1.5, "other_torch_processes": 2}}},
                              env={"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_CI_ENV": None, "HF_TOKEN": "***"})


def test_report_json_and_markdown(tmp_path):
    figures = [bench.Figure("warm_cache_noop_s", "s", 2.5, [2.4, 2.5, 2.9]),
               bench.Figure("warm_cache_auto_s", "s", 3.3, [3.3], detail={"note": "0 of 6 hub checkpoints cached"}),
               bench.Figure("e2e_warm_cold_ratio", "x", 0.71),
               bench.Figure.missing("e2e_cold_s", "s", "e2e-cold exited 2 (log: artifacts/bench/logs/e2e-cold.log)"),
               bench.Figure.missing("env_setup_pip_s", "s", "skipped (--skip-pip)", skipped=True)]
    text = bench.write_report(_report(figures), tmp_path)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.md").read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md"]
    assert data["command"] == "nox -s bench -- --skip-pip" and data["skip_pip"] is True and data["runs"] == 3
    assert data["figures"]["warm_cache_noop_s"] == {"unit": "s", "value": 2.5, "samples": [2.4, 2.5, 2.9],
                                                    "reason": None, "detail": {}}
    assert data["figures"]["env_setup_pip_s"]["detail"] == {"skipped": True}
    verdicts = {g["figure"]: g["verdict"] for g in data["goals"]}
    assert verdicts == {"warm_cache_noop_s": "met", "e2e_warm_cold_ratio": "not met", "e2e_cold_s": "not measured",
                        **{g.figure: "not measured" for g in bench.GOALS
                           if g.figure not in ("warm_cache_noop_s", "e2e_warm_cold_ratio")}}
    assert "| warm_cache_noop_s | 2.50 s | 2.4, 2.5, 2.9 |  |" in text
    assert "| e2e_warm_cold_ratio | 0.710 |" in text
    assert "| warm_cache_auto_s | 3.30 s | 3.3 | 0 of 6 hub checkpoints cached |" in text
    assert "| e2e_cold_s | not measured |  | e2e-cold exited 2" in text
    assert "| env_setup_pip_s | not measured |  | skipped (--skip-pip) |" in text
    assert "not met" in text and "not measured (not selected (--only))" in text
    assert "Command: `nox -s bench -- --skip-pip`" in text and "vllm 0.32.0" in text
    assert "- warm_noop: start 0.5, 0; end 1.5, 2" in text
    assert "Environment (besides each session's pins): VLLM_USE_AOT_COMPILE=0\n" in text
    assert data["env"] == {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_CI_ENV": None, "HF_TOKEN": "***"}


def test_the_readme_table_is_regenerated_from_the_report_and_nothing_else_changes():
    figures = [bench.Figure("e2e_warm_s", "s", 77.5, [77.5]),
               bench.Figure("e2e_vs_upstream_ratio", "x", 0.9, [0.8, 0.9, 1.1]),
               bench.Figure("fresh_clone_ci_s", "s", 900.0, [0.1, 899.9], detail={"commit": "0123456789abcdef"})]
    block = benchreport.readme_block(_report(figures))
    old = f"intro\n{benchreport.README_BEGIN}\n| stale | table |\n{benchreport.README_END}\noutro\n"
    new = benchreport.splice_readme(old, block)
    assert new == f"intro\n{benchreport.README_BEGIN}\n{block}{benchreport.README_END}\noutro\n"
    assert benchreport.splice_readme(new, block) == new
    assert ("| fixture-mode cpu_e2e takes at most 90 s with a warm compile cache | `e2e_warm_s` | 77.50 s (77.5) "
            "| 90 | met |") in block
    assert "| `e2e_vs_upstream_ratio` | 0.900 (0.8, 0.9, 1.1) | 0.8 | not met |" in block
    assert "| `tests_pytest_s` | not measured | 120 | not measured (not selected (--only)) |" in block
    assert "`fresh_clone` ran commit `0123456789`. 1-minute load at the start of each figure: warm_noop 0.5." in block
    with pytest.raises(ValueError, match="no '<!-- bench table"):
        benchreport.splice_readme("a README without the block\n", block)


def test_the_repo_readme_has_the_block_and_bad_input_exits_2_writing_nothing(tmp_path):
    readme = (REPO / "docs" / "performance.md").read_text()
    assert readme.index(benchreport.README_BEGIN) < readme.index(benchreport.README_END)
    broken = tmp_path / "bench.json"
    broken.write_text("{not json")
    for argv in ([str(tmp_path / "missing.json")], [str(broken)], ["--what"]):
        out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_readme.py"), *argv],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and not out.stdout, out
    assert (REPO / "docs" / "performance.md").read_text() == readme


def test_report_scrubs_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secretvalue123")
    figures = [bench.Figure.missing("e2e_cold_s", "s", "failed with token hf_secretvalue123")]
    bench.write_report(_report(figures), tmp_path)
    for name in ("bench.json", "bench.md"):
        assert "hf_secretvalue123" not in (tmp_path / name).read_text()


# --------------------------------------------------------------------------- readers

def test_machine_info_reads_cpuinfo_and_meminfo(tmp_path):
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Test Xeon 9000\nflags\t: fpu avx2 fma\n\n"
                                      "processor\t: 1\nmodel name\t: Test Xeon 9000\n")
    (tmp_path / "meminfo").write_text("MemTotal:       24576000 kB\nMemFree:         1000 kB\n")
    info = bench.machine_info(tmp_path / "cpuinfo", tmp_path / "meminfo")
    assert info["cpu_model"] == "Test Xeon 9000"
    assert info["isa"] == ["avx2"] and info["bf16_native"] is (platform.machine() != "x86_64")
    assert info["memory_gib"] == round(24576000 / 2**20, 1)
    assert info["cores"] == os.cpu_count() and 1 <= info["usable_cores"] <= info["cores"]
    empty = bench.machine_info(tmp_path / "missing", tmp_path / "missing")
    assert empty["cpu_model"] is None and empty["memory_gib"] is None


def test_machine_info_on_this_host():
    info = bench.machine_info()
    assert info["cpu_model"] and info["memory_gib"] > 0


def test_versions_name_the_installed_packages():
    info = bench.versions("2026.10.20", ("/usr/bin/uv", "0.13.9"))
    assert info["torch"] and info["vllm"] and info["python"] == ".".join(map(str, sys.version_info[:3]))
    assert (info["nox"], info["uv"]) == ("2026.10.20", "0.13.9")
    assert bench.versions(None, None)["uv"] is None


def test_torch_processes_are_found_by_what_they_map():
    child = subprocess.Popen([sys.executable, "-c", "import torch; print(flush=True); import time; time.sleep(60)"],
                             stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # torch is imported
        assert child.pid in bench.torch_pids()
    finally:
        child.kill()
        child.wait()
    assert child.pid not in bench.torch_pids()
    snapshot = bench.load_snapshot()
    assert snapshot["loadavg_1m"] >= 0 and snapshot["other_torch_processes"] >= 0


def test_read_fresh_summary_ignores_an_older_or_unfinished_run(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path))
    since = time.time()
    record = summary.begin("cpu_e2e")
    assert bench.read_fresh_summary("cpu_e2e", since=since) is None       # still running
    summary.finish(record, 0)
    assert bench.read_fresh_summary("cpu_e2e", since=since)["exit_code"] == 0
    assert bench.read_fresh_summary("cpu_e2e", since=since + 5) is None   # started before that run


# --------------------------------------------------------------------------- running children

def test_runner_logs_output_and_flags_unexpected_codes(tmp_path):
    runner = bench.Runner(tmp_path / "bench")
    ok = runner.run("ok", [sys.executable, "-c", "print('hello')"], env=dict(os.environ))
    assert (ok.exit_code, ok.problem, ok.log) == (0, None, "bench/logs/ok.log")
    assert "hello" in (tmp_path / "bench" / "logs" / "ok.log").read_text()
    bad = runner.run("bad", [sys.executable, "-c", "raise SystemExit(3)"], env=dict(os.environ), ok_codes=(0, 1))
    assert bad.exit_code == 3 and bad.problem == "bad exited 3 (log: artifacts/bench/logs/bad.log)"


STOPPED_BENCH = """
import os, signal, sys
from pathlib import Path
from specgate.sessions import lifecycle
from specgate.sessions.bench import session as bench
signal.signal(signal.SIGTERM, lifecycle._raise_stopped)     # as the bench session's lifecycle does
grandchild = "import time; print('up', flush=True); time.sleep(300)"
try:
    bench.Runner(Path(sys.argv[1])).run("nox", [sys.executable, "-c",
        f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"], env=dict(os.environ))
except lifecycle.Stopped:
    print("stopped", flush=True)
"""


def test_a_stopped_bench_ends_the_whole_tree_of_the_run_it_was_waiting_for(tmp_path):
    """SIGTERM while a sample runs (a session under nox, its engines under it): nothing of that
    run may outlive the bench, grandchildren included."""
    import psutil

    driver = subprocess.Popen([sys.executable, "-c", STOPPED_BENCH, str(tmp_path / "bench")], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parent.parent)
    log = tmp_path / "bench" / "logs" / "nox.log"
    deadline = time.monotonic() + 60
    while not (log.is_file() and "up" in log.read_text().splitlines()) and time.monotonic() < deadline:
        time.sleep(0.1)
    tree = psutil.Process(driver.pid).children(recursive=True)
    assert len(tree) == 2, tree                     # the run and its child
    driver.terminate()
    assert driver.communicate(timeout=60)[0].strip() == "stopped"
    gone, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"outlived the bench: {alive}"


def test_shell_env_drops_this_venv():
    own_bin = str(Path(sys.prefix) / "bin")
    env = bench.shell_env({"PATH": os.pathsep.join([own_bin, "/usr/bin"]), "VIRTUAL_ENV": sys.prefix,
                           "UV_PYTHON": sys.prefix, "UV_PROJECT_ENVIRONMENT": sys.prefix,
                           "SPECGATE_SESSION": "bench", "PIP_FIND_LINKS": "/opt/wheels"})
    assert env == {"PATH": "/usr/bin", "PIP_FIND_LINKS": "/opt/wheels"}


def test_bare_pytest_plan_uses_the_session_venv_pins_and_files(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "64")  # a hostile shell value the pins override
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/home/someone/.cache/vllm")
    manifest = load()
    summary = {"files_run": ["tests/v1/spec_decode/test_ngram.py"], "upstream": {"root": "/cache/upstream/vllm-0.32.0"}}
    seen = {"VLLM_CACHE_ROOT": "/c/compile/k/vllm", "TORCHINDUCTOR_CACHE_DIR": "/c/compile/k/inductor"}
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    plan = bench.bare_pytest_plan(manifest, summary, tmp_path / "venv", seen)
    assert plan["cwd"] == "/cache/upstream/vllm-0.32.0"
    assert plan["command"][:3] == [str(tmp_path / "venv" / "bin" / "python"), "-m", "pytest"]
    assert plan["command"][-1] == "tests/v1/spec_decode/test_ngram.py"
    assert f"--timeout={manifest.unit.timeout_s}" in plan["command"]
    assert "--continue-on-collection-errors" in plan["command"]  # as the session: one bad file stops nothing
    env = plan["env"]
    for name, value in manifest.session("cpu_unit").env.items():
        assert env[name] == value
    assert env["VIRTUAL_ENV"] == str(tmp_path / "venv") and env["PATH"].startswith(str(tmp_path / "venv" / "bin"))
    assert (env["VLLM_CACHE_ROOT"], env["TORCHINDUCTOR_CACHE_DIR"]) == ("/c/compile/k/vllm", "/c/compile/k/inductor")
    # a session that set no compile cache (torch wrote its own default at import): the bare run the same
    seen = {"VLLM_CACHE_ROOT": None, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root"}
    bare = bench.bare_pytest_plan(manifest, summary, tmp_path / "venv", seen)["env"]
    assert "VLLM_CACHE_ROOT" not in bare and bare["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/torchinductor_root"


@pytest.mark.parametrize("argv", [["--bogus"], ["--runs", "0"], ["--only", "nothing"], ["--", "-k", "x"]])
def test_bad_options_exit_2_with_one_line(argv):
    proc = subprocess.run([sys.executable, "-m", "specgate.sessions.bench", *argv], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "-> exit 2 (bad input)" in proc.stdout.splitlines()[-1]


def test_engine_starts_come_from_the_e2e_summary():
    # shaped like a real cpu_e2e summary.json, whose own "run" says which CI job wrote it
    summary = {"run": {"build_id": None, "attempt": 1},
               "engines": [{"key": "a", "init_s": 31.5, "compilation": {"mode": "VLLM_COMPILE", "backend": "inductor"}},
                           {"key": "b", "init_s": None, "error": "RuntimeError: boom"},
                           {"key": "c", "init_s": 22.0}]}
    assert bench.engine_starts(summary) == [31.5, 22.0]
    assert bench.engine_starts({"engines": []}) == [] and bench.engine_starts({}) == []
    runner = None  # summaries given: no session run is needed
    runs = [{**summary, "engines": [], bench.BENCH_RUN: "cold"}, {**summary, bench.BENCH_RUN: "warm"}]
    figure, warm, count = bench.engine_start(runner, runs)
    assert (figure.value, figure.samples) == (26.75, [31.5, 22.0])
    assert (count.name, count.value, count.samples) == ("e2e_engine_starts", 2.0, [0.0, 2.0])
    assert (warm.name, warm.value) == ("engine_start_warm_s", 26.75)
    assert figure.detail["by_run"] == {"cold": [], "warm": [31.5, 22.0]}
    assert figure.detail["compile"] == ["VLLM_COMPILE/inductor"] and "(warm run)" in figure.detail["from"]
    empties = bench.engine_start(runner, [{**summary, "engines": [], bench.BENCH_RUN: "warm"}])
    assert all(e.value is None and "no engine start times" in e.reason for e in empties) and len(empties) == 2
    assert benchreport._value({"value": 7.0, "unit": "engines"}) == "7 engines"


def test_a_goal_is_met_only_when_every_sample_meets_it():
    goal = bench.Goal("e2e_vs_upstream_ratio", 0.8, "at most 0.8x")
    def verdict(value, samples):
        return goal.verdict({goal.figure: bench.Figure(goal.figure, "x", value, samples)})["verdict"]
    assert verdict(0.7, [0.6, 0.7, 0.75]) == "met"
    assert verdict(0.7, [0.6, 0.7, 0.95]) == "not met"     # the median meets it, one sample does not
