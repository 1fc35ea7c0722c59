"""Speculative sampling at temperature > 0 through real vLLM engines, against an exact oracle
(specgate.sessions.e2e.sampling: the theorem that speculation leaves the target's distribution
unchanged, on targets whose distribution is known at every position).

Each case is a config with a [sampling] table and a draft sample method. Where the manifest
declares vLLM #55005 for the build's version ([e2e.sampling.known_defect]) and the probe finds it
on the build (specgate.vllmside.enginehooks.probe_defects), the sampling phases run with the
runtime repair, so the checks still show what they catch, and test_sampling_release is an xfail
citing the issue; on a build the probe finds fixed, everything runs as built and that test
passes as `fixed`. Every row records its statistics.
"""

from __future__ import annotations

import pytest
from test_spec_decode import _generate, declared_defect_fixed, expect_declared_defect

from specgate.core import build
from specgate.sessions.e2e import compare, planning, report, runs, sampling
from specgate.vllmside import enginehooks, knownanswer

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

LOGPROB_TOLERANCE = 0.01     # the engines land on the design's logits to about 1e-5 in either dtype


def _design(result, request: runs.Request) -> sampling.Design:
    p = request.params
    return sampling.Design(tuple(result.answer_logits), result.run.target.vocab_size, p["temperature"] or 1.0,
                           p.get("top_k", 0), p.get("top_p", 1.0))


def _offsets(result, roles: tuple[str, ...]) -> tuple[list[int | str], sampling.Design]:
    """The pooled offsets of the requests in `roles`, and their (shared) design."""
    chosen = [(i, r) for i, r in enumerate(result.requests) if r.role in roles]
    designs = {_design(result, r).probs()[0].__repr__(): _design(result, r) for _, r in chosen}
    assert len(designs) == 1, f"requests {roles} sample from different distributions; pool them separately"
    values: list[int | str] = []
    for i, r in chosen:
        values += sampling.offsets(r.prompt, result.token_ids[i], result.run.target.vocab_size,
                                   len(result.answer_logits))
    return values, next(iter(designs.values()))


def _bounds(plan):
    s = plan.settings.sampling
    return s.false_alarm, s.tv_shift, s.power


def _record(row: dict, name: str, test: dict, engine_run: runs.Run) -> None:
    row.setdefault("sampling", {})[name] = {**test, "engine": engine_run.key}


def _require(test: dict, what: str, want_power: float | None = None) -> None:
    if want_power is not None:
        assert test["power"] >= want_power, (
            f"{what}: power {test['power']:.4f} < {want_power} against a shift of total variation "
            f"{test['tv_shift']} with {test['n']} samples; the check would be too weak to trust")
    outside = f", {test['outside_support']} outside the support" if test.get("outside_support") else ""
    # The acceptance check also fails on events no correct sampler produces, whatever its p-value.
    impossible = f"{len(test['impossible'])} event(s) no correct sampler produces; " if test.get("impossible") else ""
    statistic = (f"log e-value {test['statistic']} over {test['df']} position(s)" if test.get("test") == "e-value"
                 else f"chi-square {test['statistic']} on {test['df']} df")
    relation = "<" if test["p_value"] < test["alpha"] else ">="
    shown = ", ".join(f"{key} {test[key]}" for key in ("counts", "expected", "top", "rare") if key in test)
    assert test["passed"], (f"{what}: {impossible}{statistic}, p = {test['p_value']:.3g} "
                            f"{relation} {test['alpha']} ({shown}{outside})"
                            + "".join(f"\n  {line}" for line in test.get("impossible", [])))


def _case(plan, engines, sampling_case: str, row: dict):
    spec_run, base_run, _ = plan.sampling_runs(sampling_case)
    row.update(report.run_identity(spec_run), case=sampling_case)
    return _generate(engines, plan, spec_run, row), spec_run


@pytest.mark.configs("sampling_target")
def test_sampling_target_follows_design(target_fixture, plan, engines, row):
    """The oracle itself, on the target alone: at every position vLLM's own logprobs equal the
    analytic ones (in the engines' dtype), and the sampled offsets follow the design's distribution."""
    run = plan.sampling_baseline(target_fixture)
    row.update(report.run_identity(run))
    result = _generate(engines, plan, run, row)
    design = sampling.Design(tuple(result.answer_logits), result.run.target.vocab_size, 1.0)
    want, far = design.raw_logprobs(), []
    for i, (request, tokens) in enumerate(zip(result.requests, result.token_ids, strict=True)):
        seq = list(request.prompt)
        for position, (token, step) in enumerate(zip(tokens, result.logprobs[i], strict=True)):
            a = sampling.answer(seq, design.vocab)
            for j, lp in enumerate(want):
                got = step.get((a + j) % design.vocab)
                if got is None or abs(got - lp) > LOGPROB_TOLERANCE:
                    far.append(f"request {i} position {position}: logprob of answer + {j} is {got}, designed {lp:.4f}")
            seq.append(token)
    row["logprob_mismatches"] = len(far)
    assert not far, f"{len(far)} logprobs off the design by more than {LOGPROB_TOLERANCE}:\n" + "\n".join(far[:10])
    alpha, tv, want_power = _bounds(plan)
    values, design = _offsets(result, ("sampled",))
    test = sampling.goodness_of_fit(values, design, alpha, tv)
    _record(row, "distribution", test, run)
    _require(test, "the target alone", want_power)


@pytest.mark.configs("sampling")
def test_sampling_distribution(sampling_case, plan, engines, row):
    """With speculation the sampled tokens still follow the target's distribution at T."""
    result, run = _case(plan, engines, sampling_case, row)
    assert result.counters["drafted_tokens"] > 0, "no drafts: the check would not test speculation"
    alpha, tv, want_power = _bounds(plan)
    values, design = _offsets(result, ("sampled",))
    test = sampling.goodness_of_fit(values, design, alpha, tv)
    _record(row, "distribution", test, run)
    _require(test, f"{sampling_case}: offsets at T={design.temperature}", want_power)


@pytest.mark.configs("sampling")
def test_sampling_truncated(sampling_case, plan, engines, row):
    """top-k and top-p requests follow the truncated, renormalised distribution."""
    result, run = _case(plan, engines, sampling_case, row)
    alpha, tv, want_power = _bounds(plan)
    values, design = _offsets(result, ("top_k", "top_p"))
    test = sampling.goodness_of_fit(values, design, alpha, tv)
    _record(row, "truncated", test, run)
    _require(test, f"{sampling_case}: top-k/top-p offsets", want_power)


@pytest.mark.configs("sampling")
def test_sampling_acceptance(sampling_case, plan, engines, row):
    """Every verified draft is accepted with the probability the target gives it: per draft
    position, accepted counts against the analytic sum; and no step emits what a correct
    sampler cannot (an impossible draft accepted, the rejected draft as its own recovery)."""
    result, run = _case(plan, engines, sampling_case, row)
    alpha, tv, _ = _bounds(plan)
    parts = []
    for i, request in enumerate(result.requests):
        if request.role == "greedy":
            continue
        metrics = result.request_metrics[i]
        assert metrics is not None, f"request {i}: no per-request spec_decode_metrics (detailed)"
        steps = result.data["drafts"][i]          # [tokens computed before the step, its drafts]
        parts.append(sampling.acceptance(request.prompt, result.token_ids[i], [d for _, d in steps],
                                         metrics["per_step_accepted"], _design(result, request), run.k,
                                         f"request {i}", starts=[at + 1 - len(request.prompt) for at, _ in steps],
                                         draft_q=result.data["draft_q"][i]))
    test = sampling.acceptance_test(parts, run.k, alpha, tv)
    _record(row, "acceptance", test, run)
    assert sum(test["trials"]) > 0, "no draft was verified; the check would be vacuous"
    _require(test, f"{sampling_case}: per-position acceptance {test['accepted']} of {test['trials']}, "
                   f"expected {test['expected']}")


@pytest.mark.configs("sampling")
def test_sampling_mixed_batch_greedy(sampling_case, plan, engines, row):
    """Greedy requests batched with sampled ones still give their known answer exactly."""
    result, _ = _case(plan, engines, sampling_case, row)
    greedy = [i for i, r in enumerate(result.requests) if r.role == "greedy"]
    assert greedy, "[e2e.sampling] greedy_requests is 0: nothing to check"
    vocab = result.run.target.vocab_size
    expected = [knownanswer.continuation(knownanswer.CONTEXT_RULE, result.requests[i].prompt,
                                         len(result.token_ids[i]), vocab) for i in greedy]
    differ = compare.token_mismatches(expected, [result.token_ids[i] for i in greedy], ("analytic", sampling_case))
    row["matches_expected"] = not differ
    assert not differ, "greedy requests in a sampled batch changed:\n" + "\n".join(differ)


@pytest.mark.configs("sampling")
def test_sampling_spec_vs_target(sampling_case, plan, engines, row):
    """Two-sample test of the target alone against the target with speculation, on the same
    seeded requests: needs no analytic answer (the power is recorded, not required)."""
    result, run = _case(plan, engines, sampling_case, row)
    base = _generate(engines, plan, run.baseline(), row, measured=False)
    alpha, tv, _ = _bounds(plan)
    spec_values, _ = _offsets(result, ("sampled",))
    base_values, _ = _offsets(base, ("sampled",))
    test = sampling.two_sample(base_values, spec_values, len(result.answer_logits), alpha, tv)
    _record(row, "spec_vs_target", test, run)
    _require(test, f"{sampling_case} against the target alone")


@pytest.mark.configs("text_sampling")
def test_sampling_spec_vs_target_text(config_id, plan, engines, row):
    """The two-sample test on the config's own checkpoints (the pinned hub ones, where cached):
    the text prompts sampled at T, with and without speculation, on the same seeds. Each
    request's continuation is one draw; no oracle is needed. The power is recorded, not required."""
    config = plan.configs[config_id]
    found = plan.text_sampling_runs(config_id)
    if not found:
        models = ", ".join(f"{m.fixture} for {m.name}" for m in (config.target, config.draft)
                           if m and m.source == "fixture")
        pytest.skip(f"{config_id} runs on fixture stand-ins ({models}): a known-answer target samples its "
                    f"answer and random weights spread a continuation over thousands of classes, so a two-sample "
                    f"test has no power on either; test_sampling_spec_vs_target covers {config.method} on the "
                    f"spread fixtures")
    base_run, spec_run = found
    row.update(report.run_identity(spec_run))
    spec = _generate(engines, plan, spec_run, row)
    base = _generate(engines, plan, base_run, row, measured=False)
    assert spec.counters["drafted_tokens"] > 0, f"{config.method} drafted no tokens; the test would be vacuous"
    alpha, tv, _ = _bounds(plan)
    test = sampling.two_sample_continuations(_continuations(base), _continuations(spec), alpha, tv)
    _record(row, "spec_vs_target_text", test, spec_run)
    _require(test, f"{config_id} against its target alone, on its own checkpoints")


def _continuations(result) -> list[tuple]:
    """One class per request: its prompt and every token it got."""
    return [(r.prompt, *tokens) for r, tokens in zip(result.requests, result.token_ids, strict=True)]


@pytest.mark.configs("sampling")
def test_sampling_seeded_determinism(sampling_case, plan, engines, row):
    """The same per-request seeds give the same tokens when generated again, with and without
    speculation. Where the drafts came from a spread q (probabilistic drafts, not one-hot), the
    sampled requests with speculation fall under [e2e.sampling.unseeded_drafts] where declared:
    an xfail while they differ, `fixed` once they reproduce."""
    result, run = _case(plan, engines, sampling_case, row)
    base = _generate(engines, plan, run.baseline(), row, measured=False)
    spread = any(1e-6 < q < 1 - 1e-6 for steps in result.data["draft_q"] for step in steps or []
                 for position in step or [] for _, q in position)
    must, unseeded = [], []
    for label, r in (("speculation", result), ("target alone", base)):
        for i, again in zip(runs.repeated(r.requests), r.data["repeat_token_ids"], strict=True):
            group = unseeded if spread and r is result and r.requests[i].role != "greedy" else must
            group += [f"{label}: {line}" for line in compare.token_mismatches(
                [r.token_ids[i]], [again], ("first generation", "second"), labels=[i])]
    row["repeated"] = len(runs.repeated(result.requests))
    assert not must, "seeded requests are not reproducible:\n" + "\n".join(must)
    declared = plan.settings.sampling.unseeded_drafts
    if not unseeded and spread and planning.declared_for(declared, build.version_under_test()):
        declared_defect_fixed(row, "manifest.toml ([e2e.sampling.unseeded_drafts])")
    elif unseeded:
        if not planning.declared_for(declared, build.version_under_test()):
            pytest.fail("seeded requests with drafts from a spread q are not reproducible:\n" + "\n".join(unseeded))
        row.update(expected_failure=declared["reason"], defect_status="present")
        pytest.xfail(f"{declared['reason']}:\n" + "\n".join(unseeded))


@pytest.mark.configs("sampling_undrafted")
def test_sampling_undrafted_match_target(sampling_case, plan, engines, row):
    """A seeded request that never got a draft (ngram finds no match) generates exactly what
    the target alone generates with that seed: verification draws nothing for it."""
    result, run = _case(plan, engines, sampling_case, row)
    base = _generate(engines, plan, run.baseline(), row, measured=False)
    undrafted = [i for i, r in enumerate(result.requests)      # the baseline has the same sampled requests
                 if r.role == "sampled" and not (result.request_metrics[i] or {}).get("num_draft_tokens")]
    drafted = [i for i, r in enumerate(result.requests) if (result.request_metrics[i] or {}).get("num_draft_tokens")]
    row["undrafted_requests"] = undrafted
    if not undrafted or not drafted:
        pytest.skip(f"needs requests with and without drafts in one engine; drafted: {drafted}, undrafted: {undrafted}")
    differ = compare.token_mismatches([base.token_ids[i] for i in undrafted], [result.token_ids[i] for i in undrafted],
                                      ("target alone", sampling_case))
    assert not differ, "requests without drafts changed under speculation:\n" + "\n".join(differ)


@pytest.mark.configs("sampling_release")
def test_sampling_release(sampling_case, plan, engines, row):
    """The sampling defect the manifest declares for this build's version (vLLM #55005), decided by
    its probe on this build (specgate.vllmside.enginehooks.probe_defects) and shown end to end by
    the case's engine as built (sampled requests only, before any repaired phase). Present: an
    xfail citing the issue, while the repaired phases carry the other checks; fixed: every
    sampling check ran as built, this one passes and its row says to remove the declaration."""
    if not plan.repair:
        pytest.skip(f"vLLM {build.version_under_test()} is not declared to have the sampling defect "
                    "([e2e.sampling.known_defect] versions): every sampling check ran on the build as built")
    _, _, run = plan.sampling_runs(sampling_case)
    defect = plan.settings.sampling.defect
    probe = engines.probe(defect["repair"])
    row.update(report.run_identity(run), case=sampling_case, probe=probe)
    result = _generate(engines, plan, run, row)
    alpha, tv, _ = _bounds(plan)
    values, design = _offsets(result, ("sampled",))
    test = sampling.goodness_of_fit(values, design, alpha, tv)
    _record(row, "distribution", test, run)
    if probe == enginehooks.FIXED:
        _require(test, f"{sampling_case} as built, where the probe found {defect['issue']} fixed")
        declared_defect_fixed(row, "manifest.toml ([e2e.sampling.known_defect])")
        return
    assert probe == enginehooks.PRESENT, f"{defect['issue']}'s probe: {probe}"
    assert not test["passed"], (f"the probe found {defect['issue']} on this build, yet {sampling_case} sampled as "
                                f"designed as built (p = {test['p_value']:.3g}): the probe and the engine disagree")
    row.update(expected_failure=defect["issue"], defect_status="present")
    pytest.xfail(f"{defect['issue']}: {defect['reason']}")


@pytest.mark.configs("sampling_known_defect")
def test_sampling_known_defect(sampling_case, plan, engines, row):
    """A vLLM defect on this config's sampling path the manifest declares (its `sampling.known_defect`):
    an xfail on its exact symptom, on requests that reach it (the last phase of the config's
    engine: it ends the engine); the config's other sampling checks run without those requests.
    The day a build no longer shows it, the test passes and its row says the defect is fixed."""
    defect = plan.sampling_defect(sampling_case)
    if not defect["applies"]:
        pytest.skip(f"vLLM {build.version_under_test()} is outside the versions the defect is declared for "
                    f"({defect['versions']}): the config's sampling phase ran its {defect['requests']} requests")
    run = plan.sampling_defect_run(sampling_case)
    row.update(report.run_identity(run), case=sampling_case)
    expect_declared_defect(row, defect, lambda: _generate(engines, plan, run, row))
