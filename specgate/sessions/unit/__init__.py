"""`nox -s cpu_unit`: the session is specgate.sessions.unit.session."""
