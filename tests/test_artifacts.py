"""Artifacts are written whole or not at all."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from contract import assert_valid, read_valid

from specgate.contract import artifacts, summary

REPO = Path(__file__).resolve().parent.parent


def test_summary_lands_under_artifacts_session(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path))
    path = summary.finish(summary.begin("cpu_unit"), 0)
    assert path == tmp_path / "cpu_unit" / "summary.json"
    data = read_valid(path)
    assert data["session"] == "cpu_unit" and data["status"] == "finished" and data["exit_code"] == 0
    assert [p.name for p in path.parent.iterdir()] == ["summary.json"]  # no temp file left


def test_the_tests_contract_check_names_a_bad_entry_and_a_bad_field(tmp_path, monkeypatch):
    """tests/contract.py checks each `tests` entry on its own (cached): a bad entry must still
    fail there, under its index, as a bad top-level field does."""
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path))
    record = read_valid(summary.finish(summary.begin("cpu_unit"), 0))
    entry = {"nodeid": "t::a", "outcome": "passed", "cause": None, "reason": None, "time_s": 0.5}
    assert_valid({**record, "tests": [entry, entry]})
    with pytest.raises(AssertionError, match=re.escape("tests/1/outcome: 'weird' is not one of")):
        assert_valid({**record, "tests": [entry, {**entry, "outcome": "weird"}]})
    with pytest.raises(AssertionError, match="status: 'nope' is not one of"):
        assert_valid({**record, "status": "nope", "tests": [entry]})


def test_a_writer_killed_mid_write_leaves_the_old_file_intact(tmp_path):
    """A real child process writes a large JSON slowly and is SIGKILLed half-way."""
    target = tmp_path / "summary.json"
    artifacts.write_json(target, {"generation": 1})
    child = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from specgate.contract import artifacts
class Slow(str):
    pass
import specgate.contract.artifacts as a
real = a.redact
def slow(text):
    time.sleep(30)
    return real(text)
a.redact = slow
a.write_atomic(__import__('pathlib').Path({str(target)!r}), '{{"generation": 2}}')
"""
    proc = subprocess.Popen([sys.executable, "-c", child])
    deadline = time.time() + 20
    while time.time() < deadline and not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
        time.sleep(0.05)
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "the writer never started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads(target.read_text()) == {"generation": 1}


def test_format_rows_aligns_columns():
    text = artifacts.format_rows(["a", "bb"], [[1, None], ["long", 2]])
    assert text.splitlines() == ["a     bb", "----  --", "1", "long  2"]


def test_junit_for_a_session_without_pytest(tmp_path, monkeypatch):
    from specgate.sessions import pytestrun

    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path))
    path = artifacts.write_junit("warm_cache", [("a/b@123", None, 0.5), ("c/d@456", "hub unreachable", 1.0)])
    results = {r.nodeid.split("::")[-1]: r for r in pytestrun.read_junit(path)}
    assert results["a/b@123"].outcome == "passed"
    assert results["c/d@456"].outcome == "failed" and results["c/d@456"].message == "hub unreachable"
    assert [p.name for p in path.parent.iterdir()] == ["junit.xml"]
