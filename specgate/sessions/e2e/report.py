"""What the tests record (records.jsonl) and how it becomes the summary's test entries,
engine rows, the exit code and the printed report."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specgate.contract import artifacts, exitcodes
from specgate.contract import summary as contract
from specgate.sessions import pytestrun
from specgate.sessions.e2e.runs import Run

RECORDS_VAR = "SPECGATE_E2E_RECORDS"
FIXED = "fixed"   # a declared defect's test whose defect no longer reproduces (its row's defect_status)
# What each test entry carries beside the common nodeid/outcome/cause/reason/time_s.
MEASURED_FIELDS = ("method", "model_source", "target", "draft", "revision", "runner", "drafts", "drafted_tokens",
                   "accepted_tokens", "acceptance_len", "threshold", "matches_baseline")



class Recorder:
    """Appends one JSON object per line; the tests write, the session reads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def write(self, kind: str, **fields: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"kind": kind, **fields}, default=str) + "\n")
            handle.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_identity(run: Run) -> dict[str, Any]:
    """The summary fields that say what a test ran: method, sources, checkpoints, revisions."""
    sources = {run.target.source, run.draft.source if run.draft else run.target.source}
    return {
        "method": run.method,
        "model_source": "fixture" if "fixture" in sources else "hub",
        "target": run.target.name,
        "draft": run.draft.name if run.draft else None,
        "revision": run.target.revision if run.draft is None else f"{run.target.revision} + {run.draft.revision}",
    }


def merge_results(results: Sequence[pytestrun.TestResult], records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One test entry per JUnit test case, filled from what the test recorded (the last record
    wins per field); outcome, reason (skip or failure message) and time come from JUnit."""
    by_test: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.get("kind") == "test":
            fields = {k: v for k, v in record.items() if k not in ("kind", "test")}
            by_test.setdefault(record["test"], {}).update(fields)
    rows = []
    for result in results:
        measured = {**dict.fromkeys(MEASURED_FIELDS), **by_test.get(result.nodeid, {})}
        outcome = _outcome(result, measured)
        rows.append(result.entry(cause=_cause(result, outcome), **measured) | {"outcome": outcome})
    return rows


def _cause(result: pytestrun.TestResult, outcome: str) -> str | None:
    """specgate.ciside.classify's label for a failure (failure, env-blocked, cache-miss, ...);
    env-blocked or skip for a skip; known-defect for an xfail; None for a pass."""
    from specgate.ciside import classify

    if outcome == "passed":
        return None
    if outcome == "xfailed":
        return "known-defect"
    label, _ = classify.explain(result.text or result.message)
    if outcome == "skipped":
        return label if label == "env-blocked" else "skip"
    return label


def _outcome(result: pytestrun.TestResult, row: dict[str, Any]) -> str:
    """passed / failed / error / skipped, and xfailed: a declared defect that showed its
    symptom (JUnit calls it skipped; the test recorded that it expected the failure)."""
    if result.outcome == "skipped" and row.get("expected_failure"):
        return "xfailed"
    return result.outcome


def engine_record(phases: Sequence[Run], data: dict[str, Any]) -> dict[str, Any]:
    """One engine start as records.jsonl keeps it: what it loaded, its times, and each phase it
    ran (requests, the repair applied, generate time, what speculation counted, its error)."""
    ran = data.get("phases") or {}
    return {"key": phases[0].engine_key, **run_identity(phases[0]), "error": _first_line(data["error"]),
            **{k: data.get(k) for k in ("runner", "compilation", "kernels", "compile_counters", "process", "threads",
                                        "import_s", "init_s", "shutdown_s")},
            "generate_s": round(sum(p.get("generate_s") or 0 for p in ran.values()), 2),
            "phases": [{"key": run.key, "requests": run.requests or "greedy", "ran": run.key in ran,
                        **{k: ran.get(run.key, {}).get(k) for k in ("repair", "generate_s", "counters")},
                        "error": _first_line(ran.get(run.key, {}).get("error")),
                        # mutant_fired: only under nox -s mutants
                        **{k: ran[run.key][k] for k in ("mutant_fired",) if k in ran.get(run.key, {})}}
                       for run in phases]}


def _first_line(error: dict[str, Any] | None) -> str | None:
    return f"{error['type']}: {error['message']}".splitlines()[0] if error else None


def engine_rows(records: Sequence[dict[str, Any]], tests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per engine start, with the tests that read each (`checks`)."""
    rows = [{k: v for k, v in r.items() if k != "kind"} for r in records if r.get("kind") == "engine"]
    for row in rows:
        keys = {phase["key"] for phase in row["phases"]}
        row["checks"] = [t["nodeid"] for t in tests if keys & set(t.get("engines") or ())]
    return rows


def compile_backend(engines: Sequence[dict[str, Any]]) -> str | None:
    """The one backend every engine compiled with, or "mixed: a, b" (None: no engine started)."""
    backends = sorted({e["compilation"]["backend"] for e in engines if e.get("compilation")})
    if not backends:
        return None
    return backends[0] if len(backends) == 1 else "mixed: " + ", ".join(backends)


def kernel_libraries(engines: Sequence[dict[str, Any]]) -> list[str]:
    """vLLM's kernel libraries the engines ran, in one sorted list."""
    return sorted({name for e in engines for name in e.get("kernels") or ()})


def session_exit_code(pytest_code: int, rows: Sequence[dict[str, Any]]) -> int:
    """pytest's code in the exit-code model; a failed or errored row fails whatever pytest said."""
    failed = any(r["outcome"] in ("failed", "error") for r in rows)
    return exitcodes.worst(exitcodes.from_pytest(pytest_code), exitcodes.FAILURE if failed else exitcodes.OK)


def format_report(rows: Sequence[dict[str, Any]], engines: Sequence[dict[str, Any]]) -> str:
    short = [[_short_test(r["nodeid"]), r["method"], r["model_source"], contract.model_label(r), r["runner"],
              r["outcome"], r["drafts"], r["drafted_tokens"], r["accepted_tokens"], _fmt(r["acceptance_len"]),
              _fmt(r["threshold"]), r["matches_baseline"], r["time_s"]] for r in rows]
    lines = [artifacts.format_rows(["test", "method", "source", "model", "runner", "outcome", "drafts", "drafted",
                                    "accepted", "accept_len", "floor", "=baseline", "time_s"], short)]
    reasons = [f"  {_short_test(r['nodeid'])}: {r['reason']}" for r in rows if r["outcome"] != "passed" and r["reason"]]
    if reasons:
        lines += ["", "reasons:", *reasons]
    fixed = [f"  {_short_test(r['nodeid'])}: {r.get('note')}" for r in rows if r.get("defect_status") == FIXED]
    if fixed:
        lines += ["", "declared defects that no longer reproduce (remove their declarations):", *fixed]
    if engines:
        lines += ["", "engine starts:", artifacts.format_rows(
            ["engine", "process", "threads", "runner", "compile", "import_s", "start_s", "phases", "generate_s",
             "shutdown_s", "checks", "error"],
            [[e["key"], e.get("process"), e.get("threads"), e.get("runner"), _compile(e), e.get("import_s"),
              e.get("init_s"), len(e["phases"]), e.get("generate_s"), e.get("shutdown_s"),
              len(e.get("checks") or ()), e.get("error") or next((p["error"] for p in e["phases"] if p["error"]), None)]
             for e in engines])]
        starts = [e["init_s"] for e in engines if e.get("init_s") is not None]
        if starts:
            lines.append(f"{len(starts)} engine starts: {sum(starts):.1f} s in all, "
                         f"{sum(starts) / len(starts):.1f} s each on average, {max(starts):.1f} s at most")
    return "\n".join(lines)


def _compile(engine: dict[str, Any]) -> str | None:
    c = engine.get("compilation")
    return f"{c['mode']}/{c['backend']}" if c else None


def _fmt(value: Any) -> Any:
    return f"{value:.3f}" if isinstance(value, float) else value


def _short_test(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]
