"""The Buildkite pipeline: it parses, names real nox sessions, soft-fails only on 75,
runs every step through the wrapper, and its annotations render from summaries."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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


def commands(step: dict) -> list[str]:
    text = step.get("command") or "\n".join(step.get("commands", []))
    return [line for line in text.splitlines() if line.strip()]


def interpolated(line: str) -> str:
    """What Buildkite's upload-time interpolation leaves for the agent's shell."""
    return line.replace("$$", "$")


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
        for middle in lines[1:-1]:  # only the annotation, which may never fail the step
            assert re.fullmatch(r"python3 scripts/annotate\.py (cpu_unit|cpu_e2e) \|\| true", middle), middle


def test_commands_parse_as_bash_and_escape_every_dollar(steps):
    for step in steps:
        text = "\n".join(commands(step))
        assert not re.search(r"(?<!\$)\$(?!\$)", text.replace("$$", "")), f"{step['key']}: a $ Buildkite would interpolate"
        proc = subprocess.run(["bash", "-n", "-c", interpolated(text)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_the_wrapper_status_survives_the_annotation(steps, tmp_path):
    """Run a step's command block as the agent does (bash -e), with the wrapper's place
    taken by a command that exits 75: the step must exit 75, annotated or not."""
    for step in steps:
        lines = [interpolated(line) for line in commands(step)]
        lines[0] = re.sub(r'^bash scripts/run-cpu-test\.sh \S+ "[^"]+"', "bash -c 'exit 75'", lines[0])
        env = {**os.environ, "SPECGATE_ARTIFACTS": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
        proc = subprocess.run(["bash", "-e", "-c", "\n".join(lines)], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 75, (step["key"], proc.stdout, proc.stderr)


def test_every_named_session_exists_in_the_noxfile(steps):
    names = set()
    for step in steps:
        for line in commands(step):
            names.update(re.findall(r"(?:nox|noxw\.py)\s+(?:\S+\s+)*?-s\s+(\w+)", line))
    assert names == {"warm_cache", "cpu_unit", "cpu_e2e"}
    proc = subprocess.run([sys.executable, "-m", "nox", "-l", "--json", "-s", *sorted(names)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = {entry["session"] for entry in json.loads(proc.stdout)}
    assert names <= listed


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


def test_artifacts_and_source_dependencies(steps):
    for step in steps:
        assert "artifacts/**" in step["artifact_paths"]
        deps = step["source_file_dependencies"]
        assert {"specgate/", "manifest.toml", "constraints/", "noxfile.py"} <= set(deps)
        for dep in deps:
            assert (REPO / dep).exists(), f"{step['key']}: {dep} does not exist"
    e2e = next(s for s in steps if s["key"] == "cpu_e2e")
    assert "tests/e2e/" in e2e["source_file_dependencies"]


# --- annotations ---------------------------------------------------------------------------------
E2E = {"vllm_version": "0.32.0", "exit_code": 1, "finished_at": "2026-11-29T22:00:00+00:00", "results": [
    {"test": "tests/e2e/test_spec_decode.py::test_acceptance[eagle3-tiny-qwen3]", "method": "eagle3",
     "model_source": "fixture", "runner": "v1", "outcome": "passed", "acceptance_len": 4.0, "threshold": 3.5},
    {"test": "tests/e2e/test_spec_decode.py::test_acceptance[ngram-tiny-qwen3]", "method": "ngram",
     "model_source": "hub", "runner": "v1", "outcome": "failed", "acceptance_len": 1.31, "threshold": 2.0},
    {"test": "tests/e2e/test_spec_decode.py::test_acceptance[mtp-qwen3_5]", "method": "mtp", "model_source": "fixture",
     "runner": "v1", "outcome": "skipped", "acceptance_len": None, "threshold": 2.0,
     "skip_reason": "env-blocked: torchvision is not importable (No module named 'torchvision')"},
]}
UNIT = {"vllm_version": "0.32.0", "exit_code": 75, "finished_at": "2026-11-29T22:00:00+00:00", "tests": [
    {"nodeid": "tests/v1/spec_decode/test_ngram.py::test_ngram_proposer", "outcome": "passed", "cause": None, "reason": None},
    {"nodeid": "tests/v1/spec_decode/test_dflash2.py::test_fused[a|b]", "outcome": "failed", "cause": "env-blocked",
     "reason": "env-blocked: Triton CPU backend missing (a Triton kernel was launched)"},
]}


def _write_summaries(root: Path) -> None:
    for session, summary in (("cpu_e2e", E2E), ("cpu_unit", UNIT)):
        (root / session).mkdir(parents=True)
        (root / session / "summary.json").write_text(json.dumps({"session": session, **summary}))


def _annotate(*args: str, path_dirs: list[Path] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"])
    return subprocess.run([sys.executable, str(ANNOTATE), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": path, **(env or {})})


def test_annotate_renders_the_acceptance_and_causes_tables(tmp_path):
    _write_summaries(tmp_path)
    proc = _annotate("--artifacts", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "#### cpu_e2e: 1 failed, 1 passed, 1 skipped (vLLM 0.32.0, exit 1)" in out
    assert "| test | method | model source | runner | outcome | acceptance len | threshold |" in out
    assert ("| tests/e2e/test_spec_decode.py::test_acceptance[ngram-tiny-qwen3] | ngram | hub | v1 | failed | 1.310 "
            "| 2.000 |") in out
    assert "| tests/e2e/test_spec_decode.py::test_acceptance[mtp-qwen3_5] | mtp | fixture | v1 | skipped | – | 2.000 |" in out
    assert "- tests/e2e/test_spec_decode.py::test_acceptance[mtp-qwen3_5]: env-blocked: torchvision is not importable" in out
    assert "#### cpu_unit: 1 failed, 1 passed (vLLM 0.32.0, exit 75)" in out
    assert ("| tests/v1/spec_decode/test_dflash2.py::test_fused[a\\|b] | failed | env-blocked | env-blocked: Triton CPU "
            "backend missing (a Triton kernel was launched) |") in out
    assert "test_ngram_proposer" not in out  # passes are counted, not listed


def test_annotate_posts_through_buildkite_agent_when_it_exists(tmp_path):
    """buildkite-agent is not installed here: a stand-in on PATH records how it is called."""
    _write_summaries(tmp_path / "artifacts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.jsonl"
    agent = bin_dir / "buildkite-agent"
    agent.write_text(f"#!{sys.executable}\nimport json, sys\n"
                     f"open({str(calls)!r}, 'a').write(json.dumps([sys.argv[1:], sys.stdin.read()]) + '\\n')\n")
    agent.chmod(0o755)
    proc = _annotate("--artifacts", str(tmp_path / "artifacts"), "cpu_unit", "cpu_e2e", path_dirs=[bin_dir],
                     env={"BUILDKITE_PARALLEL_JOB": "1"})
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    posted = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [args for args, _ in posted] == [
        ["annotate", "--style", "warning", "--context", "specgate-cpu_unit-1"],
        ["annotate", "--style", "error", "--context", "specgate-cpu_e2e-1"],
    ]
    assert posted[0][1].startswith("#### cpu_unit shard 1: ") and "| test | outcome | cause | reason |" in posted[0][1]
    assert "| acceptance len |" in posted[1][1]


def test_annotate_reports_a_missing_summary_and_rejects_a_malformed_one(tmp_path):
    proc = _annotate("--artifacts", str(tmp_path), "cpu_unit")
    assert proc.returncode == 0
    assert f"#### cpu_unit: no summary at {tmp_path}/cpu_unit/summary.json" in proc.stdout
    (tmp_path / "cpu_e2e").mkdir()
    (tmp_path / "cpu_e2e" / "summary.json").write_text('{"results": [')
    proc = _annotate("--artifacts", str(tmp_path), "cpu_e2e")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and f"{tmp_path}/cpu_e2e/summary.json: not readable JSON" in proc.stderr
    proc = _annotate("cpu_bench")
    assert proc.returncode == 2 and proc.stderr.strip() == "annotate: unknown session 'cpu_bench' (expected cpu_unit or cpu_e2e)"
