"""Options every session module shares, and the start-of-session banner.

Session arguments come from `nox -s NAME -- [options] [-- pytest args]`.
Unknown options exit 2 with a usage line (argparse's own behaviour).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import TypeVar

from specgate import envpin
from specgate.manifest import Manifest, ManifestError, load

MODEL_SOURCES = ("auto", "hub", "fixture")
MODEL_SOURCE_VAR = "SPECGATE_MODEL_SOURCE"
T = TypeVar("T")


class BadInput(Exception):
    """User input the session cannot act on; the message is the one line shown."""


def parser(prog: str, description: str, *, shards: bool = False, model_source: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"nox -s {prog} --", description=description)
    if model_source:
        p.add_argument("--model-source", choices=MODEL_SOURCES, default=None,
                       help=f"auto (cached hub checkpoint, else fixture), hub, or fixture; default ${MODEL_SOURCE_VAR} or auto")
    if shards:
        p.add_argument("--num-shards", type=int, default=None, help="split the work across this many agents "
                       "(default $BUILDKITE_PARALLEL_JOB_COUNT or 1)")
        p.add_argument("--shard-id", type=int, default=None, help="this agent's shard, 0-based "
                       "(default $BUILDKITE_PARALLEL_JOB or 0)")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER,
                   help="after a second '--': arguments passed through to pytest")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.pytest_args and args.pytest_args[0] == "--":
        args.pytest_args = args.pytest_args[1:]
    elif args.pytest_args:
        p.error(f"unrecognized arguments: {' '.join(args.pytest_args)} (pytest arguments go after '--')")
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
    """Load the manifest (exit 2 on a defect) and print the effective environment."""
    try:
        manifest = load()
    except ManifestError as exc:
        print(f"error: {exc}", flush=True)
        raise SystemExit(2) from None
    print(envpin.format_table(envpin.session_report(manifest, session), f"{session}: effective environment"), flush=True)
    return manifest
