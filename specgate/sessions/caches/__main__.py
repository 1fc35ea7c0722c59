"""`python -m specgate.sessions.caches`: the cache session (specgate.sessions.caches.session)."""

from specgate.sessions import lifecycle
from specgate.sessions.caches.session import SESSION, build_parser, step

lifecycle.main(SESSION, build_parser(), step)
