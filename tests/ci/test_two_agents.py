"""Two agents on one host (two checkouts) gate two different vLLM builds at the same time with
vLLM's pipeline, sharing one harness cache and one HF cache: both pass, and nothing they leave
behind is damaged."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import wheels
from pragent import PRAgent, with_fixtures


def test_two_jobs_of_different_builds_at_once_share_the_caches_and_both_pass(tmp_path):
    """Both jobs verify the same fixtures at once, install their venvs from one uv cache,
    compile into two compile-cache entries, and prune at once (both choose an entry last used 60
    days ago: one removes it, the other finds it gone). Afterwards a warm_cache on each build
    verifies every fixture whole. (Three processes building one fixture at once:
    tests/test_fixtures.py.)"""
    pinned = wheels.download(wheels.PINNED, tmp_path / "pinned")
    wheel_a, wheel_b = (wheels.repack(pinned, tmp_path / "built" / name, note=f"PR {name}") for name in "ab")
    xdg = with_fixtures(tmp_path / "xdg")
    stale = xdg / "specgate" / "compile" / "stale-0123456789abcdef"
    stale.mkdir(parents=True)
    (stale / "factors.json").write_text("{}")
    then = time.time() - 60 * 86400
    os.utime(stale, (then, then))
    agents = [PRAgent(tmp_path / name, xdg) for name in "ab"]
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(agent.gate, wheel) for agent, wheel in zip(agents, (wheel_a, wheel_b), strict=True)]
        summaries = [run.result() for run in runs]          # re-raises either job's failure
    assert not stale.exists()
    assert summaries[0]["cpu_e2e"]["vllm"]["id"] != summaries[1]["cpu_e2e"]["vllm"]["id"]
    compiles = sorted(p.name for p in (xdg / "specgate" / "compile").iterdir() if p.is_dir())
    assert len(compiles) == 2, compiles                      # one per build, none left half-made
    fixtures = xdg / "specgate" / "fixtures"
    assert not [p.name for p in fixtures.iterdir() if ".tmp" in p.name or p.name.startswith(".trash")]
    for agent, wheel in zip(agents, (wheel_a, wheel_b), strict=True):
        agent.gate(wheel, ("warm_cache",))                   # full verify: no "rebuilding it"
