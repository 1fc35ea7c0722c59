"""Engine tests of `nox -s cpu_e2e`: the plan, one engine at a time, and what the tests record.

Engine starts dominate the session's time, so every engine (a target, a speculative
configuration and the prompt set its target calls for, see specgate.sessions.e2e.runs.Run) starts
once per session, in a process of its own that exits (freeing everything) before the
next one starts: it generates every prompt of its set and its measurements are kept.
Tests that need the same engine share its results.

Collection reads only the manifest (and the session's plan.json): no vLLM import,
no fixture build, so `nox -s tests` collects this folder for free and deselects it.
This process never imports vLLM: the engine host answers what needs it (which engines
cannot start here, and why), in the same import its engines use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

from specgate.core import build, cli
from specgate.core.manifest import load
from specgate.sessions import pytestrun
from specgate.sessions.e2e import compare, planning, report, runs
from specgate.vllmside import engine

MANIFEST = load()
PLANNED = planning.planned_ids(os.environ.get(planning.PLAN_VAR))
CONFIGS = [c for c in MANIFEST.e2e if PLANNED is None or c.id in PLANNED]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "configs(test): parametrize `config_id` with the configs "
                                       "specgate.sessions.e2e.runs.SELECTORS[test] picks")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("configs")
    if marker is None:
        return
    kind = marker.args[0]
    if kind == "known_answer_baseline":
        metafunc.parametrize("target_fixture", runs.known_answer_targets(CONFIGS))
    elif kind == "sampling_target":
        metafunc.parametrize("target_fixture", runs.sampling_targets(CONFIGS))
    elif kind == "sampling_release":
        # The probe decides whether the build has the declared defect; one case's engine shows it
        # end to end (the declaration's `evidence`), where the config is in this shard's plan.
        declared = MANIFEST.e2e_settings.get("sampling", {}).get("known_defect", {})
        metafunc.parametrize("sampling_case", [case for case in [declared.get("evidence")]
                                               if case and case in runs.sampling_cases(CONFIGS)])
    elif kind.startswith("sampling"):
        wanted = {"sampling_undrafted": lambda c: c.method == "ngram",
                  "sampling_known_defect": lambda c: "known_defect" in c.raw["sampling"]}.get(kind, lambda c: True)
        metafunc.parametrize("sampling_case", runs.sampling_cases(
            c for c in CONFIGS if isinstance(c.raw.get("sampling"), dict) and wanted(c)))
    else:
        metafunc.parametrize("config_id", runs.select(CONFIGS, kind))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test no config of this run selects is deselected, not reported as a skip."""
    empty = [item for item in items if item.get_closest_marker("configs") is not None
             and not any(isinstance(v, str) for v in getattr(item, "callspec", None).params.values())]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if item not in empty]


@dataclass
class Plan:
    mode: str
    settings: planning.Settings
    configs: dict[str, planning.Config]
    repair: str | None = None      # what the sampling engines run with (runs.defect_repair)

    def sampling_runs(self, case: str) -> tuple[runs.Run, runs.Run, runs.Run]:
        """(speculation, the target alone, the build as built with the short request set: the
        first phase of the speculation's engine, before any repaired phase)."""
        config_id, method = case.split("/")
        config = self.configs[config_id]
        spec = runs.sampling_run(config, method, self.repair)
        return spec, spec.baseline(), runs.sampling_run(config, method, None, runs.RELEASED)

    def sampling_defect(self, case: str) -> dict[str, Any]:
        """The sampling defect a case's config declares (its `sampling.known_defect`)."""
        return self.configs[case.split("/")[0]].sampling["known_defect"]

    def sampling_defect_run(self, case: str) -> runs.Run:
        """The requests a config's declared sampling defect needs, on the build as the other checks run it."""
        config_id, method = case.split("/")
        return runs.sampling_run(self.configs[config_id], method, self.repair, runs.TOP_K)

    def text_sampling_runs(self, config_id: str) -> list[runs.Run]:
        """(the target alone, speculation) on the config's own checkpoints, where both come from
        the hub (test_sampling_spec_vs_target_text); none for fixture stand-ins."""
        config = self.configs[config_id]
        if config.model_source != "hub":
            return []
        spec = runs.text_sampling_run(config, self.repair)
        return [spec.baseline(), spec]

    def sampling_baseline(self, fixture: str) -> runs.Run:
        target = next(c.sampling["target"] for c in self.configs.values()
                      if c.sampling and c.sampling["target"].name == fixture)
        return runs.Run(target, None, "none", 0, requests=runs.SAMPLED)


@pytest.fixture(scope="session")
def plan() -> Plan:
    path = os.environ.get(planning.PLAN_VAR)
    if path:
        mode, settings, configs = planning.load_plan(path)
    else:  # pytest run by hand: resolve here, under $SPECGATE_MODEL_SOURCE (default auto)
        mode = cli.resolve_model_source(None)
        settings = planning.Settings.parse(MANIFEST)
        configs = [planning.resolve_config(MANIFEST, c, mode, build.version_under_test()) for c in CONFIGS]
    return Plan(mode, settings, {c.id: c for c in configs}, runs.defect_repair(settings, build.version_under_test()))


@pytest.fixture(scope="session")
def recorder(tmp_path_factory: pytest.TempPathFactory) -> report.Recorder:
    path = os.environ.get(report.RECORDS_VAR) or tmp_path_factory.mktemp("e2e") / "records.jsonl"
    return report.Recorder(path)


@pytest.fixture
def row(request: pytest.FixtureRequest, recorder: report.Recorder) -> dict[str, Any]:
    """The test's summary row: the test fills it in, it is recorded whatever the outcome."""
    data: dict[str, Any] = {"test": request.node.nodeid}
    yield data
    recorder.write("test", **data)


@dataclass
class Result:
    """What one engine produced, kept for every test that needs it."""
    run: runs.Run
    prompts: list[Any]
    max_tokens: int
    data: dict[str, Any]
    dtype: str                                   # what the engine computed in (planning.Settings.dtype)
    requests: list[runs.Request] | None = None   # a sampling engine's requests (runs.sampling_requests)

    @property
    def answer_logits(self) -> list[float]:
        """The sampling target's logits on answer + j, as this engine's dtype computes them."""
        by_dtype = self.run.target.answer_logits
        assert by_dtype, f"{self.run.target.name}: fixture.json names no answer_logits; not a sampling target"
        return by_dtype[self.dtype]

    @property
    def token_ids(self) -> list[list[int]]:
        return self.data["token_ids"]

    @cached_property   # built once: the sampling checks index it per request
    def logprobs(self) -> list[list[dict[int, float]]]:
        return [[dict((int(t), lp) for t, lp in step) for step in seq] for seq in self.data["logprobs"]]

    @property
    def pairs(self) -> list[tuple[list[int], list[dict[int, float]]]]:
        return list(zip(self.token_ids, self.logprobs, strict=True))

    @property
    def request_metrics(self) -> list[dict[str, Any] | None]:
        return self.data["request_metrics"]

    @property
    def counters(self) -> dict[str, Any]:
        return self.data["counters"]

    @property
    def runner(self) -> str:
        return self.data["runner"]

    @property
    def compilation(self) -> dict[str, str]:
        return self.data["compilation"]

    def acceptance(self) -> dict[str, Any]:
        c = self.counters
        return {"drafts": c["drafts"], "drafted_tokens": c["drafted_tokens"], "accepted_tokens": c["accepted_tokens"],
                "acceptance_len": round(compare.acceptance_len(c["drafts"], c["accepted_tokens"]), 4)}


class Engines:
    """Starts every engine the selected tests need once: when a test first needs a phase, every
    pending engine runs with all its pending phases, in as few processes as possible, in lanes
    that run at once (specgate.vllmside.engine.run_engines, runs.engine_lanes), each lane's engines
    in specgate.sessions.e2e.runs.process_order."""

    def __init__(self, settings: planning.Settings, recorder: report.Recorder, workdir: Path,
                 pending: list[runs.Run], expected_to_fail: set[str], only_v2: set[str]) -> None:
        self.settings, self.recorder, self.workdir = settings, recorder, workdir
        self.pending, self.expected_to_fail, self.only_v2 = pending, expected_to_fail, only_v2
        self.results: dict[str, Result | BaseException] = {}   # phase key -> what it produced
        self.blocked: dict[str, str] = {}   # phase key -> why its engine cannot start here
        self.answered = False   # whether an engine host has said what blocks the V2 runner
        self._v2_blocker: str | None = None
        self._probes: dict[str, str] = {}

    def result(self, run: runs.Run) -> Result:
        self._ensure(run)
        outcome = self.results[run.key]
        if isinstance(outcome, BaseException):
            raise outcome  # every test that needs this phase reports its error
        return outcome

    def blocked_reason(self, run: runs.Run) -> str | None:
        """Why this machine cannot start the run's engine (a model class vLLM cannot import)."""
        self._ensure(run)
        return self.blocked.get(run.key)

    def v2_blocker(self) -> str | None:
        """Why vLLM picks the V1 runner here (specgate.vllmside.engine.v2_runner_blocker), from the
        engine host, which starts now for the pending engines if none has answered yet."""
        self._answer()
        return self._v2_blocker

    def probe(self, repair: str) -> str:
        """The build's verdict on the declared defect `repair` mends (specgate.vllmside.enginehooks
        probe_defects), from the engine host."""
        self._answer()
        return self._probes.get(repair, "unknown: no engine host ran")

    def _answer(self) -> None:
        if not self.answered and self.pending:
            self._generate(self._take_pending())

    def _ensure(self, run: runs.Run) -> None:
        if run.key not in self.results and run.key not in self.blocked:
            self._generate(self._take_pending(run))

    def _take_pending(self, *also: runs.Run) -> list[list[runs.Run]]:
        engines = runs.process_order([*self.pending, *also], self.expected_to_fail)
        self.pending = []
        return engines

    def _phase_request(self, run: runs.Run) -> tuple[dict[str, Any], tuple[list[Any], int, list[runs.Request] | None]]:
        """What the engine host needs for one phase, and (prompts, max_tokens, requests) for its Result."""
        phase: dict[str, Any] = {"key": run.key, "batch": runs.batch_size(run, self.settings)}
        if run.requests:
            sampled = runs.sampling_requests(run, self.settings)
            phase.update(prompts=[r.prompt for r in sampled], sampling=[r.params for r in sampled],
                         repeat=runs.repeated(sampled) if run.requests in runs.ONE_BATCH else [],
                         record_drafts=run.method != "none", repair=run.repair)
            return phase, ([r.prompt for r in sampled], max(r.params["max_tokens"] for r in sampled), sampled)
        prompts, max_tokens = runs.prompts_for(run, self.settings)
        phase.update(prompts=prompts, sampling={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                                                "logprobs": self.settings.num_logprobs})
        return phase, (prompts, max_tokens, None)

    def _generate(self, engines: list[list[runs.Run]]) -> None:
        requests, inputs = [], {}
        for phases in engines:
            first = phases[0]
            request: dict[str, Any] = {"key": first.engine_key, "llm": runs.llm_kwargs(phases, self.settings),
                                       "models": runs.models(first), "phases": [],
                                       "only_v2": all(r.key in self.only_v2 for r in phases)}
            for run in phases:
                phase, inputs[run.key] = self._phase_request(run)
                request["phases"].append(phase)
            requests.append(request)
        env = pytestrun.child_env(self.settings.child_env())
        answer = engine.run_engines(requests, self.workdir / f"group-{len(self.results) + len(self.blocked)}",
                                    env=env, timeout_s=self.settings.engine_timeout_s,
                                    lanes=runs.engine_lanes(engines, self.settings))
        if not self.answered and answer.v2_known:
            self.answered, self._v2_blocker, self._probes = True, answer.v2_blocker, answer.probes
        for phases in engines:
            data = answer.results[phases[0].engine_key]
            if data.get("blocked"):
                self.blocked.update((run.key, data["blocked"]) for run in phases)
                continue
            self.recorder.write("engine", **report.engine_record(phases, data))
            for run in phases:
                self.results[run.key] = self._phase_result(run, data, inputs[run.key])

    def _phase_result(self, run: runs.Run, data: dict[str, Any],
                      inputs: tuple[list[Any], int, list[runs.Request] | None]) -> Result | BaseException:
        """A phase's Result, or the error that kept it from one: its engine's, its own, or the
        earlier phase's that ended the engine before it ran."""
        if data["error"]:
            return engine.relay(data["error"])
        phase = data["phases"].get(run.key)
        if phase is None:
            failed = next(key for key, p in data["phases"].items() if p["error"])
            return engine.EngineProcessError(f"not run: an earlier phase of its engine failed ({failed})")
        if phase["error"]:
            return engine.relay(phase["error"])
        engine_level = {k: data.get(k) for k in ("runner", "compilation", "compile_counters")}
        return Result(run, *inputs[:2], {**phase, **engine_level}, self.settings.dtype, inputs[2])


def _needed_runs(items: list[pytest.Item], plan: Plan) -> tuple[list[runs.Run], set[str], set[str]]:
    """The engines the selected tests will read; the keys expected to fail; and the keys only
    V2 tests read (the engine host starts those only where nothing blocks the V2 runner)."""
    needed, expected_to_fail, v2_keys, other_keys = [], set(), set(), set()
    for item in items:
        marker = item.get_closest_marker("configs")
        if marker is None:
            continue
        test, params = marker.args[0], item.callspec.params
        if test == "known_answer_baseline":
            found = [runs.known_answer_baseline_run(plan.configs.values(), params["target_fixture"])]
        elif test == "sampling_target":
            found = [plan.sampling_baseline(params["target_fixture"])]
        elif test == "sampling_release":
            found = [plan.sampling_runs(params["sampling_case"])[2]] if plan.repair else []
        elif test == "sampling_known_defect":   # its test skips on a version outside the declaration's
            case = params["sampling_case"]
            found = [plan.sampling_defect_run(case)] if plan.sampling_defect(case)["applies"] else []
        elif test.startswith("sampling"):
            found = list(plan.sampling_runs(params["sampling_case"])[:2])
        elif test == "text_sampling":
            found = plan.text_sampling_runs(params["config_id"])
        else:
            found = runs.runs_for(test, plan.configs[params["config_id"]])
        needed += found
        (v2_keys if test == "v2_smoke" else other_keys).update(r.key for r in found)
        if test == "sampling_known_defect" or test == "known_defect" and plan.configs[
                params["config_id"]].known_defect["applies"]:
            expected_to_fail |= {r.key for r in found}
    return needed, expected_to_fail, v2_keys - other_keys


@pytest.fixture(scope="session")
def engines(request: pytest.FixtureRequest, plan: Plan, recorder: report.Recorder,
            tmp_path_factory: pytest.TempPathFactory) -> Engines:
    needed, expected_to_fail, only_v2 = _needed_runs(request.session.items, plan)
    return Engines(plan.settings, recorder, tmp_path_factory.mktemp("engines"), needed, expected_to_fail, only_v2)
