"""Buildkite Test Engine: the sessions' pytest runs (specgate.sessions.pytestrun.run_pytest) load the
official collector when BUILDKITE_ANALYTICS_TOKEN is set, and nothing changes without it. The
collector uploads to a real local server ($BUILDKITE_ANALYTICS_API_URL), never to Buildkite."""

from __future__ import annotations

import json
import os
from http.server import BaseHTTPRequestHandler

import pytest
from localserver import LocalServer

from specgate.sessions import pytestrun

TOKEN = "bkta_0123456789abcdef0123456789abcdef"
PROBE = """
def pytest_configure(config):
    import pathlib
    loaded = config.pluginmanager.has_plugin("buildkite-test-collector")
    pathlib.Path("collector-loaded").write_text(str(loaded))
"""


class UploadServer(LocalServer):
    """Test Engine's upload endpoint (POST {api}/uploads), recording what it is sent."""

    def __init__(self) -> None:
        self.uploads: list[tuple[str | None, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.uploads.append((self.headers.get("Authorization"), body))
                reply = json.dumps({"id": "upload-1", "queued": len(body["data"]), "skipped": 0}).encode()
                self.send_response(202)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        super().__init__(Handler)

    @property
    def url(self) -> str:
        return f"{self.origin}/v1"


def test_the_collector_is_asked_for_only_with_its_token():
    assert pytestrun.collector_args({"BUILDKITE_ANALYTICS_TOKEN": TOKEN}) == ["-p", "buildkite-test-collector"]
    assert pytestrun.collector_args({}) == ["-p", "no:buildkite-test-collector"]
    assert pytestrun.collector_args({"BUILDKITE_ANALYTICS_TOKEN": ""}) == ["-p", "no:buildkite-test-collector"]


@pytest.mark.parametrize("token", [TOKEN, None])
def test_a_session_pytest_run_reports_to_test_engine_only_with_the_token(tmp_path, capsys, token):
    (tmp_path / "conftest.py").write_text(PROBE)
    (tmp_path / "test_sample.py").write_text("def test_sample():\n    assert True\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUILDKITE", "SPECGATE_SESSION"))}
    with UploadServer() as engine:
        env["BUILDKITE_ANALYTICS_API_URL"] = engine.url
        if token:
            env["BUILDKITE_ANALYTICS_TOKEN"] = token
        code = pytestrun.run_pytest(["-q", "-p", "no:cacheprovider"], tmp_path / "junit.xml", cwd=tmp_path, env=env)
    out = capsys.readouterr().out
    assert code == 0, out
    assert (tmp_path / "collector-loaded").read_text() == str(bool(token))
    assert [r.outcome for r in pytestrun.read_junit(tmp_path / "junit.xml")] == ["passed"]   # the gate's input
    assert "BUILDKITE_ANALYTICS_TOKEN" not in out            # no warning about a missing token
    if token:
        [(authorization, upload)] = engine.uploads
        assert authorization == f'Token token="{token}"'
        assert upload["format"] == "json" and [t["name"] for t in upload["data"]] == ["test_sample"]
        assert token not in out
    else:
        assert engine.uploads == []
