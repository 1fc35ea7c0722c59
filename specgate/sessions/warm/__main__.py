"""`python -m specgate.sessions.warm`: the warm_cache session (specgate.sessions.warm.session)."""

from specgate.sessions import lifecycle
from specgate.sessions.warm.session import SESSION, build_parser, step

lifecycle.main(SESSION, build_parser(), step)
