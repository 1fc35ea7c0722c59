"""`python -m specgate.sessions.unit`: the cpu_unit session (specgate.sessions.unit.session)."""

from specgate.sessions import lifecycle
from specgate.sessions.unit.session import SESSION, build_parser, step

lifecycle.main(SESSION, build_parser(), step)
