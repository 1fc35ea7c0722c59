"""cpu_e2e logic that needs no engine: settings, selection, engine sharing, comparisons,
per-position acceptance, the summary merge and the exit codes."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import hermetic
import pytest
from contract import entry_errors, read_valid

from specgate.contract import summary as contract
from specgate.core import manifest as m
from specgate.sessions import pytestrun
from specgate.sessions.e2e import compare, planning, report, runs
from specgate.vllmside import engine, knownanswer

REPO = Path(__file__).resolve().parent.parent


def _manifest_with(tmp_path: Path, old: str, new: str) -> Path:
    text = (REPO / "manifest.toml").read_text()
    assert old in text, f"test drifted from manifest.toml: {old!r}"
    path = tmp_path / "manifest.toml"
    path.write_text(text.replace(old, new, 1))
    return path


def _model(name: str, source: str = "fixture", fixture: str | None = None, revision: str = "abcdef0123456789",
           answer_rule: str | None = None) -> planning.Model:
    return planning.Model(name, source, f"/models/{name}", revision, fixture or name, source, "", answer_rule, 512,
                     "Qwen3ForCausalLM")


# --------------------------------------------------------------------------- settings and selection

def test_real_manifest_settings_parse():
    settings = planning.Settings.parse(m.load())
    assert settings.compile_backend == "inductor"
    assert any(len(p) == 1 for p in settings.known_answer_prompts), "the 1-token defect needs a 1-token prompt"
    assert len(settings.known_answer_prompts) > 1 and settings.max_num_seqs >= len(settings.prompts)


AVX2_HOST = {"machine": "x86_64", "isa": ["avx2"]}
BF16_HOST = {"machine": "x86_64", "isa": ["avx2", "avx512f", "avx512_bf16"]}


@pytest.mark.parametrize("host,want", [
    (BF16_HOST, "bfloat16"),
    ({"machine": "x86_64", "isa": ["avx2", "avx512f", "avx512bw"]}, "float32"),   # vLLM's _C_AVX512
    (AVX2_HOST, "float32"),
    ({"machine": "aarch64", "isa": []}, "bfloat16"),     # vLLM's own dtype rules hold there
])
def test_engines_run_in_bf16_only_where_the_cpu_computes_it(host, want):
    """On an AVX2 host vLLM's bf16 linear layers fall back to torch's widening GEMM (a warm cpu_e2e
    took three times as long): the manifest's fallback dtype runs there, and the settings say why."""
    settings = planning.Settings.parse(m.load(), host)
    assert settings.dtype == want
    assert (settings.dtype_fallback_reason is None) == (want == "bfloat16")
    if settings.dtype_fallback_reason:
        assert "AVX512-BF16" in settings.dtype_fallback_reason


def test_the_fallback_dtype_can_keep_bf16_everywhere(tmp_path):
    path = _manifest_with(tmp_path, 'dtype_without_native_bf16 = "float32"', 'dtype_without_native_bf16 = "bfloat16"')
    settings = planning.Settings.parse(m.load(path), AVX2_HOST)
    assert (settings.dtype, settings.dtype_fallback_reason) == ("bfloat16", None)


@pytest.mark.parametrize("old,new,message", [
    ('dtype = "bfloat16"', 'dtype = "float16"', "key 'e2e.dtype': expected one of bfloat16, float32, got 'float16'"),
    ('dtype_without_native_bf16 = "float32"', 'dtype_without_native_bf16 = "auto"',
     "key 'e2e.dtype_without_native_bf16': expected one of bfloat16, float32, got 'auto'"),
    ("known_answer_max_tokens = 72", "known_answer_max_tokens = 0",
     "key 'e2e.known_answer_max_tokens': expected a positive integer, got 0"),
    ('compile_backend = "inductor"', "compile_backend = 1", "key 'e2e.compile_backend': expected a string, got 1"),
    ("known_answer_prompts = [", "known_answer_prompts = [[], ",
     "key 'e2e.known_answer_prompts': expected a non-empty list of non-empty token-id lists"),
])
def test_bad_settings_name_the_key(tmp_path, old, new, message):
    with pytest.raises(m.ManifestError, match=message.replace("[", r"\[").replace("(", r"\(")):
        planning.Settings.parse(m.load(_manifest_with(tmp_path, old, new)))


@pytest.mark.parametrize("version,repaired", [
    ("0.32.0", True), ("0.31.0", True),
    ("0.33.1.dev5+g1a2b3c4.cpu", True),    # a PR's dev build after the releases: the defect is still there
    ("0.32.0+pr55006", True),              # a local build of 0.32.0 says so too; the probe decides what it has
    ("0.30.1", False), (None, False),
])
def test_the_sampling_defect_covers_the_builds_its_specifier_names(version, repaired):
    settings = planning.Settings.parse(m.load())
    assert runs.defect_repair(settings, version) == ("vllm-55005" if repaired else None)


def test_without_the_sampling_declaration_nothing_is_repaired(tmp_path):
    """A manifest with no [e2e.sampling.known_defect] runs every sampling check on the build as built."""
    text = (REPO / "manifest.toml").read_text()
    start = text.index("[e2e.sampling.known_defect]")
    path = tmp_path / "manifest.toml"
    path.write_text(text[:start] + text[text.index("[[e2e.configs]]", start):])
    settings = planning.Settings.parse(m.load(path))
    assert settings.sampling is not None and settings.sampling.defect is None
    assert runs.defect_repair(settings, "0.32.0") is None


def test_a_sampling_defect_version_that_is_no_specifier_is_one_clear_error(tmp_path):
    path = _manifest_with(tmp_path, 'versions = ">=0.31.0"', 'versions = "0.31 or later"')
    with pytest.raises(m.ManifestError, match=r"key 'e2e.sampling.known_defect.versions': expected a PEP 440 version "
                                              r"specifier such as '>=0.31.0', got '0.31 or later'"):
        planning.Settings.parse(m.load(path))


@pytest.mark.parametrize("version,applies", [("0.32.0", True), ("0.33.1.dev5+g1a2b3c4", True), ("0.31.0", False)])
def test_a_configs_declared_defects_hold_only_for_their_versions(version, applies):
    """ngram's top-k crash is declared for >=0.32.0 (0.31.0 does not show it): on 0.31.0 its
    top-k requests run in the config's sampling phase like the others', not set aside as top-p,
    and the test of the declaration does not expect it (the e2e tests skip or require a clean run)."""
    manifest = m.load()
    by_id = {c.id: planning.resolve_config(manifest, c, "fixture", version) for c in manifest.e2e}
    assert by_id["ngram"].sampling["known_defect"]["applies"] is applies
    assert by_id["mtp-v1-prefix-caching"].known_defect["applies"] is applies
    run = runs.sampling_run(by_id["ngram"], "greedy", None)
    assert run.requests == (runs.TOP_P_ONLY if applies else runs.SAMPLED)
    roles = {r.role for r in runs.sampling_requests(run, planning.Settings.parse(manifest))}
    assert ("top_k" in roles) is not applies


def test_probabilistic_drafts_run_on_the_spread_drafter_and_greedy_ones_on_the_successor():
    """A one-hot q would test min(1, p / q) and max(0, p - q) no further than greedy drafts do:
    eagle3's probabilistic case drafts from eagle3-spread, its greedy case from eagle3-successor."""
    manifest = m.load()
    by_id = {c.id: planning.resolve_config(manifest, c, "fixture", "0.32.0") for c in manifest.e2e}
    eagle3 = by_id["eagle3-v1"]
    greedy, probabilistic = (runs.sampling_run(eagle3, method, None) for method in ("greedy", "probabilistic"))
    assert (greedy.draft.name, probabilistic.draft.name) == ("eagle3-successor", "eagle3-spread")
    assert dict(probabilistic.speculative) == {"draft_sample_method": "probabilistic"}
    dflash = by_id["dflash-v1"].sampling
    assert dflash["probabilistic_draft"] == dflash["draft"]   # none named: the same drafter


@pytest.mark.parametrize("new,message", [
    ('probabilistic_draft = "eagle3-nowhere"', "probabilistic_draft': expected a fixture declared under [fixtures]"),
    ('probabilistic_draft = "eagle3-spread", draft_sample_methods = ["greedy"]',
     "probabilistic_draft': expected a fixture only where draft_sample_methods has probabilistic"),
])
def test_a_bad_probabilistic_draft_is_one_clear_error(tmp_path, new, message):
    old = 'draft_sample_methods = ["greedy", "probabilistic"], probabilistic_draft = "eagle3-spread"'
    manifest = m.load(_manifest_with(tmp_path, old, new))
    with pytest.raises(m.ManifestError, match=message.replace("[", r"\[")):
        for config in manifest.e2e:
            planning.resolve_config(manifest, config, "fixture", "0.32.0")


@pytest.mark.parametrize("version,declared", [("0.32.0", True), ("0.31.0", True), ("0.33.1.dev5+g1a2b3c4", True),
                                              ("0.30.1", False)])
def test_unseeded_probabilistic_drafts_are_declared_for_the_releases_that_have_them(version, declared):
    """vLLM 0.31 and 0.32 draw probabilistic drafts from the global RNG (a TODO in
    llm_base_proposer): their seeded sampled requests with spread drafts are an xfail, not a failure."""
    unseeded = planning.Settings.parse(m.load()).sampling.unseeded_drafts
    assert "TODO(woosuk): Consider seeds" in unseeded["reason"]
    assert planning.declared_for(unseeded, version) is declared


@pytest.mark.parametrize("old", ['{ versions = ">=0.32.0", raises = "RuntimeError"',
                                 '{ versions = ">=0.32.0", raises = "TypeError"'])
def test_a_configs_declared_defect_needs_a_version_specifier(tmp_path, old):
    manifest = m.load(_manifest_with(tmp_path, old, old.replace('versions = ">=0.32.0", ', "")))
    with pytest.raises(m.ManifestError, match=r"known_defect.versions': expected"):
        for config in manifest.e2e:
            planning.resolve_config(manifest, config, "fixture", "0.32.0")


def test_selection_covers_each_config_as_the_brief_asks():
    configs = m.load().e2e
    by_id = {c.id: c for c in configs}
    for test in runs.SELECTORS:
        for config_id in runs.select(configs, test):
            config = by_id[config_id]
            if test == "v2_smoke":
                assert config.runner == "v2"
            if test in ("per_position", "one_token_prompt"):
                assert config.raw["known_answer"]["exact_drafts"] and config.method in runs.DRAFT_MODEL_METHODS
    v1 = {by_id[i].method for i in runs.select(configs, "v1_matches_baseline")}
    v2 = {by_id[i].method for i in runs.select(configs, "v2_smoke")}
    assert v1 == v2 == {"eagle3", "dflash", "mtp"}
    assert runs.select(configs, "known_defect") and runs.select(configs, "ngram")
    assert set(runs.select(configs, "per_position")) <= set(runs.select(configs, "known_answer"))


def test_known_answer_must_name_a_declared_fixture(tmp_path):
    path = _manifest_with(tmp_path, 'known_answer = { target = "context-qwen3-spread", floor',
                          'known_answer = { target = "no-such-fixture", floor')
    manifest = m.load(path)
    config = next(c for c in manifest.e2e if c.method == "ngram")
    with pytest.raises(m.ManifestError, match="known_answer.target': expected a fixture declared"):
        planning.resolve_config(manifest, config, "fixture", "0.32.0")


@pytest.mark.parametrize("old,new", [
    ("exact_drafts = true, wrong_at = 1,", "exact_drafts = true,"),
    ("exact_drafts = true, wrong_at = 1,", "exact_drafts = true, wrong_at = 3,"),
])
def test_exact_drafts_need_their_known_wrong_position(tmp_path, old, new):
    manifest = m.load(_manifest_with(tmp_path, old, new))
    config = next(c for c in manifest.e2e if c.id == "eagle3-v1")
    with pytest.raises(m.ManifestError, match=r"known_answer.wrong_at': expected a draft position \(0 .. "):
        planning.resolve_config(manifest, config, "fixture", "0.32.0")


# --------------------------------------------------------------------------- engine runs

def test_a_hub_id_and_its_fixture_share_one_engine():
    """Qwen/Qwen3-4B resolved to tiny-qwen3 and tiny-qwen3 itself load the same files."""
    as_hub_id = _model("Qwen/Qwen3-4B", fixture="tiny-qwen3")
    as_fixture = _model("tiny-qwen3")
    assert runs.Run(as_hub_id, None, "none", 0).key == runs.Run(as_fixture, None, "none", 0).key
    hub = _model("Qwen/Qwen3-4B", source="hub", revision="1cfa9a7208912126459214e8b04321603b3df60c")
    assert runs.Run(hub, None, "none", 0).key != runs.Run(as_fixture, None, "none", 0).key


def test_process_order_keeps_ngram_and_expected_failures_last():
    target = _model("t")
    base = runs.Run(target, None, "none", 0)
    ngram = runs.Run(target, None, "ngram", 3, (("prompt_lookup_min", 3),))
    eagle = runs.Run(target, _model("d"), "eagle3", 3)
    broken = runs.Run(_model("q"), None, "mtp", 1, (), (("enable_prefix_caching", True),))
    order = runs.process_order([ngram, broken, eagle, base, base], {broken.key})
    assert [[r.method for r in phases] for phases in order] == [["none"], ["eagle3"], ["ngram"], ["mtp"]]


def test_one_engine_serves_every_phase_of_its_configuration_the_repaired_ones_late_the_failing_one_last():
    """Phases that share target, drafter, k, draft method and engine extras are one engine start;
    within it the phases without a repair run first (memory a repaired phase wrote must not mask
    the defect), the one expected to fail (it ends the engine) last."""
    target, draft = _model("t"), _model("d")
    def phase(requests="", repair=None, method="eagle3", speculative=()):
        return runs.Run(target, draft, method, 3, speculative, requests=requests, repair=repair)
    sampled, released, greedy = phase(runs.SAMPLED, "vllm-55005"), phase(runs.RELEASED), phase()
    top_k = phase(runs.TOP_K, "vllm-55005")
    probabilistic = phase(runs.SAMPLED, "vllm-55005", speculative=(("draft_sample_method", "probabilistic"),))
    order = runs.process_order([top_k, sampled, probabilistic, greedy, released, sampled], {top_k.key})
    assert [[r.key for r in phases] for phases in order] == [[probabilistic.key],
                                                             [greedy.key, released.key, sampled.key, top_k.key]]
    assert len({r.engine_key for r in order[1]}) == 1 and greedy.engine_key != probabilistic.engine_key
    settings = planning.Settings.parse(m.load())
    kwargs = runs.llm_kwargs(order[1], settings)
    batch = len(runs.sampling_requests(sampled, settings))
    assert kwargs["max_num_seqs"] == runs.batch_size(sampled, settings) == batch
    assert runs.batch_size(top_k, settings) == runs.batch_size(greedy, settings) == settings.max_num_seqs


def test_fixture_stand_ins_fold_into_the_known_answer_pair_only_where_the_model_classes_match():
    """ngram on tiny-qwen3 and DFlash on tiny-qwen3 + dflash-random run on their known-answer pair
    (the same vLLM model classes); Qwen3.5's stand-in is another architecture than MiMo's pair."""
    known = {"target": _model("context-qwen3-spread", answer_rule="previous-plus-two"), "draft": None,
             "floor": None, "exact_drafts": False, "note": None}
    ngram = planning.Config("ngram", "ngram", "v1", 3, {}, _model("Qwen/Qwen3-0.6B", fixture="tiny-qwen3"), None,
                            {"prompt_lookup_min": 3}, {}, known, None, {})
    assert runs.spec_run(ngram) == runs.known_answer_run(ngram)
    hub = dataclasses.replace(ngram, target=_model("Qwen/Qwen3-0.6B", source="hub"))
    assert runs.spec_run(hub).target.source == "hub"
    qwen35 = dataclasses.replace(_model("Qwen/Qwen3.5-0.8B", fixture="qwen35-mtp-random"),
                                 architecture="Qwen3_5ForCausalLM")
    mtp = dataclasses.replace(ngram, method="mtp", target=qwen35, speculative={})
    assert runs.spec_run(mtp).target == qwen35


def test_llm_kwargs_compile_and_only_speculation_asks_for_request_metrics():
    settings = planning.Settings.parse(m.load())
    target, draft = _model("t"), _model("d")
    base = runs.llm_kwargs([runs.Run(target, None, "none", 0)], settings)
    spec = runs.llm_kwargs([runs.Run(target, draft, "eagle3", 3, (), (("enable_prefix_caching", False),))], settings)
    assert "enforce_eager" not in base and "enforce_eager" not in spec
    assert "speculative_config" not in base and "per_request_spec_decode_metrics" not in base
    assert spec["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 3, "model": "/models/d"}
    assert spec["per_request_spec_decode_metrics"] == "detailed" and spec["enable_prefix_caching"] is False


def test_known_answer_runs_drop_the_hub_targets_engine_workaround():
    qwen35 = dataclasses.replace(_model("Qwen/Qwen3.5-0.8B"), architecture="Qwen3_5ForCausalLM")
    mimo = dataclasses.replace(_model("mimo", answer_rule="previous-plus-two"), architecture="MiMoForCausalLM")
    config = planning.Config("mtp-v1", "mtp", "v1", 3, {"hub": 1.5}, qwen35, None, {},
                        {"enable_prefix_caching": False},
                        {"target": mimo, "draft": None, "floor": None,
                         "exact_drafts": True, "note": None},
                        None, {})
    run = runs.known_answer_run(config)
    assert run.engine == () and run.target.name == "mimo"
    assert runs.runs_for("known_answer", config) == [run.baseline(), run]
    assert runs.runs_for("v1_matches_baseline", config)[1].engine == (("enable_prefix_caching", False),)
    assert not runs.folds_into_known_answer(config)   # Qwen3.5's stand-in is another model class than MiMo


def test_text_sampling_runs_the_configs_own_checkpoints_and_its_baseline_keeps_the_requests():
    """test_sampling_spec_vs_target_text: the hub target with its engine extras, text prompts
    cycled, one seed per request; the baseline samples the same requests without speculation."""
    settings = planning.Settings.parse(m.load())
    hub = _model("Qwen/Qwen3.5-0.8B", source="hub", revision="1cfa9a7208912126459214e8b04321603b3df60c")
    config = planning.Config("mtp-v1", "mtp", "v1", 3, {"hub": 1.5}, hub, None, {},
                             {"enable_prefix_caching": False}, None, None, {})
    spec = runs.text_sampling_run(config, "vllm-55005")
    base = spec.baseline()
    assert (spec.requests, base.requests, spec.repair, base.repair) == (runs.TEXT, runs.TEXT, "vllm-55005", None)
    assert spec.engine == base.engine == (("enable_prefix_caching", False),) and base.method == "none"
    requests = runs.sampling_requests(spec, settings)
    s = settings.sampling
    assert len(requests) == s.text_requests and {r.role for r in requests} == {"sampled"}
    assert [r.prompt for r in requests[:len(settings.prompts)]] == list(settings.prompts)
    assert [r.params["seed"] for r in requests] == [s.seed_base + i for i in range(s.text_requests)]
    assert {r.params["max_tokens"] for r in requests} == {s.text_max_tokens}
    assert all(r.params["temperature"] == s.temperature and "logprobs" not in r.params for r in requests)
    assert runs.sampling_requests(base, settings) == requests


def test_text_sampling_covers_every_v1_method_but_the_declared_crash():
    configs = m.load().e2e
    by_id = {c.id: c for c in configs}
    chosen = runs.select(configs, "text_sampling")
    assert {by_id[i].method for i in chosen} == {"ngram", "eagle3", "dflash", "mtp"}
    assert "mtp-v1-prefix-caching" not in chosen and all(by_id[i].runner == "v1" for i in chosen)


def test_prompts_follow_the_target():
    settings = planning.Settings.parse(m.load())
    known = runs.Run(_model("s", answer_rule="previous-plus-two"), None, "none", 0)
    prompts, n = runs.prompts_for(known, settings)
    assert prompts == [list(p) for p in settings.known_answer_prompts] and n == settings.known_answer_max_tokens
    assert runs.prompts_for(runs.Run(_model("t"), None, "none", 0), settings)[0] == list(settings.prompts)


def test_plan_round_trips(tmp_path):
    settings = planning.Settings.parse(m.load())
    config = planning.Config("x", "eagle3", "v1", 3, {"fixture": 3.5}, _model("t"), _model("d"), {"a": 1}, {},
                        {"target": _model("s", answer_rule="previous-plus-two"), "draft": _model("e"), "floor": 3.9,
                         "exact_drafts": True, "note": "n"}, None, {"hub": 1.85})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(planning.plan_dict("fixture", settings, [config], (1, 0))))
    mode, loaded_settings, configs = planning.load_plan(path)
    assert (mode, loaded_settings, configs) == ("fixture", settings, [config])
    assert planning.planned_ids(str(path)) == ["x"] and planning.planned_ids(None) is None


# --------------------------------------------------------------------------- comparisons

def test_acceptance_length_is_vllms():
    assert compare.acceptance_len(0, 0) == 1.0
    assert compare.acceptance_len(64, 192) == 4.0


def test_token_mismatches_point_at_the_first_difference():
    lines = compare.token_mismatches([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]], ("a", "b"))
    assert lines == ["request 1: first difference at output position 1: a [5], b [6] (lengths 2 vs 2)"]
    assert compare.token_mismatches([[1]], [[1], [2]]) == ["1 expected sequences vs 2 got"]


def test_logprobs_close_in_vllms_sense():
    ref = [([1, 2], [{1: -0.1, 2: -2.0}, {2: -0.1, 3: -3.0}])]
    assert compare.logprobs_not_close(ref, ref) == []
    swapped = [([1, 3], [{1: -0.1, 2: -2.0}, {3: -0.2, 2: -0.3}])]
    assert compare.logprobs_not_close(ref, swapped) == []   # diverged, but each token is in the other's top-k
    far = [([1, 4], [{1: -0.1}, {4: -0.1, 5: -1.0}])]
    assert compare.logprobs_not_close(ref, far) == [
        "request 0 position 1: baseline token 2 (top-k [2, 3]), spec token 4 (top-k [4, 5])"]
    assert compare.max_logprob_gap(ref, swapped) == pytest.approx(0.0)


def test_positions_name_the_rejected_position():
    found = compare.positions([3, 3, 2], [3, 1, 2], 3)
    assert found.drafted == [3, 3, 2] and found.accepted == [3, 2, 1]
    assert found.rejections == [(1, 1)]
    negative_control = compare.positions([3] * 4, [1] * 4, 3)   # drafts beyond position 0 wrong by design
    assert negative_control.accepted == [4, 0, 0] and len(negative_control.rejections) == 4


def test_known_answers_say_what_each_prompt_continues_with_and_each_step_accepts():
    rule = knownanswer.CONTEXT_RULE
    assert compare.expected_outputs(rule, [[5, 6, 7], [300, 200], [42], [510, 511]], 4, 512) == [
        [8, 9, 10, 11], [302, 202, 304, 204], [44, 44, 46, 46], [0, 1, 2, 3]]
    assert knownanswer.successor_drafts_exact([5, 6, 7], 64, 512)
    assert not knownanswer.successor_drafts_exact([42], 64, 512)
    assert not knownanswer.successor_drafts_exact([300, 200], 64, 512)
    assert compare.expected_accepts(True, 1, [3, 3, 2]) == [3, 3, 2]
    assert compare.expected_accepts(False, 1, [3, 3, 1, 0]) == [1, 1, 1, 0]


def test_every_known_answer_prompt_set_exercises_both_kinds():
    """Exact drafts somewhere (per-position acceptance) and wrong drafts elsewhere (rejection,
    KV rollback), with room for the drafts inside the context kernel's exact range."""
    settings = planning.Settings.parse(m.load())
    multi = [p for p in settings.known_answer_prompts if len(p) > 1]
    exact = [knownanswer.successor_drafts_exact(p, settings.known_answer_max_tokens, 512) for p in multi]
    assert any(exact) and not all(exact)
    longest = max(len(p) for p in settings.known_answer_prompts) + settings.known_answer_max_tokens + 8
    assert longest <= min(settings.max_model_len, knownanswer.MAX_DISTANCE)


def test_first_step_fully_rejected():
    assert compare.first_step_fully_rejected([3, 3], [0, 3])
    assert not compare.first_step_fully_rejected([3, 3], [3, 0])
    assert not compare.first_step_fully_rejected([], [])


# --------------------------------------------------------------------------- summary and exit codes

def assert_valid_test_entry(entry: dict) -> None:
    errors = entry_errors(entry)
    assert not errors, errors


def _result(nodeid: str, outcome: str, message: str = "", time_s: float = 1.0) -> pytestrun.TestResult:
    return pytestrun.TestResult(nodeid, outcome, message, message, time_s)


def test_merge_fills_rows_from_records(tmp_path):
    recorder = report.Recorder(tmp_path / "records.jsonl")
    recorder.write("test", test="t.py::a", method="ngram", drafts=3, acceptance_len=2.0, engines=["k"])
    recorder.write("test", test="t.py::c", engines=["k requests=sampled", "other"])
    recorder.write("engine", key="k", init_s=12.5, compilation={"mode": "DYNAMO_TRACE_ONCE", "backend": "inductor"},
                   phases=[{"key": "k requests=sampled", "generate_s": 2.0, "error": None},
                           {"key": "k", "generate_s": 0.5, "error": None}])
    recorder.write("test", test="t.py::d", method="mtp", expected_failure="TypeError: known")
    rows = report.merge_results([_result("t.py::a", "passed", time_s=3.216),
                              _result("t.py::b", "skipped", "Model Runner V2 requires Triton; using the V1 model "
                                                            "runner instead (the Triton CPU backend is missing)"),
                              _result("t.py::c", "error", "boom"), _result("t.py::d", "skipped", "known")],
                             recorder.read())
    assert [r["outcome"] for r in rows] == ["passed", "skipped", "error", "xfailed"]
    assert [r["cause"] for r in rows] == [None, "env-blocked", "failure", "known-defect"]
    assert rows[0]["drafts"] == 3 and rows[0]["time_s"] == 3.22 and rows[0]["reason"] is None
    assert rows[1]["reason"].startswith("Model Runner V2 requires Triton") and rows[1]["method"] is None
    assert rows[2]["reason"] == "boom"
    assert set(report.MEASURED_FIELDS) <= set(rows[1])
    for row in rows:
        assert_valid_test_entry(row)
    engines = report.engine_rows(recorder.read(), rows)
    assert engines[0]["checks"] == ["t.py::a", "t.py::c"]     # every test that read one of its phases
    assert report.compile_backend(engines) == "inductor"
    assert "1 engine starts: 12.5 s in all" in report.format_report(rows, engines)


def test_the_report_names_a_fixture_before_the_checkpoint_it_stands_in_for():
    fixture = {"nodeid": "t.py::test_v1_matches_baseline[dflash-v1]", "outcome": "passed", "time_s": 1.0,
               "reason": None, **dict.fromkeys(report.MEASURED_FIELDS), "method": "dflash", "model_source": "fixture",
               "target": "Qwen/Qwen3-4B", "draft": "z-lab/Qwen3-4B-DFlash-b16", "runner": "v1",
               "engines": ["tiny-qwen3@690c46d068 none", "tiny-qwen3@690c46d068 dflash-random@0bcc402f61 dflash k=4"]}
    skipped = {**fixture, "nodeid": "t.py::test_v2_speculator_smoke[dflash-v2]", "outcome": "skipped", "engines": None}
    hub = {**fixture, "nodeid": "t.py::test_v1_matches_baseline[hub]", "model_source": "hub",
           "engines": ["Qwen/Qwen3-4B@1cfa9a7208 z-lab/Qwen3-4B-DFlash-b16@0123456789 dflash k=4"]}
    header, _, *cells = [re.split(r"\s{2,}", line) for line in report.format_report([fixture, skipped, hub],
                                                                                     []).splitlines()]
    assert header[2:4] == ["source", "model"]
    assert [row[2:4] for row in cells] == [
        ["fixture", "tiny-qwen3 (stand-in for Qwen/Qwen3-4B) + dflash-random (stand-in for z-lab/Qwen3-4B-DFlash-b16)"],
        # No engine started: no fixture name to give, but never the bare hub id.
        ["fixture", "fixture (stand-in for Qwen/Qwen3-4B) + fixture (stand-in for z-lab/Qwen3-4B-DFlash-b16)"],
        ["hub", "Qwen/Qwen3-4B + z-lab/Qwen3-4B-DFlash-b16"]]
    # An engine row (its key, no engines list) reads the same way.
    row = {"key": fixture["engines"][1], "model_source": "fixture", "target": "Qwen/Qwen3-4B",
           "draft": "z-lab/Qwen3-4B-DFlash-b16"}
    assert contract.model_labels(row) == ("tiny-qwen3 (stand-in for Qwen/Qwen3-4B)",
                                          "dflash-random (stand-in for z-lab/Qwen3-4B-DFlash-b16)")


def test_compile_backend_reports_a_mix():
    engines = [{"compilation": {"mode": "X", "backend": b}} for b in ("inductor", "eager")]
    assert report.compile_backend(engines) == "mixed: eager, inductor"
    assert report.compile_backend([]) is None


@pytest.mark.parametrize("code,outcomes,want", [
    (0, ["passed", "skipped", "xfailed"], 0),
    (1, ["passed", "failed"], 1),
    (4, [], 2),            # pytest usage error: bad pytest arguments
    (5, [], 1),            # nothing collected is a failure, never a pass
    (0, [], 0),            # an empty run is failed by the lifecycle, which counts what executed
    (0, ["error"], 1),
])
def test_session_exit_code(code, outcomes, want):
    assert report.session_exit_code(code, [{"outcome": o} for o in outcomes]) == want


def test_engine_errors_travel_with_their_type_and_traceback():
    try:
        {}["x"]()
    except Exception as exc:
        record = engine._error_record(exc)
    relayed = engine.relay(record)
    assert type(relayed) is KeyError and relayed.__traceback__ is not None
    assert "KeyError" in record["traceback"]
    fallback = engine.relay({**record, "pickle": None})
    assert isinstance(fallback, engine.EngineProcessError) and str(fallback).startswith("KeyError: 'x'")


# --------------------------------------------------------------------------- the session's own exits

def _session(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = hermetic.env_without("SPECGATE_", "HF_")
    env.update(SPECGATE_ARTIFACTS=str(tmp_path / "artifacts"), HF_HUB_CACHE=str(tmp_path / "empty-hub"),
               HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "specgate.sessions.e2e", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_unknown_option_exits_2(tmp_path):
    """Unknown options go to pytest (nox's convention), which rejects them: bad input."""
    proc = _session(tmp_path, "--no-such-option")
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-option" in proc.stdout + proc.stderr


def test_hub_mode_without_the_checkpoints_exits_75_before_any_engine(tmp_path):
    proc = _session(tmp_path, "--model-source", "hub")
    assert proc.returncode == 75, proc.stdout + proc.stderr
    summary = read_valid(tmp_path / "artifacts" / "cpu_e2e" / "summary.json")
    assert summary["exit_code"] == 75 and summary["tests"] == [] and summary["engines"] == []
    assert summary["status"] == "finished" and "required checkpoint(s) not cached" in summary["error"]
    missing = {entry["name"] for entry in summary["missing"]}
    assert {"Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B"} <= missing
    assert "missing: Qwen/Qwen3-0.6B" in proc.stdout


def test_compiled_model_reads_vllms_and_inductors_compile_counters():
    assert not engine.compiled_model({})
    assert not engine.compiled_model({"num_models_seen": 2})   # what an eager (or AOT-off) engine shows in vLLM's
    assert not engine.compiled_model({"num_models_seen": 2, "inductor.fxgraph_cache_hit": 0})
    assert engine.compiled_model({"num_aot_compiles": 1})
    assert engine.compiled_model({"num_aot_artifacts_loaded": 1})   # compiled earlier, loaded from the cache
    assert engine.compiled_model({"num_models_seen": 2, "inductor.fxgraph_cache_miss": 1})   # AOT off, cold
    assert engine.compiled_model({"num_models_seen": 2, "inductor.fxgraph_cache_hit": 1})    # AOT off, warm


def test_acceptance_floors_judge_only_the_versions_they_were_measured_on():
    """A build of another vLLM version is not judged against 0.32.0's acceptance numbers; its
    exact checks (known answers, per-step acceptance) still are."""
    manifest = m.load()
    assert planning.unrecorded_floors(manifest, "0.32.0") is None
    assert planning.unrecorded_floors(manifest, "0.31.0") == (
        "no acceptance floors recorded for vLLM 0.31.0 (manifest [e2e] floors_recorded_on: 0.32.0): "
        "acceptance is measured and shown, not judged")
    eagle3 = planning.resolve_config(manifest, next(c for c in manifest.e2e if c.id == "eagle3-v1"), "fixture",
                                     "0.32.0")
    assert eagle3.threshold == 2.6 and eagle3.known_answer["floor"] == 2.6
    unjudged = planning.without_floors(eagle3)
    assert unjudged.threshold is None and unjudged.known_answer["floor"] is None
    assert unjudged.known_answer["exact_drafts"] is True and unjudged.known_answer["wrong_at"] == 1
