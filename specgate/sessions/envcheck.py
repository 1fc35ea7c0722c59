"""pytest plugin loaded into every session's pytest process (see specgate.sessions.pytestrun).

It compares the environment the test process really sees with the manifest and
stops the run before any test when they differ, so a value set in two places
with two values cannot go unnoticed. The online phase (SPECGATE_ONLINE=1, the
rerun of a cache miss) is compared with the manifest's [online.env] on top of
the session's pins, every other variable as usual.
"""

from __future__ import annotations

import os

import pytest

from specgate.contract import artifacts
from specgate.core import envpin
from specgate.core import manifest as manifest_mod


def pytest_configure(config: pytest.Config) -> None:
    session = os.environ.get("SPECGATE_SESSION")
    if not session or hasattr(config, "workerinput"):
        return
    try:
        manifest = manifest_mod.load()
    except manifest_mod.ManifestError as exc:
        raise pytest.UsageError(str(exc)) from None
    problems = envpin.mismatches(manifest, session, os.environ)
    artifacts.write_json(artifacts.artifacts_dir(session) / "pytest-env.json", {
        "env": envpin.session_report(manifest, session),
        "phase": "online" if os.environ.get(envpin.ONLINE_VAR) == "1" else "offline",
        "mismatches": problems,
    })
    if problems:
        raise pytest.UsageError(f"{session}: the test process environment differs from manifest.toml: "
                                + "; ".join(problems))
