"""`python -m specgate.sessions.e2e`: the cpu_e2e session (specgate.sessions.e2e.session)."""

from specgate.sessions import lifecycle
from specgate.sessions.e2e import SESSION
from specgate.sessions.e2e.session import build_parser, step

lifecycle.main(SESSION, build_parser(), step)
