"""`python -m specgate.mutants`: the mutants session (specgate.mutants.session)."""

from specgate import lifecycle
from specgate.mutants import SESSION
from specgate.mutants.session import build_parser, step

lifecycle.main(SESSION, build_parser(), step)
