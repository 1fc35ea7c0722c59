"""No process outlives its step: children die with their parent, and a session that
is stopped takes its whole process tree with it (psutil walks the tree). Nor does a
session process's temp dir."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator

PR_SET_PDEATHSIG = 1
GRACE_S = 3.0


def die_with_parent() -> None:
    """preexec_fn for a child: SIGKILL when the parent dies, even by SIGKILL (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def end_tree(grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every descendant of this process, SIGKILL what is left after grace_s.
    Descendants that started their own session are found too. Returns their pids."""
    return end_process_tree(os.getpid(), grace_s, spare_root=True)


def end_process_tree(pid: int, grace_s: float = GRACE_S, *, spare_root: bool = False) -> list[int]:
    """SIGTERM the process pid and every descendant, SIGKILL what is left after grace_s
    (spare_root: only the descendants). The tree is read before anything is signalled,
    so a grandchild is found while its parent still links it. Returns their pids."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + ([] if spare_root else [root])
    except psutil.NoSuchProcess:
        return []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return [proc.pid for proc in procs]


_given_tempdir: str | None = None   # the session's temp dir while session_tempdir() holds it


@contextlib.contextmanager
def session_tempdir() -> Iterator[None]:
    """The session process's own temp files go into a folder removed when it leaves this block,
    as its pytest child's do: a session that builds a fixture imports torch._dynamo, whose import
    creates <temp dir>/torchinductor_<user>. tempfile's setting, not TMPDIR: other child
    processes keep the temp dir the environment names, and a pytest child's folder goes there
    too, not one level down (the socket paths stay short)."""
    global _given_tempdir
    _given_tempdir = given = tempfile.gettempdir()
    private = tempfile.tempdir = tempfile.mkdtemp(prefix="specgate-")
    try:
        yield
    finally:
        tempfile.tempdir, _given_tempdir = given, None
        shutil.rmtree(private, ignore_errors=True)


def given_tempdir() -> str:
    """The temp dir this process was given (the environment's), inside session_tempdir() too."""
    return _given_tempdir or tempfile.gettempdir()
