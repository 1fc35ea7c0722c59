"""What a session's pytest child (specgate.sessions.pytestrun.run_pytest) leaves behind: nothing in
the temp dir, whatever it wrote there (pytest's tmp_path, files, Unix sockets as vLLM's IPC uses);
inductor's precompiled headers, which torch keeps under the temp dir whatever
TORCHINDUCTOR_CACHE_DIR says, land in the compile cache instead."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from specgate.sessions import pytestrun

LITTERS = """
import os, socket, tempfile

def test_litter(tmp_path):
    (tmp_path / "kept-by-pytest").write_text("x")
    with open(os.path.join(tempfile.gettempdir(), "vllm_dist_0123"), "w") as f:
        f.write("gloo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(tempfile.gettempdir(), "0d2c6f1e-ipc"))
    with open("seen-tempdir", "w") as f:
        f.write(tempfile.gettempdir())
"""

HEADERS = """
import os

def test_headers():
    from torch._inductor import codecache
    os.makedirs(codecache._HEADER_DIR, exist_ok=True)
    with open(os.path.join(codecache._HEADER_DIR, "probe.h.gch"), "w") as f:
        f.write("pch")
"""


@pytest.fixture
def temp_root(monkeypatch):
    """The harness's own temp dir, empty, with a path as short as /tmp's children (tmp_path's is
    too long for a Unix socket two folders down); tempfile caches it, so set it there too."""
    root = Path(tempfile.mkdtemp(prefix="root-"))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root)


def run(folder, source: str, env: dict[str, str]) -> int:
    (folder / "test_child.py").write_text(source)
    return pytestrun.run_pytest(["-q", "-p", "no:cacheprovider", "test_child.py"], folder / "junit.xml",
                                cwd=folder, env=env)


def test_the_child_litters_a_private_temp_dir_that_goes_with_it(tmp_path, temp_root):
    work = tmp_path / "work"
    work.mkdir()
    assert run(work, LITTERS, dict(os.environ)) == 0
    seen = (work / "seen-tempdir").read_text()
    assert os.path.dirname(seen) == str(temp_root)       # under the user's TMPDIR, not beside it
    assert not os.path.exists(seen)
    assert list(temp_root.iterdir()) == []


@pytest.mark.vllm
def test_inductor_keeps_its_precompiled_headers_in_the_compile_cache(tmp_path, temp_root):
    """Real torch: where its codecache puts precompiled headers under the child's environment.
    If torch renames its default cache dir, the headers stay in the private temp dir (built
    again each run, never left behind) and this fails."""
    work, inductor = tmp_path / "work", tmp_path / "compile" / "inductor"
    work.mkdir()
    inductor.mkdir(parents=True)
    assert run(work, HEADERS, {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}) == 0
    assert (inductor / "precompiled_headers" / "probe.h.gch").read_text() == "pch"
    assert list(temp_root.iterdir()) == []
