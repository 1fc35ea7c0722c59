"""The pipeline for vLLM's own CI (.buildkite/vllm/pipeline.yml): valid for Buildkite's schema,
triggered by specgate.ciside.vllmpaths' globs (which cover every file a mutant patches), wired for
both builds under test (a wheel artifact, vLLM's CPU test image), and shaped like specgate's
own pipeline: the wrapper, the annotation, soft_fail on 75 only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pipelines import commands, glob_regex, interpolated, validate_for_buildkite

from specgate.ciside import vllmpaths
from specgate.vllmside import catalogue

REPO = Path(__file__).resolve().parent.parent
PIPELINE = REPO / ".buildkite" / "vllm" / "pipeline.yml"
KEYS = ["warm_cache", "cpu_unit", "cpu_e2e"]
WRAPPER_LINE = re.compile(r'^bash scripts/run-cpu-test\.sh (\S+) "python3 scripts/noxw\.py -s (\w+)[^"]*" '
                          r'\|\| status=\$\$\?$')
UPLOAD_DEFAULT = re.compile(r"\$\{(\w+):-([^}]*)\}")


@pytest.fixture(scope="module")
def pipeline() -> dict:
    data = yaml.safe_load(PIPELINE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("steps"), list)
    return data


@pytest.fixture(scope="module")
def steps(pipeline) -> list[dict]:
    return pipeline["steps"]


def test_the_pipeline_is_valid_for_buildkite():
    proc = validate_for_buildkite(PIPELINE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok -- validation done" in proc.stdout


def test_steps_and_dependencies(steps):
    by_key = {s["key"]: s for s in steps}
    assert list(by_key) == KEYS
    assert by_key["warm_cache"]["depends_on"] == "${SPECGATE_BUILD_STEP:-build-cpu-wheel}"  # vLLM's build step
    for key in ("cpu_unit", "cpu_e2e"):
        assert by_key[key]["depends_on"] == "warm_cache"


# --- triggering ------------------------------------------------------------------------------------

def test_every_step_is_triggered_by_vllmpaths_globs(steps):
    expected = vllmpaths.if_changed(vllmpaths.UPSTREAM_DEPENDENCIES_0_32)
    for step in steps:
        assert "source_file_dependencies" not in step, "vLLM's generator reads it, Buildkite does not"
        assert step["if_changed"] == expected, step["key"]


def test_upstream_entries_become_globs_and_the_cpu_files_follow():
    globs = vllmpaths.if_changed(["vllm/v1/spec_decode/", "vllm/config/speculative.py"])
    assert globs == ["vllm/v1/spec_decode/**", "vllm/config/speculative.py", *vllmpaths.CPU_SPEC_DECODE_FILES]
    upstream = [glob_regex(g) for g in vllmpaths.as_globs(vllmpaths.UPSTREAM_DEPENDENCIES_0_32)]
    for path in vllmpaths.CPU_SPEC_DECODE_FILES:  # each extra file is one upstream's list really misses
        assert not any(g.fullmatch(path) for g in upstream), path


CPU_YAML = """\
group: CPU
depends_on: []
steps:
- label: CPU-Kernel Tests
  key: cpu-kernel-tests
  source_file_dependencies:
  - csrc/cpu/
- label: CPU-Spec Decode Tests
  key: cpu-spec-decode-tests
  source_file_dependencies:
{entries}
  commands:
    - bash .buildkite/scripts/hardware_ci/run-cpu-test.sh 30m "pytest -x tests/v1/spec_decode/test_ngram.py"
"""


def test_upstream_dependencies_are_read_from_a_cpu_yaml():
    text = CPU_YAML.format(entries="\n".join(f"  - {e}" for e in vllmpaths.UPSTREAM_DEPENDENCIES_0_32))
    assert vllmpaths.upstream_dependencies(text) == list(vllmpaths.UPSTREAM_DEPENDENCIES_0_32)
    assert vllmpaths.upstream_dependencies(text, "cpu-kernel-tests") == ["csrc/cpu/"]
    with pytest.raises(KeyError, match="no step keyed 'cpu-e2e'"):
        vllmpaths.upstream_dependencies(text, "cpu-e2e")


def mutant_targets() -> set[str]:
    """The vLLM files the catalogue patches, from what each mutant declares it patches."""
    return {target.split(":")[0].replace(".", "/") + ".py" for m in catalogue.CATALOGUE for target in m.patches}


def test_every_file_a_mutant_patches_triggers_the_pipeline():
    targets = mutant_targets()
    assert {"vllm/v1/worker/cpu_model_runner.py", "vllm/v1/sample/rejection_sampler.py"} <= targets
    assert "vllm/v1/spec_decode/ngram_proposer.py" in targets
    globs = [glob_regex(g) for g in vllmpaths.if_changed(vllmpaths.UPSTREAM_DEPENDENCIES_0_32)]
    for path in sorted(targets):
        assert any(g.fullmatch(path) for g in globs), f"{path}: a mutant patches it, no glob triggers on it"


# --- commands --------------------------------------------------------------------------------------

def build_block(step: dict) -> str:
    return step["commands"][0]


def test_every_step_selects_the_build_then_runs_through_the_wrapper(steps):
    assert len({build_block(s) for s in steps}) == 1  # one text for all: the YAML alias
    for step in steps:
        assert build_block(step).splitlines()[0] == 'cd "$$SPECGATE_DIR"'  # specgate's paths, as in its pipeline
        lines = commands({"commands": step["commands"][1:]})
        match = WRAPPER_LINE.match(lines[0])
        assert match and match.group(2) == step["key"], f"{step['key']}: not through the wrapper: {lines[0]}"
        assert lines[-1] == "exit $${status:-0}"
        for middle in lines[1:-1]:  # only the annotation, told the wrapper's status, which may never fail the step
            assert middle == f'python3 scripts/annotate.py {step["key"]} --step-exit "$${{status:-0}}" || true', middle


def test_both_builds_under_test_are_wired(steps):
    text = build_block(steps[0])
    wheel, image = text.split("wheel)")[1].split(";;")[0], text.split("image)")[1].split(";;")[0]
    assert 'buildkite-agent artifact download "dist/*.whl" . --step "$$SPECGATE_BUILD_STEP"' in wheel
    assert "export SPECGATE_VLLM=dist/" in wheel and "SPECGATE_DOCKER_IMAGE" not in wheel
    assert 'export SPECGATE_DOCKER_IMAGE="$${SPECGATE_CPU_IMAGE:?' in image
    assert "export SPECGATE_VLLM=installed" in image and "artifact download" not in image


def test_soft_fail_only_for_exit_75_and_the_artifacts_are_kept(steps):
    for step in steps:
        assert step["soft_fail"] == [{"exit_status": 75}], step["key"]
        assert step["artifact_paths"] == ["${SPECGATE_DIR:-specgate}/artifacts/**"], step["key"]


def test_every_command_parses_as_bash(steps, tmp_path):
    for step in steps:
        script = tmp_path / f"{step['key']}.sh"
        script.write_text(interpolated("\n".join(step["commands"])) + "\n")
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{step['key']}: {proc.stderr}"


def test_every_named_session_exists_in_the_noxfile(steps):
    names = {WRAPPER_LINE.match(commands({"commands": s["commands"][1:]})[0]).group(2) for s in steps}
    assert names == set(KEYS)
    proc = subprocess.run([sys.executable, "-m", "nox", "-l", "--json", "-s", *sorted(names)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert names <= {entry["session"] for entry in json.loads(proc.stdout)}


def test_each_step_timeout_is_the_gate_budget_in_the_manifest(steps):
    from specgate.core.manifest import load

    units = {"s": 1, "m": 60, "h": 3600}
    budgets = load().gate.budget_s
    for step in steps:
        if step["key"] in budgets:
            number, unit = re.search(r"run-cpu-test\.sh (\d+)([smh])", step["commands"][1]).groups()
            assert int(number) * units[unit] == budgets[step["key"]], step["key"]


# --- the commands as an agent runs them -------------------------------------------------------------

STUB_WRAPPER = """#!/bin/bash
# Records what the wrapper was given: the build, the image, where it ran, the command.
printf '%s\\n' "vllm=${SPECGATE_VLLM:-} image=${SPECGATE_DOCKER_IMAGE:-} cwd=$PWD timeout=$1 command=$2" \\
    >>"$CALLS"
exit "${STUB_EXIT:-0}"
"""


@pytest.fixture
def checkout(tmp_path):
    """A vLLM checkout holding specgate/, whose wrapper and annotate.py only record their
    calls, and a buildkite-agent stand-in on PATH that records its own."""
    specgate = tmp_path / "vllm" / "specgate"
    (specgate / "scripts").mkdir(parents=True)
    (specgate / "scripts" / "run-cpu-test.sh").write_text(STUB_WRAPPER)
    (specgate / "scripts" / "annotate.py").write_text(
        "import os, sys\nopen(os.environ['CALLS'], 'a').write('annotate ' + ' '.join(sys.argv[1:]) + '\\n')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    agent = bin_dir / "buildkite-agent"
    agent.write_text('#!/bin/bash\necho "buildkite-agent $*" >>"$CALLS"\n')
    agent.chmod(0o755)
    return tmp_path


def run_step(step: dict, pipeline: dict, checkout: Path, upload_env: dict[str, str], **job_env: str):
    """The step's script under `bash -e` (as the agent runs it), in the vLLM checkout, with the
    pipeline's env block as the upload interpolates it from `upload_env`. Returns (exit, calls)."""
    calls = checkout / "calls.txt"
    calls.unlink(missing_ok=True)
    env = {k: UPLOAD_DEFAULT.sub(lambda m: upload_env.get(m[1]) or m[2], str(v)) for k, v in pipeline["env"].items()}
    env.update(job_env, CALLS=str(calls), PATH=f"{checkout / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin",
               BUILDKITE_PARALLEL_JOB="0", BUILDKITE_PARALLEL_JOB_COUNT="2")
    proc = subprocess.run(["bash", "-e", "-c", interpolated("\n".join(step["commands"]))], cwd=checkout / "vllm",
                          env=env, capture_output=True, text=True, timeout=60)
    return proc, (calls.read_text().splitlines() if calls.exists() else [])


def test_wheel_mode_downloads_the_build_steps_wheel_and_names_it(steps, pipeline, checkout):
    specgate = checkout / "vllm" / "specgate"
    proc, calls = run_step(steps[2], pipeline, checkout, {})
    assert proc.returncode == 0, proc.stderr
    assert calls[0] == 'buildkite-agent artifact download dist/*.whl . --step build-cpu-wheel'
    assert calls[1].startswith(f"vllm=dist/ image= cwd={specgate} timeout=60m command=python3 scripts/noxw.py "
                               "-s cpu_e2e -- --num-shards=2 --shard-id=0")
    assert calls[2] == "annotate cpu_e2e --step-exit 0"
    proc, calls = run_step(steps[0], pipeline, checkout, {"SPECGATE_BUILD_STEP": "cpu-wheel"})
    assert calls[0].endswith("--step cpu-wheel")


def test_image_mode_runs_in_the_image_with_its_installed_vllm(steps, pipeline, checkout):
    image = "public.ecr.aws/vllm/vllm-ci-test-repo:abc-cpu"
    proc, calls = run_step(steps[1], pipeline, checkout,
                           {"SPECGATE_VLLM_FROM": "image", "SPECGATE_CPU_IMAGE": image}, STUB_EXIT="75")
    assert proc.returncode == 75, proc.stderr  # the wrapper's status survives the annotation
    assert calls[0].startswith(f"vllm=installed image={image} cwd=")
    assert calls[1:] == ["annotate cpu_unit --step-exit 75"]  # and nothing was downloaded


@pytest.mark.parametrize("upload_env,says", [
    ({"SPECGATE_VLLM_FROM": "image"}, "SPECGATE_CPU_IMAGE names no image"),
    ({"SPECGATE_VLLM_FROM": "pinned"}, "SPECGATE_VLLM_FROM is 'pinned', expected wheel or image"),
])
def test_a_misconfigured_build_fails_the_step_before_any_session(steps, pipeline, checkout, upload_env, says):
    proc, calls = run_step(steps[1], pipeline, checkout, upload_env)
    assert proc.returncode not in (0, 75) and says in proc.stderr
    assert calls == []
