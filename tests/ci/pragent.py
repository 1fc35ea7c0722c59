"""An agent that gates PR builds with vLLM's pipeline (.buildkite/vllm/pipeline.yml): each
build's step uploads a different vLLM wheel, the pinned one repacked as a PR's CI would build
it, and the caches stay from build to build (tests/ci/test_agent_disk.py,
tests/ci/test_two_agents.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import hermetic
from agent import VLLM_PIPELINE, Agent, agent_checkout

from specgate.core import build

SELECTED = "test_known_answer and ngram"     # the cheapest engine in shard 0: a cold compile per build


class PRAgent:
    """An agent with its own checkout and build folder that runs vLLM's pipeline on the wheel it
    is handed, with the caches at `xdg` (XDG_CACHE_HOME: the harness cache and the HF cache)."""

    def __init__(self, home: Path, xdg: Path) -> None:
        self.checkout = agent_checkout(home / "vllm" / "specgate")
        self.uploaded = home / "uploaded"
        self.agent = Agent(self.checkout.parent, home / "agent", {"XDG_CACHE_HOME": str(xdg),
                                                                  "STUB_UPLOADED": str(self.uploaded)},
                           pipeline=VLLM_PIPELINE)

    def gate(self, wheel: Path, steps: tuple[str, ...] = ("warm_cache", "cpu_e2e")) -> dict[str, dict]:
        """One build (cpu_e2e: shard 0, SELECTED) on `wheel`; each step's summary. Every step must pass."""
        dist = self.uploaded / "build-cpu-wheel" / "dist"
        shutil.rmtree(dist, ignore_errors=True)
        dist.mkdir(parents=True)
        shutil.copy(wheel, dist)
        run = self.agent.run_build(list(steps), shards=[0],
                                   step_env={"cpu_e2e": {"PYTEST_ADDOPTS": f"-k '{SELECTED}'"}})
        assert [(j.step, j.outcome) for j in run.jobs] == [(step, "passed") for step in steps], \
            [j.output[-3000:] for j in run.jobs]
        found = {job.step: json.loads((job.uploaded / "specgate" / "artifacts" / job.step / "summary.json").read_text())
                 for job in run.jobs}
        for job in run.jobs:
            assert found[job.step]["vllm"]["sha256"] == build.sha256_of(wheel), found[job.step]["vllm"]
            assert "rebuilding it" not in job.output, job.output[-3000:]    # no damaged fixture met
        if "cpu_e2e" in found:
            assert found["cpu_e2e"]["counts"]["passed"] >= 1, found["cpu_e2e"]["counts"]
        return found


def with_fixtures(xdg: Path) -> Path:
    """A cache home holding this run's fixtures (hard links, as the tests' own home has them)."""
    shutil.copytree(Path(os.environ["XDG_CACHE_HOME"]) / "specgate" / "fixtures", xdg / "specgate" / "fixtures",
                    copy_function=hermetic._link, ignore=shutil.ignore_patterns(".*"))
    return xdg
