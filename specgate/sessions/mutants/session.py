"""`nox -s mutants`: the fixture-mode cpu_e2e checks, once per mutant of the catalogue.

1. A control run with no mutant of the checks that score the chosen mutants: every one must
   pass, or a kill would mean nothing. `--seed-sets N` runs it on N seed sets of the sampling
   requests (seed_base, seed_base + 1000, ...) and counts the false alarms: a statistical check
   that fails there without a fault. `--control-only` stops after it.
2. Per mutant, the checks its catalogue entry names (`checks`: the greedy path's faults are
   scored by the greedy checks, the random path's by the sampling checks) with the mutant
   installed in every engine process (MUTANT_VAR). The checks that fail or error kill it;
   one that no check catches survives
   (a finding: add the check, or explain in the README why fixture mode cannot see it). A
   mutant whose patch never fired was not exercised and counts as a survivor too; so does
   one whose patched function moved in the build under test (--vllm): it says so, and is
   never counted as killed.
3. summary.json: `mutants` (name, what, why_real, killed_by, survived, fired) and `kill_rate`;
   its `tests` hold one entry per mutant, passed when killed, failed when it survived.

Exit codes: 0 every mutant killed, 1 a survivor or a failed control run, 2 bad input.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

from specgate.contract import artifacts, exitcodes
from specgate.core import build, cli
from specgate.core.manifest import ManifestError
from specgate.sessions import lifecycle, pytestrun
from specgate.sessions.e2e.planning import Settings, missing_models, plan_dict, resolve_config
from specgate.sessions.e2e.session import run_tests
from specgate.sessions.mutants import MUTANT_VAR, SESSION
from specgate.vllmside.catalogue import CATALOGUE, MUTANTS
from specgate.vllmside.engine import TIMED_OUT

MODE = "fixture"     # the offline checks this session scores; hub checkpoints are not needed
SEED_STRIDE = 1000   # between the control's seed sets: far more than the requests one set seeds


def build_parser():
    p = cli.parser(SESSION, __doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--only", nargs="+", metavar="NAME", choices=list(MUTANTS),
                   help="run only these mutants (default: the whole catalogue)")
    p.add_argument("--seed-sets", type=cli.positive_int, default=1, metavar="N",
                   help=f"run the control on N seed sets of the sampling requests, {SEED_STRIDE} apart, "
                        "and count its false alarms (default: 1; the mutants use the first)")
    p.add_argument("--control-only", action="store_true", help="stop after the control run(s)")
    return p


def _timed_out(row: dict[str, Any]) -> bool:
    """A check that lost its engine to the per-engine timeout: an overloaded machine can do that
    as well as a fault, so it is neither a kill nor a false alarm."""
    return TIMED_OUT in (row.get("reason") or "")


def _failed(rows: list[dict[str, Any]]) -> list[str]:
    return [r["nodeid"] for r in rows if r["outcome"] in ("failed", "error") and not _timed_out(r)]


def _lost(rows: list[dict[str, Any]]) -> list[str]:
    return [r["nodeid"] for r in rows if r["outcome"] in ("failed", "error") and _timed_out(r)]


def step(ctx: lifecycle.Context) -> int:
    args, manifest, record = ctx.args, ctx.manifest, ctx.record
    out = artifacts.artifacts_dir(SESSION)
    chosen = [m for m in CATALOGUE if not args.only or m.name in args.only]
    record.update(model_mode=MODE, mutants=[], kill_rate=None, control=None)
    try:
        settings = Settings.parse(manifest)
        configs = [resolve_config(manifest, c, MODE, build.version_under_test()) for c in manifest.e2e]
    except ManifestError as exc:
        raise cli.BadInput(str(exc)) from None
    if missing_models(configs):
        raise lifecycle.Abort("a fixture could not be resolved: " + ", ".join(m.name for m in missing_models(configs)),
                              exitcodes.FAILURE)
    plan = plan_dict(MODE, settings, configs, (1, 0))

    # The control covers exactly the checks that score the chosen mutants.
    scope = " or ".join(f"({expr})" for expr in dict.fromkeys(m.checks for m in chosen))
    control: dict[str, Any] = {"seed_sets": [], "false_alarms": 0, "checks": 0}   # filled as each set ends
    record["control"] = control
    _control(control, manifest, settings, configs, out, [*args.pytest_args, "-k", scope], args.seed_sets)
    broken = [s for s in control["seed_sets"] if not s["clean"]]
    if broken:
        record["error"] = "the control run did not pass, so no kill would mean anything: " + "; ".join(
            f"seed set {s['seed_base']}: " + (", ".join(s["failed"]) or f"pytest exit {s['pytest_exit_code']}")
            for s in broken)
        return exitcodes.FAILURE
    if args.control_only:
        record["tests"] = [_control_entry(s) for s in control["seed_sets"]]
        return exitcodes.OK

    moved = _moved(chosen)
    for mutant in chosen:
        if moved.get(mutant.name):
            print(f"{mutant.name}: NOT SCORED: {moved[mutant.name]}", flush=True)
            record["mutants"].append({"name": mutant.name, "what": mutant.what, "why_real": mutant.why_real,
                                      "killed_by": [], "survived": True, "fired": 0, "moved": moved[mutant.name],
                                      "pytest_exit_code": None, "time_s": 0.0})
            continue
        print(f"== {SESSION}: {mutant.name}: {mutant.what} ==", flush=True)
        started = time.monotonic()
        code, rows, engines, *_ = run_tests(manifest, SESSION, plan, out / mutant.name,
                                            [*args.pytest_args, "-k", mutant.checks],
                                            {MUTANT_VAR: mutant.name})
        fired = sum(p.get("mutant_fired") or 0 for e in engines for p in e["phases"])
        killed_by = _failed(rows) if fired else []
        record["mutants"].append({"name": mutant.name, "what": mutant.what, "why_real": mutant.why_real,
                                  "killed_by": killed_by, "timed_out": _lost(rows), "survived": not killed_by,
                                  "fired": fired, "moved": None, "pytest_exit_code": code,
                                  "time_s": round(time.monotonic() - started, 1)})
        lost = f" ({len(_lost(rows))} check(s) lost their engine to the timeout: not kills)" if _lost(rows) else ""
        print(f"{mutant.name}: fired {fired} times; " + (f"killed by {len(killed_by)} check(s)" if killed_by
                                                          else "SURVIVED") + lost, flush=True)
    results = record["mutants"]
    record["kill_rate"] = round(sum(not m["survived"] for m in results) / len(results), 4) if results else None
    record["tests"] = [_entry(m) for m in results]
    print(format_table(results), flush=True)
    return exitcodes.FAILURE if any(m["survived"] for m in results) else exitcodes.OK


def _control(control: dict[str, Any], manifest, settings: Settings, configs: list, out, pytest_args: list[str],
             seed_sets: int) -> None:
    """The control run without a mutant, once per seed set, into `control` as each set ends (a
    stopped study keeps the sets it finished); the first set is the manifest's (the one the
    mutants run on, in out/control). A set is clean when every check passed; a check that
    failed there is a false alarm."""
    sampling = settings.sampling
    variants = [(None, settings)] if sampling is None else [
        (seed, replace(settings, sampling=replace(sampling, seed_base=seed)))
        for seed in range(sampling.seed_base, sampling.seed_base + seed_sets * SEED_STRIDE, SEED_STRIDE)]
    sets = control["seed_sets"]
    for k, (seed, seeded) in enumerate(variants):
        print(f"== {SESSION}: control run (no mutant), seed set {k + 1}/{len(variants)} (seed_base {seed}) ==",
              flush=True)
        started = time.monotonic()
        code, rows, *_ = run_tests(manifest, SESSION, plan_dict(MODE, seeded, configs, (1, 0)),
                                   out / ("control" if k == 0 else f"control-{seed}"), pytest_args)
        passed, failed, lost = sum(r["outcome"] == "passed" for r in rows), _failed(rows), _lost(rows)
        sets.append({"seed_base": seed, "pytest_exit_code": code, "failed": failed, "timed_out": lost,
                     "passed": passed, "clean": code == 0 and passed > 0 and not failed,
                     "time_s": round(time.monotonic() - started, 1)})
        control["false_alarms"] += len(failed)
        control["checks"] += passed + len(failed)
        print(f"seed set {seed}: {passed} passed, {len(failed)} failed"
              + (f", {len(lost)} lost their engine to the timeout (not judged)" if lost else ""), flush=True)


def _control_entry(seed_set: dict[str, Any]) -> dict[str, Any]:
    """A seed set of a --control-only run as a summary test entry: failed on a false alarm."""
    failed, lost = seed_set["failed"], seed_set.get("timed_out") or []
    reason = (f"false alarm(s): {', '.join(n.split('::')[-1] for n in failed)}" if failed
              else f"{seed_set['passed']} checks passed" if seed_set["clean"]
              else f"not judged: {len(lost)} check(s) lost their engine to the timeout" if lost
              else f"pytest exit {seed_set['pytest_exit_code']} with no check failed")
    clean = seed_set["clean"]
    return {"nodeid": f"control:seed_base={seed_set['seed_base']}", "outcome": "passed" if clean else "failed",
            "cause": None if clean else "failure", "reason": reason, "time_s": seed_set["time_s"]}


def _moved(chosen: list) -> dict[str, str | None]:
    """Per mutant, why the build under test lacks what it patches (None: it has it). Asked in
    a process of its own, so this session never imports vLLM; in the step's private temp dir,
    where its vLLM import's <temp dir>/torchinductor_<user> goes with the step."""
    found = subprocess.run([sys.executable, "-m", "specgate.vllmside.catalogue", *(m.name for m in chosen)],
                           capture_output=True, text=True, check=True,
                           env=pytestrun.child_env({"TMPDIR": tempfile.gettempdir()}))
    return json.loads(found.stdout.strip().splitlines()[-1])


def _entry(m: dict[str, Any]) -> dict[str, Any]:
    """The mutant as a summary test entry: passed when a check killed it; a mutant whose target
    moved in this vLLM is never a kill."""
    if m.get("moved"):
        reason = f"not scored: the function it patches moved in this vLLM: {m['moved']}"
    elif not m["survived"]:
        reason = f"killed by {len(m['killed_by'])} check(s): " + ", ".join(n.split("::")[-1] for n in m["killed_by"])
    elif not m["fired"]:
        reason = "survived: the patch never fired, so the mutant was not exercised"
    elif m.get("timed_out"):
        reason = (f"not scored: {len(m['timed_out'])} check(s) lost their engine to the timeout and no other "
                  "check failed; rerun it on a machine with room")
    else:
        reason = "survived: every check passed with the fault in place"
    return {"nodeid": f"mutant:{m['name']}", "outcome": "failed" if m["survived"] else "passed",
            "cause": "failure" if m["survived"] else None, "reason": reason, "time_s": m["time_s"]}


def format_table(mutants: list[dict[str, Any]]) -> str:
    return artifacts.format_rows(["mutant", "fired", "killed by"], [
        [m["name"], m["fired"], ", ".join(n.split("::")[-1] for n in m["killed_by"]) or "SURVIVED"]
        for m in mutants])
