"""`nox -s cpu_unit`: vLLM's own spec-decode unit files, at the installed vLLM version.

1. The upstream test tree of the installed version (specgate.vllmside.upstream).
2. The file list from upstream's CPU pipeline step, with the drift against the manifest pin.
3. pytest over those files, offline, with a per-test timeout and JUnit XML.
4. Every non-pass explained (specgate.ciside.classify); cache misses rerun once, online.
5. artifacts/cpu_unit/summary.json and a short table.

Declared offline stand-ins ([[unit.redirects]] in the manifest) are applied through
vLLM's own VLLM_MODEL_REDIRECT_PATH, only to the tests they name, and only when
specgate.vllmside.sources resolves the checkpoint to its fixture (not cached at its pinned
revision, or --model-source fixture). The specgate.vllmside.redirect plugin sets the variable
around those tests only, so the redirect reaches no other test.

Exit codes: 0 all passed, or skipped/blocked for a reason the summary names and
something declares (the test's own skip, or the venv's torch probe record);
1 any failure (also: upstream pipeline step or a listed file missing);
75 only cache misses, transient or auth errors left, or an undeclared missing
environment piece (also: the sdist could not be fetched); 2 bad input.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from junitparser import JUnitXml

from specgate.ciside import classify
from specgate.contract import artifacts, exitcodes, summary
from specgate.core import cli, envpin, torchprobe
from specgate.core.manifest import Manifest, Redirect
from specgate.sessions import lifecycle, pytestrun
from specgate.sessions.pytestrun import TestResult
from specgate.vllmside import cachestore, fixtures, sources, upstream
from specgate.vllmside.redirect import MAP_VAR as REDIRECTS_MAP_VAR

SESSION = "cpu_unit"
REDIRECT_VAR = "VLLM_MODEL_REDIRECT_PATH"
OFFLINE_VAR = "HF_HUB_OFFLINE"
RETRIED = "cache-miss"                       # the one cause worth a second, online attempt
INCOMPLETE = {"cache-miss", "transient", "auth", "env-blocked"}  # exit 75 when nothing failed
UPSTREAM_SKIP = "upstream-skip"              # a test's own skip that names no missing environment piece
SKIP_DECLARES = "the test's own skip condition"
# A skip reason naming one of these is a missing piece of this machine ("Requires CUDA").
ENV_PIECE = re.compile(
    r"\b(?:CUDA|ROCm|HIP|NVIDIA|GPUs?|XPU|TPU|HPU|Triton|FlashInfer|flash[-_ ]?attn\w*|torchvision|torchaudio"
    r"|torchcodec|(?:\d+|two|multiple) devices|not supported on (?:the )?CPU)\b", re.IGNORECASE)
REASON_WIDTH = 110


# --------------------------------------------------------------------------- explaining results

@dataclass
class Outcome:
    """One test's result in one attempt, with its cause and reason."""
    result: TestResult
    attempt: int
    group: str
    cause: str | None = None
    reason: str | None = None
    declared_by: str | None = None           # what declares an env-blocked outcome acceptable
    redirect: dict[str, str] | None = None   # checkpoint -> fixture path, when the test ran redirected
    earlier: list[dict] = field(default_factory=list)

    @property
    def nodeid(self) -> str:
        return self.result.nodeid

    def entry(self) -> dict:
        data: dict[str, Any] = {
            "nodeid": self.nodeid, "outcome": self.result.outcome, "cause": self.cause, "reason": self.reason,
            "attempt": self.attempt, "time_s": round(self.result.time_s, 3), "declared_by": self.declared_by,
            "redirect": self.redirect,
        }
        if self.earlier:
            data["earlier"] = self.earlier
        return data


def explain(result: TestResult, degraded: list[dict],
            offline: bool | None = None) -> tuple[str | None, str | None, str | None]:
    """(cause, reason, declared_by) for one result; all None for a pass.

    A skip is the test's own statement: env-blocked when its reason names a piece of the
    environment, else upstream-skip; its reason is the skip message. Failures and errors
    (collection errors included) go through the shared classifier."""
    if result.outcome == "passed":
        return None, None, None
    if result.outcome == "skipped":
        message = result.message or "skipped without a reason"
        return ("env-blocked" if ENV_PIECE.search(message) else UPSTREAM_SKIP), message, SKIP_DECLARES
    text = result.text or result.message
    label, reason = classify.explain(text, offline=offline)
    reason = reason or result.message or f"{result.outcome} without a message"
    return label, reason, declaring_record(text, degraded) if label == "env-blocked" else None


def declaring_record(text: str, degraded: list[dict]) -> str | None:
    """The torch probe record entry that explains `text` (a package it removed, named in the error)."""
    for entry in degraded:
        package = entry.get("package", "")
        if package and re.search(rf"\b{re.escape(package)}\b", text):
            return f"torch probe: {package} {entry.get('action', 'degraded')} ({entry.get('reason', '')})"
    return None


def exit_code(final: list[Outcome]) -> int:
    """0 when every non-pass is declared; 75 when the undeclared ones are all incomplete
    environment or cache; else 1 (a failure, or a cause this harness does not know)."""
    open_causes = {o.cause for o in final if o.result.outcome != "passed" and not o.declared_by}
    if not open_causes:
        return exitcodes.OK
    return exitcodes.INCOMPLETE if open_causes <= INCOMPLETE else exitcodes.FAILURE


# --------------------------------------------------------------------------- redirects

@dataclass
class RedirectPlan:
    redirect: Redirect
    source: str                 # what specgate.vllmside.sources resolved: hub / fixture
    status: str
    why: str
    path: str | None            # the fixture folder when applied
    tests: list[str]            # the declared tests inside this run's files

    @property
    def applied(self) -> bool:
        return self.path is not None and bool(self.tests)

    def entry(self) -> dict:
        r = self.redirect
        return {"checkpoint": r.checkpoint, "fixture": r.fixture, "tests": list(r.tests), "reason": r.reason,
                "applied": self.applied, "resolved_source": self.source, "status": self.status, "why": self.why,
                "path": self.path, "tests_in_run": self.tests}


def plan_redirects(manifest: Manifest, mode: str, files: list[str]) -> list[RedirectPlan]:
    """Each declared redirect, applied only where sources.resolve picks the fixture."""
    plans = []
    for redirect in manifest.unit.redirects:
        tests = [t for t in redirect.tests if t.split("::")[0] in files]
        if not tests:
            plans.append(RedirectPlan(redirect, "-", "not in this run", "none of its tests is in this run's files",
                                      None, []))
            continue
        src = sources.resolve(manifest, redirect.checkpoint, mode)
        path = str(fixtures.ensure(manifest, redirect.fixture)) if src.source == "fixture" else None
        plans.append(RedirectPlan(redirect, src.source, src.status, src.reason, path, tests))
    return plans


def redirect_map(plans: list[RedirectPlan]) -> dict[str, dict[str, str]]:
    """test id -> {checkpoint: fixture folder}, from the applied plans only."""
    mapping: dict[str, dict[str, str]] = {}
    for plan in plans:
        if plan.applied:
            assert plan.path is not None  # applied means there is a fixture folder
            for test in plan.tests:
                mapping.setdefault(test, {})[plan.redirect.checkpoint] = plan.path
    return mapping


def redirect_file_text(mapping: dict[str, str]) -> str:
    """vLLM's VLLM_MODEL_REDIRECT_PATH file: a JSON object, model name -> local folder
    (read by vllm.transformers_utils.utils.maybe_model_redirect)."""
    return json.dumps(mapping, indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------- running pytest

@dataclass
class Group:
    """One pytest process: its targets, extra environment and deselections."""
    name: str
    targets: list[str]
    env: dict[str, str | None]
    redirect: dict[str, dict[str, str]] | None = None   # test id -> {checkpoint: fixture folder}


def groups_for(files: list[str], mapping: dict[str, dict[str, str]], out: Path) -> list[Group]:
    """One pytest process; declared tests get their redirect file through specgate.vllmside.redirect."""
    if not mapping:
        return [Group("main", files, {REDIRECT_VAR: None})]
    files_by_mapping: dict[str, Path] = {}
    per_test = {}
    for test, checkpoints in sorted(mapping.items()):
        key = json.dumps(checkpoints, sort_keys=True)
        if key not in files_by_mapping:
            files_by_mapping[key] = out / f"model-redirect-{len(files_by_mapping) + 1}.json"
            artifacts.write_atomic(files_by_mapping[key], redirect_file_text(checkpoints))
        per_test[test] = str(files_by_mapping[key])
    plan = out / "redirects.json"
    artifacts.write_json(plan, per_test)
    return [Group("main", files, {REDIRECT_VAR: None, REDIRECTS_MAP_VAR: str(plan)}, mapping)]


def pytest_args(timeout_s: int, exitfirst: bool, extra: list[str]) -> list[str]:
    """--tb=short: tracebacks without library source lines, which would feed the classifier
    code (`except GatedRepoError:`) instead of errors. The user's arguments come last and win."""
    return ["-rA", "-p", "no:cacheprovider", "--continue-on-collection-errors", "--tb=short",
            f"--timeout={timeout_s}", "-o", "timeout_method=signal", *(["-x"] if exitfirst else []), *extra]


@dataclass
class Run:
    group: Group
    attempt: int
    exit_code: int
    wall_s: float
    junit: Path
    results: list[TestResult]
    offline: bool               # HF_HUB_OFFLINE=1 in its environment: a hint for the classifier

    def entry(self) -> dict:
        return {"group": self.group.name, "attempt": self.attempt, "exit_code": self.exit_code,
                "wall_s": round(self.wall_s, 1), "junit": str(self.junit), "targets": self.group.targets,
                "tests": len(self.results)}


def run_group(group: Group, attempt: int, *, root: Path, base_env: dict[str, str | None], args: list[str],
              out: Path) -> Run:
    stem = f"attempt{attempt}-{group.name}"
    junit, log = out / f"junit-{stem}.xml", out / f"pytest-{stem}.log"
    junit.unlink(missing_ok=True)
    plugin = ["-p", "specgate.vllmside.redirect"] if group.redirect else []
    env = pytestrun.child_env({**base_env, **group.env})
    code, wall = pytestrun.run_pytest_timed([*plugin, *args, *group.targets], junit, cwd=root, env=env, log=log)
    results = pytestrun.read_junit(junit) if junit.is_file() else []
    if code not in (0, 1):
        # pytest itself failed (usage error, internal error, interrupted, nothing collected):
        # an error entry of its own, so it can never pass silently.
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-40:])
        message = f"pytest exited {code}"
        results.append(TestResult(f"<pytest {stem}>", "error", message, tail or message, wall))
    return Run(group, attempt, code, wall, junit, results, env.get(OFFLINE_VAR) == "1")


def explained(run: Run, degraded: list[dict]) -> list[Outcome]:
    outcomes = []
    for result in run.results:
        outcome = Outcome(result, run.attempt, run.group.name, redirect=(run.group.redirect or {}).get(result.nodeid))
        outcome.cause, outcome.reason, outcome.declared_by = explain(result, degraded, run.offline)
        outcomes.append(outcome)
    return outcomes


def merge_attempts(first: list[Outcome], second: list[Outcome]) -> list[Outcome]:
    """Final outcomes: a rerun replaces its attempt-1 entry (a file-level collection error
    is replaced by the tests the file yields on the rerun); the earlier one is kept inside."""
    final = []
    for old in first:
        newer = [o for o in second if o.nodeid == old.nodeid or o.nodeid.startswith(old.nodeid + "::")]
        if not newer:
            final.append(old)
        for new in newer:
            new.earlier.append({"attempt": old.attempt, "nodeid": old.nodeid, "outcome": old.result.outcome,
                                "cause": old.cause, "reason": old.reason})
    seen = {o.nodeid for o in final}
    return final + [o for o in second if o.nodeid not in seen]


def merge_junit(runs: list[Run], path: Path) -> None:
    """One JUnit file with every attempt; each suite is named for, and carries, its attempt."""
    merged = JUnitXml(name=SESSION)
    for run in runs:
        if not run.junit.is_file():
            continue
        for suite in JUnitXml.fromfile(str(run.junit)):
            suite.name = f"{SESSION} attempt {run.attempt} ({run.group.name})"
            suite.add_property("attempt", str(run.attempt))
            suite.add_property("group", run.group.name)
            for case in suite:
                case._elem.set("attempt", str(run.attempt))
            merged.add_testsuite(suite)
    artifacts.write_atomic(path, merged.tostring().decode("utf-8"))


# --------------------------------------------------------------------------- the session

def build_parser():
    p = cli.parser(SESSION, "Run vLLM's own spec-decode unit files (upstream's CPU pipeline step).",
                   shards=True, model_source=True)
    p.add_argument("--vllm-source-dir", default=None,
                   help=f"a vLLM checkout to take tests/ and .buildkite/ from (default ${upstream.SOURCE_DIR_VAR}; "
                        "else the installed version's sdist from the package index)")
    p.add_argument("--pinned-files", action="store_true",
                   help="run the manifest's pinned unit.files instead of upstream's pipeline list")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure (pytest -x)")
    return p


def select_files(root: Path, manifest: Manifest, pinned_only: bool) -> tuple[list[str], str, dict | None, list[str]]:
    """(files, files_source, drift, notes). Raises UpstreamError when upstream's list is unusable
    and the pinned list was not asked for."""
    unit, notes = manifest.unit, []
    pinned = list(unit.files)
    try:
        listed = upstream.pipeline_files(root / unit.pipeline, unit.step_key)
    except upstream.UpstreamError as exc:
        if not pinned_only:
            raise upstream.UpstreamError(f"{exc} (--pinned-files runs the manifest's list instead)",
                                         exc.exit_code) from None
        notes.append(str(exc))
        listed = None
    gap = None
    if listed is not None:
        gap = upstream.drift(pinned, listed)
        print(f"upstream: {len(listed)} files from {unit.pipeline} step {unit.step_key}")
        print("drift vs manifest unit.files: " + (f"{len(gap.lines())} change(s)" if gap else "none"))
        for line in gap.lines():
            print(line)
    if pinned_only:
        files, source = pinned, "manifest"
    else:
        assert listed is not None  # without --pinned-files an unusable upstream list was raised above
        files, source = listed, "upstream-pipeline"
    missing = upstream.missing_files(root, files)
    if missing:
        raise upstream.UpstreamError(f"{len(missing)} listed test file(s) missing from the upstream tree: "
                                     + ", ".join(missing), 1)
    return files, source, gap.as_dict() if gap is not None else None, notes


def step(ctx: lifecycle.Context) -> int:
    args, manifest, record = ctx.args, ctx.manifest, ctx.record
    out = artifacts.artifacts_dir(SESSION)   # an earlier run's attempts are gone (lifecycle.run)
    base_env: dict[str, str | None] = {**envpin.session_env(manifest, SESSION), "SPECGATE_SESSION": SESSION}
    record.update({"upstream": None, "files": [], "files_run": [], "files_source": None, "drift": None, "notes": [],
                   "redirects": [], "runs": []})
    try:
        root, fallback = upstream.build_tree(args.vllm_source_dir)
        record["upstream"] = upstream.describe(root)
        print(f"vLLM {upstream.installed_version()}: upstream tests at {root}")
        if fallback:
            print(f"drift: {fallback}", flush=True)
        selected = select_files(root, manifest, args.pinned_files)
        files, record["files_source"], record["drift"], record["notes"] = selected
        record["notes"] = [*([f"drift: {fallback}"] if fallback else []), *record["notes"]]
    except upstream.UpstreamError as exc:
        raise lifecycle.Abort(str(exc), exc.exit_code) from None
    record["files"] = files
    files = record["files_run"] = cli.shard(files, args.num_shards, args.shard_id)
    if not files:
        print(f"shard {args.shard_id} of {args.num_shards}: no files to run")
        ctx.expects_tests = False
        return exitcodes.OK

    plans = plan_redirects(manifest, args.model_source, files)
    groups = groups_for(files, redirect_map(plans), out)
    common = pytest_args(manifest.unit.timeout_s, args.exitfirst, args.pytest_args)
    degraded = torchprobe.read_degradation()
    runs: list[Run] = []

    def launch(group: Group, attempt: int) -> Run | None:
        if args.exitfirst and any(r.exit_code != 0 for r in runs):
            print(f"-x: a failure stopped the session; not run: {group.name} attempt {attempt}", flush=True)
            return None
        with cachestore.lease(root):       # the upstream tree is never pruned while its tests run
            runs.append(run_group(group, attempt, root=root, base_env=base_env, args=common, out=out))
        return runs[-1]

    first: list[Outcome] = []
    for group in groups:
        if run := launch(group, 1):
            first += explained(run, degraded)
    second: list[Outcome] = []
    for group in groups:
        misses = [o.nodeid for o in first if o.group == group.name and o.cause == RETRIED
                  and not o.nodeid.startswith("<pytest")]  # a pytest crash is no test to rerun
        if misses:
            print(f"rerunning {len(misses)} cache-miss test(s) online ({group.name}): {', '.join(misses)}", flush=True)
            online = Group(group.name, misses, {**group.env, **envpin.online_env(manifest)},
                           group.redirect)
            if run := launch(online, 2):
                second += explained(run, degraded)
    final = merge_attempts(first, second)
    merge_junit(runs, out / "junit.xml")
    record.update({"tests": [o.entry() for o in final], "redirects": [p.entry() for p in plans],
                   "runs": [r.entry() for r in runs]})
    code = exit_code(final)
    if any(r.exit_code == exitcodes.PYTEST[4] for r in runs):
        code = exitcodes.worst(code, exitcodes.BAD_INPUT)   # pytest rejected its arguments
    print(report(record, code), flush=True)
    return code


def report(record: dict, code: int) -> str:
    """The human summary: counts, redirects, degradations and every non-pass with cause and reason."""
    tally = summary.counts(record["tests"])
    lines = [f"== {SESSION}: " + ", ".join(f"{n} {k}" for k, n in tally.items()) + f" -> exit {code} =="]
    for r in record["redirects"]:
        state = f"applied -> {r['path']}" if r["applied"] else f"not applied ({r['resolved_source']}: {r['status']})"
        lines.append(f"redirect {r['checkpoint']} -> fixture {r['fixture']}: {state}; {r['why'] or r['reason']}")
    for d in record["degraded"]:
        lines.append(f"degraded: {d.get('package')} {d.get('action')}")
    rows = []
    for (file, outcome, attempt, cause, declared, reason), tests in _non_passes(record["tests"]).items():
        shown = tests[0] if len(tests) == 1 else f"{file} ({len(tests)} tests)"
        rows.append([shown, outcome, attempt, cause, declared, _short(reason)])
    if rows:
        lines.append(artifacts.format_rows(["test", "outcome", "attempt", "cause", "declared", "reason"], rows))
    return "\n".join(lines)


def _non_passes(tests: list[dict]) -> dict[tuple, list[str]]:
    """Non-passes grouped by file, outcome, attempt, cause, declared and reason (summary.json keeps each test)."""
    grouped: dict[tuple, list[str]] = {}
    for t in tests:
        if t["outcome"] != "passed":
            declared = "yes" if t["declared_by"] else "no"  # "no" is what keeps the exit code off 0
            key = (t["nodeid"].split("::")[0], t["outcome"], t["attempt"], t["cause"], declared, t["reason"])
            grouped.setdefault(key, []).append(t["nodeid"])
    return grouped


def _short(text: str | None) -> str:
    line = " ".join((text or "").split())
    return line if len(line) <= REASON_WIDTH else line[:REASON_WIDTH - 1] + "…"

