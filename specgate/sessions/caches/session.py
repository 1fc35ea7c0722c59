"""`nox -s cache`: what the harness's caches hold, and pruning them to the manifest's bounds.

    nox -s cache                    list every entry: kind, size, age, last use, in use
    nox -s cache -- prune           remove what [cache] max_age_days and budget_gib leave out
    nox -s cache -- prune --dry-run say what a prune would remove, remove nothing

An entry a running session holds (its lease, specgate.vllmside.cachestore) or a builder is writing is
never removed; it is listed as busy. summary.json holds `cache`: the entries, what was removed
and what was busy, the total and the budget. Exit codes: 0, 2 bad input.
"""

from __future__ import annotations

import time
from typing import Any

from specgate.contract import artifacts, exitcodes
from specgate.core import cli
from specgate.core.manifest import CacheSpec
from specgate.sessions import lifecycle
from specgate.vllmside import cachestore

SESSION = "cache"
GIB = 1 << 30


def build_parser() -> cli.Parser:
    p = cli.parser(SESSION, __doc__.splitlines()[0].split(": ", 1)[1], pytest=False)
    p.add_argument("action", nargs="?", choices=("list", "prune"), default="list")
    p.add_argument("--max-age-days", type=float, default=None,
                   help="remove entries last used longer ago (default: [cache] max_age_days)")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="then remove the least recently used until the rest fits (default: [cache] budget_gib)")
    p.add_argument("--dry-run", action="store_true", help="with prune: say what would go, remove nothing")
    return p


def _row(entry: cachestore.Entry, now: float, busy: bool) -> dict[str, Any]:
    return {"kind": entry.kind, "path": str(entry.path), "size_bytes": entry.size,
            "age_days": round((now - entry.modified) / 86400, 2), "last_used_days": round(entry.age_days(now), 2),
            "in_use": busy, "belongs_to": entry.belongs_to, "build": entry.build()}


def step(ctx: lifecycle.Context) -> int:
    ctx.expects_tests = False
    args, spec = ctx.args, ctx.manifest.cache
    if spec is None:
        raise cli.BadInput(f"{ctx.manifest.path.name} has no [cache] table (max_age_days, budget_gib)")
    max_age = spec.max_age_days if args.max_age_days is None else args.max_age_days
    budget = spec.budget_gib if args.budget_gib is None else args.budget_gib
    if max_age < 0 or budget < 0:
        raise cli.BadInput("--max-age-days and --budget-gib take numbers >= 0")
    now = time.time()
    found = cachestore.entries()
    busy = {e.path for e in found if cachestore.in_use(e)}
    total = sum(e.size for e in found)
    ctx.record["cache"] = record = {"entries": [_row(e, now, e.path in busy) for e in found], "removed": [],
                                    "busy": [], "total_bytes": total, "budget_bytes": int(budget * GIB),
                                    "max_age_days": max_age, "dry_run": args.dry_run}
    print(format_table(record["entries"]), flush=True)
    print(f"{len(found)} entries, {total / GIB:.2f} GiB; bounds: last used within {max_age:g} days, "
          f"{budget:g} GiB in all", flush=True)
    if args.action == "list":
        return exitcodes.OK
    if args.dry_run:
        chosen = cachestore.choose(found, max_age_days=max_age, budget_bytes=int(budget * GIB), now=now)
        record["removed"] = [str(e.path) for e in chosen]
        print(f"prune would remove {len(chosen)}: " + (", ".join(e.path.name for e in chosen) or "nothing"))
        return exitcodes.OK
    record.update(prune(found, max_age, budget, now))
    return exitcodes.OK


def prune(found: list[cachestore.Entry], max_age_days: float, budget_gib: float, now: float) -> dict[str, Any]:
    """Prune `found` to the bounds, say what went in one line, and return it for the summary."""
    pruned = cachestore.prune(found, max_age_days=max_age_days, budget_bytes=int(budget_gib * GIB), now=now)
    freed = sum(e.size for e in pruned.removed)
    print(f"cache: removed {len(pruned.removed)} ({freed / GIB:.2f} GiB) to last use within {max_age_days:g} days "
          f"and {budget_gib:g} GiB" + (f"; in use, left alone: {', '.join(e.path.name for e in pruned.busy)}"
                                       if pruned.busy else ""), flush=True)
    return {"removed": [str(e.path) for e in pruned.removed], "busy": [str(e.path) for e in pruned.busy]}


def prune_at_job_start(spec: CacheSpec) -> dict[str, Any]:
    """warm_cache's first act, so the pipelines need no step of their own: what this build's
    jobs will use was last used by the build before, so it is the last to go, and what a
    running job holds (or this session's own build venv, leased) is never removed. The venvs'
    sizes are their recorded ones, so this costs a walk of the small caches only."""
    return prune(cachestore.entries(), spec.max_age_days, spec.budget_gib, time.time())


def format_table(rows: list[dict[str, Any]]) -> str:
    return artifacts.format_rows(["kind", "entry", "MiB", "made (days)", "last used (days)", "in use", "build"], [
        [r["kind"], r["belongs_to"], f"{r['size_bytes'] / (1 << 20):.1f}", r["age_days"], r["last_used_days"],
         "yes" if r["in_use"] else "", r["build"] or ""] for r in rows])

