"""A stand-in engine host for run_engines' lane tests (tests/test_engine_lanes.py): the real
host's arguments, claims and result records, no vLLM. What each engine does is in its "llm":
{"wait_for": key} waits (10 s at most) until some host has taken `key`; {"die": true} SIGKILLs
the host mid-engine; {"hang": true} never ends. Every other engine ends at once with a result
that says which OMP_NUM_THREADS its host had."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from specgate.vllmside import engine


def main(argv: list[str]) -> int:
    request, result = Path(argv[0]), Path(argv[1])
    claims = engine.Claims(Path(argv[2]), argv[3])
    engine._append_record(result, {"results": {}, "v2_blocker": None, "probes": {}, "stopped": None})
    for run in json.loads(request.read_text(encoding="utf-8")):
        if not claims.take(run["key"]):
            continue
        what = run["llm"]
        deadline = time.monotonic() + 10
        while what.get("wait_for") and claims.free(what["wait_for"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        if what.get("die"):
            os.kill(os.getpid(), signal.SIGKILL)
        while what.get("hang"):
            time.sleep(1)
        engine._append_record(result, {"results": {run["key"]: {"error": None, "phases": {},
                                                                "threads": os.environ.get("OMP_NUM_THREADS")}}})
    engine._append_record(result, {"stopped": None})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
