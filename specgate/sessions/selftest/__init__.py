"""`nox -s tests`, `nox -s ci_jobs` and `nox -s ci_soak`: the session is specgate.sessions.selftest.session."""
