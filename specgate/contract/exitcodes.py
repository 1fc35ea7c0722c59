"""The one exit-code model every session applies (stdlib only: the noxfile uses it too).

    0   pass: everything ran and passed; skips carry a reason
    1   failure: a regression, a crash, a timeout, nothing executed where tests were expected
    2   bad input: unknown option, malformed manifest, unknown method, a path that does not exist
    75  incomplete: a required environment piece or checkpoint is missing and could not be fetched

pytest's own codes map onto these (`from_pytest`). Several codes combine to the most
severe (`worst`): failure > bad input > incomplete > pass.
"""

from __future__ import annotations

OK, FAILURE, BAD_INPUT, INCOMPLETE = 0, 1, 2, 75
MEANING = {OK: "pass", FAILURE: "failure", BAD_INPUT: "bad input", INCOMPLETE: "environment or cache incomplete"}
SEVERITY = (FAILURE, BAD_INPUT, INCOMPLETE, OK)   # most severe first

# pytest.ExitCode: OK, TESTS_FAILED, INTERRUPTED, INTERNAL_ERROR, USAGE_ERROR, NO_TESTS_COLLECTED
PYTEST = {0: OK, 1: FAILURE, 2: FAILURE, 3: FAILURE, 4: BAD_INPUT, 5: FAILURE}
PYTEST_NO_TESTS = 5


def normal(code: int) -> int:
    """Any code outside the model (a signal, a crash's 139) is a failure."""
    return code if code in MEANING else FAILURE


def worst(*codes: int) -> int:
    """The most severe of several codes (OK when there are none)."""
    found = {normal(code) for code in codes}
    return next((code for code in SEVERITY if code in found), OK)


def from_pytest(code: int) -> int:
    return PYTEST.get(code, FAILURE)


def describe(code: int) -> str:
    return MEANING.get(code, f"failure (exit {code})")
