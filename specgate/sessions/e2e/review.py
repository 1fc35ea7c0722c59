"""What cpu_e2e does with its history once its tests have run (one call from its step):

1. stamp every test entry with its model identity (specgate.ciside.drift), so this run can be
   history for the next ones whether or not a history is available now;
2. read the history the options name (specgate.ciside.history: --history DIR / $SPECGATE_HISTORY,
   or Buildkite), check drift against it, or record why it was not checked;
3. write artifacts/cpu_e2e/acceptance.svg (specgate.ciside.charts), with the history's last runs
   when there are any.

A history that cannot be read does not hide the tests' results: drift is recorded as not
checked with the one-line reason, and the session's exit code takes the error's (2 for bad
options, a malformed summary or Buildkite's 401/403/404; 75 when Buildkite is unreachable).
A regression is exit 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specgate.ciside import buildkite, drift, history
from specgate.contract import artifacts, exitcodes
from specgate.core import cli
from specgate.sessions import lifecycle

SESSION = "cpu_e2e"
CHART = "acceptance.svg"
NO_HISTORY = (f"no history: pass --history DIR (or set ${history.FOLDER_VAR}), or set ${buildkite.TOKEN_VAR} "
              f"with the organisation and pipeline slugs, to compare this run with earlier ones")


def review(ctx: lifecycle.Context, settings: Mapping[str, Any]) -> int:
    """Drift check and chart for the run in ctx.record; returns the exit code they earn."""
    record, manifest, spec = ctx.record, ctx.manifest, ctx.manifest.drift
    assert spec is not None, "the step parsed [e2e] (Settings.parse), so its drift keys are there"
    drift.stamp(record["tests"], drift.inputs_digest(settings))
    runs: list[history.Run] = []
    code = exitcodes.OK
    try:
        source = history.locate(ctx.args, manifest.gate.history_builds)
        if source is None:
            record["drift"] = drift.unchecked(NO_HISTORY)
        else:
            runs = history.read(source)[SESSION]
            record["drift"] = drift.check(record, runs, spec, manifest.gate, source.describe())
    except (cli.BadInput, buildkite.APIError) as exc:
        print(f"error: {exc}", flush=True)
        record["drift"] = drift.unchecked(f"the history could not be read: {exc}")
        code = getattr(exc, "exit_code", exitcodes.BAD_INPUT)
    from specgate.ciside import charts  # matplotlib: only once the run is reviewed

    mine = history.run_key(record)
    chart = charts.write(artifacts.artifacts_dir(SESSION) / CHART, charts.acceptance_figure, record,
                         [run for run in runs if run.key != mine][:spec.window])
    print(drift.describe(record["drift"]) + f"\nchart: {chart}", flush=True)
    return exitcodes.worst(code, exitcodes.FAILURE if record["drift"].get("regressions") else exitcodes.OK)
