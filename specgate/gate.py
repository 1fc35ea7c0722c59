"""`nox -s gate`: may a CI step drop its soft_fail? Decided from past summary.json files.

Usage: python -m specgate.gate [--history DIR] [--runs N] [--step STEP ...]

The rule, for each step (cpu_unit, cpu_e2e) on its own:

    A step may drop `soft_fail` when its N most recent runs (default 5, ordered by
    `finished_at`) are all clean and consecutive: none exited 1 and none has a test
    whose cause is `failure`. Across those N runs no test is flaky (the same test
    both passed and failed or errored on the same vLLM version), and every skip
    carries a non-empty reason (cpu_unit `reason`, cpu_e2e `skip_reason`).
    Fewer than N runs in the history is not enough evidence.

A run is one summary.json (so each shard of a sharded build is a run of its own).
The history folder (default artifacts/history) is searched at any depth for files named
summary.json; summaries of other sessions are ignored. Runs that exited 75 count as
clean under this rule, and the verdict says how many there were: once soft_fail is
gone, such a run fails the build.

Prints the verdict and the evidence, writes artifacts/gate/summary.json, and exits 0
when every step asked about may graduate, 1 when not, 2 on bad input (a missing
folder, or a malformed summary: one line naming the file).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specgate import artifacts, cli

SESSION = "gate"
STEPS = ("cpu_unit", "cpu_e2e")
ENTRY_KEYS = {"cpu_unit": ("tests", "nodeid", "reason"), "cpu_e2e": ("results", "test", "skip_reason")}
FAILED = ("failed", "error")


@dataclass(frozen=True)
class Entry:
    id: str
    outcome: str
    cause: str | None
    reason: str | None


@dataclass(frozen=True)
class Run:
    path: Path
    step: str
    vllm_version: str | None
    exit_code: int
    finished_at: datetime
    entries: tuple[Entry, ...]

    def problems(self) -> list[str]:
        """Why this run is not clean (empty when it is)."""
        found = [f"exit {self.exit_code}"] if self.exit_code == 1 else []
        failures = sum(1 for e in self.entries if e.cause == "failure")
        if failures:
            found.append(f"{failures} test(s) with cause failure")
        return found

    def unexplained_skips(self) -> list[str]:
        return [e.id for e in self.entries if e.outcome == "skipped" and not (e.reason or "").strip()]


@dataclass
class Verdict:
    step: str
    runs: list[Run]  # newest first
    needed: int

    @property
    def window(self) -> list[Run]:
        return self.runs[: self.needed]

    @property
    def streak(self) -> int:
        count = 0
        for run in self.runs:
            if run.problems():
                break
            count += 1
        return count

    def flaky(self) -> list[str]:
        seen: dict[tuple[str | None, str], set[str]] = defaultdict(set)
        for run in self.window:
            for entry in run.entries:
                seen[(run.vllm_version, entry.id)].add(entry.outcome)
        return [f"{test} passed and failed on vLLM {version}"
                for (version, test), outcomes in sorted(seen.items(), key=lambda item: (str(item[0][0]), item[0][1]))
                if "passed" in outcomes and outcomes & set(FAILED)]

    def unexplained(self) -> list[str]:
        return [f"{test} skipped without a reason (run of {run.finished_at.isoformat()}, {run.path})"
                for run in self.window for test in run.unexplained_skips()]

    def blockers(self) -> list[str]:
        found = []
        if len(self.runs) < self.needed:
            found.append(f"only {len(self.runs)} run(s) in the history, {self.needed} needed")
        elif self.streak < self.needed:
            bad = self.runs[self.streak]
            found.append(f"only {self.streak} consecutive clean run(s), {self.needed} needed: the run of "
                         f"{bad.finished_at.isoformat()} ({bad.path}) has {', '.join(bad.problems())}")
        found += [f"flaky: {item}" for item in self.flaky()]
        found += [f"unexplained skip: {item}" for item in self.unexplained()]
        return found

    def line(self) -> str:
        blockers = self.blockers()
        if blockers:
            return f"{self.step}: keep soft_fail: " + "; ".join(blockers)
        soft = sum(1 for run in self.window if run.exit_code == 75)
        note = f" (note: {soft} of them exited 75, which fails the build once soft_fail is gone)" if soft else ""
        return (f"{self.step}: may drop soft_fail: the last {self.needed} runs are clean, none flaky, "
                f"every skip explained{note}")


# --------------------------------------------------------------------------- reading the history

def _parse_time(value: Any, path: Path) -> datetime:
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        raise cli.BadInput(f"{path}: finished_at {value!r} is not an ISO time") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def read_run(path: Path) -> Run | None:
    """The run a summary records, or None when it is not a cpu_unit/cpu_e2e summary."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise cli.BadInput(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise cli.BadInput(f"{path}: not a JSON object")
    step = data.get("session")
    if step not in STEPS:
        return None
    list_key, id_key, reason_key = ENTRY_KEYS[step]
    items, code = data.get(list_key), data.get("exit_code")
    if not isinstance(items, list) or not all(isinstance(i, dict) and i.get(id_key) and i.get("outcome") for i in items):
        raise cli.BadInput(f"{path}: '{list_key}' must be a list of objects with '{id_key}' and 'outcome'")
    if not isinstance(code, int) or isinstance(code, bool):
        raise cli.BadInput(f"{path}: exit_code must be an integer")
    if "finished_at" not in data:
        raise cli.BadInput(f"{path}: no finished_at")
    entries = tuple(Entry(str(i[id_key]), str(i["outcome"]), i.get("cause"), i.get(reason_key)) for i in items)
    return Run(path, step, data.get("vllm_version"), code, _parse_time(data["finished_at"], path), entries)


def read_history(folder: Path) -> list[Run]:
    if not folder.is_dir():
        raise cli.BadInput(f"history folder {folder} does not exist")
    runs = [run for path in sorted(folder.rglob("summary.json")) if (run := read_run(path)) is not None]
    return sorted(runs, key=lambda run: run.finished_at, reverse=True)


# --------------------------------------------------------------------------- report

def evidence(verdicts: Sequence[Verdict], folder: Path) -> str:
    rows = []
    for verdict in verdicts:
        for run in verdict.runs[: max(verdict.needed, verdict.streak + 1)]:
            tally = defaultdict(int)
            for entry in run.entries:
                tally[entry.outcome] += 1
            counts = "/".join(str(tally[k]) for k in ("passed", "failed", "skipped")) + (
                f" +{tally['error']} error" if tally["error"] else "")
            skips = run.unexplained_skips()
            notes = run.problems() + ([f"{len(skips)} unexplained skip(s)"] if skips else [])
            rows.append([verdict.step, run.finished_at.isoformat(), run.vllm_version, run.exit_code, counts,
                         "; ".join(notes) or "clean", run.path.relative_to(folder)])
    if not rows:
        return "(no cpu_unit or cpu_e2e runs in the history)"
    return artifacts.format_rows(["step", "finished_at", "vllm", "exit", "pass/fail/skip", "verdict", "file"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(SESSION, "Say from past summary.json files whether a CI step may drop soft_fail.")
    p.add_argument("--history", type=Path, default=None,
                   help="folder of past summary.json files, searched at any depth (default artifacts/history)")
    p.add_argument("--runs", type=int, default=5, help="consecutive clean runs needed (default 5)")
    p.add_argument("--step", action="append", choices=STEPS, default=None,
                   help="the step to judge, repeatable (default: cpu_unit and cpu_e2e)")
    args = cli.parse(p, argv)
    if args.pytest_args:
        p.error("gate takes no pytest arguments")
    if args.runs < 1:
        p.error("--runs must be at least 1")
    folder = args.history or artifacts.artifacts_dir(SESSION).parent / "history"
    steps = args.step or list(STEPS)
    try:
        runs = read_history(folder)
    except cli.BadInput as exc:
        print(f"error: {exc}", flush=True)
        return 2
    verdicts = [Verdict(step, [run for run in runs if run.step == step], args.runs) for step in steps]
    graduates = all(not v.blockers() for v in verdicts)
    print(evidence(verdicts, folder))
    print()
    for verdict in verdicts:
        print(verdict.line())
    code = 0 if graduates else 1
    path = artifacts.write_summary(SESSION, {
        "history": str(folder),
        "runs_needed": args.runs,
        "graduates": graduates,
        "steps": [{
            "step": v.step, "graduates": not v.blockers(), "verdict": v.line(), "blockers": v.blockers(),
            "runs_in_history": len(v.runs), "consecutive_clean": v.streak,
            "window": [{"file": str(r.path.relative_to(folder)), "finished_at": r.finished_at.isoformat(),
                        "vllm_version": r.vllm_version, "exit_code": r.exit_code, "problems": r.problems(),
                        "unexplained_skips": r.unexplained_skips()} for r in v.window],
        } for v in verdicts],
        "exit_code": code,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    })
    artifacts.write_junit(SESSION, [(f"{v.step} may drop soft_fail", "; ".join(v.blockers()) or None, 0.0)
                                    for v in verdicts])
    print(f"== gate: summary written to {path} -> exit {code} ==")
    return code


if __name__ == "__main__":
    sys.exit(main())
