"""`nox -s gate`: may a CI step drop its soft_fail? Decided from past summary.json files.

Usage: nox -s gate -- [--history DIR] [--runs N] [--step cpu_unit|cpu_e2e ...]

The rule, for each step (cpu_unit, cpu_e2e) on its own, over its N most recent runs
(N is [gate] runs in manifest.toml, or --runs):

  A run is one build's job for the step. The summaries of one Buildkite build
  (same `run.build_id`) are its shards; when a shard's job was retried, its latest
  job counts. A summary without a build id is a run of its own. Runs are ordered by
  their latest `finished_at`.

  A run is clean when
    - every shard finished (status `finished`, not running, crashed or killed) and exited 0,
    - all `shard.num_shards` shards are there,
    - it executed at least one test, and no test has cause `failure`,
    - it kept the coverage floor: for every test file listed under
      [gate.coverage."<the run's vLLM version>".<step>], at least that many of the file's
      tests passed, so a file that silently stops running fails the run. A vLLM version
      with no floor declared is not clean either: measure it and declare it first.

  The step may drop soft_fail when its N most recent runs are all clean and across them
    - no test is a flake: it passed only after a rerun (an earlier attempt inside the
      session, an earlier wrapper attempt of the job, or an earlier Buildkite job of the
      shard failed it), or it both passed and failed on the same vLLM version;
    - no run exited 75 (listed by build: today soft_fail is what keeps them green);
    - the p90 (nearest rank) of the runs' wall times, a run's wall being its slowest
      shard's `wall_s`, is under the step's timeout budget [gate.budget_s];
    - every skip carries a reason.
  Fewer than N runs is not enough evidence.

The history (--history DIR) is searched at any depth for summary.json files; summaries
of other sessions are ignored. Without --history it is artifacts/history, which a fresh
clone does not have: that is not enough evidence (exit 1, said in one line), whereas a
--history that does not exist is bad input.

Prints the evidence (one row per run) and one verdict per step, writes them to
artifacts/gate/summary.json (one entry per step in `tests`, the evidence in `steps`) and
junit.xml. Exit 0 when every step asked may graduate, 1 when one may not, 2 on bad input:
an unknown option, a --history that does not exist, or a summary that is not JSON or does
not follow specgate/summary.schema.json (one line naming the file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from specgate import artifacts, cli, exitcodes, lifecycle, summary
from specgate.manifest import GateSpec

SESSION = "gate"
STEPS = ("cpu_unit", "cpu_e2e")
FAILED = ("failed", "error")


# --------------------------------------------------------------------------- reading the history

@dataclass(frozen=True)
class Test:
    nodeid: str
    outcome: str
    cause: str | None
    reason: str | None
    failed_earlier: bool   # an earlier attempt of this test, in any rerun of its job, failed or errored

    @property
    def file(self) -> str:
        return self.nodeid.split("::", 1)[0]


@dataclass(frozen=True)
class Shard:
    """One summary.json of a step: one job of a build."""

    path: Path
    step: str
    run_key: str          # what groups shards into a run: the build id, else the summary's own run id
    label: str            # how the evidence names the run
    shard_id: int
    num_shards: int
    status: str
    exit_code: int | None
    finished_at: datetime  # started_at while the record still says running
    wall_s: float | None
    vllm_version: str | None
    executed: int
    tests: tuple[Test, ...]


@dataclass(frozen=True)
class Run:
    """One build's job for a step: its shards, ordered by shard id."""

    step: str
    shards: tuple[Shard, ...]

    @property
    def label(self) -> str:
        return self.shards[0].label

    @property
    def finished_at(self) -> datetime:
        return max(s.finished_at for s in self.shards)

    @property
    def num_shards(self) -> int:
        return max(s.num_shards for s in self.shards)

    @property
    def missing(self) -> list[int]:
        return sorted(set(range(self.num_shards)) - {s.shard_id for s in self.shards})

    @property
    def versions(self) -> list[str | None]:
        return sorted({s.vllm_version for s in self.shards}, key=str)

    @property
    def wall_s(self) -> float | None:
        walls = [s.wall_s for s in self.shards if s.wall_s is not None]
        return max(walls) if walls else None

    @property
    def executed(self) -> int:
        return sum(s.executed for s in self.shards)

    @property
    def tests(self) -> list[Test]:
        return [t for s in self.shards for t in s.tests]

    def exited(self, code: int) -> bool:
        return any(s.exit_code == code for s in self.shards)


def _validator() -> Callable[[dict[str, Any]], str | None]:
    """A check of one summary against the result contract, giving the first problem or None.
    jsonschema is in every session venv; without it, reading a summary still fails cleanly
    on a missing or mistyped field (see read_shard), just with a less precise message."""
    try:
        import jsonschema
    except ImportError:
        return lambda data: None
    schema = summary.load_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)

    def check(data: dict[str, Any]) -> str | None:
        error = jsonschema.exceptions.best_match(validator.iter_errors(data))
        if error is None:
            return None
        message = " ".join(error.message.split())
        return f"{error.json_path}: {message[:200]}{'...' if len(message) > 200 else ''}"

    return check


def _time(value: str) -> datetime:
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:   # the schema's pattern rules this out; runs are compared across hosts
        raise ValueError(f"{value!r} has no time zone")
    return moment


def _test(entry: dict[str, Any], failed_before: set[str]) -> Test:
    earlier = {attempt.get("outcome") for attempt in entry.get("earlier") or []}
    return Test(entry["nodeid"], entry["outcome"], entry.get("cause"), entry.get("reason"),
                bool(earlier & set(FAILED)) or entry["nodeid"] in failed_before)


def _shard(path: Path, data: dict[str, Any]) -> Shard:
    run = data["run"]
    # A wrapper rerun of the job carries the attempts before it and what each one failed.
    failed_before = {nodeid for attempt in data["earlier_attempts"] for nodeid in attempt["failed"]}
    build = run.get("build_id")
    label = (f"build {run['build_number']}" if run.get("build_number") else f"build {build}" if build
             else f"run {data['run_id']}")
    return Shard(
        path=path, step=data["session"], run_key=f"build {build}" if build else f"run {data['run_id']}",
        label=label, shard_id=data["shard"]["shard_id"], num_shards=data["shard"]["num_shards"],
        status=data["status"], exit_code=data["exit_code"],
        finished_at=_time(data["finished_at"] or data["started_at"]), wall_s=data["wall_s"],
        vllm_version=data["vllm_version"], executed=data["counts"]["executed"],
        tests=tuple(_test(entry, failed_before) for entry in data["tests"]),
    )


def read_shard(path: Path, check: Callable[[dict[str, Any]], str | None]) -> Shard | None:
    """The shard a summary records, or None when it is another session's summary."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise cli.BadInput(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise cli.BadInput(f"{path}: not a JSON object")
    if data.get("session") not in STEPS:
        return None
    problem = check(data)
    if problem:
        raise cli.BadInput(f"{path}: does not follow {summary.SCHEMA_FILE.name}: {problem}")
    try:
        return _shard(path, data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise cli.BadInput(f"{path}: does not follow {summary.SCHEMA_FILE.name}: "
                           f"{type(exc).__name__}: {exc}") from None


def _latest_jobs(shards: Iterable[Shard]) -> tuple[Shard, ...]:
    """One shard per shard id: the latest job. A Buildkite retry of a shard is a rerun too,
    so a test an earlier job failed counts as failed earlier in the job that superseded it."""
    by_id: dict[int, list[Shard]] = defaultdict(list)
    for shard in shards:
        by_id[shard.shard_id].append(shard)
    latest = []
    for jobs in by_id.values():
        jobs.sort(key=lambda s: (s.finished_at, str(s.path)))
        *older, last = jobs
        failed = {t.nodeid for job in older for t in job.tests if t.outcome in FAILED or t.failed_earlier}
        if failed:
            last = dataclasses.replace(last, tests=tuple(
                dataclasses.replace(t, failed_earlier=t.failed_earlier or t.nodeid in failed) for t in last.tests))
        latest.append(last)
    return tuple(sorted(latest, key=lambda s: s.shard_id))


def group_runs(shards: Iterable[Shard]) -> dict[str, list[Run]]:
    """Each step's runs, newest first."""
    groups: dict[tuple[str, str], list[Shard]] = defaultdict(list)
    for shard in shards:
        groups[(shard.step, shard.run_key)].append(shard)
    runs: dict[str, list[Run]] = {step: [] for step in STEPS}
    for (step, _), members in groups.items():
        runs[step].append(Run(step, _latest_jobs(members)))
    for step_runs in runs.values():
        step_runs.sort(key=lambda run: (run.finished_at, run.label), reverse=True)
    return runs


def read_history(folder: Path) -> dict[str, list[Run]]:
    check = _validator()
    shards = [shard for path in sorted(folder.rglob("summary.json")) if (shard := read_shard(path, check))]
    return group_runs(shards)


# --------------------------------------------------------------------------- judging

def p90(values: Sequence[float]) -> float:
    """Nearest-rank 90th percentile: with 5 runs it is the slowest, so one slow run counts."""
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


def coverage_problems(run: Run, spec: GateSpec) -> list[str]:
    if len(run.versions) > 1:
        return [f"shards ran different vLLM versions ({', '.join(map(str, run.versions))})"]
    version = run.versions[0]
    floors = spec.floors(version, run.step)
    if floors is None:
        return [(f"no coverage floor declared for vLLM {version or '(version not recorded)'} "
                 f"(manifest [gate.coverage.\"{version}\".{run.step}])")]
    passed = Counter(t.file for t in run.tests if t.outcome == "passed")
    short = [f"{name} {passed[name]}/{floor}" for name, floor in floors.items() if passed[name] < floor]
    return [f"below the coverage floor (passed/floor): {', '.join(short)}"] if short else []


def run_problems(run: Run, spec: GateSpec) -> list[str]:
    """Why a run is not clean (empty when it is)."""
    found = []
    for shard in run.shards:
        if shard.status == "running":   # killed so hard that not even nox could finish its record
            found.append(f"shard {shard.shard_id} never finished (status running)")
        elif shard.status != "finished":
            found.append(f"shard {shard.shard_id} {shard.status}")
        elif shard.exit_code != exitcodes.OK:
            found.append(f"shard {shard.shard_id} exited {shard.exit_code}")
    if run.missing:
        found.append(f"shard(s) {', '.join(map(str, run.missing))} of {run.num_shards} missing")
    if not run.executed:
        found.append("executed no test")
    failures = sum(1 for t in run.tests if t.cause == "failure")
    if failures:
        found.append(f"{failures} test(s) with cause failure")
    return found + coverage_problems(run, spec)


def flakes(window: Sequence[Run]) -> list[str]:
    found: dict[str, None] = {}   # ordered and without repeats
    outcomes: dict[tuple[str | None, str], set[str]] = defaultdict(set)
    for run in window:
        for shard in run.shards:
            for test in shard.tests:
                if test.outcome == "passed" and test.failed_earlier:
                    found[f"{test.nodeid} passed only after a rerun ({run.label})"] = None
                outcomes[(shard.vllm_version, test.nodeid)].add(test.outcome)
    for (version, nodeid), seen in sorted(outcomes.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        if "passed" in seen and seen & set(FAILED):
            found[f"{nodeid} both passed and failed on vLLM {version}"] = None
    return list(found)


@dataclass
class Verdict:
    step: str
    needed: int
    runs_in_history: int
    window: list[tuple[Run, list[str]]]   # newest first: each run and why it is not clean
    budget_s: int | None
    p90_wall_s: float | None
    blockers: list[str]

    @property
    def graduates(self) -> bool:
        return not self.blockers

    def describe(self) -> str:
        if self.blockers:
            return f"{self.step}: keep soft_fail:\n" + "\n".join(f"  - {b}" for b in self.blockers)
        return (f"{self.step}: may drop soft_fail: the last {self.needed} runs are clean (all shards finished "
                f"with exit 0, coverage kept), none flaky, p90 wall {self.p90_wall_s:.0f} s under the "
                f"{self.budget_s} s budget, every skip explained")


def judge(step: str, runs: Sequence[Run], needed: int, spec: GateSpec) -> Verdict:
    window = [(run, run_problems(run, spec)) for run in runs[:needed]]
    budget = spec.budget_s.get(step)
    walls = [run.wall_s for run, _ in window if run.wall_s is not None]
    slow = p90(walls) if walls else None
    blockers = []
    if len(runs) < needed:
        blockers.append(f"not enough evidence: {len(runs)} run(s) in the history, {needed} needed")
    blockers += [f"{run.label} ({run.finished_at.isoformat()}) not clean: {'; '.join(problems)}"
                 for run, problems in window if problems]
    soft = [run.label for run, _ in window if run.exited(exitcodes.INCOMPLETE)]
    if soft:
        blockers.append(f"exited 75 (environment or cache incomplete, green today only by soft_fail): "
                        f"{', '.join(soft)}")
    blockers += [f"flaky: {item}" for item in flakes([run for run, _ in window])]
    if budget is None:
        blockers.append(f"no timeout budget declared for {step} (manifest [gate.budget_s])")
    elif window and slow is None:
        blockers.append("no run of the window recorded its wall time")
    elif slow is not None and slow >= budget:
        blockers.append(f"p90 wall time {slow:.0f} s is not under the {budget} s budget")
    blockers += [f"unexplained skip: {t.nodeid} skipped without a reason ({run.label})"
                 for run, _ in window for t in run.tests if t.outcome == "skipped" and not (t.reason or "").strip()]
    return Verdict(step, needed, len(runs), window, budget, slow, blockers)


# --------------------------------------------------------------------------- report

def _tally(run: Run) -> str:
    counts = Counter(t.outcome for t in run.tests)
    return f"{run.executed}/{counts['passed']}/{counts['failed'] + counts['error']}/{counts['skipped']}"


def evidence(verdicts: Sequence[Verdict]) -> str:
    rows = []
    for verdict in verdicts:
        for run, problems in verdict.window:
            codes = {s.shard_id: s.exit_code for s in run.shards}
            rows.append([verdict.step, run.label, run.finished_at.isoformat(), ",".join(map(str, run.versions)),
                         f"{len(run.shards)}/{run.num_shards}",
                         ",".join("-" if i not in codes else str(codes[i]) for i in range(run.num_shards)),
                         _tally(run), "?" if run.wall_s is None else f"{run.wall_s:.0f}",
                         "; ".join(problems) or "clean"])
    if not rows:
        return "(no cpu_unit or cpu_e2e runs in the history)"
    return artifacts.format_rows(["step", "run", "finished_at", "vllm", "shards", "exit", "exec/pass/fail/skip",
                                  "wall_s", "verdict"], rows)


def _evidence_record(verdict: Verdict) -> dict[str, Any]:
    return {
        "step": verdict.step, "graduates": verdict.graduates, "blockers": verdict.blockers,
        "runs_needed": verdict.needed, "runs_in_history": verdict.runs_in_history,
        "budget_s": verdict.budget_s, "p90_wall_s": verdict.p90_wall_s,
        "window": [{
            "run": run.label, "finished_at": run.finished_at.isoformat(), "vllm_versions": run.versions,
            "num_shards": run.num_shards, "missing_shards": run.missing, "wall_s": run.wall_s,
            "executed": run.executed, "outcomes": dict(Counter(t.outcome for t in run.tests)),
            "clean": not problems, "problems": problems,
            "shards": [{"shard_id": s.shard_id, "status": s.status, "exit_code": s.exit_code, "wall_s": s.wall_s,
                        "file": str(s.path)} for s in run.shards],
        } for run, problems in verdict.window],
    }


# --------------------------------------------------------------------------- session

def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def build_parser() -> cli.Parser:
    p = cli.parser(SESSION, "Say from past summary.json files whether a CI step may drop soft_fail.", pytest=False)
    p.add_argument("--history", type=Path, default=None,
                   help="folder of past summary.json files, searched at any depth (default artifacts/history)")
    p.add_argument("--runs", type=positive_int, default=None,
                   help="clean runs needed (default: [gate] runs in manifest.toml)")
    p.add_argument("--step", action="append", choices=STEPS, default=None,
                   help="the step to judge, repeatable (default: cpu_unit and cpu_e2e)")
    return p


def step(ctx: lifecycle.Context) -> int:
    ctx.expects_tests = False   # the gate's entries are its verdicts, one per step, never an empty run
    spec = ctx.manifest.gate
    needed = ctx.args.runs or spec.runs
    folder = ctx.args.history or artifacts.artifacts_dir(SESSION).parent / "history"
    if folder.is_dir():
        runs = read_history(folder)
    elif ctx.args.history:
        raise cli.BadInput(f"history folder {folder} does not exist")
    else:
        # A fresh clone: nothing to judge yet, which is a verdict (not enough evidence), not bad input.
        print(f"no history: {folder} does not exist (put past builds' artifacts there, or pass --history DIR)")
        runs = {s: [] for s in STEPS}
    verdicts = [judge(name, runs[name], needed, spec) for name in ctx.args.step or STEPS]
    print(evidence(verdicts))
    print()
    for verdict in verdicts:
        print(verdict.describe())
    ctx.record["tests"] = [{"nodeid": f"{SESSION}::{v.step}", "outcome": "passed" if v.graduates else "failed",
                            "cause": None if v.graduates else "failure", "reason": "; ".join(v.blockers) or None,
                            "time_s": None} for v in verdicts]
    ctx.record.update(history=str(folder), history_found=folder.is_dir(), runs_needed=needed,
                      steps=[_evidence_record(v) for v in verdicts])
    artifacts.write_junit(SESSION, [(f"{v.step} may drop soft_fail", "; ".join(v.blockers) or None, 0.0)
                                    for v in verdicts])
    return exitcodes.OK if all(v.graduates for v in verdicts) else exitcodes.FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    return lifecycle.run(SESSION, build_parser(), step, argv)


if __name__ == "__main__":
    lifecycle.main(SESSION, build_parser(), step)
