"""Drift: a cpu_e2e run against its own recent past, not only against the floors.

A floor catches a collapse, not a slide: eagle3 at 1.85 can fall to 1.55 and stay above 1.5.
So every passed test that measured acceptance is compared with the median of its last N
clean runs ([e2e] drift_window; clean as specgate.ciside.history defines it) that are comparable:

  - the same test (node id) and model identity (`model_identity`, stamped on every entry
    here: the checkpoint revisions or fixture hashes, the engine keys with the method and
    speculative configuration, and a digest of the prompts and engine settings), because a
    new checkpoint, configuration or prompt set moves acceptance for a reason;
  - the same host (CPU model, ISA flags, cores). A past run on another host is not
    compared: the result says the history is incomparable and why.

Whatever their vLLM version or build: on a PR the baseline is the base branch's recent clean
runs and the run under test is the PR's build, so "eagle3 1.85 on main, 1.55 on this PR" is
what drift exists to catch. Each result names both sides' vLLM versions.

Acceptance length falling more than [e2e] acceptance_len_drop below the median, or a draft
position's acceptance rate (vLLM's accepted-per-position counter over the drafts) falling more
than per_position_drop, is a regression: the entry fails with cause `regression` and a
reason quoting both numbers. Engine start (init_s, which includes torch.compile) and
generate times above slowdown_factor x their median are warnings, not failures.

The result is the summary's `drift` field: {"checked": false, "why": ...} when there is no
history to compare with, else what was compared and found.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from specgate.ciside import history
from specgate.contract import summary as contract
from specgate.core.manifest import DriftSpec, GateSpec

IDENTITY = "model_identity"
TIMES = {"init_s": "start (compile included)", "generate_s": "generate"}
MIN_TIMED_S = 1.0   # sub-second times are mostly scheduling noise: no slowdown warning below this median
EPSILON = 1e-9      # a drop exactly at the tolerance is within it, whatever the float rounding


def inputs_digest(settings: Mapping[str, Any]) -> str:
    """A short digest of what every engine generated from: prompts, token budgets, dtype, bounds."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


def stamp(tests: Sequence[dict[str, Any]], digest: str) -> None:
    """Give every entry that ran an engine its model identity, so later runs can find it."""
    for entry in tests:
        if entry.get("revision") and entry.get("engines"):
            entry[IDENTITY] = f"{entry['revision']} | {' / '.join(entry['engines'])} | inputs {digest}"


def host_key(host: Mapping[str, Any]) -> tuple[Any, ...]:
    return host.get("cpu_model"), tuple(sorted(host.get("isa") or ())), host.get("cores")


def _describe_host(host: Mapping[str, Any]) -> str:
    model, isa, cores = host_key(host)
    return f"{model or 'unknown CPU'}, {cores} cores, {' '.join(isa) or 'no vLLM ISA flags'}"


def position_rates(entry: Mapping[str, Any], engines: Sequence[Mapping[str, Any]]) -> list[float] | None:
    """Acceptance rate per draft position of the entry's speculative engine (None: it drafted nothing)."""
    rows = contract.phases_by_key(engines)
    for key in entry.get("engines") or ():
        row = rows.get(key)
        if row and row.get("method") not in (None, "none"):
            counters = row.get("counters") or {}
            drafts = counters.get("drafts") or 0
            return [round(accepted / drafts, 4) for accepted in counters.get("per_position") or []] if drafts else None
    return None


def _matches(runs: Sequence[history.Run], want: Mapping[str, Any]) -> Iterator[tuple[history.Shard, dict]]:
    """Each run's passed entry of the same test and model identity, newest run first."""
    for run in runs:
        for shard in run.shards:
            found = next((e for e in shard.summary["tests"] if e["nodeid"] == want["nodeid"]
                          and e.get(IDENTITY) == want[IDENTITY] and e["outcome"] == "passed"), None)
            if found is not None:
                yield shard, found
                break


def _comparable(shard: history.Shard, record: Mapping[str, Any]) -> bool:
    return host_key(shard.summary["host"]) == host_key(record["host"])


def _elsewhere(shards: Sequence[history.Shard], record: Mapping[str, Any]) -> str:
    hosts = {host_key(s.summary["host"]) for s in shards} - {host_key(record["host"])}
    return (f"{len(shards)} clean run(s) with this model identity ran on {len(hosts)} other host(s), "
            f"not {_describe_host(record['host'])}: not compared")


def _regression(name: str, value: float, past: list[float], tolerance: float) -> str | None:
    median = statistics.median(past)
    drop = median - value
    if drop <= tolerance + EPSILON:
        return None
    return (f"{name} {value:.3f} is {drop:.3f} below {median:.3f}, the median of the last {len(past)} "
            f"clean run(s) (tolerance {tolerance})")


def _versions(result: Mapping[str, Any]) -> str:
    return f" (this run vLLM {result['vllm_version']}; baseline vLLM {', '.join(result['baseline_vllm_versions'])})"


def _check_entry(entry: dict[str, Any], record: Mapping[str, Any], baseline: Sequence[history.Run],
                 spec: DriftSpec) -> dict[str, Any]:
    found = list(_matches(baseline, entry))
    same = [(shard, past) for shard, past in found if _comparable(shard, record)][:spec.window]
    result: dict[str, Any] = {"nodeid": entry["nodeid"], IDENTITY: entry[IDENTITY], "runs": len(same),
                              "acceptance_len": entry["acceptance_len"], "vllm_version": record["vllm_version"],
                              "baseline_vllm_versions": sorted({str(shard.vllm_version) for shard, _ in same})}
    if not same:
        verdict = "incomparable" if found else "no-history"
        note = _elsewhere([s for s, _ in found], record) if found else "no clean past run with this model identity"
        return {**result, "verdict": verdict, "note": note}
    lengths = [past["acceptance_len"] for _, past in same]
    result["median_acceptance_len"] = statistics.median(lengths)
    found_drops = [_regression("acceptance length", entry["acceptance_len"], lengths, spec.acceptance_len_drop)]
    rates = position_rates(entry, record.get("engines") or [])
    past_rates = [r for shard, past in same if (r := position_rates(past, shard.summary.get("engines") or []))]
    if rates and past_rates:
        medians = []
        for i, rate in enumerate(rates):
            column = [r[i] for r in past_rates if i < len(r)]
            medians.append(statistics.median(column) if column else None)
            if column:
                found_drops.append(_regression(f"draft position {i + 1} acceptance rate", rate, column,
                                               spec.per_position_drop))
        result.update(position_rates=rates, median_position_rates=medians)
    drops = [d for d in found_drops if d]
    return {**result, "verdict": "regression" if drops else "ok",
            "note": "; ".join(drops) + _versions(result) if drops else None}


def _timings(record: Mapping[str, Any], baseline: Sequence[history.Run], spec: DriftSpec) -> list[dict[str, Any]]:
    """Each engine's start and generate time against the same engine's in comparable clean runs."""
    found = []
    for engine in record.get("engines") or []:
        if engine.get("error"):
            continue
        past = [row for run in baseline for shard in run.shards if _comparable(shard, record)
                for row in shard.summary.get("engines") or [] if row.get("key") == engine["key"]
                and not row.get("error")]
        for metric, name in TIMES.items():
            values = [row[metric] for row in past if isinstance(row.get(metric), (int, float))][:spec.window]
            if not isinstance(engine.get(metric), (int, float)) or not values:
                continue
            median = statistics.median(values)
            slower = median >= MIN_TIMED_S and engine[metric] > spec.slowdown_factor * median
            found.append({"engine": engine["key"], "metric": metric, "value": engine[metric], "median": median,
                          "runs": len(values), "verdict": "slower" if slower else "ok",
                          "note": (f"engine [{engine['key']}]: {name} took {engine[metric]:.1f} s, "
                                   f"{engine[metric] / median:.1f}x the median {median:.1f} s of the last "
                                   f"{len(values)} clean run(s) (warning above {spec.slowdown_factor}x)")
                          if slower else None})
    return found


def unchecked(why: str) -> dict[str, Any]:
    return {"checked": False, "why": why}


def check(record: dict[str, Any], runs: Sequence[history.Run], spec: DriftSpec, gate: GateSpec,
          source: str) -> dict[str, Any]:
    """Compare the run `record` holds (a cpu_e2e summary, entries stamped) with the clean runs
    among `runs`; fail the entries that regressed and return the summary's `drift` field."""
    mine = history.run_key(record)
    baseline = [run for run in history.clean(runs, gate) if run.key != mine]
    results = [_check_entry(entry, record, baseline, spec) for entry in record["tests"]
               if entry["outcome"] == "passed" and entry.get(IDENTITY)
               and isinstance(entry.get("acceptance_len"), (int, float))]
    for result in results:
        if result["verdict"] == "regression":
            entry = next(e for e in record["tests"] if e["nodeid"] == result["nodeid"])
            entry.update(outcome="failed", cause="regression", reason=f"regression: {result['note']}")
    timings = _timings(record, baseline, spec)
    return {"checked": True, "source": source, "clean_runs": len(baseline), "tolerances": asdict(spec),
            "results": results, "timings": timings,
            "regressions": [r["nodeid"] for r in results if r["verdict"] == "regression"],
            "incomparable": [f"{r['nodeid']}: {r['note']}" for r in results if r["verdict"] == "incomparable"],
            "warnings": [t["note"] for t in timings if t["verdict"] == "slower"]}


def describe(drift: Mapping[str, Any]) -> str:
    """A few lines for the terminal."""
    if not drift["checked"]:
        return f"drift: not checked: {drift['why']}"
    verdicts = [r["verdict"] for r in drift["results"]]
    tally = ", ".join(f"{verdicts.count(v)} {v}" for v in ("ok", "regression", "incomparable", "no-history")
                      if v in verdicts)
    lines = [f"drift: {len(verdicts)} test(s) against {drift['source']} ({drift['clean_runs']} clean run(s))"
             + (f": {tally}" if tally else ": no passed test measured acceptance")]
    lines += [f"  regression: {r['nodeid']}: {r['note']}" for r in drift["results"] if r["verdict"] == "regression"]
    lines += [f"  incomparable: {line}" for line in drift["incomparable"]]
    lines += [f"  warning: {line}" for line in drift["warnings"]]
    return "\n".join(lines)
