"""`python -m specgate.e2e`: the cpu_e2e session (specgate.e2e.session)."""

from specgate import lifecycle
from specgate.e2e import SESSION
from specgate.e2e.session import build_parser, step

lifecycle.main(SESSION, build_parser(), step)
