#!/usr/bin/env python3
"""Render a CI step's summary.json as a Buildkite annotation.

Usage: python3 scripts/annotate.py [--artifacts DIR] [SESSION ...]   (default: cpu_unit cpu_e2e)

cpu_e2e's `results` become an acceptance table, cpu_unit's `tests` a table of the
tests that did not pass with the cause and reason the classifier gave them. With
`buildkite-agent` on PATH each table is posted with `buildkite-agent annotate`
(one context per session and shard); without it the markdown is printed.
A missing summary is reported, not an error (the step may have died before writing
it). Stdlib only. Exit 2 with one line on a malformed summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specgate.artifacts import artifacts_dir  # noqa: E402

SESSIONS = ("cpu_unit", "cpu_e2e")
E2E_COLUMNS = (("test", "test"), ("method", "method"), ("model_source", "model source"), ("runner", "runner"),
               ("outcome", "outcome"), ("acceptance_len", "acceptance len"), ("threshold", "threshold"))


class BadSummary(Exception):
    pass


def cell(value: Any) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.3f}"
    return " ".join(str(value).split()).replace("|", "\\|")


def table(headers: list[str], rows: list[list[Any]], right: set[int] = frozenset()) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---:" if i in right else "---" for i in range(len(headers))) + " |"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def heading(session: str, summary: dict, detail: str) -> str:
    shard = os.environ.get("BUILDKITE_PARALLEL_JOB")
    where = f" shard {shard}" if shard else ""
    return (f"#### {session}{where}: {detail} (vLLM {summary.get('vllm_version') or 'unknown'}, "
            f"exit {summary.get('exit_code')})")


def render_e2e(summary: dict) -> str:
    results = summary.get("results")
    if not isinstance(results, list):
        raise BadSummary("cpu_e2e summary has no 'results' list")
    counts = Counter(r.get("outcome") for r in results)
    detail = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no results"
    rows = [[r.get(key) for key, _ in E2E_COLUMNS] for r in results]
    skips = [f"- {cell(r.get('test'))}: {cell(r.get('skip_reason'))}" for r in results if r.get("outcome") == "skipped"]
    notes = "\n\nSkipped:\n" + "\n".join(skips) if skips else ""
    return heading("cpu_e2e", summary, detail) + "\n\n" + table([h for _, h in E2E_COLUMNS], rows, right={5, 6}) + notes


def render_unit(summary: dict) -> str:
    tests = summary.get("tests")
    if not isinstance(tests, list):
        raise BadSummary("cpu_unit summary has no 'tests' list")
    counts = Counter(t.get("outcome") for t in tests)
    detail = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no tests"
    others = [t for t in tests if t.get("outcome") != "passed"]
    if not others:
        body = f"All {len(tests)} tests passed." if tests else "No test ran."
    else:
        rows = [[t.get("nodeid"), t.get("outcome"), t.get("cause"), t.get("reason")] for t in others]
        body = "Tests that did not pass, with their causes:\n\n" + table(["test", "outcome", "cause", "reason"], rows)
    return heading("cpu_unit", summary, detail) + "\n\n" + body


RENDERERS = {"cpu_unit": render_unit, "cpu_e2e": render_e2e}


def style(summary: dict) -> str:
    code = summary.get("exit_code")
    return "success" if code == 0 else "warning" if code == 75 else "error"


def load(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadSummary(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadSummary(f"{path}: not a JSON object")
    return data


def annotation(session: str, root: Path | None = None) -> tuple[str, str]:
    """(style, markdown) for one session; root defaults to the harness's artifacts folder."""
    path = (root / session if root else artifacts_dir(session)) / "summary.json"
    summary = load(path)
    if summary is None:
        return "error", f"#### {session}: no summary at {path} (the step ended before writing it)"
    try:
        return style(summary), RENDERERS[session](summary)
    except BadSummary as exc:
        raise BadSummary(f"{path}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="annotate.py", description=__doc__.splitlines()[0])
    p.add_argument("sessions", nargs="*", metavar="SESSION", help=f"one of {', '.join(SESSIONS)} (default: both)")
    p.add_argument("--artifacts", type=Path, default=None,
                   help="the artifacts folder (default $SPECGATE_ARTIFACTS or artifacts/)")
    args = p.parse_args(argv)
    if unknown := [s for s in args.sessions if s not in SESSIONS]:
        print(f"annotate: unknown session {unknown[0]!r} (expected {' or '.join(SESSIONS)})", file=sys.stderr)
        return 2
    agent = shutil.which("buildkite-agent")
    for session in args.sessions or SESSIONS:
        try:
            kind, markdown = annotation(session, args.artifacts)
        except BadSummary as exc:
            print(f"annotate: {exc}", file=sys.stderr)
            return 2
        if agent:
            context = f"specgate-{session}-{os.environ.get('BUILDKITE_PARALLEL_JOB', '0')}"
            subprocess.run([agent, "annotate", "--style", kind, "--context", context], input=markdown, text=True,
                           check=False)
        else:
            print(markdown + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
