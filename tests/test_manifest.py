"""The manifest is the single source of truth; a defect is one line naming file, key and expectation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from specgate.core import manifest as m

REPO = Path(__file__).resolve().parent.parent


def test_real_manifest_loads_and_pins_the_fourteen_unit_files():
    manifest = m.load()
    assert len(manifest.unit.files) == 14
    assert len(set(manifest.unit.files)) == 14
    assert manifest.unit.step_key == "cpu-spec-decode-tests"
    assert {"tests", "warm_cache", "cpu_unit", "cpu_e2e"} <= set(manifest.sessions)
    for checkpoint in manifest.checkpoints.values():
        assert m.REVISION_RE.match(checkpoint.revision) or checkpoint.unpinned_reason, checkpoint
        assert checkpoint.fixture in manifest.fixtures


def test_session_env_values_live_only_in_the_manifest():
    """Upstream set VLLM_CPU_KVCACHE_SPACE in two places with two values; here no Python
    file under specgate/ may carry a pinned value of its own."""
    manifest = m.load()
    sources = "\n".join(p.read_text() for p in (REPO / "specgate").rglob("*.py"))
    for name in manifest.managed_env_names():
        assert not re.search(rf"""["']{name}["']\s*[:=]\s*["']""", sources), f"{name} is assigned outside the manifest"


def _base() -> str:
    return (REPO / "manifest.toml").read_text()


BROKEN = [
    ("schema = 1", "schema = 2", "key 'schema': expected 1"),
    ('step_key = "cpu-spec-decode-tests"', "step_key = 3", "key 'unit.step_key': expected a string, got 3"),
    ("timeout_s = 600", "timeout_s = -1", "key 'unit.timeout_s': expected a positive integer, got -1"),
    ('revision = "c1899de289a04d12100db370d81485cdf75e47ca"', 'revision = "main"',
     "key 'checkpoints.Qwen/Qwen3-0.6B.revision': expected a 40-hex commit revision "
     "(or 'unpinned' with an unpinned_reason), got 'main'"),
    ('VLLM_CPU_CI_ENV = "1"', "VLLM_CPU_CI_ENV = 1", "key 'sessions.cpu_unit.env.VLLM_CPU_CI_ENV': expected a string"),
    ('constraints = "constraints/vllm-cpu.txt"', 'constraints = "constraints/nope.txt"',
     "key 'sessions.tests.constraints': expected an existing file"),
    ("runs = 5", "runs = 0", "key 'gate.runs': expected a positive integer, got 0"),
    ("cpu_unit = 1800", 'cpu_unit = "30m"',
     "key 'gate.budget_s.cpu_unit': expected a positive integer, got '30m'"),
    ("cpu_e2e = 3600", "cpu-e2e = 3600",
     "key 'gate.budget_s.cpu-e2e': expected a session declared under [sessions]"),
    ('[gate.coverage."0.32.0".cpu_unit]', '[gate.coverage."0.32.0".cpu_unti]',
     "key 'gate.coverage.0.32.0.cpu_unti': expected a session declared under [sessions]"),
    ('"tests/v1/spec_decode/test_ngram.py" = 2', '"tests/v1/spec_decode/test_ngram.py" = -2',
     "key 'gate.coverage.0.32.0.cpu_unit.tests/v1/spec_decode/test_ngram.py': expected an integer >= 0, got -2"),
]


@pytest.mark.parametrize("old,new,message", BROKEN, ids=[b[2].split("'")[1] for b in BROKEN])
def test_malformed_manifest_names_file_key_and_expectation(tmp_path, old, new, message):
    text = _base()
    assert old in text, f"test drifted from manifest.toml: {old!r}"
    path = tmp_path / "manifest.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(m.ManifestError) as info:
        m.load(path)
    assert str(info.value).startswith("manifest.toml: ")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unpinned_checkpoint_needs_a_reason(tmp_path):
    path = tmp_path / "manifest.toml"
    path.write_text(_base().replace('revision = "c1899de289a04d12100db370d81485cdf75e47ca"', 'revision = "unpinned"'))
    with pytest.raises(m.ManifestError,
                       match=r"Qwen3-0.6B.revision': expected a 40-hex commit revision \(or 'unpinned' "
                             r"with an unpinned_reason\), got 'unpinned'"):
        m.load(path)


def test_invalid_toml_is_one_line(tmp_path):
    path = tmp_path / "manifest.toml"
    path.write_text("schema = = 1\n")
    with pytest.raises(m.ManifestError, match=r"^manifest.toml: not valid TOML"):
        m.load(path)


def test_unknown_method_is_rejected(tmp_path):
    path = tmp_path / "manifest.toml"
    path.write_text(_base() + '\n[[e2e.configs]]\nid = "x"\nmethod = "medusa"\ntarget = "Qwen/Qwen3-0.6B"\n')
    with pytest.raises(m.ManifestError,
                       match=r"method': expected one of none, ngram, eagle3, dflash, mtp, got 'medusa'"):
        m.load(path)


def test_the_gate_section_holds_runs_budgets_and_the_measured_coverage():
    gate = m.load().gate
    assert gate.runs == 5
    assert gate.budget_s == {"cpu_unit": 1800, "cpu_e2e": 3600}
    unit = m.load().unit
    assert set(gate.floors("0.32.0", "cpu_unit")) == set(unit.files)   # every pinned unit file has a floor
    assert sum(gate.floors("0.32.0", "cpu_unit").values()) == 121
    assert gate.floors("0.32.0", "cpu_e2e")
    assert gate.floors("0.33.0", "cpu_unit") is None and gate.floors(None, "cpu_unit") is None


def test_a_coverage_table_without_files_is_rejected(tmp_path):
    path = tmp_path / "manifest.toml"
    path.write_text(_base() + '\n[gate.coverage."0.33.0".cpu_unit]\n')
    with pytest.raises(m.ManifestError, match=r"key 'gate.coverage.0.33.0.cpu_unit': expected a table of test "
                                              r"file = passed tests, got \{\}"):
        m.load(path)


def test_session_with_malformed_manifest_exits_2_with_one_line(tmp_path):
    path = tmp_path / "manifest.toml"
    path.write_text(_base().replace("schema = 1", "schema = 7"))
    proc = subprocess.run([sys.executable, "-m", "specgate.sessions.selftest"], cwd=REPO, capture_output=True,
                          text=True, env={**_env(), "SPECGATE_MANIFEST": str(path)})
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == ["error: manifest.toml: key 'schema': expected 1, got 7"]
    assert "-> exit 2 (bad input)" in lines[-1] and len(lines) == 2


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "SPECGATE_SESSION"}
