"""Options every session module shares, and the start-of-session banner.

Session arguments come from `nox -s NAME -- [args]`, as nox users expect: the
session's own options are recognised by name and everything else goes to pytest
(`nox -s tests -- -k classify`); after an explicit `--` everything goes to pytest.
A session that runs no pytest rejects what it does not know: one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

from specgate.core import envpin
from specgate.core.build import OPTION as BUILD_OPTION
from specgate.core.build import SESSIONS as BUILD_SESSIONS
from specgate.core.build import VAR as BUILD_VAR
from specgate.core.manifest import Manifest, ManifestError, load

MODEL_SOURCES = ("auto", "hub", "fixture")
MODEL_SOURCE_VAR = "SPECGATE_MODEL_SOURCE"
T = TypeVar("T")


class BadInput(Exception):
    """User input the session cannot act on; the message is the one line shown."""


class Parser(argparse.ArgumentParser):
    """argparse that raises BadInput (one line, exit 2 by the session lifecycle) instead of exiting."""

    def __init__(self, *, takes_pytest_args: bool = True, **kwargs: Any) -> None:
        # Keyword arguments only: a positional one could land on allow_abbrev.
        super().__init__(allow_abbrev=False, **kwargs)
        self.takes_pytest_args = takes_pytest_args

    def error(self, message: str):
        raise BadInput(f"{self.prog} {message}")


def positive_int(value: str) -> int:
    """An option's count: argparse turns the error into the one-line bad-input exit."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def parser(prog: str, description: str, *, shards: bool = False, model_source: bool = False,
           pytest: bool = True) -> Parser:
    p = Parser(prog=f"nox -s {prog} --", description=description, takes_pytest_args=pytest)
    # A session of build.SESSIONS takes --vllm, which nox reads and takes out before the session starts.
    takes_build = (f"{BUILD_OPTION} BUILD (read by nox before the session starts): the vLLM under test, pinned "
                   "(default), a wheel (file, folder or glob), installed[:PYTHON] or a source checkout; "
                   f"default ${BUILD_VAR} or pinned. ") if prog in BUILD_SESSIONS else ""
    if model_source:
        p.add_argument("--model-source", choices=MODEL_SOURCES, default=None,
                       help="auto (cached hub checkpoint, else fixture), hub, or fixture; "
                            f"default ${MODEL_SOURCE_VAR} or auto")
    if shards:
        p.add_argument("--num-shards", type=int, default=None, help="split the work across this many agents "
                       "(default $BUILDKITE_PARALLEL_JOB_COUNT or 1)")
        p.add_argument("--shard-id", type=int, default=None, help="this agent's shard, 0-based "
                       "(default $BUILDKITE_PARALLEL_JOB or 0)")
    p.epilog = takes_build + ("Any other argument, and everything after '--', is passed to pytest." if pytest else "")
    return p


def parse(p: Parser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The session's options; `args.pytest_args` holds the rest, in order."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, rest = p.parse_known_args(argv[:cut])
    args.pytest_args = rest + argv[cut + 1:]
    if args.pytest_args and not p.takes_pytest_args:
        p.error(f"unrecognized arguments: {' '.join(args.pytest_args)} (this session runs no pytest)")
    try:
        if hasattr(args, "model_source"):
            args.model_source = resolve_model_source(args.model_source)
        if hasattr(args, "num_shards"):
            args.num_shards, args.shard_id = resolve_shards(args.num_shards, args.shard_id)
    except BadInput as exc:
        p.error(str(exc))
    return args


def resolve_model_source(option: str | None, environ=os.environ) -> str:
    value = option or environ.get(MODEL_SOURCE_VAR) or "auto"
    if value not in MODEL_SOURCES:
        raise BadInput(f"{MODEL_SOURCE_VAR}={value!r}: expected one of {', '.join(MODEL_SOURCES)}")
    return value


def resolve_shards(num: int | None, shard: int | None, environ=os.environ) -> tuple[int, int]:
    try:
        num = num if num is not None else int(environ.get("BUILDKITE_PARALLEL_JOB_COUNT", "1"))
        shard = shard if shard is not None else int(environ.get("BUILDKITE_PARALLEL_JOB", "0"))
    except ValueError as exc:
        raise BadInput(f"shard settings must be whole numbers: {exc}") from None
    if num < 1 or not 0 <= shard < num:
        raise BadInput(f"--shard-id {shard} is not in 0..{num - 1} for --num-shards {num}")
    return num, shard


def shard(items: Sequence[T], num_shards: int, shard_id: int) -> list[T]:
    """Deterministic round-robin split over the items' given order."""
    return [item for index, item in enumerate(items) if index % num_shards == shard_id]


def start(session: str) -> Manifest:
    """Load the manifest (BadInput on a defect) and print the effective environment."""
    try:
        manifest = load()
        manifest.session(session)
    except ManifestError as exc:
        raise BadInput(str(exc)) from None
    report = envpin.session_report(manifest, session)
    print(envpin.format_table(report, f"{session}: effective environment"), flush=True)
    return manifest
