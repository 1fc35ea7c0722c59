"""`nox -s cpu_e2e`: engine-level speculative-decoding tests in torch.compile mode.

1. Every checkpoint of the [[e2e.configs]] in this shard is resolved under the
   model-source mode (specgate.vllmside.sources: the pinned hub snapshot, else its fixture);
   known-answer fixtures are built. With --model-source hub a checkpoint that is not
   cached stops the session (exit 75) before any engine starts.
2. The plan (plan.json) tells the tests in tests/e2e what to run; pytest -m e2e runs
   them with JUnit XML, and each test appends what it measured to records.jsonl.
3. summary.json merges both: one test entry per test with what it measured, plus one
   row per engine start with its time.

Exit codes: 0 passed (every skip names its reason), 1 a failure, 2 bad input, 75 what the
run needs could not be had: a required checkpoint (--model-source hub), the Buildkite
history, or upstream's sdist (--upstream-e2e).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

from specgate.ciside import history
from specgate.contract import artifacts, exitcodes
from specgate.core import build, cli, envpin
from specgate.core.manifest import REPO_ROOT, Manifest, ManifestError
from specgate.sessions import lifecycle, pytestrun
from specgate.sessions.e2e import SESSION
from specgate.sessions.e2e import review as e2e_history
from specgate.sessions.e2e.planning import (
    PLAN_VAR,
    Settings,
    missing_models,
    plan_dict,
    resolve_config,
    unrecorded_floors,
    without_floors,
)
from specgate.sessions.e2e.report import (
    RECORDS_VAR,
    Recorder,
    compile_backend,
    engine_rows,
    format_report,
    kernel_libraries,
    merge_results,
    session_exit_code,
)
from specgate.sessions.e2e.standin import run_upstream
from specgate.vllmside import cachestore, compilecache, upstream

TESTS_DIR = "tests/e2e"


def build_parser():
    p = cli.parser(SESSION, "Engine-level spec-decode tests in torch.compile mode.", shards=True,
                   model_source=True)
    p.add_argument("--upstream-e2e", action="store_true",
                   help="also run upstream's tests/v1/e2e/test_cpu_spec_decode.py from the upstream test tree, "
                        "its models redirected to their stand-ins where they resolve to fixtures")
    history.add_options(p)   # where past runs are, for the drift check (specgate.sessions.e2e.review)
    return p


class TestRun(NamedTuple):
    code: int                        # pytest's exit code
    rows: list[dict[str, Any]]       # one per test: JUnit merged with what the test recorded
    engines: list[dict[str, Any]]    # one per engine start
    env: dict[str, str]              # the environment pytest ran in
    wall_s: float                    # pytest's wall time


def run_tests(manifest: Manifest, session: str, plan: dict[str, Any], out: Path, pytest_args: list[str],
              extra_env: dict[str, str] | None = None) -> TestRun:
    """Write the plan into `out`, run tests/e2e on it under pytest (the session's pinned
    environment plus extra_env), and merge JUnit with what the tests recorded."""
    plan_path, records, junit = out / "plan.json", out / "records.jsonl", out / "junit.xml"
    artifacts.write_json(plan_path, plan)
    for stale in (records, junit):
        stale.unlink(missing_ok=True)
    env = pytestrun.child_env({**envpin.session_env(manifest, session), "SPECGATE_SESSION": session,
                               **compilecache.compile_cache_env(), PLAN_VAR: str(plan_path),
                               RECORDS_VAR: str(records), **(extra_env or {})})
    engine_env = Settings(**plan["settings"]).child_env()
    print("compile caches: " + ", ".join(f"{k}={env[k]}" for k in sorted(compilecache.compile_cache_env()))
          + "; engine processes add " + ", ".join(f"{k}={v}" for k, v in engine_env.items()), flush=True)
    with cachestore.lease(compilecache.entry(), *_fixture_paths(plan)):     # never pruned while they run
        code, wall_s = pytestrun.run_pytest_timed(["-m", "e2e", "-rA", "-p", "no:cacheprovider", TESTS_DIR,
                                                   *pytest_args], junit, cwd=REPO_ROOT, env=env,
                                                  log=out / "pytest.log")
    recorded = Recorder(records).read()
    rows = merge_results(pytestrun.read_junit(junit) if junit.is_file() else [], recorded)
    return TestRun(code, rows, engine_rows(recorded, rows), env, round(wall_s, 2))


def _fixture_paths(plan: Any) -> list[Path]:
    """Every fixture checkpoint folder the plan names (its models' `path` under the fixture cache)."""
    root = str(cachestore.roots()["fixtures"])
    if isinstance(plan, dict):
        own = [Path(plan["path"])] if isinstance(plan.get("path"), str) and plan["path"].startswith(root) else []
        return own + [p for value in plan.values() for p in _fixture_paths(value)]
    if isinstance(plan, list):
        return [p for value in plan for p in _fixture_paths(value)]
    return []


def step(ctx: lifecycle.Context) -> int:
    args, manifest, record = ctx.args, ctx.manifest, ctx.record
    out = artifacts.artifacts_dir(SESSION)
    record.update({"model_mode": args.model_source, "configs": [], "compile_backend": None, "engines": []})
    try:
        settings = Settings.parse(manifest)
        chosen = cli.shard(list(manifest.e2e), args.num_shards, args.shard_id)
        configs = [resolve_config(manifest, c, args.model_source, build.version_under_test()) for c in chosen]
    except ManifestError as exc:
        raise cli.BadInput(str(exc)) from None
    record["configs"] = [c.id for c in configs]
    record["dtype"] = {"value": settings.dtype, "fallback_reason": settings.dtype_fallback_reason}
    if settings.dtype_fallback_reason:
        print(f"engines run in {settings.dtype}: {settings.dtype_fallback_reason}", flush=True)
    missing = missing_models(configs)
    if missing:
        for m in missing:
            print(f"missing: {m.name}: {m.reason}", flush=True)
        record.update(error=f"--model-source {args.model_source}: {len(missing)} required checkpoint(s) not cached",
                      missing=[asdict(m) for m in missing])
        return exitcodes.INCOMPLETE
    if not configs:
        print(f"shard {args.shard_id} of {args.num_shards}: no configs to run")
        ctx.expects_tests = False
        return exitcodes.OK

    record["floors"] = unrecorded_floors(manifest, upstream.installed_version()) or "judged"
    if record["floors"] != "judged":
        print(f"floors: {record['floors']}", flush=True)
        configs = [without_floors(c) for c in configs]
    plan = plan_dict(args.model_source, settings, configs, (args.num_shards, args.shard_id))
    code, rows, engines, env, record["pytest_wall_s"] = run_tests(manifest, SESSION, plan, out, args.pytest_args)
    record["env"] = envpin.effective_env(env, envpin.session_env(manifest, SESSION))
    record["engine_process_env"] = settings.child_env()
    exit_code = session_exit_code(code, rows)
    record["pytest_exit_code"] = code
    if args.upstream_e2e:
        upstream_code, upstream_results, record["upstream_e2e"] = run_upstream(
            manifest, args.model_source, env, out, args.pytest_args)
        rows += upstream_results
        exit_code = exitcodes.worst(exit_code, upstream_code)
    record.update(tests=rows, engines=engines, compile_backend=compile_backend(engines),
                  kernels=kernel_libraries(engines))
    exit_code = exitcodes.worst(exit_code, e2e_history.review(ctx, asdict(settings)))   # drift and acceptance.svg
    if rows or engines:
        print(format_report(rows, engines), flush=True)
    return exit_code
