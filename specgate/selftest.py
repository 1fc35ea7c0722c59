"""`nox -s tests`: the harness's own tests, their files spread over parallel workers."""

from __future__ import annotations

from specgate import artifacts, cli, exitcodes, lifecycle, pytestrun
from specgate.manifest import REPO_ROOT

SESSION = "tests"


def step(ctx: lifecycle.Context) -> int:
    junit = artifacts.artifacts_dir(SESSION) / "junit.xml"
    junit.unlink(missing_ok=True)
    # Test files run in parallel workers, each file whole in one worker (its module fixtures and
    # its order stay as written); `-n 0` after `--` turns that off. Files go out in collection
    # order, so tests/ci (few tests, more than half of the suite's test time) starts
    # first: xdist's default order, most tests first, started it last.
    code, wall_s = pytestrun.run_pytest_timed(["-rA", "-n", "auto", "--dist", "loadfile", "--no-loadscope-reorder",
                                               *ctx.args.pytest_args], junit,
                                              cwd=REPO_ROOT, env=pytestrun.child_env(),
                                              log=junit.with_name("pytest.log"))
    ctx.record["pytest_wall_s"] = round(wall_s, 2)
    results = pytestrun.read_junit(junit) if junit.is_file() else []
    ctx.record["tests"] = [r.entry(cause=None if r.outcome == "passed" else "failure" if r.outcome in
                                   ("failed", "error") else "skip") for r in results]
    return exitcodes.from_pytest(code)


if __name__ == "__main__":
    lifecycle.main(SESSION, cli.parser(SESSION, __doc__.splitlines()[0]), step)
