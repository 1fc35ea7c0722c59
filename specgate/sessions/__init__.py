"""The sessions, the top layer: one package each (`python -m specgate.sessions.NAME` runs
it; its session.py is the session), and beside them the modules every session runs in:
lifecycle (the session's frame: its record, options, exit code), noxsupport (the noxfile's
side, in nox's own interpreter), pytestrun and envcheck (the pytest process a session starts,
and the plugin loaded into it). Sessions may import any layer below (pyproject.toml
[tool.importlinter]); nothing below imports a session."""
