"""`nox -s tests` and `nox -s ci_jobs`: the session is specgate.sessions.selftest.session."""
