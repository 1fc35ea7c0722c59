#!/usr/bin/env python3
"""Render a CI step's summary.json as a Buildkite annotation.

Usage: python3 scripts/annotate.py [--artifacts DIR] [--step-exit CODE] [SESSION ...]
(default sessions: cpu_unit cpu_e2e)

cpu_e2e's tests become an acceptance table, below its chart (artifacts/cpu_e2e/acceptance.svg,
embedded as an artifact:// image when the session wrote it) and above what its drift check
found; cpu_unit's a table of the tests that did not pass with the cause and reason the
classifier gave them. With `buildkite-agent` on PATH each annotation is posted with
`buildkite-agent annotate` (one context per session and shard); without it the markdown
is printed.

Only this job's summary is shown: on Buildkite (BUILDKITE_JOB_ID set) a summary written
by another job is refused, never rendered as if it were this run. A summary that still
says `running` means the session never finished its record (killed hard or timed out);
--step-exit, the wrapper's exit status, tells a timeout (124, or 137 after the kill)
from the rest. A missing summary is reported, not an error. Stdlib only (the agent's
system python3 runs it). Exit 2 with one line on a malformed summary.
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
from specgate.contract import summary as contract  # noqa: E402
from specgate.core import build  # noqa: E402

SESSIONS = ("cpu_unit", "cpu_e2e")
STATUSES = ("running", *contract.FINAL)
TIMEOUTS = (124, 137)   # GNU timeout: the command timed out; 137 when it also had to SIGKILL
# "model": the target and draft, a fixture named first (summary.model_label), never a bare hub id it stood in for.
E2E_COLUMNS = (("nodeid", "test"), ("method", "method"), ("model_source", "model source"), ("model", "model"),
               ("runner", "runner"), ("outcome", "outcome"), ("acceptance_len", "acceptance len"),
               ("threshold", "threshold"), ("matches_baseline", "matches baseline"))
CHART = "acceptance.svg"   # cpu_e2e's chart (specgate.ciside.charts), uploaded with artifacts/**


class BadSummary(Exception):
    pass


def cell(value: Any) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}"
    return " ".join(str(value).split()).replace("|", "\\|")


def table(headers: list[str], rows: list[list[Any]], right: set[int] = frozenset()) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---:" if i in right else "---" for i in range(len(headers))) + " |"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def title(session: str) -> str:
    shard = os.environ.get("BUILDKITE_PARALLEL_JOB")
    return f"#### {session}" + (f" shard {shard}" if shard else "")


def tally(tests: list[dict]) -> str:
    counts = Counter(t["outcome"] for t in tests)
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no tests"


def render_e2e(tests: list[dict]) -> str:
    rows = [[contract.model_label(t) if key == "model" else t.get(key) for key, _ in E2E_COLUMNS] for t in tests]
    notes = [f"- {cell(t['nodeid'])} ({t['outcome']}, {cell(t.get('cause'))}): {cell(t.get('reason'))}"
             for t in tests if t["outcome"] != "passed"]
    fixed = [f"- {cell(t['nodeid'])}: {cell(t.get('note'))}" for t in tests if t.get("defect_status") == "fixed"]
    body = table([h for _, h in E2E_COLUMNS], rows, right={6, 7})
    return (body + ("\n\nNot passed:\n" + "\n".join(notes) if notes else "")
            + ("\n\nDeclared defects that no longer reproduce (remove the declaration):\n" + "\n".join(fixed)
               if fixed else ""))


def render_unit(tests: list[dict]) -> str:
    others = [t for t in tests if t["outcome"] != "passed"]
    if not others:
        return f"All {len(tests)} tests passed." if tests else "No test ran."
    rows = [[t["nodeid"], t["outcome"], t.get("cause"), t.get("reason")] for t in others]
    return "Tests that did not pass, with their causes:\n\n" + table(["test", "outcome", "cause", "reason"], rows)


RENDERERS = {"cpu_unit": render_unit, "cpu_e2e": render_e2e}


def chart(session: str, folder: Path) -> str:
    if session != "cpu_e2e" or not (folder / CHART).is_file():
        return ""
    # artifact:// names an artifact by its path from the checkout it was uploaded from, which
    # is vLLM's in vLLM's pipeline (specgate/artifacts/...), this repository's in its own.
    uploaded = Path("artifacts", session, CHART)
    checkout = os.environ.get("BUILDKITE_BUILD_CHECKOUT_PATH")
    if checkout and (folder / CHART).resolve().is_relative_to(Path(checkout).resolve()):
        uploaded = (folder / CHART).resolve().relative_to(Path(checkout).resolve())
    return (f'\n\n<img src="artifact://{uploaded.as_posix()}" '
            'alt="acceptance per draft position and over recent runs">')


def drift_notes(drift: Any) -> str:
    """cpu_e2e's drift check: why it did not run, or its warnings (its regressions are failed tests above)."""
    if not isinstance(drift, dict):
        return ""
    if not drift.get("checked"):
        return f"\n\nDrift not checked: {cell(drift.get('why'))}"
    notes = [f"- warning: {cell(w)}" for w in drift.get("warnings") or []]
    notes += [f"- incomparable: {cell(i)}" for i in drift.get("incomparable") or []]
    return (f"\n\nDrift against {cell(drift.get('source'))}: {len(drift.get('regressions') or [])} regression(s)"
            + "".join(f"\n{n}" for n in notes))


def load(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadSummary(f"not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadSummary("not a JSON object")
    return data


def check(summary: dict, session: str) -> None:
    """The fields this script reads, in the shape specgate/contract/summary.schema.json gives them."""
    if summary.get("session") != session:
        raise BadSummary(f"'session' is {summary.get('session')!r}, not {session!r}")
    if summary.get("status") not in STATUSES:
        raise BadSummary(f"'status' is {summary.get('status')!r}, not one of {', '.join(STATUSES)}")
    if not isinstance(summary.get("run"), dict):
        raise BadSummary("no 'run' object")
    tests = summary.get("tests")
    if not isinstance(tests, list):
        raise BadSummary("no 'tests' list")
    for test in tests:
        if not (isinstance(test, dict) and isinstance(test.get("nodeid"), str)
                and test.get("outcome") in contract.OUTCOMES):
            raise BadSummary(f"a test entry without a nodeid and a known outcome: {json.dumps(test)[:200]}")


def headline(summary: dict, timed_out: bool) -> str:
    """What happened to the run: its counts, or why it has none."""
    status = summary["status"]
    if status == "running":
        what = "did not finish: its summary still says running"
    elif status in ("killed", "crashed"):
        what = f"{status}: {cell(summary.get('error') or 'no error recorded')}"
    else:
        what = tally(summary["tests"])
    return f"timed out; {what}" if timed_out else what


def style(status: str, code: int | None) -> str:
    if status != "finished":
        return "error"
    return {0: "success", 75: "warning"}.get(code, "error")


def annotation(session: str, root: Path | None = None, step_exit: int | None = None) -> tuple[str, str]:
    """(style, markdown) for one session; root defaults to the harness's artifacts folder."""
    path = root / session / "summary.json" if root else contract.path(session)
    try:
        summary = load(path)
        if summary is not None:
            check(summary, session)
    except BadSummary as exc:
        raise BadSummary(f"{path}: {exc}") from None
    if summary is None:
        ended = f"the step exited {step_exit}" if step_exit is not None else "the step ended"
        return "error", f"{title(session)}: no summary at {path} ({ended} before writing it)"
    job, found = os.environ.get("BUILDKITE_JOB_ID"), summary["run"].get("job_id")
    if job and found != job:
        where = f"job {found}" if found else "a run outside Buildkite"
        return "error", f"{title(session)}: no summary from this job (found one from {where})"
    code = summary.get("exit_code") if step_exit is None else step_exit  # the step's status is what Buildkite sees
    versions = build.describe(summary.get("vllm")) + (f", exit {code}" if code is not None else "")
    markdown = f"{title(session)}: {headline(summary, step_exit in TIMEOUTS)} ({versions})"
    markdown += chart(session, path.parent)
    if summary["tests"] or summary["status"] == "finished":  # what ran before a kill is still worth showing
        markdown += "\n\n" + RENDERERS[session](summary["tests"])
    markdown += drift_notes(summary.get("drift")) if session == "cpu_e2e" else ""   # cpu_unit's drift: its files
    return style(summary["status"], code), markdown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="annotate.py", description=__doc__.splitlines()[0])
    p.add_argument("sessions", nargs="*", metavar="SESSION", help=f"one of {', '.join(SESSIONS)} (default: both)")
    p.add_argument("--artifacts", type=Path, default=None,
                   help="the artifacts folder (default $SPECGATE_ARTIFACTS or artifacts/)")
    p.add_argument("--step-exit", type=int, default=None, metavar="CODE",
                   help="the step's exit status from scripts/run-cpu-test.sh (124 and 137 are timeouts)")
    args = p.parse_args(argv)
    if unknown := [s for s in args.sessions if s not in SESSIONS]:
        print(f"annotate: unknown session {unknown[0]!r} (expected {' or '.join(SESSIONS)})", file=sys.stderr)
        return 2
    agent = shutil.which("buildkite-agent")
    for session in args.sessions or SESSIONS:
        try:
            kind, markdown = annotation(session, args.artifacts, args.step_exit)
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
