"""Run pytest in a child process with JUnit XML, and read the result back per test."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from junitparser import Error, Failure, JUnitXml, Skipped

NO_TESTS_COLLECTED = 5  # pytest's own code; a failure for us, never a silent pass


@dataclass
class TestResult:
    nodeid: str
    outcome: str          # passed / failed / skipped / error
    message: str          # skip reason or failure message (first line)
    text: str             # the full failure/skip text, for classification
    time_s: float

    def as_dict(self) -> dict:
        data = asdict(self)
        data.pop("text")
        return data


def run_pytest(args: list[str], junit: Path, *, cwd: Path, env: dict[str, str] | None = None,
               log: Path | None = None) -> int:
    """Run `python -m pytest` with JUnit output; stream to the terminal (and a log file if given)."""
    # specgate.envcheck verifies, inside the test process, that the environment matches the manifest.
    command = [sys.executable, "-m", "pytest", "-p", "specgate.envcheck", f"--junitxml={junit}",
               "-o", "junit_family=xunit1", *args]
    print("+ " + " ".join(command), flush=True)
    if log is None:
        return subprocess.run(command, cwd=cwd, env=env).returncode
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace") as proc, log.open("w", encoding="utf-8") as sink:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sink.write(line)
        return proc.wait()


def nodeid(case) -> str:
    """Rebuild pytest's node id from xunit1 attributes (file + classname + name)."""
    file = case._elem.get("file")
    classname = case.classname or ""
    parts = classname.split(".")
    if file:
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file
        if not classname and case.name == module:
            return file  # a collection error: pytest reports it against the file itself
        rest = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
        return "::".join([file, *filter(None, rest.split(".")), case.name])
    return "::".join([*parts, case.name])


def read_junit(junit: Path) -> list[TestResult]:
    results = []
    for suite in JUnitXml.fromfile(str(junit)):
        for case in suite:
            outcome, message, text = "passed", "", ""
            for item in case.result:
                kind = {Failure: "failed", Error: "error", Skipped: "skipped"}.get(type(item))
                if kind:
                    outcome, message, text = kind, item.message or "", item.text or item.message or ""
                    break
            results.append(TestResult(nodeid(case), outcome, message, text, float(case.time or 0)))
    return results


def counts(results: list[TestResult]) -> dict[str, int]:
    tally = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for r in results:
        tally["errors" if r.outcome == "error" else r.outcome] += 1
    return tally


def child_env(extra: dict[str, str | None] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env
