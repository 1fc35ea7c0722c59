"""The nox side of the exit-code model, under real nox: every session of a call runs, and the
call ends with the most severe session code (nox alone would say 1 for any failure)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
