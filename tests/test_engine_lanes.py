"""run_engines' lanes (specgate.vllmside.engine): engine hosts at once, sharing the engines as
they free up, each with its share of the threads; a host that dies or overruns is blamed for
the engine it was running and its lane goes on. The hosts are tests/fakehost.py: the real
claims and result records, no vLLM (tests/test_engine_host.py runs the real host)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from specgate.vllmside import engine

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def fake_host(monkeypatch):
    monkeypatch.setattr(engine, "HOST_MODULE", "fakehost")


def _env(threads: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": threads,
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}


def _engine(key: str, **what) -> dict:
    return {"key": key, "llm": what, "phases": []}


def _owners(workdir: Path) -> list[str]:
    return sorted(path.read_text() for path in (workdir / "claims").iterdir())


def test_two_lanes_share_the_engines_and_the_threads(tmp_path):
    """The first lane's first engine waits until another host has taken the second: only the
    second lane can, so both ran, each engine once, each host with one of the two threads."""
    engines = [_engine("a", wait_for="b"), _engine("b"), _engine("c"), _engine("d")]
    answer = engine.run_engines(engines, tmp_path, env=_env("2"), timeout_s=60, lanes=2)
    assert sorted(answer.results) == ["a", "b", "c", "d"]
    assert {r["threads"] for r in answer.results.values()} == {"1"}
    assert answer.results["a"]["process"] != answer.results["b"]["process"]
    owners = _owners(tmp_path)
    assert len(owners) == 4 and {o.split("/")[0] for o in owners} == {"0", "1"}


def test_never_more_lanes_than_threads_or_engines(tmp_path):
    answer = engine.run_engines([_engine("a"), _engine("b")], tmp_path / "one", env=_env("1"), timeout_s=60, lanes=2)
    assert {r["threads"] for r in answer.results.values()} == {"1"} and _owners(tmp_path / "one") == ["0/0"] * 2
    answer = engine.run_engines([_engine("a")], tmp_path / "few", env=_env("4"), timeout_s=60, lanes=2)
    assert answer.results["a"]["threads"] == "4" and not (tmp_path / "few" / "request-1.json").exists()
    assert engine.run_engines([], tmp_path / "none", env=_env("2"), timeout_s=60, lanes=2).results == {}


def test_a_host_that_dies_is_blamed_for_its_engine_and_a_fresh_host_takes_its_lane_on(tmp_path):
    engines = [_engine("a"), _engine("dies", die=True), _engine("c"), _engine("d")]
    answer = engine.run_engines(engines, tmp_path, env=_env("1"), timeout_s=60, lanes=1)
    dead = answer.results["dies"]
    assert dead["error"]["message"] == "engine process exited -9" and dead["process"] == 0
    assert answer.results["c"]["error"] is None and answer.results["c"]["process"] == 1
    assert answer.results["d"]["error"] is None


def test_a_host_past_its_time_is_ended_and_blamed_and_leaves_no_process(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engines = [_engine("hangs", hang=True), _engine("b"), _engine("c")]
    answer = engine.run_engines(engines, tmp_path, env=_env("2"), timeout_s=3, lanes=2)
    message = answer.results["hangs"]["error"]["message"]
    assert message == f"{engine.TIMED_OUT} (3 s per engine) and was killed"
    assert answer.results["b"]["error"] is None and answer.results["c"]["error"] is None
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_an_engine_is_taken_once_and_its_claim_names_who_took_it(tmp_path):
    first, second = engine.Claims(tmp_path, "0/0"), engine.Claims(tmp_path, "1/1")
    assert first.free("x") and first.taken_by("x") is None
    assert first.take("x") and not second.take("x") and not second.free("x")
    assert second.taken_by("x") == "0/0" and second.take("y") and first.taken_by("y") == "1/1"
    assert len(list(tmp_path.iterdir())) == 2   # the claims alone, nothing left of making them
    assert engine.Claims(None, "").take("x")    # a host run by hand takes everything
