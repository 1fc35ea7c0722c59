"""pytest plugin: vLLM's VLLM_MODEL_REDIRECT_PATH set around the declared tests only.

cpu_unit loads it with SPECGATE_REDIRECTS naming a JSON file {test id: redirect file}.
The variable exists while a declared test runs and at no other time, so one pytest
process serves every test (no second vLLM import) and no other test is redirected.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

MAP_VAR = "SPECGATE_REDIRECTS"
REDIRECT_VAR = "VLLM_MODEL_REDIRECT_PATH"


def _clear_vllm_env_cache() -> None:
    """vLLM may cache its environment reads after engine start; forget them around a switch."""
    envs = sys.modules.get("vllm.envs")
    cache_clear = getattr(getattr(envs, "__getattr__", None), "cache_clear", None)
    if cache_clear:
        cache_clear()


def _redirect_for(nodeid: str) -> str | None:
    """The redirect file for this test, from the JSON map SPECGATE_REDIRECTS names (if set)."""
    map_path = os.environ.get(MAP_VAR)
    if not map_path:
        return None
    with open(map_path) as map_file:
        return json.load(map_file).get(nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    redirect = _redirect_for(item.nodeid)
    if redirect is None:
        return (yield)
    os.environ[REDIRECT_VAR] = redirect
    _clear_vllm_env_cache()
    try:
        return (yield)
    finally:
        os.environ.pop(REDIRECT_VAR, None)
        _clear_vllm_env_cache()
