"""Upstream's own tests/v1/e2e/test_cpu_spec_decode.py, run offline over a stand-in hub cache."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specgate.core.manifest import SPEC_METHODS, Manifest
from specgate.sessions import pytestrun
from specgate.sessions.e2e import SESSION
from specgate.sessions.e2e.report import merge_results, session_exit_code

UPSTREAM_FILE = "tests/v1/e2e/test_cpu_spec_decode.py"


def stand_in_hub_cache(manifest: Manifest, mode: str, dest: Path) -> dict[str, str]:
    """An HF hub cache for upstream's file: every cpu_e2e checkpoint that resolves to its
    fixture appears as a snapshot at its pinned revision (refs/main pointing at it) whose
    files link to the fixture's; one resolved to the hub links to its real cache folder.
    Returns hub id -> what stands behind it.

    VLLM_MODEL_REDIRECT_PATH cannot do this in vLLM 0.32: with HF_HUB_OFFLINE=1 EngineArgs
    swaps a hub id for its offline snapshot (arg_utils.py, get_model_path), and
    maybe_override_with_speculators reads the id's config from the hub, both before
    ModelConfig consults the redirect."""
    import shutil

    from specgate.vllmside import sources

    shutil.rmtree(dest, ignore_errors=True)
    behind = {}
    for checkpoint in manifest.checkpoints_for([SESSION]):
        src = sources.resolve(manifest, checkpoint.repo_id, mode)
        folder = sources.repo_folder(checkpoint.repo_id, dest)
        if src.source == "hub":
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.symlink_to(sources.repo_folder(checkpoint.repo_id), target_is_directory=True)
            behind[checkpoint.repo_id] = f"hub cache {src.path}"
            continue
        snapshot = folder / "snapshots" / checkpoint.revision
        snapshot.mkdir(parents=True)
        assert src.path is not None, "a source resolved to its fixture has the fixture's folder"
        for item in Path(src.path).iterdir():
            (snapshot / item.name).symlink_to(item)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(checkpoint.revision)
        behind[checkpoint.repo_id] = f"fixture {src.fixture} ({src.path})"
    return behind


def upstream_rows(results: Sequence[pytestrun.TestResult], behind: dict[str, str]) -> list[dict[str, Any]]:
    """Summary rows for upstream's tests: what JUnit says, the method from the test's name."""
    rows = merge_results(results, [])
    for row in rows:
        name = row["nodeid"].split("::")[-1]
        param = name[name.find("[") + 1:-1] if name.endswith("]") else ""
        row["method"] = "ngram" if "ngram" in name else (param if param in SPEC_METHODS else None)
        row["model_source"] = "fixture" if any(v.startswith("fixture") for v in behind.values()) else "hub"
        row["nodeid"] = f"upstream:{row['nodeid']}"
    return rows


def run_upstream(manifest: Manifest, mode: str, env: dict[str, str], out: Path,
                 pytest_args: list[str]) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """Upstream's tests/v1/e2e/test_cpu_spec_decode.py from the upstream test tree, run
    offline over the stand-in hub cache (fixtures where the checkpoints resolve to them).
    Returns the session exit code this part earns, its rows and what the summary says."""
    from specgate.vllmside import upstream

    try:
        root, fallback = upstream.build_tree()
    except upstream.UpstreamError as exc:
        print(f"upstream e2e: {exc}", flush=True)
        return exc.exit_code, [], {"error": str(exc)}
    if fallback:
        print(f"upstream e2e: drift: {fallback}", flush=True)
    cache = out / "upstream-hub-cache"
    behind = stand_in_hub_cache(manifest, mode, cache)
    for repo_id, what in behind.items():
        print(f"upstream e2e: {repo_id} -> {what}", flush=True)
    junit = out / "junit-upstream.xml"
    junit.unlink(missing_ok=True)
    code, wall = pytestrun.run_pytest_timed(["-rA", "-p", "no:cacheprovider", UPSTREAM_FILE, *pytest_args], junit,
                                            cwd=root, env={**env, "HF_HUB_CACHE": str(cache)},
                                            log=out / "pytest-upstream.log")
    rows = upstream_rows(pytestrun.read_junit(junit) if junit.is_file() else [], behind)
    return session_exit_code(code, rows), rows, {"tree": str(root), "drift": fallback, "file": UPSTREAM_FILE,
                                                 "hub_cache": str(cache),
                                                 "checkpoints": behind, "pytest_exit_code": code,
                                                 "pytest_wall_s": round(wall, 2)}
