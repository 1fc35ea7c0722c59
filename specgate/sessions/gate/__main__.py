"""`python -m specgate.sessions.gate`: the gate session (specgate.sessions.gate.session)."""

from specgate.sessions import lifecycle
from specgate.sessions.gate.session import SESSION, build_parser, step

lifecycle.main(SESSION, build_parser(), step)
