"""`python -m specgate.sessions.bench`: the bench session (specgate.sessions.bench.session)."""

from specgate.sessions import lifecycle
from specgate.sessions.bench.session import SESSION, build_parser, step

lifecycle.main(SESSION, build_parser(), step)
