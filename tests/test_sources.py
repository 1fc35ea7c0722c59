"""Model sources: a hub snapshot counts only when complete at its pinned revision;
auto falls back to the fixture, hub reports it missing, fixture ignores the cache.
The cache is filled by real huggingface_hub downloads from tests/hubserver.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hubserver import ConnectionGuard, HubServer, Repo, hf_env, write_manifest

from specgate.core.cli import BadInput
from specgate.core.manifest import load
from specgate.vllmside import sources

REPO_ID = "acme/tiny-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FILES = {"config.json": b'{"model_type": "qwen3"}', "tokenizer/vocab.json": b'{"a": 0}' * 50,
         "model.safetensors": os.urandom(200_000)}


@pytest.fixture
def env(tmp_path):
    """A fresh folder for HF homes and the manifest. Fixtures come from the harness cache
    as usual (content-addressed, built once under a lock)."""
    return tmp_path


@pytest.fixture(scope="module")
def hub():
    with HubServer([Repo(REPO_ID, COMMIT, dict(FILES))]) as server:
        yield server


def download(hub: HubServer, home: Path) -> Path:
    """A real snapshot_download in a child process, as a user or warm_cache would run it."""
    code = f"from huggingface_hub import snapshot_download as d; print(d({REPO_ID!r}, revision={COMMIT!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=hf_env(hub.endpoint, home, HF_HUB_OFFLINE="0"),
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def manifest_for(folder: Path):
    return load(write_manifest(folder, {REPO_ID: {"revision": COMMIT, "suites": ["cpu_e2e"]}}))


def test_complete_snapshot_is_found_with_its_size(env, hub):
    path = download(hub, env / "home")
    snap = sources.snapshot(REPO_ID, COMMIT, env / "home" / "hub")
    assert snap.path == path and snap.reason == ""
    assert snap.size == sum(len(v) for v in FILES.values())
    assert (snap.path / "model.safetensors").read_bytes() == FILES["model.safetensors"]


def test_absent_snapshot_says_not_cached(env):
    snap = sources.snapshot(REPO_ID, COMMIT, env / "nothing")
    assert snap.path is None and "not in the HF cache" in snap.reason


@pytest.mark.parametrize("damage", ["truncated blob", "missing file"])
def test_damaged_snapshot_is_not_complete(env, hub, damage):
    path = download(hub, env / "home")
    target = path / "model.safetensors"
    if damage == "truncated blob":
        blob = target.resolve()
        blob.write_bytes(blob.read_bytes()[:1000])
    else:
        target.unlink()
    snap = sources.snapshot(REPO_ID, COMMIT, env / "home" / "hub")
    assert snap.path is None
    assert "1 of 3 files missing or incomplete (model.safetensors)" in snap.reason


def test_snapshot_without_cached_listing_does_not_count(env, hub):
    """A folder full of files is not proof of completeness without the commit's file listing."""
    download(hub, env / "home")
    for listing in (sources.repo_folder(REPO_ID, env / "home" / "hub") / "trees").iterdir():
        listing.unlink()
    snap = sources.snapshot(REPO_ID, COMMIT, env / "home" / "hub")
    assert snap.path is None and "no cached file listing" in snap.reason


def test_other_revision_is_not_the_pinned_one(env, hub):
    download(hub, env / "home")
    snap = sources.snapshot(REPO_ID, "f" * 40, env / "home" / "hub")
    assert snap.path is None and "not in the HF cache" in snap.reason


def test_resolve_cached_hub_checkpoint_in_auto_and_hub_without_network(env, hub):
    manifest = manifest_for(env)
    path = download(hub, env / "home")
    with ConnectionGuard() as guard:
        for mode in ("auto", "hub"):
            source = sources.resolve(manifest, REPO_ID, mode, cache_dir=env / "home" / "hub")
            assert source == sources.Source(REPO_ID, COMMIT, "hub", str(path), "tiny-qwen3", "cached", "")
    assert guard.events == []


def test_resolve_missing_hub_checkpoint(env):
    manifest = manifest_for(env)
    source = sources.resolve(manifest, REPO_ID, "hub", cache_dir=env / "empty")
    assert (source.source, source.status, source.path) == ("hub", "missing", None)
    assert "not in the HF cache" in source.reason and "warm_cache" in source.reason


@pytest.mark.vllm
def test_resolve_auto_falls_back_to_the_fixture(env):
    manifest = manifest_for(env)
    with ConnectionGuard() as guard:
        source = sources.resolve(manifest, REPO_ID, "auto", cache_dir=env / "empty")
    assert (source.source, source.status, source.fixture) == ("fixture", "fixture", "tiny-qwen3")
    assert Path(source.path).is_dir() and any(Path(source.path).iterdir())
    assert "not in the HF cache" in source.reason and "using fixture tiny-qwen3" in source.reason
    assert not [e for e in guard.events if e[0] == "socket.connect"]


@pytest.mark.vllm
def test_resolve_fixture_mode_ignores_a_cached_snapshot(env, hub):
    manifest = manifest_for(env)
    download(hub, env / "home")
    source = sources.resolve(manifest, REPO_ID, "fixture", cache_dir=env / "home" / "hub")
    assert (source.source, source.status) == ("fixture", "fixture")
    assert source.reason == "model source is fixture"


def test_resolve_rejects_unknown_checkpoint_and_mode(env):
    manifest = manifest_for(env)
    with pytest.raises(BadInput, match="other/model: not a checkpoint in manifest.toml"):
        sources.resolve(manifest, "other/model", "auto")
    with pytest.raises(BadInput, match="model source 'cloud': expected one of auto, hub, fixture"):
        sources.resolve(manifest, REPO_ID, "cloud")
