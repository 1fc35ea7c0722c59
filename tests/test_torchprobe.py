"""The torchvision trap: companions that do not import are found, removed and recorded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specgate.core import torchprobe


def _package(root, name, body):
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(body)


def test_probe_finds_the_broken_and_ignores_the_working_and_the_absent(tmp_path, monkeypatch):
    _package(tmp_path, "fakevision", 'raise RuntimeError("operator torchvision::nms does not exist")\n')
    _package(tmp_path, "fakeaudio", "VALUE = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    broken = torchprobe.probe(("fakevision", "fakeaudio", "not_installed_anywhere"))
    assert broken == {"fakevision": "RuntimeError: operator torchvision::nms does not exist"}


def test_degradation_is_recorded_in_the_venv_and_read_back(tmp_path):
    entries = torchprobe.degradation({"torchvision": "RuntimeError: operator torchvision::nms does not exist"})
    assert entries[0]["package"] == "torchvision" and entries[0]["action"] == "removed"
    assert "torchvision::nms" in entries[0]["reason"] and "SPECGATE_TORCH_CPU_INDEX" in entries[0]["reason"]
    assert torchprobe.read_degradation(str(tmp_path)) == []
    torchprobe.write_record(entries, str(tmp_path))
    assert torchprobe.read_degradation(str(tmp_path)) == entries


def test_this_session_venv_has_no_half_working_companion():
    """After the session's install step, each companion either imports or is absent."""
    assert torchprobe.probe() == {}
    removed = {entry["package"] for entry in torchprobe.read_degradation()}
    for module in removed:
        assert torchprobe.import_error(module) is None  # absent, so nothing imports it by accident


@pytest.mark.vllm
def test_vllm_and_transformers_models_import_after_the_probe():
    code = "import vllm; from transformers import Qwen3ForCausalLM; print('ok', vllm.__version__)"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok ")
