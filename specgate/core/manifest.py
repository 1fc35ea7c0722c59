"""The manifest: one TOML file, validated once, read by every session.

Stdlib only: the noxfile imports this before any venv exists.
"""

from __future__ import annotations

import builtins  # _Reader.str shadows the builtin inside the class
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]   # specgate/core/manifest.py
DEFAULT_MANIFEST = REPO_ROOT / "manifest.toml"
REVISION_RE = re.compile(r"^[0-9a-f]{40}$")
UNPINNED = "unpinned"  # a checkpoint whose commit is not known yet; never fetched, see Checkpoint.unpinned_reason
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SPEC_METHODS = ("none", "ngram", "eagle3", "dflash", "mtp")
RUNNERS = ("v1", "v2")


class ManifestError(ValueError):
    """A malformed manifest; str() is the one line shown to the user."""


@dataclass(frozen=True)
class SessionSpec:
    name: str
    constraints: str
    env: dict[str, str]


@dataclass(frozen=True)
class Checkpoint:
    repo_id: str
    revision: str
    fixture: str
    suites: tuple[str, ...]
    gated: bool = False
    unpinned_reason: str | None = None

    @property
    def pinned(self) -> bool:
        return self.revision != UNPINNED


@dataclass(frozen=True)
class Fixture:
    name: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Redirect:
    checkpoint: str
    fixture: str
    tests: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class UnitSpec:
    pipeline: str
    step_key: str
    timeout_s: int
    files: tuple[str, ...]
    redirects: tuple[Redirect, ...]


@dataclass(frozen=True)
class E2EConfig:
    id: str
    method: str
    runner: str
    target: str
    draft: str | None
    num_speculative_tokens: int
    floors: dict[str, float]
    raw: dict[str, Any]


@dataclass(frozen=True)
class GateSpec:
    """[gate]: what `nox -s gate` needs before a CI step may drop soft_fail."""

    runs: int                                         # clean runs a step needs (--runs overrides)
    history_builds: int                               # recent builds a Buildkite history reads (--builds overrides)
    budget_s: dict[str, int]                          # step -> its timeout budget in .buildkite/pipeline.yml
    coverage: dict[str, dict[str, dict[str, int]]]    # vLLM version -> step -> test file -> passed tests, at least

    def floors(self, vllm_version: str | None, step: str) -> dict[str, int] | None:
        """The step's passed-tests-per-file floor on that vLLM version; None when none is declared."""
        return self.coverage.get(vllm_version or "", {}).get(step)


@dataclass(frozen=True)
class CacheSpec:
    """[cache]: what `nox -s cache -- prune` keeps (specgate.vllmside.cachestore)."""

    max_age_days: float      # entries last used longer ago are removed
    budget_gib: float        # then the least recently used, until the rest fits


@dataclass(frozen=True)
class DriftSpec:
    """[e2e] drift keys: how far a cpu_e2e run may fall behind its recent clean runs (specgate.ciside.drift)."""

    window: int                  # the median is taken over this many most recent comparable clean runs
    acceptance_len_drop: float   # acceptance length may fall this far below the median; further is a regression
    per_position_drop: float     # so may a draft position's acceptance rate (0..1)
    slowdown_factor: float       # an engine start or generate time above this multiple of the median warns


@dataclass(frozen=True)
class Manifest:
    path: Path
    sessions: dict[str, SessionSpec]
    checkpoints: dict[str, Checkpoint]
    fixtures: dict[str, Fixture]
    unit: UnitSpec
    e2e: tuple[E2EConfig, ...]
    e2e_settings: dict[str, Any]
    online_env: dict[str, str]
    gate: GateSpec
    cache: CacheSpec | None      # None without a [cache] table (nox -s cache then refuses to run)
    drift: DriftSpec | None      # None when the manifest has no [e2e] table (no cpu_e2e to compare)

    def managed_env_names(self) -> set[str]:
        """Every variable some session pins: each session sets or removes all of them."""
        return {name for spec in self.sessions.values() for name in spec.env}

    def session(self, name: str) -> SessionSpec:
        try:
            return self.sessions[name]
        except KeyError:
            raise ManifestError(
                f"{self.path.name}: key 'sessions.{name}': missing (known: {', '.join(sorted(self.sessions))})"
            ) from None

    def checkpoints_for(self, suites: list[str] | None = None) -> list[Checkpoint]:
        return [c for c in self.checkpoints.values() if not suites or set(c.suites) & set(suites)]


class _Reader:
    """Typed access to a TOML table that names the file and key in every error."""

    def __init__(self, path: Path, data: dict[str, Any], prefix: str = "") -> None:
        self.path, self.data, self.prefix = path, data, prefix

    def _key(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, expected: str, got: Any = None) -> ManifestError:
        shown = "missing" if got is None else f"got {got!r}"
        return ManifestError(f"{self.path.name}: key '{self._key(key)}': expected {expected}, {shown}")

    def get(self, key: str, typ: type | tuple[type, ...], expected: str, default: Any = ...) -> Any:
        if key not in self.data:
            if default is ...:
                raise self.fail(key, expected)
            return default
        value = self.data[key]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise self.fail(key, expected, value)
        return value

    def str(self, key: str, default: Any = ..., pattern: re.Pattern[str] | None = None,
            choices: tuple[str, ...] | None = None, expected: str = "a string") -> Any:
        value = self.get(key, str, expected, default)
        if value is None or value is default:
            return value
        if pattern is not None and not pattern.match(value):
            raise self.fail(key, expected, value)
        if choices is not None and value not in choices:
            raise self.fail(key, f"one of {', '.join(choices)}", value)
        return value

    def str_list(self, key: builtins.str, default: Any = ...) -> tuple[builtins.str, ...]:
        value = self.get(key, list, "a list of strings", default)
        if value is default:
            return value
        if not all(isinstance(v, str) for v in value):
            raise self.fail(key, "a list of strings", value)
        return tuple(value)

    def table(self, key: builtins.str, default: Any = ...) -> _Reader:
        value = self.get(key, dict, "a table", default)
        return _Reader(self.path, value if isinstance(value, dict) else {}, f"{self._key(key)}.")


def _env(table: _Reader) -> dict[str, str]:
    env = {}
    for var, value in table.data.items():
        if not isinstance(value, str):
            raise table.fail(var, "a string (quote numbers)", value)
        env[var] = value
    return env


def _sessions(root: _Reader) -> dict[str, SessionSpec]:
    sessions = {}
    for name in root.table("sessions").data:
        table = root.table("sessions").table(name)
        env = _env(table.table("env", default={}))
        constraints = table.str("constraints")
        if not (REPO_ROOT / constraints).is_file():
            raise table.fail("constraints", "an existing file", constraints)
        sessions[name] = SessionSpec(name, constraints, env)
    return sessions


def _checkpoints(root: _Reader, fixtures: dict[str, Fixture]) -> dict[str, Checkpoint]:
    checkpoints = {}
    table = root.table("checkpoints")
    for repo_id in table.data:
        if not HUB_ID_RE.match(repo_id):
            raise table.fail(repo_id, "a hub id shaped like 'owner/name'", repo_id)
        entry = table.table(repo_id)
        fixture = entry.str("fixture")
        if fixture not in fixtures:
            raise entry.fail("fixture", f"a fixture declared under [fixtures] ({', '.join(sorted(fixtures))})", fixture)
        unpinned_reason = entry.str("unpinned_reason", default=None)
        revision = entry.str("revision")
        if not (REVISION_RE.match(revision) or (revision == UNPINNED and unpinned_reason)):
            raise entry.fail("revision", f"a 40-hex commit revision (or {UNPINNED!r} with an unpinned_reason)",
                             revision)
        checkpoints[repo_id] = Checkpoint(
            repo_id=repo_id,
            revision=revision,
            fixture=fixture,
            suites=entry.str_list("suites"),
            gated=entry.get("gated", bool, "true or false", False),
            unpinned_reason=unpinned_reason,
        )
    return checkpoints


def _fixtures(root: _Reader) -> dict[str, Fixture]:
    table = root.table("fixtures")
    fixtures = {}
    for name in table.data:
        entry = table.table(name)
        params = {k: v for k, v in entry.data.items() if k != "kind"}
        fixtures[name] = Fixture(name, entry.str("kind"), params)
    return fixtures


def _unit(root: _Reader, checkpoints: dict[str, Checkpoint], fixtures: dict[str, Fixture]) -> UnitSpec:
    unit = root.table("unit")
    redirects = []
    for index, raw in enumerate(unit.get("redirects", list, "an array of tables", [])):
        entry = _Reader(root.path, raw, f"unit.redirects[{index}].")
        checkpoint = entry.str("checkpoint")
        if checkpoint not in checkpoints:
            raise entry.fail("checkpoint", "a checkpoint declared under [checkpoints]", checkpoint)
        fixture = entry.str("fixture")
        if fixture not in fixtures:
            raise entry.fail("fixture", "a fixture declared under [fixtures]", fixture)
        redirects.append(Redirect(checkpoint, fixture, entry.str_list("tests"), entry.str("reason")))
    files = unit.str_list("files")
    if not files:
        raise unit.fail("files", "a non-empty list of test files", [])
    timeout = unit.get("timeout_s", int, "a positive integer")
    if timeout <= 0:
        raise unit.fail("timeout_s", "a positive integer", timeout)
    return UnitSpec(unit.str("pipeline"), unit.str("step_key"), timeout, files, tuple(redirects))


def _e2e(root: _Reader, checkpoints: dict[str, Checkpoint]) -> tuple[tuple[E2EConfig, ...], dict[str, Any]]:
    e2e = root.table("e2e", default={})
    configs = []
    for index, raw in enumerate(e2e.get("configs", list, "an array of tables", [])):
        entry = _Reader(root.path, raw, f"e2e.configs[{index}].")
        target = entry.str("target")
        draft = entry.str("draft", default=None)
        for key, repo in (("target", target), ("draft", draft)):
            if repo is not None and repo not in checkpoints:
                raise entry.fail(key, "a checkpoint declared under [checkpoints]", repo)
        k = entry.get("num_speculative_tokens", int, "a positive integer", 0)
        floors = entry.get("floors", dict, "a table of acceptance-length floors", {})
        for source, floor in floors.items():
            if not isinstance(floor, (int, float)) or isinstance(floor, bool) or floor < 1.0:
                raise entry.fail(f"floors.{source}", "a number >= 1.0", floor)
        configs.append(E2EConfig(
            id=entry.str("id"),
            method=entry.str("method", choices=SPEC_METHODS),
            runner=entry.str("runner", choices=RUNNERS, default="v1"),
            target=target,
            draft=draft,
            num_speculative_tokens=k,
            floors={s: float(f) for s, f in floors.items()},
            raw=dict(raw),
        ))
    ids = [c.id for c in configs]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate:
        raise e2e.fail("configs", "unique ids", duplicate)
    settings = {k: v for k, v in e2e.data.items() if k != "configs"}
    return tuple(configs), settings


def _int_at_least(table: _Reader, key: str, minimum: int) -> int:
    expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    value = table.get(key, int, expected)
    if value < minimum:
        raise table.fail(key, expected, value)
    return value


def _gate(root: _Reader, sessions: dict[str, SessionSpec]) -> GateSpec:
    gate = root.table("gate")

    def step_of(table: _Reader, step: str) -> str:
        # A step is a session; a misspelt one would silently never be judged.
        if step not in sessions:
            raise table.fail(step, f"a session declared under [sessions] ({', '.join(sorted(sessions))})", step)
        return step

    budgets = gate.table("budget_s")
    coverage: dict[str, dict[str, dict[str, int]]] = {}
    for version in gate.table("coverage").data:
        per_step = gate.table("coverage").table(version)
        coverage[version] = {}
        for step in per_step.data:
            files = per_step.table(step_of(per_step, step))
            if not files.data:
                raise per_step.fail(step, "a table of test file = passed tests", {})
            coverage[version][step] = {name: _int_at_least(files, name, 0) for name in files.data}
    return GateSpec(
        runs=_int_at_least(gate, "runs", 1),
        history_builds=_int_at_least(gate, "history_builds", 1),
        budget_s={step_of(budgets, step): _int_at_least(budgets, step, 1) for step in budgets.data},
        coverage=coverage,
    )


def _cache(root: _Reader) -> CacheSpec | None:
    if "cache" not in root.data:
        return None
    cache = root.table("cache")

    def positive(key: str) -> float:
        value = cache.get(key, (int, float), "a number > 0")
        if isinstance(value, bool) or value <= 0:
            raise cache.fail(key, "a number > 0", value)
        return float(value)

    return CacheSpec(max_age_days=positive("max_age_days"), budget_gib=positive("budget_gib"))


def _drift(root: _Reader) -> DriftSpec | None:
    if "e2e" not in root.data:
        return None
    e2e = root.table("e2e")

    def number(key: str, minimum: float, expected: str) -> float:
        value = e2e.get(key, (int, float), expected)
        if isinstance(value, bool) or value < minimum:
            raise e2e.fail(key, expected, value)
        return float(value)

    return DriftSpec(
        window=_int_at_least(e2e, "drift_window", 1),
        acceptance_len_drop=number("acceptance_len_drop", 0.0, "a number >= 0"),
        per_position_drop=number("per_position_drop", 0.0, "a number >= 0"),
        slowdown_factor=number("slowdown_factor", 1.0, "a number >= 1.0"),
    )


def load(path: Path | str | None = None) -> Manifest:
    """Load and validate the manifest; raise ManifestError with one line on any defect.

    SPECGATE_MANIFEST points every session at another manifest (tests use it)."""
    path = Path(path or os.environ.get("SPECGATE_MANIFEST") or DEFAULT_MANIFEST)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path}: manifest not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path.name}: not valid TOML: {exc}") from None
    root = _Reader(path, data)
    if root.get("schema", int, "schema = 1") != 1:
        raise root.fail("schema", "1", data["schema"])
    fixtures = _fixtures(root)
    checkpoints = _checkpoints(root, fixtures)
    e2e, e2e_settings = _e2e(root, checkpoints)
    sessions = _sessions(root)
    return Manifest(
        path=path,
        sessions=sessions,
        checkpoints=checkpoints,
        fixtures=fixtures,
        unit=_unit(root, checkpoints, fixtures),
        e2e=e2e,
        e2e_settings=e2e_settings,
        online_env=_env(root.table("online").table("env")),
        gate=_gate(root, sessions),
        cache=_cache(root),
        drift=_drift(root),
    )
