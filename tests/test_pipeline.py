"""The Buildkite pipeline: it is valid for Buildkite's schema, names real nox sessions,
soft-fails only on 75, runs every step through the wrapper, skips only what if_changed
allows, and its annotations render this job's summary (never another's)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from pipelines import commands, glob_regex, interpolated, validate_for_buildkite

from specgate.contract import summary as contract

REPO = Path(__file__).resolve().parent.parent
PIPELINE = REPO / ".buildkite" / "pipeline.yml"
ANNOTATE = REPO / "scripts" / "annotate.py"
WRAPPER_LINE = re.compile(r'^bash scripts/run-cpu-test\.sh (\S+) "([^"]+)" \|\| status=\$\$\?$')
TIMEOUT_FORM = re.compile(r"^[0-9]+(\.[0-9]+)?[smhd]?$")  # what run-cpu-test.sh accepts


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    data = yaml.safe_load(PIPELINE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("steps"), list)
    return data["steps"]


def test_steps_and_dependencies(steps):
    by_key = {s["key"]: s for s in steps}
    assert list(by_key) == ["warm_cache", "cpu_unit", "cpu_e2e"]
    assert "depends_on" not in by_key["warm_cache"]
    for key in ("cpu_unit", "cpu_e2e"):
        assert by_key[key]["depends_on"] in ("warm_cache", ["warm_cache"])


def test_every_step_runs_through_the_wrapper_and_keeps_its_status(steps):
    for step in steps:
        lines = commands(step)
        match = WRAPPER_LINE.match(lines[0])
        assert match, f"{step['key']}: first command does not go through the wrapper: {lines[0]}"
        assert TIMEOUT_FORM.match(match.group(1)), match.group(1)
        assert lines[-1] == "exit $${status:-0}"
        for middle in lines[1:-1]:  # only the annotation, told the wrapper's status, which may never fail the step
            assert middle == f'python3 scripts/annotate.py {step["key"]} --step-exit "$${{status:-0}}" || true', middle


def test_commands_parse_as_bash_and_escape_every_dollar(steps):
    for step in steps:
        text = "\n".join(commands(step))
        lone_dollar = re.search(r"(?<!\$)\$(?!\$)", text.replace("$$", ""))
        assert not lone_dollar, f"{step['key']}: a $ Buildkite would interpolate"
        proc = subprocess.run(["bash", "-n", "-c", interpolated(text)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("code", [75, 124])
def test_the_wrapper_status_survives_the_annotation(steps, tmp_path, code):
    """Run a step's command block as the agent does (bash -e), with the wrapper's place
    taken by a command that exits `code`: the step must exit with it, annotated or not,
    and the annotation is told it."""
    for step in steps:
        lines = [interpolated(line) for line in commands(step)]
        lines[0] = re.sub(r'^bash scripts/run-cpu-test\.sh \S+ "[^"]+"', f"bash -c 'exit {code}'", lines[0])
        artifacts = tmp_path / str(code)
        env = {**outside_buildkite(), "SPECGATE_ARTIFACTS": str(artifacts),
               "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
        proc = subprocess.run(["bash", "-e", "-c", "\n".join(lines)], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == code, (step["key"], proc.stdout, proc.stderr)
        if step["key"] != "warm_cache":
            assert (f"#### {step['key']}: no summary at {artifacts}/{step['key']}/summary.json "
                    f"(the step exited {code} before writing it)") in proc.stdout


def test_every_named_session_exists_in_the_noxfile(steps):
    names = set()
    for step in steps:
        for line in commands(step):
            names.update(re.findall(r"(?:nox|noxw\.py)\s+(?:\S+\s+)*?-s\s+(\w+)", line))
    assert names == {"warm_cache", "cpu_unit", "cpu_e2e"}
    proc = subprocess.run([sys.executable, "-m", "nox", "-l", "--json", "-s", *sorted(names)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = {entry["session"] for entry in json.loads(proc.stdout)}
    assert names <= listed


def test_each_step_timeout_is_the_gate_budget_in_the_manifest(steps):
    """One value, two readers: the wrapper's timeout and the gate's wall-time budget."""
    from specgate.core.manifest import load

    units = {"s": 1, "m": 60, "h": 3600}
    budgets = load().gate.budget_s
    for step in steps:
        if step["key"] in budgets:
            number, unit = re.search(r"run-cpu-test\.sh (\d+)([smh])", step["command"]).groups()
            assert int(number) * units[unit] == budgets[step["key"]], step["key"]


def test_soft_fail_only_for_exit_75(steps):
    for step in steps:
        if "soft_fail" in step:
            assert step["soft_fail"] == [{"exit_status": 75}], step["key"]


def test_sharded_steps_pass_the_shard_options(steps):
    for step in steps:
        if step["key"] == "warm_cache":
            assert "parallelism" not in step
            continue
        assert isinstance(step.get("parallelism"), int) and step["parallelism"] >= 2
        first = commands(step)[0]
        assert "--num-shards=$$BUILDKITE_PARALLEL_JOB_COUNT --shard-id=$$BUILDKITE_PARALLEL_JOB" in first
        assert first.index(" -- --num-shards") > first.index(f"-s {step['key']}")  # session options follow nox's --


def test_the_pipeline_is_valid_for_buildkite(tmp_path):
    """Buildkite's published schema (pipelines.validate_for_buildkite) rejects a key Buildkite
    does not know, such as vLLM's own source_file_dependencies."""
    proc = validate_for_buildkite(PIPELINE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok -- validation done" in proc.stdout
    vllm_style = tmp_path / "pipeline.yml"
    vllm_style.write_text(PIPELINE.read_text().replace("if_changed:", "source_file_dependencies:"))
    proc = validate_for_buildkite(vllm_style)
    assert proc.returncode == 1 and "Schema validation errors" in proc.stdout


def test_if_changed_names_what_each_step_runs(steps):
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    by_key = {s["key"]: s for s in steps}
    for step in steps:
        assert "source_file_dependencies" not in step, "vLLM's generator reads it, Buildkite does not"
        assert "artifacts/**" in step["artifact_paths"]
        globs = step["if_changed"]
        assert {"specgate/**", "manifest.toml", "constraints/**", "noxfile.py"} <= set(globs)
        for glob in globs:
            assert any(glob_regex(glob).fullmatch(f) for f in files), f"{step['key']}: {glob} matches no file"
    assert "tests/e2e/**" in by_key["cpu_e2e"]["if_changed"]
    for step in steps:  # a step never runs while the step it depends on was skipped
        if "depends_on" in step:
            assert set(step["if_changed"]) <= set(by_key[step["depends_on"]]["if_changed"]), step["key"]


# --- annotations ---------------------------------------------------------------------------------
BUILD, JOB = "0190-build", "0190-job-a"
ON_BUILDKITE = {"BUILDKITE_BUILD_ID": BUILD, "BUILDKITE_JOB_ID": JOB, "BUILDKITE_STEP_KEY": "cpu_e2e"}


def outside_buildkite() -> dict[str, str]:
    """This environment without Buildkite's job variables (the tests may run on an agent)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("BUILDKITE_")}


def entry(nodeid: str, outcome: str, cause: str | None = None, reason: str | None = None, **extras) -> dict:
    return {"nodeid": nodeid, "outcome": outcome, "cause": cause, "reason": reason, "time_s": 1.5, **extras}


def e2e(name: str, outcome: str, method: str, source: str, acceptance: float | None, threshold: float,
        matches: bool | None, cause: str | None = None, reason: str | None = None, **models) -> dict:
    return entry(f"tests/e2e/test_spec_decode.py::test_acceptance[{name}]", outcome, cause, reason, method=method,
                 model_source=source, runner="v1", acceptance_len=acceptance, threshold=threshold,
                 matches_baseline=matches, **models)


E2E_TESTS = [
    e2e("eagle3-tiny-qwen3", "passed", "eagle3", "fixture", 4.0, 3.5, True, target="Qwen/Qwen3-0.6B",
        draft="AngelSlim/Qwen3-0.6B_eagle3", engines=["tiny-qwen3@690c46d068 none",
                                                    "tiny-qwen3@690c46d068 eagle3-random@1a2b3c4d5e eagle3 k=3"]),
    e2e("ngram-tiny-qwen3", "failed", "ngram", "hub", 1.31, 2.0, False, "regression", "acceptance 1.310 < floor 2.000",
        target="Qwen/Qwen3-0.6B", engines=["Qwen/Qwen3-0.6B@c1899de289 ngram k=3"]),
    e2e("mtp-qwen3_5", "skipped", "mtp", "fixture", None, 2.0, None, "env-blocked",
        "torchvision is not importable (No module named 'torchvision')"),
]
UNIT_TESTS = [
    entry("tests/v1/spec_decode/test_ngram.py::test_ngram_proposer", "passed"),
    entry("tests/v1/spec_decode/test_dflash2.py::test_fused[a|b]", "failed", "env-blocked",
          "Triton CPU backend missing (a Triton kernel was launched)"),
]


# A PR's wheel: the annotation names the build by its file, id and commit, not by its version alone.
PR_BUILD = {"id": "1f2e3d4c5b6a7980", "source": "wheel", "distribution": "vllm",
            "version": "0.32.1.dev12+g0a1b2c3d",
            "file": "/agent/dist/vllm-0.32.1.dev12+g0a1b2c3d-cp38-abi3-linux_x86_64.whl",
            "sha256": "1f2e3d4c5b6a7980" * 4, "commit": "0a1b2c3d", "location": None}
NAMED = ("vLLM 0.32.1.dev12+g0a1b2c3d (vllm-0.32.1.dev12+g0a1b2c3d-cp38-abi3-linux_x86_64.whl, id 1f2e3d4c5b6a7980, "
         "commit 0a1b2c3d)")


@pytest.fixture
def write_summary(tmp_path, monkeypatch):
    """Write artifacts/<session>/summary.json through specgate.contract.summary, as a session does,
    and check it against the contract's schema. Returns the artifacts folder's path."""
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    validator = jsonschema.Draft202012Validator(contract.load_schema())

    def write(session: str, tests: list[dict], code: int | None, *, status: str = "finished",
              error: str | None = None, environ: dict | None = None) -> Path:
        record = contract.begin(session, environ=environ or {})
        record.update(tests=tests, vllm=PR_BUILD, vllm_version=PR_BUILD["version"])
        if status == "running":  # the session never got to finish its record
            path = contract.write(record)
        else:
            path = contract.finish(record, code, status=status, error=error)
        validator.validate(json.loads(path.read_text()))
        return tmp_path / "artifacts"

    return write


def _annotate(*args: str, path_dirs: list[Path] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"])
    return subprocess.run([sys.executable, str(ANNOTATE), *args], capture_output=True, text=True, timeout=60,
                          env={**outside_buildkite(), "PATH": path, **(env or {})})


def _agent(tmp_path: Path) -> tuple[Path, Path]:
    """buildkite-agent is not installed here: a stand-in on PATH records how it is called."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    agent = bin_dir / "buildkite-agent"
    agent.write_text(f"#!{sys.executable}\nimport json, sys\n"
                     f"open({str(calls)!r}, 'a').write(json.dumps([sys.argv[1:], sys.stdin.read()]) + '\\n')\n")
    agent.chmod(0o755)
    return bin_dir, calls


def _posted(calls: Path) -> list[tuple[list[str], str]]:
    return [tuple(json.loads(line)) for line in calls.read_text().splitlines()]


def test_annotate_renders_the_acceptance_and_causes_tables(write_summary):
    write_summary("cpu_e2e", E2E_TESTS, 1)
    root = write_summary("cpu_unit", UNIT_TESTS, 75)
    proc = _annotate("--artifacts", str(root))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"#### cpu_e2e: 1 failed, 1 passed, 1 skipped ({NAMED}, exit 1)" in out
    assert ("| test | method | model source | model | runner | outcome | acceptance len | threshold "
            "| matches baseline |") in out
    # A fixture's row names the fixture first, then the hub checkpoint it stands in for.
    assert ("| tests/e2e/test_spec_decode.py::test_acceptance[eagle3-tiny-qwen3] | eagle3 | fixture "
            "| tiny-qwen3 (stand-in for Qwen/Qwen3-0.6B) + eagle3-random (stand-in for AngelSlim/Qwen3-0.6B_eagle3) "
            "| v1 | passed | 4.000 | 3.500 | yes |") in out
    assert ("| tests/e2e/test_spec_decode.py::test_acceptance[ngram-tiny-qwen3] | ngram | hub | Qwen/Qwen3-0.6B | v1 "
            "| failed | 1.310 | 2.000 | no |") in out
    assert ("| tests/e2e/test_spec_decode.py::test_acceptance[mtp-qwen3_5] | mtp | fixture | – | v1 | skipped | – "
            "| 2.000 | – |") in out
    assert ("- tests/e2e/test_spec_decode.py::test_acceptance[mtp-qwen3_5] (skipped, env-blocked): torchvision is not "
            "importable") in out
    assert f"#### cpu_unit: 1 failed, 1 passed ({NAMED}, exit 75)" in out
    assert ("| tests/v1/spec_decode/test_dflash2.py::test_fused[a\\|b] | failed | env-blocked | Triton CPU "
            "backend missing (a Triton kernel was launched) |") in out
    assert "test_ngram_proposer" not in out  # passes are counted, not listed


def test_annotate_says_to_remove_a_declared_defect_a_build_no_longer_has(write_summary):
    """A declared defect's test that passed on a build without the defect (defect_status fixed)
    is listed apart, with what to do: a passing run, not a failure and not a silent pass."""
    note = "the declared defect no longer reproduces on this build: remove its declaration from manifest.toml"
    fixed = entry("tests/e2e/test_sampling.py::test_sampling_release[eagle3-v1/greedy]", "passed",
                  defect_status="fixed", note=note)
    root = write_summary("cpu_e2e", [fixed, E2E_TESTS[0]], 0)
    proc = _annotate("--artifacts", str(root), "cpu_e2e")
    assert proc.returncode == 0, proc.stderr
    assert "#### cpu_e2e: 2 passed" in proc.stdout
    assert ("Declared defects that no longer reproduce (remove the declaration):\n"
            f"- tests/e2e/test_sampling.py::test_sampling_release[eagle3-v1/greedy]: {note}") in proc.stdout


def test_annotate_posts_through_buildkite_agent_when_it_exists(write_summary, tmp_path):
    on_job = {**ON_BUILDKITE, "BUILDKITE_PARALLEL_JOB": "1"}
    write_summary("cpu_unit", UNIT_TESTS, 75, environ=on_job)
    root = write_summary("cpu_e2e", E2E_TESTS, 1, environ=on_job)
    bin_dir, calls = _agent(tmp_path)
    proc = _annotate("--artifacts", str(root), "--step-exit", "75", "cpu_unit", path_dirs=[bin_dir], env=on_job)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    proc = _annotate("--artifacts", str(root), "--step-exit", "1", "cpu_e2e", path_dirs=[bin_dir], env=on_job)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    posted = _posted(calls)
    assert [args for args, _ in posted] == [
        ["annotate", "--style", "warning", "--context", "specgate-cpu_unit-1"],
        ["annotate", "--style", "error", "--context", "specgate-cpu_e2e-1"],
    ]
    assert posted[0][1].startswith("#### cpu_unit shard 1: ") and "| test | outcome | cause | reason |" in posted[0][1]
    assert "| acceptance len |" in posted[1][1]


def test_annotate_never_shows_another_jobs_summary(write_summary, tmp_path):
    """The previous run's green summary, found by the next job (which died before writing
    its own), is refused: only BUILDKITE_JOB_ID's summary is rendered."""
    root = write_summary("cpu_e2e", E2E_TESTS[:1], 0, environ={**ON_BUILDKITE, "BUILDKITE_JOB_ID": "0190-job-old"})
    bin_dir, calls = _agent(tmp_path)
    proc = _annotate("--artifacts", str(root), "--step-exit", "1", "cpu_e2e", path_dirs=[bin_dir], env=ON_BUILDKITE)
    assert proc.returncode == 0, proc.stderr
    [(args, markdown)] = _posted(calls)
    assert args[:3] == ["annotate", "--style", "error"]
    assert markdown == "#### cpu_e2e: no summary from this job (found one from job 0190-job-old)"
    # Outside Buildkite there is no job to compare with: the summary is shown.
    proc = _annotate("--artifacts", str(root), "cpu_e2e")
    assert f"#### cpu_e2e: 1 passed ({NAMED}, exit 0)" in proc.stdout


@pytest.mark.parametrize("step_exit,said", [
    (None, f"#### cpu_e2e: did not finish: its summary still says running ({NAMED})"),
    ("124", f"#### cpu_e2e: timed out; did not finish: its summary still says running ({NAMED}, exit 124)"),
    ("137", f"#### cpu_e2e: timed out; did not finish: its summary still says running ({NAMED}, exit 137)"),
])
def test_annotate_says_a_run_did_not_finish(write_summary, tmp_path, step_exit, said):
    root = write_summary("cpu_e2e", [], None, status="running", environ=ON_BUILDKITE)
    bin_dir, calls = _agent(tmp_path)
    args = ["--step-exit", step_exit] if step_exit else []
    proc = _annotate("--artifacts", str(root), *args, "cpu_e2e", path_dirs=[bin_dir], env=ON_BUILDKITE)
    assert proc.returncode == 0, proc.stderr
    assert _posted(calls) == [(["annotate", "--style", "error", "--context", "specgate-cpu_e2e-0"], said)]


def test_annotate_says_killed_or_crashed_with_the_error(write_summary):
    root = write_summary("cpu_e2e", E2E_TESTS[:1], 1, status="killed", error="SIGTERM: the step timed out",
                         environ=ON_BUILDKITE)
    proc = _annotate("--artifacts", str(root), "--step-exit", "124", "cpu_e2e", env=ON_BUILDKITE)
    assert proc.stdout.startswith("#### cpu_e2e: timed out; killed: SIGTERM: the step timed out "
                                  f"({NAMED}, exit 124)")
    assert "test_acceptance[eagle3-tiny-qwen3]" in proc.stdout  # what ran before the kill
    root = write_summary("cpu_unit", [], 1, status="crashed", error="ManifestError: manifest.toml: missing")
    proc = _annotate("--artifacts", str(root), "--step-exit", "1", "cpu_unit")
    assert proc.stdout.strip() == f"#### cpu_unit: crashed: ManifestError: manifest.toml: missing ({NAMED}, exit 1)"


def test_annotate_reports_a_missing_summary(tmp_path):
    proc = _annotate("--artifacts", str(tmp_path), "cpu_unit")
    assert proc.returncode == 0
    assert proc.stdout.strip() == (f"#### cpu_unit: no summary at {tmp_path}/cpu_unit/summary.json "
                                   "(the step ended before writing it)")
    proc = _annotate("--artifacts", str(tmp_path), "--step-exit", "137", "cpu_unit")
    assert "(the step exited 137 before writing it)" in proc.stdout


@pytest.mark.parametrize("text,problem", [
    ('{"tests": [', "not readable JSON"),
    ("[]", "not a JSON object"),
    ('{"session": "cpu_e2e", "status": "finished", "run": {}, "results": []}', "no 'tests' list"),  # the old contract
    ('{"session": "cpu_e2e", "status": "done", "run": {}, "tests": []}', "'status' is 'done'"),
    ('{"session": "cpu_unit", "status": "finished", "run": {}, "tests": []}', "'session' is 'cpu_unit'"),
    ('{"session": "cpu_e2e", "status": "finished", "run": {}, "tests": [{"test": "x", "outcome": "passed"}]}',
     "a test entry without a nodeid"),
])
def test_annotate_rejects_a_malformed_summary_with_one_line(tmp_path, text, problem):
    (tmp_path / "cpu_e2e").mkdir()
    (tmp_path / "cpu_e2e" / "summary.json").write_text(text)
    proc = _annotate("--artifacts", str(tmp_path), "cpu_e2e")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and f"{tmp_path}/cpu_e2e/summary.json: {problem}" in proc.stderr


def test_annotate_rejects_an_unknown_session():
    proc = _annotate("cpu_bench")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "annotate: unknown session 'cpu_bench' (expected cpu_unit or cpu_e2e)"
