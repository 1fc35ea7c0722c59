"""`nox -s bench`: the session is specgate.sessions.bench.session."""
