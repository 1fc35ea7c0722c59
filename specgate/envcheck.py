"""pytest plugin loaded into every session's pytest process (see specgate.pytestrun).

It compares the environment the test process really sees with the manifest and
stops the run before any test when they differ, so a value set in two places
with two values cannot go unnoticed. A phase that changes a pinned variable on
purpose (the online rerun) names it in SPECGATE_PHASE_OVERRIDES.
"""

from __future__ import annotations

import os

import pytest

from specgate import artifacts, envpin, manifest as manifest_mod

OVERRIDES_VAR = "SPECGATE_PHASE_OVERRIDES"


def pytest_configure(config: pytest.Config) -> None:
    session = os.environ.get("SPECGATE_SESSION")
    if not session or hasattr(config, "workerinput"):
        return
    try:
        manifest = manifest_mod.load()
    except manifest_mod.ManifestError as exc:
        raise pytest.UsageError(str(exc)) from None
    overrides = set(filter(None, os.environ.get(OVERRIDES_VAR, "").split(",")))
    problems = [p for p in envpin.mismatches(manifest, session, os.environ) if p.split(":")[0] not in overrides]
    artifacts.write_json(artifacts.artifacts_dir(session) / "pytest-env.json", {
        "env": envpin.session_report(manifest, session),
        "phase_overrides": sorted(overrides),
        "mismatches": problems,
    })
    if problems:
        raise pytest.UsageError(f"{session}: the test process environment differs from manifest.toml: " + "; ".join(problems))
