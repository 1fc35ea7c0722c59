"""A corrupt compile cache is torch's and vLLM's business: it must cost a recompile, never a
red build. One real cpu_e2e engine fills a fresh compile cache; every file in it is then
damaged as a bad disk or a killed writer would leave it; the next run still passes, and
inductor compiles again (its FX graph cache misses) where it had loaded before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from contract import read_valid

from specgate.vllmside import compilecache

REPO = Path(__file__).resolve().parents[2]
SELECTED = "test_known_answer_baseline and context-qwen3"


def e2e(tmp_path: Path, compile_root: Path, name: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    artifacts = tmp_path / name
    env = {**os.environ, compilecache.ROOT_VAR: str(compile_root), "SPECGATE_ARTIFACTS": str(artifacts),
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "specgate.sessions.e2e", "--model-source", "fixture", "-k", SELECTED],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    read_valid(artifacts / "cpu_e2e" / "summary.json")
    records = [json.loads(line) for line in (artifacts / "cpu_e2e" / "records.jsonl").read_text().splitlines()]
    return proc, [r for r in records if r["kind"] == "engine"]


def damage_every_file(root: Path) -> int:
    """Garbage of the same size in every other file (a bad disk), the rest cut to half (a killed writer)."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.name != "factors.json")
    for index, path in enumerate(files):
        size = path.stat().st_size
        if index % 2:
            os.truncate(path, size // 2)
        else:
            path.write_bytes(os.urandom(size))
    return len(files)


def test_a_corrupt_compile_cache_entry_is_compiled_again_and_the_run_passes(tmp_path):
    root = tmp_path / "compile"
    proc, [cold] = e2e(tmp_path, root, "cold")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert cold["compile_counters"].get("inductor.fxgraph_cache_miss", 0) > 0, cold
    proc, [warm] = e2e(tmp_path, root, "warm")
    assert proc.returncode == 0 and warm["compile_counters"].get("inductor.fxgraph_cache_hit", 0) > 0, warm

    assert damage_every_file(root) > 10
    proc, [damaged] = e2e(tmp_path, root, "damaged")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert damaged["error"] is None and damaged["compile_counters"].get("inductor.fxgraph_cache_miss", 0) > 0, damaged
