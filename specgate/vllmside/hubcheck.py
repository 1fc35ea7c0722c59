"""Whether a cached hub snapshot holds the bytes the hub listed, and removing what does not.

huggingface_hub records each snapshot's file listing (get_cached_repo_tree: sizes and git blob
ids) and stores a file's bytes as a blob named by its etag: an LFS file's sha256, any other
file's git blob id. specgate.vllmside.sources counts a snapshot complete when every listed
file has its listed size; this reads the bytes: an LFS blob against the sha256 its name
carries, any other file against its listed blob id. (A cache made without symlinks holds
copies with no such name; their sizes are all that is checked.)

Hashing gigabytes on every warm_cache would break its warm no-op, so a file that matched once
is stamped (size, mtime and inode of its blob; build.VerifiedStamps) and hashed again only
when the stamp no longer fits: a truncated, rewritten or replaced blob changes it. The stamps
sit beside warm_cache's download locks (<hub cache>/.locks/specgate/), where huggingface_hub's
own cache scan does not look.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from specgate.core.build import VerifiedStamps, hash_file
from specgate.vllmside.sources import hub_cache, repo_folder

CORRUPT = "cache-corrupt"    # the cause of a cached file whose bytes are not the hub's
SHA256 = re.compile(r"[0-9a-f]{64}")       # an LFS blob's name


def _stamp_file(repo_id: str, revision: str, cache: Path) -> Path:
    return hub_cache(cache) / ".locks" / "specgate" / f"{repo_folder(repo_id, cache).name}@{revision}.verified.json"


def _stamp(path: Path) -> list[int]:
    st = os.stat(path)        # follows the snapshot's link to its blob
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _digest(path: Path, lfs: bool) -> str:
    """sha256 of the bytes (LFS), else their git blob id: sha1 of "blob <size>\\0" + bytes."""
    return hash_file(path, hashlib.sha256() if lfs else hashlib.sha1(b"blob %d\0" % path.stat().st_size))


def damaged(repo_id: str, revision: str, cache: Path) -> dict[str, str]:
    """{file: why} for each listed file of the cached snapshot that is on disk but not what
    the hub listed (a missing file is not damaged: a fetch fills it). Stamps what matched."""
    from huggingface_hub import get_cached_repo_tree

    folder = repo_folder(repo_id, cache) / "snapshots" / revision
    stamps = VerifiedStamps(_stamp_file(repo_id, revision, cache))
    found = {}
    for entry in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache):
        path = folder / entry.path
        try:
            stamp = _stamp(path)
        except OSError:
            continue
        if stamps.fits(entry.path, stamp) or not path.is_symlink():   # a copy, not a blob: no name to check
            stamps.matched(entry.path, stamp)
            continue
        blob = path.resolve().name
        lfs = SHA256.fullmatch(blob) is not None
        want = blob if lfs else entry.blob_id
        if stamp[0] != entry.size:
            found[entry.path] = f"{stamp[0]} bytes, the hub listed {entry.size}"
        elif _digest(path, lfs) != want:
            found[entry.path] = f"its {'sha256' if lfs else 'git blob id'} is not the listed {want[:12]}"
        else:
            stamps.matched(entry.path, stamp)
    stamps.save()
    return found


def discard(repo_id: str, revision: str, names: Iterable[str], cache: Path) -> None:
    """Remove damaged files: the snapshot's link and the blob it points to, so the next
    fetch downloads them again and no session reads them before that."""
    folder = repo_folder(repo_id, cache)
    for name in names:
        link = folder / "snapshots" / revision / name
        blob = link.resolve()
        link.unlink(missing_ok=True)
        if blob.parent == (folder / "blobs").resolve():
            blob.unlink(missing_ok=True)
