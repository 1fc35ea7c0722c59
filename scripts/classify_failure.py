#!/usr/bin/env python3
"""Print why a failed CI run failed: the label is the last line of stdout.

Usage: python3 scripts/classify_failure.py LOGFILE

Stdlib only, so the CI wrapper can call it from a bare host. Exit 0 with a label
(see specgate.ciside.classify.LABELS); exit 2 with one line when LOGFILE cannot be read.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specgate.ciside.classify import explain  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: classify_failure.py LOGFILE", file=sys.stderr)
        return 2
    try:
        text = Path(argv[0]).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        print(f"classify_failure: cannot read {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    label, reason = explain(text)
    print(reason)
    print(label)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
