"""Sessions that gate vLLM speculative decoding on CPU. Logic lives in specgate/.

Every session records its result in artifacts/<session>/summary.json and ends with
its own exit code (0 pass, 1 failure, 2 bad input, 75 incomplete); a nox call that
runs several ends with the most severe of them (specgate.sessions.noxsupport).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent))
from specgate.sessions.noxsupport import lock_constraints, run_module, static_check  # noqa: E402

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"


@nox.session(python=PYTHON, tags=["check"])
def tests(session: nox.Session) -> None:
    """Run the harness's own tests but the Buildkite job chain (the fast loop)."""
    run_module(session, "specgate.sessions.selftest")


@nox.session(python=PYTHON, tags=["check"])
def ci_jobs(session: nox.Session) -> None:
    """Run tests/ci: the Buildkite job chain, driven as an agent runs it (its soak tests aside)."""
    run_module(session, "specgate.sessions.selftest")


@nox.session(python=PYTHON, tags=["soak"], default=False)
def ci_soak(session: nox.Session) -> None:
    """Run tests/ci's soak tests: five PR builds in a row on one agent's disk budget."""
    run_module(session, "specgate.sessions.selftest")


@nox.session(python=PYTHON, tags=["check"])
def lint(session: nox.Session) -> None:
    """Lint the repository with ruff, and specgate/'s layers with import-linter (both in pyproject.toml)."""
    static_check(session, ("ruff", "check", "."), ("lint-imports",))


@nox.session(python=PYTHON, tags=["check"])
def typecheck(session: nox.Session) -> None:
    """Type-check specgate/ with mypy (settings in pyproject.toml)."""
    static_check(session, ("mypy",))


@nox.session(python=PYTHON, tags=["gate"])
def warm_cache(session: nox.Session) -> None:
    """Fill the HF cache with every pinned checkpoint and build the fixtures."""
    run_module(session, "specgate.sessions.warm")


@nox.session(python=PYTHON, tags=["gate"])
def cpu_unit(session: nox.Session) -> None:
    """Run vLLM's own 14 spec-decode unit files at the installed vLLM version."""
    run_module(session, "specgate.sessions.unit")


@nox.session(python=PYTHON, tags=["gate"])
def cpu_e2e(session: nox.Session) -> None:
    """Run engine-level spec-decode e2e tests in torch.compile mode."""
    run_module(session, "specgate.sessions.e2e")


@nox.session(python=PYTHON, default=False)
def mutants(session: nox.Session) -> None:
    """Inject each catalogued spec-decode fault into the engine and see which e2e checks kill it."""
    run_module(session, "specgate.sessions.mutants")


@nox.session(python=PYTHON, default=False)
def gate(session: nox.Session) -> None:
    """Say from past summary.json files whether the CI step may drop soft_fail."""
    run_module(session, "specgate.sessions.gate")


@nox.session(python=PYTHON, default=False)
def cache(session: nox.Session) -> None:
    """List the harness's caches, or prune them to the manifest's bounds (-- prune)."""
    run_module(session, "specgate.sessions.caches")


@nox.session(python=PYTHON, default=False)
def bench(session: nox.Session) -> None:
    """Measure harness overhead, cache no-op, env setup and compile-cache speedups."""
    run_module(session, "specgate.sessions.bench")


@nox.session(venv_backend="none", default=False)
def lock(session: nox.Session) -> None:
    """Regenerate constraints/*.txt from constraints/*.in with uv pip compile."""
    lock_constraints(session)


if __name__ == "__main__":
    nox.main()
