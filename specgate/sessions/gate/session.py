"""`nox -s gate`: may a CI step drop its soft_fail? Decided from past summary.json files.

Usage: nox -s gate -- [--history DIR | --org ORG --pipeline SLUG --branch B --builds N]
                      [--runs N] [--step cpu_unit|cpu_e2e ...]

The history is read by specgate.ciside.history: a folder (--history DIR, $SPECGATE_HISTORY), or
Buildkite's REST API with $BUILDKITE_API_TOKEN and the organisation and pipeline slugs (the
branch's last [gate] history_builds finished builds); both give the same runs and so the same
verdict. With neither it is artifacts/history, which a fresh clone does not have: that is not
enough evidence (exit 1, said in one line), whereas a --history that does not exist is bad input.

The rule, for each step (cpu_unit, cpu_e2e) on its own, over its N most recent runs
(N is [gate] runs in manifest.toml, or --runs; a run and a clean run are defined in
specgate.ciside.history: every shard finished with exit 0, none missing, tests executed, none
with cause failure, the coverage floor of its vLLM version kept):

  The step may drop soft_fail when its N most recent runs are all clean and across them
    - no test is a flake: it passed only after a rerun (an earlier attempt inside the
      session, an earlier wrapper attempt of the job, or an earlier Buildkite job of the
      shard failed it), or it both passed and failed on the same vLLM build (its id, never
      the version string alone: two PR builds can share one);
    - every run is judged: a run whose vLLM version has no floors recorded is shown as
      "not judged" (neither clean nor a failure) and does not count towards graduation;
    - no run exited 75 (listed by build: today soft_fail is what keeps them green);
    - the p90 (nearest rank) of the runs' wall times, a run's wall being its slowest
      shard's `wall_s`, is under the step's timeout budget [gate.budget_s];
    - every skip carries a reason.
  Fewer than N runs is not enough evidence.

Prints the evidence (one row per run) and one verdict per step, writes them to
artifacts/gate/summary.json (one entry per step in `tests`, the evidence in `steps`),
junit.xml, and window.svg: per step, one mark per run of the window (clean, failure, 75,
flaky). Exit 0 when every step asked may graduate, 1 when one may not, 2 on bad input: an
unknown option, a --history that does not exist, Buildkite's 401/403/404, or a summary that
is not JSON or does not follow specgate/contract/summary.schema.json (one line naming the file);
75 when Buildkite cannot be reached.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specgate.ciside import buildkite, history
from specgate.ciside.history import FAILED, STEPS, Run
from specgate.contract import artifacts, exitcodes
from specgate.core import cli
from specgate.core.manifest import GateSpec
from specgate.sessions import lifecycle

SESSION = "gate"
CHART = "window.svg"
FLOORS = "floors.toml"


# --------------------------------------------------------------------------- judging

def p90(values: Sequence[float]) -> float:
    """Nearest-rank 90th percentile: with 5 runs it is the slowest, so one slow run counts."""
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


def flakes(window: Sequence[Run]) -> dict[str, set[str]]:
    """Each flake (in order, without repeats) and the labels of the runs it showed in."""
    found: dict[str, set[str]] = defaultdict(set)
    outcomes: dict[tuple[str | None, str, str], dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for run in window:
        for shard in run.shards:
            for test in shard.tests:
                if test.outcome == "passed" and test.failed_earlier:
                    found[f"{test.nodeid} passed only after a rerun ({run.label})"].add(run.label)
                outcomes[(shard.vllm_version, shard.vllm_build, test.nodeid)][test.outcome].add(run.label)
    # One build, not one version string: two builds of 0.32.0 that disagree are two builds, not a flake.
    for (version, build, nodeid), seen in sorted(outcomes.items(), key=lambda item: tuple(map(str, item[0]))):
        failed = set().union(*(seen[o] for o in FAILED if o in seen))
        if "passed" in seen and failed:
            found[f"{nodeid} both passed and failed on vLLM {version} ({build})"] |= seen["passed"] | failed
    return dict(found)


@dataclass
class Verdict:
    step: str
    needed: int
    runs_in_history: int
    window: list[tuple[Run, list[str]]]   # newest first: each run and why it is not clean
    budget_s: int | None
    p90_wall_s: float | None
    blockers: list[str]
    flaky_runs: set[str]                  # labels of the window's runs a flake showed in
    unjudged_runs: set[str]               # labels of the window's runs whose vLLM version has no floors

    @property
    def graduates(self) -> bool:
        return not self.blockers

    @property
    def marks(self) -> list[tuple[Run, str]]:
        """One word per run of the window, newest first: failure > 75 > not judged > flaky > clean."""
        def mark(run: Run, problems: list[str]) -> str:
            if run.exited(exitcodes.INCOMPLETE) and not run.exited(exitcodes.FAILURE):
                return "75"
            if problems:
                return "failure"
            if run.label in self.unjudged_runs:
                return "not judged"
            return "flaky" if run.label in self.flaky_runs else "clean"

        return [(run, mark(run, problems)) for run, problems in self.window]

    def verdict_line(self) -> str:
        return "keep soft_fail" if self.blockers else "may drop soft_fail"

    def describe(self) -> str:
        if self.blockers:
            return f"{self.step}: keep soft_fail:\n" + "\n".join(f"  - {b}" for b in self.blockers)
        return (f"{self.step}: may drop soft_fail: the last {self.needed} runs are clean (all shards finished "
                f"with exit 0, coverage kept), none flaky, p90 wall {self.p90_wall_s:.0f} s under the "
                f"{self.budget_s} s budget, every skip explained")


def judge(step: str, runs: Sequence[Run], needed: int, spec: GateSpec) -> Verdict:
    window = [(run, history.problems(run, spec)) for run in runs[:needed]]
    budget = spec.budget_s.get(step)
    walls = [run.wall_s for run, _ in window if run.wall_s is not None]
    slow = p90(walls) if walls else None
    blockers = []
    if len(runs) < needed:
        blockers.append(f"not enough evidence: {len(runs)} run(s) in the history, {needed} needed")
    blockers += [f"{run.label} ({run.finished_at.isoformat()}) not clean: {'; '.join(problems)}"
                 for run, problems in window if problems]
    unjudged = {run.label: why for run, problems in window if not problems
                and (why := history.unjudged(run, spec)) is not None}
    blockers += [f"{label} not judged: {why}" for label, why in unjudged.items()]
    soft = [run.label for run, _ in window if run.exited(exitcodes.INCOMPLETE)]
    if soft:
        blockers.append(f"exited 75 (environment or cache incomplete, green today only by soft_fail): "
                        f"{', '.join(soft)}")
    flaky = flakes([run for run, _ in window])
    blockers += [f"flaky: {item}" for item in flaky]
    if budget is None:
        blockers.append(f"no timeout budget declared for {step} (manifest [gate.budget_s])")
    elif window and slow is None:
        blockers.append("no run of the window recorded its wall time")
    elif slow is not None and slow >= budget:
        blockers.append(f"p90 wall time {slow:.0f} s is not under the {budget} s budget")
    blockers += [f"unexplained skip: {t.nodeid} skipped without a reason ({run.label})"
                 for run, _ in window for t in run.tests if t.outcome == "skipped" and not (t.reason or "").strip()]
    return Verdict(step, needed, len(runs), window, budget, slow, blockers, set().union(*flaky.values()),
                   set(unjudged))


# --------------------------------------------------------------------------- report

def _tally(run: Run) -> str:
    counts = Counter(t.outcome for t in run.tests)
    return f"{run.executed}/{counts['passed']}/{counts['failed'] + counts['error']}/{counts['skipped']}"


def evidence(verdicts: Sequence[Verdict]) -> str:
    rows = []
    for verdict in verdicts:
        for run, problems in verdict.window:
            codes = {s.shard_id: s.exit_code for s in run.shards}
            rows.append([verdict.step, run.label, run.finished_at.isoformat(),
                         ",".join(f"{v} ({b})" for v, b in sorted({(str(s.vllm_version), s.vllm_build)
                                                                  for s in run.shards})),
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
            "vllm_builds": run.builds,
            "num_shards": run.num_shards, "missing_shards": run.missing, "wall_s": run.wall_s,
            "executed": run.executed, "outcomes": dict(Counter(t.outcome for t in run.tests)),
            "clean": not problems, "problems": problems, "mark": mark,
            "shards": [{"shard_id": s.shard_id, "status": s.status, "exit_code": s.exit_code, "wall_s": s.wall_s,
                        "file": str(s.path)} for s in run.shards],
        } for (run, problems), (_, mark) in zip(verdict.window, verdict.marks, strict=True)],
    }


# --------------------------------------------------------------------------- session

def build_parser() -> cli.Parser:
    p = cli.parser(SESSION, "Say from past summary.json files whether a CI step may drop soft_fail.", pytest=False)
    history.add_options(p)
    p.add_argument("--runs", type=cli.positive_int, default=None,
                   help="clean runs needed (default: [gate] runs in manifest.toml)")
    p.add_argument("--step", action="append", choices=STEPS, default=None,
                   help="the step to judge, repeatable (default: cpu_unit and cpu_e2e)")
    p.add_argument("--record", action="store_true",
                   help=f"write the coverage floors of each step's newest vLLM version without floors, from its "
                        f"runs that have no problem, to artifacts/{SESSION}/{FLOORS} (for manifest.toml)")
    return p


def recorded_floors(step: str, runs: Sequence[Run], spec: GateSpec) -> str | None:
    """The TOML table of floors for the newest vLLM version among `runs` that has none: per test
    file, the fewest tests that passed in any of that version's runs without a problem."""
    unjudged = [run for run in runs if not history.problems(run, spec) and history.unjudged(run, spec)]
    if not unjudged:
        return None
    version = unjudged[0].versions[0]
    same = [run for run in unjudged if run.versions == [version]]
    files = sorted({t.file for run in same for t in run.tests})
    floors = {name: min(Counter(t.file for t in run.tests if t.outcome == "passed")[name] for run in same)
              for name in files}
    rows = "\n".join(f'"{name}" = {count}' for name, count in floors.items())
    return (f"# from {len(same)} run(s) without a problem: {', '.join(run.label for run in same)}\n"
            f'[gate.coverage."{version}".{step}]\n{rows}\n')


def _read(ctx: lifecycle.Context) -> tuple[str, bool, dict[str, list[Run]]]:
    """Where the history is, whether it exists, and each step's runs in it."""
    source = history.locate(ctx.args, ctx.manifest.gate.history_builds)
    if source is None:
        folder = artifacts.artifacts_dir(SESSION).parent / "history"
        if not folder.is_dir():
            # A fresh clone: nothing to judge yet, which is a verdict (not enough evidence), not bad input.
            print(f"no history: {folder} does not exist (put past builds' artifacts there, or pass --history DIR)")
            return str(folder), False, {s: [] for s in STEPS}
        source = history.Source(folder=folder)
    print(f"history: {source.describe()}", flush=True)
    try:
        return (str(source.folder) if source.folder else source.describe()), True, history.read(source)
    except buildkite.APIError as exc:
        raise lifecycle.Abort(str(exc), exc.exit_code) from None


def step(ctx: lifecycle.Context) -> int:
    ctx.expects_tests = False   # the gate's entries are its verdicts, one per step, never an empty run
    spec = ctx.manifest.gate
    needed = ctx.args.runs or spec.runs
    where, found, runs = _read(ctx)
    verdicts = [judge(name, runs[name], needed, spec) for name in ctx.args.step or STEPS]
    print(evidence(verdicts))
    print()
    for verdict in verdicts:
        print(verdict.describe())
    from specgate.ciside import charts  # matplotlib: only once the verdicts are in

    chart = charts.write(artifacts.artifacts_dir(SESSION) / CHART, charts.window_figure,
                         [(v.step, v.verdict_line(), [(run.label, mark) for run, mark in reversed(v.marks)])
                          for v in verdicts])
    print(f"chart: {chart}")
    if ctx.args.record:
        tables = [table for name in ctx.args.step or STEPS if (table := recorded_floors(name, runs[name], spec))]
        target = artifacts.artifacts_dir(SESSION) / FLOORS
        artifacts.write_atomic(target, "\n".join(tables))
        print(f"floors: {len(tables)} table(s) in {target}; add them to manifest.toml" if tables
              else "floors: every vLLM version in the history has its floors already")
    ctx.record["tests"] = [{"nodeid": f"{SESSION}::{v.step}", "outcome": "passed" if v.graduates else "failed",
                            "cause": None if v.graduates else "failure", "reason": "; ".join(v.blockers) or None,
                            "time_s": None} for v in verdicts]
    ctx.record.update(history=where, history_found=found, runs_needed=needed,
                      steps=[_evidence_record(v) for v in verdicts])
    artifacts.write_junit(SESSION, [(f"{v.step} may drop soft_fail", "; ".join(v.blockers) or None, 0.0)
                                    for v in verdicts])
    return exitcodes.OK if all(v.graduates for v in verdicts) else exitcodes.FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    return lifecycle.run(SESSION, build_parser(), step, argv)

