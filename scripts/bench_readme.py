#!/usr/bin/env python3
"""Regenerate the performance table in docs/performance.md from a bench report.

Usage: python3 scripts/bench_readme.py [BENCH_JSON]   (default: the bench's own, artifacts/bench/bench.json)

Rewrites only the block between specgate.sessions.bench.report's README_BEGIN/README_END markers in
docs/performance.md, atomically. Exit 0 when written; exit 2 with one line when the report or
the page's block cannot be read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from specgate.contract import artifacts  # noqa: E402
from specgate.sessions.bench import report as benchreport  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: bench_readme.py [BENCH_JSON]", file=sys.stderr)
        return 2
    source = Path(argv[0]) if argv else artifacts.artifacts_dir("bench") / "bench.json"   # where the bench wrote it
    page = REPO / "docs" / "performance.md"
    try:
        block = benchreport.readme_block(json.loads(source.read_text(encoding="utf-8")))
        text = benchreport.splice_readme(page.read_text(encoding="utf-8"), block)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"bench_readme: cannot regenerate from {source}: {exc}", file=sys.stderr)
        return 2
    artifacts.write_atomic(page, text)
    print(f"docs/performance.md: performance table regenerated from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
