"""`nox -s gate`: the session is specgate.sessions.gate.session."""
