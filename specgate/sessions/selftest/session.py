"""`nox -s tests`, `nox -s ci_jobs` and `nox -s ci_soak`: the harness's own tests, their files
spread over parallel workers. `tests` is the fast loop, everything but tests/ci; `ci_jobs` is
tests/ci, the Buildkite job chain driven as an agent runs it (real installs and engines: minutes,
not seconds), but its soak tests; `ci_soak` is those: many builds in a row (tens of minutes)."""

from __future__ import annotations

from specgate.contract import artifacts, exitcodes
from specgate.core.manifest import REPO_ROOT
from specgate.sessions import lifecycle, pytestrun

# Which tests each session runs (its session name comes from noxsupport, as SPECGATE_SESSION).
# `-m` replaces pyproject's `-m 'not e2e'`, so each tier says it again.
TIERS = {"tests": ["--ignore=tests/ci"], "ci_jobs": ["tests/ci", "-m", "not e2e and not soak"],
         "ci_soak": ["tests/ci", "-m", "soak and not e2e"]}


def step(ctx: lifecycle.Context) -> int:
    junit = artifacts.artifacts_dir(ctx.session) / "junit.xml"
    junit.unlink(missing_ok=True)
    # Test files run in parallel workers, each file whole in one worker (its module fixtures and
    # its order stay as written); `-n 0` after `--` turns that off. Files go out in collection
    # order, not xdist's default of most tests first.
    code, wall_s = pytestrun.run_pytest_timed(["-rA", "-n", "auto", "--dist", "loadfile", "--no-loadscope-reorder",
                                               *TIERS[ctx.session], *ctx.args.pytest_args], junit,
                                              cwd=REPO_ROOT, env=pytestrun.child_env(),
                                              log=junit.with_name("pytest.log"))
    ctx.record["pytest_wall_s"] = round(wall_s, 2)
    results = pytestrun.read_junit(junit) if junit.is_file() else []
    ctx.record["tests"] = [r.entry(cause=None if r.outcome == "passed" else "failure" if r.outcome in
                                   ("failed", "error") else "skip") for r in results]
    return exitcodes.from_pytest(code)

