"""Past runs of a step, read from where their summary.json files live, and which are clean.

Where: a folder (--history DIR or $SPECGATE_HISTORY), searched at any depth, or Buildkite
(specgate.ciside.buildkite) when BUILDKITE_API_TOKEN is set with organisation and pipeline slugs
(--org/--pipeline, else $BUILDKITE_ORGANIZATION_SLUG/$BUILDKITE_PIPELINE_SLUG) and a branch
(--branch, else $BUILDKITE_BRANCH): its --builds most recent finished builds. Both end as
summary files read the same way, so both give the same runs. Naming both is bad input.

Runs: a run is one build's job for a step. The summaries of one Buildkite build (same
`run.build_id`) are its shards; when a shard's job was retried, its latest job counts. A
summary without a build id is a run of its own. Runs are ordered by their latest
`finished_at`, newest first; summaries of other sessions are ignored.

A run is clean when
  - every shard finished (status `finished`, not running, crashed or killed) and exited 0,
  - all `shard.num_shards` shards are there,
  - it executed at least one test, and no test has cause `failure`,
  - it kept the coverage floor: for every test file listed under
    [gate.coverage."<the run's vLLM version>".<step>], at least that many of the file's
    tests passed, so a file that silently stops running fails the run. A vLLM version
    with no floor declared is not clean either: measure it and declare it first.

A summary that is not JSON or does not follow specgate/contract/summary.schema.json is bad input
(one line naming the file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from specgate.ciside import buildkite
from specgate.contract import exitcodes, summary
from specgate.core import cli
from specgate.core.manifest import GateSpec

STEPS = ("cpu_unit", "cpu_e2e")
FAILED = ("failed", "error")
FOLDER_VAR = "SPECGATE_HISTORY"


# --------------------------------------------------------------------------- where it lives

@dataclass(frozen=True)
class Source:
    """Where the past summaries are: a folder, or a Buildkite pipeline's branch."""

    folder: Path | None = None
    pipeline: buildkite.Pipeline | None = None
    builds: int = 0

    def describe(self) -> str:
        if self.folder is not None:
            return f"folder {self.folder}"
        assert self.pipeline is not None  # a Source names a folder or a pipeline
        return f"Buildkite {self.pipeline.describe()}, its last {self.builds} finished builds"

    def files(self) -> list[Path]:
        if self.folder is not None:
            return sorted(self.folder.rglob("summary.json"))
        assert self.pipeline is not None  # a Source names a folder or a pipeline
        return buildkite.summaries(self.pipeline, self.builds)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--history", type=Path, default=None,
                   help=f"folder of past summary.json files, searched at any depth (default ${FOLDER_VAR})")
    p.add_argument("--org", default=None, help="Buildkite organisation slug, for a history read from Buildkite "
                   f"(default ${buildkite.ORG_VAR}; needs ${buildkite.TOKEN_VAR})")
    p.add_argument("--pipeline", default=None, help=f"Buildkite pipeline slug (default ${buildkite.PIPELINE_VAR})")
    p.add_argument("--branch", default=None, help=f"the branch whose builds count (default ${buildkite.BRANCH_VAR})")
    p.add_argument("--builds", type=cli.positive_int, default=None,
                   help="how many of the branch's most recent finished builds to read (default: [gate] "
                        "history_builds in manifest.toml)")


def locate(args: argparse.Namespace, default_builds: int,
           environ: Mapping[str, str] = os.environ) -> Source | None:
    """The history the options and environment name, or None when they name none."""
    folder = args.history or (Path(environ[FOLDER_VAR]) if environ.get(FOLDER_VAR) else None)
    asked_buildkite = args.org or args.pipeline
    if args.history and asked_buildkite:
        raise cli.BadInput("--history and --org/--pipeline name two histories: pass one of them")
    if folder is not None and not asked_buildkite:
        if not folder.is_dir():
            raise cli.BadInput(f"history folder {folder} does not exist")
        return Source(folder=folder)
    token = environ.get(buildkite.TOKEN_VAR)
    org, slug = args.org or environ.get(buildkite.ORG_VAR), args.pipeline or environ.get(buildkite.PIPELINE_VAR)
    if asked_buildkite and not (token and org and slug):
        raise cli.BadInput(f"a Buildkite history needs ${buildkite.TOKEN_VAR} and both the organisation "
                           "(--org) and pipeline (--pipeline) slugs")
    if not (token and org and slug):
        return None
    branch = args.branch or environ.get(buildkite.BRANCH_VAR)
    if not branch:
        raise cli.BadInput(f"a Buildkite history reads one branch: pass --branch or set ${buildkite.BRANCH_VAR}")
    return Source(pipeline=buildkite.Pipeline(org, slug, branch, token), builds=args.builds or default_builds)


def read(source: Source) -> dict[str, list[Run]]:
    """Each step's runs in the history, newest first (buildkite.APIError when Buildkite
    cannot give them)."""
    check = _validator()
    return group_runs(shard for path in source.files() if (shard := read_shard(path, check)))


# --------------------------------------------------------------------------- runs

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
    vllm_build: str       # the build's id (specgate.core.build); older summaries: their version
    executed: int
    tests: tuple[Test, ...]
    summary: dict[str, Any] = field(compare=False, repr=False)   # the whole record, for what else it measured


@dataclass(frozen=True)
class Run:
    """One build's job for a step: its shards, ordered by shard id."""

    step: str
    shards: tuple[Shard, ...]

    @property
    def key(self) -> str:
        return self.shards[0].run_key

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
    def builds(self) -> list[str]:
        return sorted({s.vllm_build for s in self.shards})

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


def build_key(data: Mapping[str, Any]) -> str:
    """What tells two vLLM builds apart: the build's id, never its version alone (two PR builds
    can share one); a summary written before builds were named has only its version."""
    found = (data.get("vllm") or {}).get("id")
    return f"build {found}" if found else f"version {data['vllm_version']}"


def run_key(data: Mapping[str, Any]) -> str:
    """What makes summaries shards of one run: their Buildkite build, else their own run id."""
    build = data["run"].get("build_id")
    return f"build {build}" if build else f"run {data['run_id']}"


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
        path=path, step=data["session"], run_key=run_key(data),
        label=label, shard_id=data["shard"]["shard_id"], num_shards=data["shard"]["num_shards"],
        status=data["status"], exit_code=data["exit_code"],
        finished_at=_time(data["finished_at"] or data["started_at"]), wall_s=data["wall_s"],
        vllm_version=data["vllm_version"], vllm_build=build_key(data), executed=data["counts"]["executed"],
        tests=tuple(_test(entry, failed_before) for entry in data["tests"]), summary=data,
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


# --------------------------------------------------------------------------- clean runs

def unjudged(run: Run, spec: GateSpec) -> str | None:
    """Why a run cannot be judged (its version has no floors), or None. Such a run is
    neither clean nor a failure: another version's numbers say nothing about it."""
    if len(run.versions) == 1 and spec.floors(run.versions[0], run.step) is None:
        version = run.versions[0]
        return (f"no floors recorded for vLLM {version or '(version not recorded)'} "
                f"(manifest [gate.coverage.\"{version}\".{run.step}]; record them with nox -s gate -- --record)")
    return None


def coverage_problems(run: Run, spec: GateSpec) -> list[str]:
    if len(run.builds) > 1:
        return [f"shards ran different vLLM builds ({', '.join(run.builds)})"]
    floors = spec.floors(run.versions[0], run.step)
    if floors is None:
        return []   # not judged (unjudged), not a problem of the run's
    passed = Counter(t.file for t in run.tests if t.outcome == "passed")
    short = [f"{name} {passed[name]}/{floor}" for name, floor in floors.items() if passed[name] < floor]
    return [f"below the coverage floor (passed/floor): {', '.join(short)}"] if short else []


def problems(run: Run, spec: GateSpec) -> list[str]:
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


def clean(runs: Sequence[Run], spec: GateSpec) -> list[Run]:
    return [run for run in runs if not problems(run, spec)]
