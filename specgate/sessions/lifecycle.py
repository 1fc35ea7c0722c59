"""One session lifecycle, shared by every session module:

    begin the record (a `running` summary that replaces any older one)
    -> parse options, load the manifest, print the effective environment
    -> run the session's own step
    -> finish the record in `finally`: `finished`, or `crashed` / `killed` with the
       process tree ended, so no summary is ever stale or half-written
    -> the exit-code model (specgate.contract.exitcodes) and one closing line.

A session supplies its parser and a step `(Context) -> exit code` that fills
`ctx.record["tests"]` (one shape for every session) and its own fields.
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specgate.contract import artifacts, exitcodes, processes, summary
from specgate.core import build, cli, envpin
from specgate.core.manifest import Manifest
from specgate.vllmside import cachestore

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Abort(Exception):
    """The session cannot go on: one line for the user, and the exit code that earns."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Stopped(BaseException):
    """A stop signal arrived; raised from the handler so `finally` blocks run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Context:
    session: str
    manifest: Manifest
    args: argparse.Namespace
    record: dict[str, Any]
    expects_tests: bool = True   # a run that executes none of them is a failure
    notes: list[str] = field(default_factory=list)

    def set_shard(self, num_shards: int, shard_id: int) -> None:
        self.record["shard"] = {"num_shards": num_shards, "shard_id": shard_id}


Step = Callable[[Context], int]


def _raise_stopped(signum: int, _frame: Any) -> None:
    # One stop is enough: a second (a job's timeout signals nox, which signals us again) must not
    # cut the cleanup short.
    _ignore_stops()
    raise Stopped(signum)


def _ignore_stops() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def run(session: str, parser: cli.Parser, step: Step, argv: Sequence[str] | None = None) -> int:
    record = summary.begin(session)
    artifacts.clear_earlier_outputs(session)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    status, error, code = "finished", None, exitcodes.FAILURE
    ctx: Context | None = None
    try:
        args = cli.parse(parser, argv)
        manifest = cli.start(session)
        print(f"== {session}: testing {build.describe(record['vllm'])} ==", flush=True)
        record["env"] = envpin.session_report(manifest, session)
        ctx = Context(session, manifest, args, record)
        if hasattr(args, "num_shards"):
            ctx.set_shard(args.num_shards, args.shard_id)
        # The lease: the build's venv is never pruned while the session runs.
        with cachestore.lease(*cachestore.build_venv()), processes.session_tempdir():
            code = step(ctx)
    except (cli.BadInput, Abort) as exc:
        print(f"error: {exc}", flush=True)
        code, error = getattr(exc, "exit_code", exitcodes.BAD_INPUT), str(exc)
    except SystemExit as exc:  # --help
        code = exc.code if isinstance(exc.code, int) else exitcodes.BAD_INPUT
    except Stopped as exc:
        status, code, error = "killed", 128 + exc.signum, f"stopped by {exc}"
        ended = processes.end_tree()
        print(f"{session}: stopped by {exc}; ended {len(ended)} child process(es)", flush=True)
    except Exception as exc:  # a bug in the harness or an unexpected environment: say so, never pass
        traceback.print_exc()
        status, code, error = "crashed", exitcodes.FAILURE, f"{type(exc).__name__}: {exc}"
        if artifacts.disk_full(exc):   # the machine's, not vLLM's: a rerun elsewhere (or after a prune) helps
            where = getattr(exc, "filename", None) or "a write"
            code, error = exitcodes.INCOMPLETE, f"env-blocked: disk full (No space left on device) at {where}"
        processes.end_tree()
    finally:
        _ignore_stops()   # until the summary is written: a stop now would leave it saying "running"
    tally = summary.counts(record["tests"])
    expected_tests = ctx is not None and ctx.expects_tests
    if status == "finished" and code == exitcodes.OK and expected_tests and not tally["executed"]:
        code, error = exitcodes.FAILURE, "executed no test where tests were expected: an empty run is not a pass"
    path = summary.finish(record, code, status=status, error=error or record.get("error"))
    artifacts.scrub_tree(path.parent)
    print(summary.closing_line(record, path), flush=True)
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    return code


def main(session: str, parser: cli.Parser, step: Step) -> None:
    sys.exit(run(session, parser, step))
