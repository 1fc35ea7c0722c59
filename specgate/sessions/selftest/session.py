"""`nox -s tests`, `nox -s ci_jobs` and `nox -s ci_soak`: the harness's own tests, their files
spread over parallel workers. `tests` is the fast loop, everything but tests/ci; `ci_jobs` is
tests/ci, the Buildkite job chain driven as an agent runs it (real installs and engines: minutes,
not seconds), but its soak tests; `ci_soak` is those: many builds in a row (tens of minutes)."""

from __future__ import annotations

from specgate.contract import artifacts, exitcodes
from specgate.core.manifest import REPO_ROOT
from specgate.sessions import lifecycle, pytestrun

# Which tests each session runs (its session name comes from noxsupport, as SPECGATE_SESSION):
# where, and the marker expression a user's `-m` narrows but never widens (pytest keeps only
# the last -m, so `-m vllm` alone would run the e2e tests without the engines they need).
TIERS = {"tests": (["--ignore=tests/ci"], "not e2e"), "ci_jobs": (["tests/ci"], "not e2e and not soak"),
         "ci_soak": (["tests/ci"], "soak and not e2e")}


def tier_args(session: str, pytest_args: list[str]) -> list[str]:
    """The session's tier, its marker expression and-ed with the last `-m` among pytest_args."""
    paths, markers = TIERS[session]
    rest, wanted = [], None
    args = iter(pytest_args)
    for arg in args:
        if arg == "-m":
            wanted = next(args, None)
            if wanted is None:      # a -m with no expression: left for pytest to reject
                rest.append(arg)
        elif arg.startswith("-m"):
            wanted = arg[2:].removeprefix("=")
        else:
            rest.append(arg)
    expression = f"({markers}) and ({wanted})" if wanted else markers
    return [*paths, "-m", expression, *rest]


def step(ctx: lifecycle.Context) -> int:
    junit = artifacts.artifacts_dir(ctx.session) / "junit.xml"
    junit.unlink(missing_ok=True)
    # Test files run in parallel workers, each file whole in one worker (its module fixtures and
    # its order stay as written); `-n 0` after `--` turns that off. Files go out in collection
    # order, not xdist's default of most tests first.
    code, wall_s = pytestrun.run_pytest_timed(["-rA", "-n", "auto", "--dist", "loadfile", "--no-loadscope-reorder",
                                               *tier_args(ctx.session, ctx.args.pytest_args)], junit,
                                              cwd=REPO_ROOT, env=pytestrun.child_env(),
                                              log=junit.with_name("pytest.log"))
    ctx.record["pytest_wall_s"] = round(wall_s, 2)
    results = pytestrun.read_junit(junit) if junit.is_file() else []
    ctx.record["tests"] = [r.entry(cause=None if r.outcome == "passed" else "failure" if r.outcome in
                                   ("failed", "error") else "skip") for r in results]
    return exitcodes.from_pytest(code)

