"""`python -m specgate.sessions.mutants`: the mutants session (specgate.sessions.mutants.session)."""

from specgate.sessions import lifecycle
from specgate.sessions.mutants import SESSION
from specgate.sessions.mutants.session import build_parser, step

lifecycle.main(SESSION, build_parser(), step)
