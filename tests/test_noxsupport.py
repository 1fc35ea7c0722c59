"""The nox side of the exit-code model, under real nox: every session of a call runs, and the
call ends with the most severe session code (nox alone would say 1 for any failure)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from contract import read_valid

REPO = Path(__file__).resolve().parent.parent
NOXFILE = f'''
import sys
sys.path.insert(0, {str(REPO)!r})
import nox
from specgate.sessions import noxsupport

def ending(code):
    def session(session):
        open(session.posargs[0] + "/" + session.name, "w").close()   # it ran
        noxsupport.conclude(session, code)
    return session

for name, code in {{"passes": 0, "incomplete": 75, "bad_input": 2, "fails": 1, "passes_too": 0}}.items():
    nox.session(name=name, venv_backend="none")(ending(code))
'''


@pytest.mark.parametrize("sessions, want", [
    (["passes", "passes_too"], 0),
    (["incomplete", "passes"], 75),
    (["bad_input", "incomplete", "passes"], 2),
    (["incomplete", "fails", "bad_input", "passes"], 1),
])
def test_the_nox_call_ends_with_the_most_severe_code_after_running_every_session(tmp_path, sessions, want):
    noxfile = tmp_path / "noxfile.py"
    noxfile.write_text(NOXFILE)
    proc = subprocess.run([sys.executable, "-m", "nox", "-f", str(noxfile), "-s", *sessions, "--", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == want, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "noxfile.py") == sorted(sessions)


RECORDED = f'''
import sys
sys.path.insert(0, {str(REPO)!r})
import nox
from specgate.sessions import noxsupport

@nox.session(name="lint", venv_backend="none")
def lint(session):
    noxsupport.recorded(session, lambda: session.run(sys.executable, "-c", "raise SystemExit(1)", external=True))

@nox.session(name="typecheck", venv_backend="none")
def typecheck(session):
    noxsupport.recorded(session, lambda: session.run(sys.executable, "-c", "pass", external=True))
'''


def _nox_recorded(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """nox over RECORDED's sessions, their artifacts under tmp_path."""
    noxfile = tmp_path / "noxfile.py"
    noxfile.write_text(RECORDED)
    return subprocess.run([sys.executable, "-m", "nox", "-f", str(noxfile), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "SPECGATE_ARTIFACTS": str(tmp_path / "artifacts")})


def test_a_session_without_a_session_process_still_writes_its_summary_and_closing_line(tmp_path):
    """lint, typecheck and lock run only tools, but each leaves a summary of this run and ends
    with the one closing line, like every other session."""
    proc = _nox_recorded(tmp_path, "-s", "lint", "typecheck")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed, passed = (read_valid(tmp_path / "artifacts" / name / "summary.json") for name in ("lint", "typecheck"))
    assert (failed["status"], failed["exit_code"]) == ("finished", 1)
    assert (passed["status"], passed["exit_code"]) == ("finished", 0)
    assert failed["error"] and passed["error"] is None and failed["run_id"] != passed["run_id"]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert [line.split(":")[0] for line in lines] == ["== lint", "== typecheck"], proc.stdout
    assert "-> exit 1 (failure)" in lines[0] and "-> exit 0 (pass)" in lines[1]


def test_install_only_records_nothing(tmp_path):
    """`nox --install-only` runs no command, so it leaves no summary saying a check passed."""
    proc = _nox_recorded(tmp_path, "--install-only", "-s", "lint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "artifacts" / "lint").exists() and "== lint" not in proc.stdout
