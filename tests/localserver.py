"""The start and stop of the tests' local HTTP servers, in one place: a ThreadingHTTPServer
on 127.0.0.1 at a port the OS picks, served by a daemon thread, shut down and closed on exit.
Used by tests/hubserver.py, tests/buildkiteserver.py and the fakes in the tests themselves."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


class LocalServer:
    """Give it a handler class; start with `with ...:` (or `start()`), stop on exit (or `close()`)."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)   # daemon_threads: True, its default
        # shutdown() waits for serve_forever's next poll: 0.5 s by default, in every test that closes one.
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)

    @property
    def origin(self) -> str:
        """http://127.0.0.1:<port>, where the server listens."""
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Self:
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
