"""Which tests `nox -s tests`, `ci_jobs` and `ci_soak` select (specgate.sessions.selftest)."""

from __future__ import annotations

import pytest

from specgate.sessions.selftest.session import tier_args


@pytest.mark.parametrize("user,expression", [
    ([], "not e2e"),
    (["-m", "vllm"], "(not e2e) and (vllm)"),
    (["-m", "not vllm"], "(not e2e) and (not vllm)"),
    (["-mvllm"], "(not e2e) and (vllm)"),
    (["-m-x"], "(not e2e) and (-x)"),   # as pytest reads it: never a second -m after ours
    (["-m", "e2e", "-m", "vllm"], "(not e2e) and (vllm)"),   # pytest keeps the last -m
])
def test_a_users_marker_narrows_the_tier_and_never_brings_in_the_engine_tests(user, expression):
    assert tier_args("tests", [*user, "-k", "host", "tests/test_engine_host.py"]) == [
        "--ignore=tests/ci", "-m", expression, "-k", "host", "tests/test_engine_host.py"]


def test_ci_jobs_keeps_the_soak_tests_out_whatever_the_user_selects():
    assert tier_args("ci_jobs", ["-m", "not slow"]) == ["tests/ci", "-m", "(not e2e and not soak) and (not slow)"]
    assert tier_args("ci_soak", []) == ["tests/ci", "-m", "soak and not e2e"]


def test_a_bare_trailing_marker_option_is_left_for_pytest_to_reject():
    assert tier_args("tests", ["-k", "x", "-m"]) == ["--ignore=tests/ci", "-m", "not e2e", "-k", "x", "-m"]
