"""Where a checkpoint's files come from: its pinned hub snapshot, or its fixture.

Modes (--model-source / SPECGATE_MODEL_SOURCE):
  auto     the hub snapshot at its pinned revision when it is fully cached, else the fixture
  hub      the hub snapshot is required; without it the checkpoint is missing
  fixture  always the fixture

Nothing here touches the network: "cached" means huggingface_hub's own cached
file listing for the pinned commit exists and every listed file is on disk at
its listed size. A snapshot folder without that listing (an interrupted or
foreign download) does not count. specgate.sessions.warm fills the cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specgate.core.cli import MODEL_SOURCES, BadInput
from specgate.core.manifest import UNPINNED, Checkpoint, Manifest


@dataclass(frozen=True)
class Source:
    repo_id: str
    revision: str
    source: str          # "hub" | "fixture"
    path: str | None     # the folder to load, None when missing
    fixture: str         # the fixture that stands in for this checkpoint
    status: str          # "cached" | "downloaded" | "fixture" | "missing"
    reason: str          # why this source (empty for a cached hub snapshot)


@dataclass(frozen=True)
class Snapshot:
    path: Path | None    # the snapshot folder when complete
    size: int            # bytes the cached listing names (0 when unknown)
    reason: str          # why it is not complete ("" when it is)


def hub_cache(cache_dir: Path | str | None = None) -> Path:
    """The HF hub cache folder (HF_HUB_CACHE, else HF_HOME/hub, as huggingface_hub reads them)."""
    if cache_dir is not None:
        return Path(cache_dir)
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_folder(repo_id: str, cache_dir: Path | str | None = None) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return hub_cache(cache_dir) / repo_folder_name(repo_id=repo_id, repo_type="model")


def snapshot(repo_id: str, revision: str, cache_dir: Path | str | None = None) -> Snapshot:
    """The cached snapshot of repo_id at revision, judged without any network access."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    where = f"{repo_id}@{revision[:12]}"
    if revision == UNPINNED:
        return Snapshot(None, 0, f"{repo_id}: no pinned revision, so no cached snapshot can count as it")
    folder = repo_folder(repo_id, cache_dir) / "snapshots" / revision
    try:
        files = get_cached_repo_tree(repo_id, revision=revision, cache_dir=hub_cache(cache_dir))
    except CachedRepoTreeNotFoundError:
        why = ("snapshot folder has no cached file listing, so it may be partial" if folder.is_dir()
               else "not in the HF cache")
        return Snapshot(None, 0, f"{where}: {why}")
    size = sum(f.size for f in files)
    missing = [f.path for f in files if not _on_disk(folder / f.path, f.size)]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return Snapshot(None, size, f"{where}: {len(missing)} of {len(files)} files missing or incomplete ({shown})")
    return Snapshot(folder, size, "")


def _on_disk(path: Path, size: int) -> bool:
    try:
        return os.stat(path).st_size == size  # follows the blob symlink; a dangling one fails
    except OSError:
        return False


def checkpoint(manifest: Manifest, repo_id: str) -> Checkpoint:
    try:
        return manifest.checkpoints[repo_id]
    except KeyError:
        raise BadInput(f"{repo_id}: not a checkpoint in {manifest.path.name} "
                       f"(known: {', '.join(sorted(manifest.checkpoints))})") from None


def fixture_source(manifest: Manifest, ckpt: Checkpoint, reason: str) -> Source:
    from specgate.vllmside import fixtures

    path = fixtures.ensure(manifest, ckpt.fixture)
    return Source(ckpt.repo_id, ckpt.revision, "fixture", str(path), ckpt.fixture, "fixture", reason)


def hub_source(ckpt: Checkpoint, snap: Snapshot, status: str = "cached") -> Source:
    path = str(snap.path) if snap.path else None
    return Source(ckpt.repo_id, ckpt.revision, "hub", path, ckpt.fixture, status if path else "missing", snap.reason)


def resolve(manifest: Manifest, repo_id: str, mode: str, *, cache_dir: Path | str | None = None) -> Source:
    """The source to load repo_id from under `mode`; never downloads (see specgate.sessions.warm)."""
    if mode not in MODEL_SOURCES:
        raise BadInput(f"model source {mode!r}: expected one of {', '.join(MODEL_SOURCES)}")
    ckpt = checkpoint(manifest, repo_id)
    if mode == "fixture":
        return fixture_source(manifest, ckpt, "model source is fixture")
    snap = snapshot(ckpt.repo_id, ckpt.revision, cache_dir)
    if snap.path is not None:
        return hub_source(ckpt, snap)
    if mode == "hub":
        return hub_source(ckpt, Snapshot(None, snap.size,
                                         f"{snap.reason}; fill it with `nox -s warm_cache -- --model-source hub`"))
    return fixture_source(manifest, ckpt, f"{snap.reason}; using fixture {ckpt.fixture}")
