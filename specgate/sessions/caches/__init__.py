"""`nox -s cache`: the session is specgate.sessions.caches.session."""
