"""Shared by the harness's own tests: no test writes into the real artifacts/ folder."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def isolated_artifacts(tmp_path_factory, monkeypatch):
    """Each test (and every session process it starts) writes its artifacts under a temporary
    folder, unless the test points SPECGATE_ARTIFACTS elsewhere itself."""
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path_factory.mktemp("artifacts")))

