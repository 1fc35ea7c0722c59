"""Run pytest in a child process with JUnit XML, and read the result back per test."""

from __future__ import annotations

import getpass
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from junitparser import Error, Failure, JUnitXml, Skipped

from specgate.contract import artifacts, processes
from specgate.core.secrets import redact, redactor

# Buildkite Test Engine's collector (package buildkite-test-collector), by its pytest11 entry point.
TEST_ENGINE_PLUGIN = "buildkite-test-collector"
TEST_ENGINE_TOKEN = "BUILDKITE_ANALYTICS_TOKEN"


@dataclass
class TestResult:
    nodeid: str
    outcome: str          # passed / failed / skipped / error
    message: str          # skip reason or failure message (first line)
    text: str             # the full failure/skip text, for classification
    time_s: float

    def entry(self, cause: str | None = None, reason: str | None = None, **extra) -> dict:
        """The summary's test entry (summary.schema.json#/$defs/test)."""
        return {"nodeid": self.nodeid, "outcome": self.outcome, "cause": cause,
                "reason": reason if reason is not None else (self.message or None), "time_s": round(self.time_s, 2),
                **extra}


def collector_args(env: Mapping[str, str]) -> list[str]:
    """Load the collector when its token is set, so timings and flakiness reach Test Engine.
    Without the token it is blocked: an installed pytest11 plugin loads by itself, and this one
    would add its options and warn about the missing token."""
    return ["-p", TEST_ENGINE_PLUGIN if env.get(TEST_ENGINE_TOKEN) else f"no:{TEST_ENGINE_PLUGIN}"]


def run_pytest(args: list[str], junit: Path, *, cwd: Path, env: dict[str, str] | None = None,
               log: Path | None = None) -> int:
    """Run `python -m pytest` with JUnit output. Its output reaches the terminal (and the log
    file, if given) with secrets masked, and so does the JUnit XML; it dies with this process."""
    # specgate.sessions.envcheck verifies, inside the test process, that the environment matches the manifest.
    env = dict(os.environ if env is None else env)
    command = [sys.executable, "-m", "pytest", "-p", "specgate.sessions.envcheck",
               *collector_args(env), f"--junitxml={junit}", "-o", "junit_family=xunit1", *args]
    print(redact("+ " + " ".join(command)), flush=True)
    # A short name: vLLM's IPC sockets go in it, and a Unix socket's path has at most 107 bytes.
    given = processes.given_tempdir()
    with tempfile.TemporaryDirectory(prefix="specgate-", dir=given, ignore_cleanup_errors=True) as private:
        return _run(command, cwd, private_tmpdir_env(env, Path(private)), junit, log)


def private_tmpdir_env(env: dict[str, str], private: Path) -> dict[str, str]:
    """`env` with TMPDIR at `private`, a folder removed after the run: what the child leaves
    in its temp dir (pytest's tmp_path, vLLM's IPC sockets and gloo files) goes with it.
    Inductor keeps its precompiled headers (about 155 MB per compiler command line) in
    <temp dir>/torchinductor_<user> whatever TORCHINDUCTOR_CACHE_DIR says (torch's codecache
    keeps them "global"); that name links to the compile cache, so they are kept and pruned
    with it instead of built again each run (about 40 s of a cold cpu_e2e) or left in /tmp."""
    inductor = env.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())     # as torch's default_cache_dir names it
        (private / f"torchinductor_{user}").symlink_to(inductor, target_is_directory=True)
    return {**env, "TMPDIR": str(private)}


def _run(command: list[str], cwd: Path, env: dict[str, str], junit: Path, log: Path | None) -> int:
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", preexec_fn=processes.die_with_parent) as proc:
        assert proc.stdout is not None
        sink = log.open("w", encoding="utf-8") if log else None
        scrub = redactor()
        try:
            for line in proc.stdout:
                line = scrub(line)
                sys.stdout.write(line)
                if sink:
                    sink.write(line)
        finally:
            if sink:
                sink.close()
        code = proc.wait()
    if junit.is_file():
        artifacts.scrub_file(junit)
    return code


def run_pytest_timed(args: list[str], junit: Path, *, cwd: Path, env: dict[str, str] | None = None,
                     log: Path | None = None) -> tuple[int, float]:
    """run_pytest, and its wall time in seconds (unrounded: each caller records it at its own precision)."""
    started = time.monotonic()
    code = run_pytest(args, junit, cwd=cwd, env=env, log=log)
    return code, time.monotonic() - started


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


def child_env(extra: dict[str, str | None] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env
