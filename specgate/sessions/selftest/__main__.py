"""`python -m specgate.sessions.selftest`: the tests, ci_jobs or ci_soak session, as $SPECGATE_SESSION names it
(specgate.sessions.selftest.session)."""

import os

from specgate.core import cli
from specgate.sessions import lifecycle
from specgate.sessions.selftest import session as selftest

session = os.environ.get("SPECGATE_SESSION", "tests")
lifecycle.main(session, cli.parser(session, selftest.__doc__.splitlines()[0]), selftest.step)
