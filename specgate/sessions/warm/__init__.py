"""`nox -s warm_cache`: the session is specgate.sessions.warm.session."""
