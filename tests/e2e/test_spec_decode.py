"""Speculative decoding through real vLLM engines in torch.compile mode (no enforce_eager).

Configs come from [[e2e.configs]] in manifest.toml; each test records its row of the
session summary (the `row` fixture) whatever its outcome. See conftest.py for how engine
starts are shared.
"""

from __future__ import annotations

import pytest

from specgate.sessions.e2e import compare, report, runs
from specgate.vllmside import engine, knownanswer

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]


def _generate(engines, plan, run: runs.Run, row: dict, *, measured: bool = True):
    """The phase's results, after checking its engine compiled the way the session requires. The
    row records the phase among the engines the test read; with `measured` (the phase the test is
    about, not a baseline it compares with) also its runner, acceptance and applied repair."""
    blocked = engines.blocked_reason(run)
    if blocked:
        pytest.skip(blocked)
    row.setdefault("engines", []).append(run.key)
    result = engines.result(run)
    if measured and run.method != "none":
        row.update(runner=result.runner, **result.acceptance())
    else:
        row.setdefault("runner", result.runner)
    if measured and run.requests:
        row["repair"] = result.data["repair"]
    row["compilation"] = result.compilation
    want = plan.settings.compile_backend
    assert result.compilation["mode"] != "NONE" and result.compilation["backend"] == want, (
        f"engine [{run.key}] ran with compilation {result.compilation}; the session requires torch.compile "
        f"with the {want} backend")
    if plan.settings.in_process_engine:  # the counters live in the engine core's process
        counters = result.data.get("compile_counters", {})
        assert engine.compiled_model(counters), (
            f"engine [{run.key}]: vLLM's and inductor's compile counters saw no torch.compile of the model "
            f"({counters})")
    return result


def _expected(result) -> list[list[int]]:
    target = result.run.target
    assert target.vocab_size, f"{target.name}: config.json names no vocab_size"
    return compare.expected_outputs(target.answer_rule, result.prompts, result.max_tokens, target.vocab_size)


def _require_floor(row: dict, threshold: float | None) -> None:
    row["threshold"] = threshold
    if threshold is not None:
        assert row["acceptance_len"] >= threshold, (
            f"acceptance length {row['acceptance_len']:.3f} below the floor {threshold} "
            f"({row['accepted_tokens']} accepted of {row['drafted_tokens']} drafted in {row['drafts']} drafts)")


@pytest.mark.configs("ngram")
def test_ngram_matches_baseline(config_id, plan, engines, row):
    """Greedy ngram speculation changes nothing: same token ids, logprobs close in vLLM's
    sense at every position; and it really drafted and accepted (or the test is vacuous)."""
    config = plan.configs[config_id]
    run = runs.spec_run(config)
    row.update(report.run_identity(run), threshold=config.threshold)
    base = _generate(engines, plan, run.baseline(), row)
    spec = _generate(engines, plan, run, row)
    row["matches_baseline"] = spec.token_ids == base.token_ids
    row["max_logprob_gap"] = round(compare.max_logprob_gap(base.pairs, spec.pairs), 4)
    assert spec.counters["drafted_tokens"] > 0, "the ngram proposer drafted no tokens; the test would be vacuous"
    assert spec.counters["accepted_tokens"] > 0, f"no draft token accepted of {spec.counters['drafted_tokens']}"
    far = compare.logprobs_not_close(base.pairs, spec.pairs, ("baseline", "ngram"))
    assert not far, "logprobs not close:\n" + "\n".join(far)
    differ = compare.token_mismatches(base.token_ids, spec.token_ids, ("baseline", "ngram"))
    assert not differ, "greedy output changed by speculation:\n" + "\n".join(differ)
    _require_floor(row, config.threshold)


@pytest.mark.configs("known_answer_baseline")
def test_known_answer_baseline(target_fixture, plan, engines, row):
    """The known-answer target alone reproduces its analytic continuation exactly."""
    run = runs.known_answer_baseline_run(plan.configs.values(), target_fixture)
    row.update(report.run_identity(run))
    result = _generate(engines, plan, run, row)
    differ = compare.token_mismatches(_expected(result), result.token_ids, ("analytic", "baseline"))
    row["matches_expected"] = not differ
    assert not differ, "the known-answer target does not reproduce its analytic output:\n" + "\n".join(differ)


@pytest.mark.configs("known_answer")
def test_known_answer(config_id, plan, engines, row):
    """With speculation the known-answer target still reproduces the analytic output exactly,
    equal to its baseline, and the drafts are accepted at least as often as the floor says."""
    config = plan.configs[config_id]
    run = runs.known_answer_run(config)
    floor = config.known_answer["floor"]
    row.update(report.run_identity(run), threshold=floor)
    spec = _generate(engines, plan, run, row)
    base = _generate(engines, plan, run.baseline(), row, measured=False)
    expected = _expected(spec)
    differ = compare.token_mismatches(expected, spec.token_ids, ("analytic", config.method))
    row["matches_expected"] = not differ
    row["matches_baseline"] = spec.token_ids == base.token_ids
    assert not differ, f"{config.method} changed the known answer:\n" + "\n".join(differ)
    assert row["matches_baseline"], "\n".join(compare.token_mismatches(base.token_ids, spec.token_ids,
                                                                   ("baseline", config.method)))
    assert spec.counters["drafted_tokens"] > 0, f"{config.method} drafted no tokens; the test would be vacuous"
    _require_floor(row, floor)


@pytest.mark.configs("v2_smoke")
def test_v2_speculator_smoke(config_id, plan, engines, row):
    """Upstream's V2 smoke: the engine runs Model Runner V2 and drafts pay off (the floor)."""
    config = plan.configs[config_id]
    run = runs.spec_run(config)
    row.update(report.run_identity(run), runner="v2", threshold=config.threshold)
    blocker = engines.v2_blocker()
    if blocker:
        pytest.skip(blocker)
    result = _generate(engines, plan, run, row)
    assert result.runner == "v2", (f"{config.method} fell back to the V1 runner; this test is meant to cover "
                                   "the V2 path")
    _require_floor(row, config.threshold)


@pytest.mark.configs("v1_matches_baseline")
def test_v1_matches_baseline(config_id, plan, engines, row):
    """Where V2 is unavailable: the method on the V1 CPU runner, greedy output equal to the
    baseline's, acceptance recorded (and held to the floor where one is declared)."""
    config = plan.configs[config_id]
    run = runs.spec_run(config)
    row.update(report.run_identity(run), threshold=config.threshold)
    base = _generate(engines, plan, run.baseline(), row, measured=False)
    spec = _generate(engines, plan, run, row)
    row["matches_baseline"] = spec.token_ids == base.token_ids
    assert spec.runner == "v1", f"expected the V1 runner, the engine ran {spec.runner}"
    assert spec.counters["drafted_tokens"] > 0, f"{config.method} drafted no tokens; the test would be vacuous"
    differ = compare.token_mismatches(base.token_ids, spec.token_ids, ("baseline", config.method))
    assert not differ, "greedy output changed by speculation:\n" + "\n".join(differ)
    _require_floor(row, config.threshold)


@pytest.mark.configs("per_position")
def test_per_position_acceptance(config_id, plan, engines, row):
    """Every draft step accepts exactly what the known answer says: all of its drafts where the
    answer is a successor chain, only those before `wrong_at` elsewhere (so every such request
    rejects and rolls back its KV cache at a known position). A failure names the request,
    step and position instead of an average. 1-token prompts are left to test_one_token_prompt
    (a known vLLM CPU defect)."""
    config = plan.configs[config_id]
    run = runs.known_answer_run(config)
    wrong_at = config.known_answer["wrong_at"]
    row.update(report.run_identity(run), threshold=config.known_answer["floor"], wrong_at=wrong_at)
    result = _generate(engines, plan, run, row)
    total = compare.PositionReport([0] * config.k, [0] * config.k)
    broken, unexercised = [], []
    for index, (prompt, metrics) in enumerate(zip(result.prompts, result.request_metrics, strict=True)):
        assert metrics is not None, f"request {index}: no per-request spec_decode_metrics (detailed)"
        if len(prompt) < 2:
            continue
        drafted, accepted = metrics["per_step_drafted"], metrics["per_step_accepted"]
        exact = knownanswer.successor_drafts_exact(prompt, result.max_tokens, run.target.vocab_size)
        steps = compare.positions(drafted, accepted, config.k)
        total.drafted = [a + b for a, b in zip(total.drafted, steps.drafted, strict=True)]
        total.accepted = [a + b for a, b in zip(total.accepted, steps.accepted, strict=True)]
        name = f"request {index} (prompt {prompt[:4]}{'...' if len(prompt) > 4 else ''})"
        want = compare.expected_accepts(exact, wrong_at, drafted)
        broken += [f"{name}: step {step} accepted {got} of {d} drafts, the known answer says {w}"
                   for step, (d, got, w) in enumerate(zip(drafted, accepted, want, strict=False)) if got != w]
        if not exact and not steps.rejections:
            unexercised.append(f"{name}: drafts wrong at position {wrong_at} by design, yet no step rejected one")
    row["per_position"] = {"drafted": total.drafted, "accepted": total.accepted}
    assert sum(total.drafted) > 0, "no drafts on the multi-token prompts; the test would be vacuous"
    assert not broken, f"{len(broken)} draft step(s) off the known answer:\n" + "\n".join(broken[:20])
    assert not unexercised, "rejection was not exercised:\n" + "\n".join(unexercised)


@pytest.mark.configs("one_token_prompt")
def test_one_token_prompt(config_id, plan, engines, row):
    """vLLM CPU defect: a 1-token prompt batched with others sometimes has its first draft
    rejected in full (EAGLE3, MTP). The output must still be right; whether the symptom
    appeared in this run is recorded in the summary (defect_symptom). On a 1-token prompt the
    successor drafts are right up to `wrong_at`, so the symptom is visible only when that is > 0."""
    config = plan.configs[config_id]
    run = runs.known_answer_run(config)
    wrong_at = config.known_answer["wrong_at"]
    row.update(report.run_identity(run))
    result = _generate(engines, plan, run, row)
    singles = [i for i, p in enumerate(result.prompts) if len(p) == 1]
    assert singles and len(result.prompts) > 1, "known_answer_prompts needs a 1-token prompt batched with others"
    expected = _expected(result)
    symptoms = []
    for i in singles:
        metrics = result.request_metrics[i] or {}
        drafted, accepted = metrics.get("per_step_drafted", []), metrics.get("per_step_accepted", [])
        symptoms.append({"request": i, "prompt": result.prompts[i], "per_step_accepted": accepted,
                         "first_step_fully_rejected": (compare.first_step_fully_rejected(drafted, accepted)
                                                       if wrong_at > 0 else None)})
    row["defect_symptom"] = symptoms
    if wrong_at == 0:
        row["note"] = "the defect's symptom is not observable: these drafts are wrong at position 0 on a 1-token prompt"
    if config.known_answer.get("note"):
        row["note"] = config.known_answer["note"]
    differ = compare.token_mismatches([expected[i] for i in singles], [result.token_ids[i] for i in singles],
                                      ("analytic", config.method))
    row["matches_expected"] = not differ
    assert not differ, "1-token prompt output wrong:\n" + "\n".join(differ)


@pytest.mark.configs("known_defect")
def test_known_defect(config_id, plan, engines, row):
    """A vLLM CPU defect the manifest declares: an xfail on its exact symptom; the day a build no
    longer shows it the test passes and its row says the defect is fixed (remove the declaration).
    On a version outside the declaration's the engine must simply work."""
    config = plan.configs[config_id]
    defect = config.known_defect
    run = runs.spec_run(config)
    row.update(report.run_identity(run))
    blocked = engines.blocked_reason(run)
    if blocked:
        pytest.skip(blocked)
    if not defect["applies"]:
        _generate(engines, plan, run, row)
        return
    expect_declared_defect(row, defect, lambda: _generate(engines, plan, run, row))


def expect_declared_defect(row: dict, defect: dict, start) -> None:
    """Run `start` against a declared defect: its exception with its symptom is an xfail; the same
    exception without the symptom, or another error, fails; no error means the build fixed it."""
    reason = f"{defect['symptom']}: {defect['reason']}"
    row["expected_failure"] = reason
    try:
        start()
    except Exception as exc:
        if type(exc).__name__ != defect["raises"]:
            raise
        if defect["symptom"] not in str(exc):
            raise AssertionError(f"{defect['raises']} without the declared symptom: {exc}") from exc
        row["defect_status"] = "present"
        pytest.xfail(reason)
    declared_defect_fixed(row, "manifest.toml")


def declared_defect_fixed(row: dict, where: str) -> None:
    """The row of a declared defect this build no longer has: the test passes, and says so."""
    row.update(expected_failure=None, defect_status=report.FIXED,
               note=f"the declared defect no longer reproduces on this build: remove its declaration from {where}")
