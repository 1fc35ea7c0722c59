"""`nox -s tests`: the harness's own tests, fast (no vLLM engine starts)."""

from __future__ import annotations

import sys
from datetime import datetime, timezone

from specgate import artifacts, cli, envpin, pytestrun, torchprobe
from specgate.manifest import REPO_ROOT

SESSION = "tests"


def main(argv: list[str] | None = None) -> int:
    args = cli.parse(cli.parser(SESSION, __doc__), argv)
    manifest = cli.start(SESSION)
    out = artifacts.artifacts_dir(SESSION)
    junit = out / "junit.xml"
    junit.unlink(missing_ok=True)
    code = pytestrun.run_pytest(["-rA", *args.pytest_args], junit, cwd=REPO_ROOT, env=pytestrun.child_env())
    results = pytestrun.read_junit(junit) if junit.is_file() else []
    tally = pytestrun.counts(results)
    if code == pytestrun.NO_TESTS_COLLECTED or not results:
        print("error: pytest ran no tests; an empty run is a failure, not a pass")
        code = 1
    artifacts.write_summary(SESSION, {
        "exit_code": code,
        "counts": tally,
        "tests": [r.as_dict() for r in results if r.outcome != "passed"],
        "degraded": torchprobe.read_degradation(),
        "env": envpin.session_report(manifest, SESSION),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    })
    print(f"{SESSION}: " + ", ".join(f"{n} {k}" for k, n in tally.items()) + f" -> exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
