"""The mutant catalogue and session logic that need no engine: every entry names a vLLM function
that exists in the installed vLLM with the arguments the patch relies on, the patches change
exactly what they say, nothing is patched unless a mutant is named, and the summary entries."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import hermetic
import numpy as np
import pytest
from contract import VALIDATOR, entry_errors, read_valid

from specgate.contract import processes
from specgate.core.manifest import REPO_ROOT
from specgate.sessions.mutants import MUTANT_VAR, session
from specgate.vllmside import catalogue


def test_catalogue_entries_are_named_and_explained_in_one_line():
    names = [m.name for m in catalogue.CATALOGUE]
    assert len(names) == len(set(names)) >= 7
    for m in catalogue.CATALOGUE:
        assert m.what and m.why_real and "\n" not in m.what + m.why_real, m.name


def test_unknown_mutant_is_an_error():
    with pytest.raises(ValueError, match="unknown mutant 'nope'"):
        catalogue.install("nope")


PATCHED = {   # mutant -> (module, attribute path) it replaces
    "noncausal-verify": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder.build"),
    "draft-positions-shifted": ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner._prepare_inputs"),
    "kv-not-rewritten": ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner._prepare_inputs"),
    "kv-slots-shifted": ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner._prepare_inputs"),
    "accept-one-extra": ("vllm.v1.sample.rejection_sampler", "rejection_sample"),
    "bonus-dropped": ("vllm.v1.sample.rejection_sampler", "rejection_sample"),
    "draft-hidden-shifted": ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.propose"),
    "ngram-wrong-offset": ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.propose_draft_token_ids"),
    "uniform-constant": ("vllm.v1.sample.rejection_sampler", "generate_uniform_probs"),
    "draft-target-swapped": ("vllm.utils.cpu_triton_utils", "_rejection_random_sample_kernel_impl"),
    "recovered-from-target": ("vllm.utils.cpu_triton_utils", "_sample_recovered_tokens_kernel_impl"),
    "recovered-as-one-hot": ("vllm.utils.cpu_triton_utils", "_sample_recovered_tokens_kernel_impl"),
    "rejected-draft-not-excluded": ("vllm.utils.cpu_triton_utils", "_sample_recovered_tokens_kernel_impl"),
    "bonus-argmax": ("vllm.v1.sample.sampler", "Sampler.forward"),
    "temperature-not-applied": ("vllm.v1.sample.rejection_sampler", "apply_sampling_constraints"),
    "top-k-top-p-not-applied": ("vllm.v1.sample.rejection_sampler", "apply_sampling_constraints"),
    "generators-ignored": ("vllm.v1.sample.rejection_sampler", "generate_uniform_probs"),
    "draws-for-undrafted": ("vllm.v1.sample.rejection_sampler", "generate_uniform_probs"),
}
SAMPLING = list(PATCHED)[8:]          # the random-sampling (temperature > 0) mutants

PROBE = """
import importlib, json, sys
from specgate.vllmside import catalogue
replaced = {}
for name, (module, path) in json.loads(sys.argv[1]).items():
    def get():
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj
    before = get()
    catalogue.install(name)
    replaced[name] = get() is not before
print(json.dumps({"replaced": replaced, "llvmlite": "llvmlite" in sys.modules}))
"""


@pytest.mark.vllm
def test_each_mutant_replaces_the_vllm_function_it_names_and_loads_no_numba():
    """In a fresh process (as in the engine child): each named function exists in the installed
    vLLM and install() replaces it; installing every mutant loads no llvmlite (numba), after
    which vLLM 0.32 CPU could not start an engine (specgate.vllmside.engine). One process, one vLLM import."""
    assert set(PATCHED) == set(catalogue.MUTANTS)
    assert {name: catalogue.MUTANTS[name].patches[0] for name in PATCHED} == {
        name: f"{module}:{path}" for name, (module, path) in PATCHED.items()}   # what moved() looks for
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(PATCHED)], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    probe = json.loads(out.stdout.splitlines()[-1])
    assert probe["replaced"] == dict.fromkeys(PATCHED, True)
    assert probe["llvmlite"] is False


def test_the_ngram_mutant_patches_the_proposer_class_once_and_keeps_the_runners_counts():
    calls = []

    class Proposer:
        def propose(self, k, sampled, num_tokens_no_spec, token_ids, slot_mappings=None):
            calls.append(num_tokens_no_spec)
            return [[1]]

    catalogue._short_ngram_context(Proposer)
    catalogue._short_ngram_context(Proposer)        # a second engine's runner: no double shift
    counts = np.array([10, 20])
    assert Proposer().propose(3, [[5]], counts, None, slot_mappings={}) == [[1]]
    assert calls[0].tolist() == [9, 19] and counts.tolist() == [10, 20]


@pytest.mark.vllm
def test_the_patched_signatures_are_the_ones_the_patches_assume():
    from vllm.v1.sample.rejection_sampler import rejection_sample
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    assert list(inspect.signature(rejection_sample).parameters)[:7] == [
        "draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs",
        "target_logits", "bonus_token_ids"]
    assert "target_hidden_states" in inspect.signature(SpecDecodeBaseProposer.propose).parameters
    assert list(inspect.signature(NgramProposer.propose).parameters)[:5] == [
        "self", "num_speculative_tokens", "sampled_token_ids", "num_tokens_no_spec", "token_ids_cpu"]


@pytest.mark.vllm
def test_the_sampling_patches_assume_vllms_signatures_and_leave_the_expand_repair_alone():
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    def names(function):
        return list(inspect.signature(function).parameters)

    assert names(rejection_sampler.generate_uniform_probs) == ["num_tokens", "num_draft_tokens", "generators", "device"]
    assert names(rejection_sampler.sample_recovered_tokens)[:7] == [
        "max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids", "draft_probs", "target_probs",
        "sampling_metadata"]
    assert names(rejection_sampler.apply_sampling_constraints) == ["logits", "cu_num_draft_tokens", "sampling_metadata"]
    assert names(Sampler.forward) == ["self", "logits", "sampling_metadata", "predict_bonus_token",
                                      "logprobs_mode_override"]
    assert {"draft_probs", "target_probs"} <= set(names(cpu_triton_utils._rejection_random_sample_kernel_impl))
    assert {"draft_probs", "target_probs", "NO_DRAFT_PROBS"} <= set(
        names(cpu_triton_utils._sample_recovered_tokens_kernel_impl))
    assert names(CPUModelRunner._dummy_sampler_run)[:2] == ["self", "hidden_states"]
    # Another hook repairs vLLM #55005 there: no mutant may replace it.
    assert not [m.name for m in catalogue.CATALOGUE if any("_expand_kernel_impl" in t for t in m.patches)]


SAMPLING_PROBE = """
import importlib, json
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm.utils import cpu_triton_utils
from vllm.v1.sample import rejection_sampler as rs
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from specgate.vllmside import catalogue


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    # vLLM #55005 repaired as the engine host does it: the mutants must compose with this wrapper.
    ends = cu_num_tokens.to(torch.int64)
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output.copy_(torch.repeat_interleave(values, torch.diff(ends, prepend=ends.new_zeros(1))))


cpu_triton_utils._expand_kernel_impl = expand
CpuPlatform.register_triton_kernel_overrides()
torch.manual_seed(0)
V, R, D = 8, 8, 3                                                   # vocab, requests, drafts per request
DRAFTS = torch.tensor([1, 2, 3] * R, dtype=torch.int32)
ONE_HOT = torch.nn.functional.one_hot(DRAFTS.long(), V).float()     # a drafter sure of its drafts
SPREAD = 0.5 * ONE_HOT + 0.5 * (1 - ONE_HOT) / (V - 1)              # half on the draft, half spread
CU = torch.arange(1, R + 1, dtype=torch.int32) * D


def meta(temperature, generators=None, top_k=None):
    t = torch.tensor(temperature, dtype=torch.float32)
    n = len(temperature)
    return SamplingMetadata(
        temperature=t, all_greedy=bool((t == 0).all()), all_random=bool((t > 0).all()), top_p=None,
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32), generators=generators or {},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())


def seeded(n=R):
    return {i: torch.Generator().manual_seed(i) for i in range(n)}


def target_logits(p_draft):
    # At every drafted position the target gives the draft p_draft and the other tokens the rest evenly.
    probs = torch.full((R * D, V), (1 - p_draft) / (V - 1))
    probs[torch.arange(R * D), DRAFTS.long()] = p_draft
    return probs.log()


def verify(p_draft, draft_probs):
    # rejection_sample's rows (emitted tokens, bonus 7, then -1) for seeded requests at temperature 1.
    bonus = torch.full((R, 1), 7, dtype=torch.int32)
    rows = rs.rejection_sample(DRAFTS, [D] * R, D, CU, draft_probs, target_logits(p_draft), bonus,
                               meta([1.0] * R, seeded()))
    return rows.tolist()


def recovered_drafts(draft_probs):
    # How many drafted positions would be replaced by their own draft if rejected (p(draft) = 0.9).
    probs = target_logits(0.9).softmax(dim=-1)
    recovered = rs.sample_recovered_tokens(D, [D] * R, CU, DRAFTS, draft_probs, probs, meta([1.0] * R), "cpu")
    return int((recovered == DRAFTS).sum())


def states(generators):
    return [g.get_state() for g in generators.values()]


def advanced(draw, generators):
    before = states(generators)
    draw(generators)
    return [not torch.equal(a, b) for a, b in zip(before, states(generators))]


def one_draw_more():
    generators = seeded(2)
    rs.generate_uniform_probs(2, [0, 2], generators, "cpu")
    reference = torch.Generator().manual_seed(0)
    torch.empty(1, dtype=torch.float64).uniform_(generator=reference)
    return torch.equal(generators[0].get_state(), reference.get_state())


def bonus(predict_bonus_token):
    logits = torch.full((16, V), 0.1).log()
    logits[:, 3] = torch.tensor(0.3).log()                          # the argmax, sampled 30% of the time
    out = Sampler()(logits=logits, sampling_metadata=meta([0.0] + [1.0] * 15),
                    predict_bonus_token=predict_bonus_token).sampled_token_ids
    return {"tokens": out[:, 0].tolist(), "dtype": str(out.dtype), "shape": list(out.shape)}


RAW = torch.randn(5, V)
COUNTS = [2, 1, 2]                                                  # drafts of three requests


def constrained(temperature, top_k=None):
    cu = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0).to(torch.int32)
    out = rs.apply_sampling_constraints(RAW.clone(), cu, meta(temperature, top_k=top_k))
    t = torch.tensor(temperature)
    per_token = torch.where(t == 0, 1.0, t).repeat_interleave(torch.tensor(COUNTS))[:, None]
    kept = out.isfinite()
    return {"unscaled": bool(torch.allclose(out[kept], RAW[kept])),
            "scaled": bool(torch.allclose(out[kept], (RAW / per_token)[kept])), "masked": (~kept).sum(1).tolist()}


def fired(part):
    before = catalogue._fired
    return {"out": part(), "fired": catalogue._fired - before}


RECOVERY = lambda: {"probabilistic": fired(lambda: recovered_drafts(ONE_HOT)),
                    "no_draft_probs": fired(lambda: recovered_drafts(None))}
CONSTRAINTS = lambda: {"top_k": fired(lambda: constrained([0.5, 0.0, 2.0], top_k=[2, 2, 2])),
                       "temperature_1": fired(lambda: constrained([1.0, 0.0, 1.0], top_k=[2, 2, 2])),
                       "no_top_k": fired(lambda: constrained([0.5, 0.0, 2.0]))}
CASES = {
    "uniform-constant": lambda: {
        "uniform": fired(lambda: rs.generate_uniform_probs(6, [3, 0, 3], {}, "cpu").tolist()),
        "verify": fired(lambda: verify(0.6, None))},
    "draft-target-swapped": lambda: {
        "probabilistic": fired(lambda: verify(0.01, ONE_HOT)), "no_draft_probs": fired(lambda: verify(0.01, None))},
    "recovered-from-target": RECOVERY,
    "recovered-as-one-hot": lambda: {**RECOVERY(), "spread": fired(lambda: recovered_drafts(SPREAD))},
    "rejected-draft-not-excluded": RECOVERY,
    "bonus-argmax": lambda: {"bonus": fired(lambda: bonus(True)), "not_bonus": fired(lambda: bonus(False))},
    "temperature-not-applied": CONSTRAINTS,
    "top-k-top-p-not-applied": CONSTRAINTS,
    "generators-ignored": lambda: {
        "uniform": fired(lambda: advanced(lambda g: rs.generate_uniform_probs(4, [2, 2], g, "cpu"), seeded(2))),
        "recovery": fired(lambda: advanced(lambda g: rs.sample_recovered_tokens(
            D, [D] * R, CU, DRAFTS, None, target_logits(0.5).softmax(dim=-1), meta([1.0] * R, g), "cpu"), seeded())),
        "undrafted": fired(lambda: advanced(lambda g: rs.generate_uniform_probs(2, [0, 2], g, "cpu"), seeded(1)))},
    "draws-for-undrafted": lambda: {
        "advanced": fired(lambda: advanced(lambda g: rs.generate_uniform_probs(2, [0, 2], g, "cpu"), seeded(2))),
        "one_draw": fired(one_draw_more),
        "uniform": fired(lambda: rs.generate_uniform_probs(2, [0, 2], seeded(2), "cpu").tolist())},
}


def resolve(target):
    module, _, path = target.partition(":")
    *owners, attr = path.split(".")
    owner = importlib.import_module(module)
    for name in owners:
        owner = getattr(owner, name)
    return owner, attr


def mutated(name, case):
    # The case with the mutant installed, then once more inside a stand-in profile run; then vLLM as it was.
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in map(resolve, catalogue.MUTANTS[name].patches)]
    CPUModelRunner._dummy_sampler_run = lambda self, hidden_states: case()
    catalogue.install(name)
    CpuPlatform.register_triton_kernel_overrides()
    try:
        out = case()
        counted = catalogue._fired
        CPUModelRunner._dummy_sampler_run(None, None)
        return {**out, "fired_in_profile_run": catalogue._fired - counted,
                "expand_repaired": cpu_triton_utils._expand_kernel_impl is expand}
    finally:
        catalogue.take_fired()
        for owner, attr, value in saved:
            setattr(owner, attr, value)
        CpuPlatform.register_triton_kernel_overrides()


print(json.dumps({name: {"base": case(), "mutant": mutated(name, case)} for name, case in CASES.items()}))
"""


@pytest.fixture(scope="module")
def sampling():
    """Each random-sampling mutant's cases through the real vLLM functions on tiny tensors, without
    and with the mutant (installed, CPU kernels re-registered, then undone): one fresh process."""
    out = subprocess.run([sys.executable, "-c", SAMPLING_PROBE], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


ALL_ACCEPTED = [[1, 2, 3, 7]] * 8      # the probe's drafts 1, 2, 3 and bonus 7, for each of its 8 requests


@pytest.mark.vllm
def test_the_sampling_mutants_ran_with_the_expand_repair_and_do_not_count_the_profile_run(sampling):
    assert list(sampling) == SAMPLING
    for name in SAMPLING:
        mutant = sampling[name]["mutant"]
        assert catalogue.PROFILE_RUN in catalogue.MUTANTS[name].patches, name
        assert mutant["expand_repaired"] and mutant["fired_in_profile_run"] == 0, name


@pytest.mark.vllm
def test_uniform_constant_tests_every_draft_against_one_half(sampling):
    base, mutant = sampling["uniform-constant"]["base"], sampling["uniform-constant"]["mutant"]
    assert mutant["uniform"] == {"out": [0.5] * 6, "fired": 1} and 0.5 not in base["uniform"]["out"]
    # p(draft) = 0.6 >= 0.5 everywhere: every draft is accepted, where real draws reject some.
    assert mutant["verify"] == {"out": ALL_ACCEPTED, "fired": 1} and base["verify"]["out"] != ALL_ACCEPTED


@pytest.mark.vllm
def test_draft_target_swapped_accepts_with_q_over_p_and_only_with_draft_probabilities(sampling):
    base, mutant = sampling["draft-target-swapped"]["base"], sampling["draft-target-swapped"]["mutant"]
    # q one-hot on each draft, p(draft) = 0.01: p/q rejects almost every draft, q/p = 100 accepts all.
    assert mutant["probabilistic"] == {"out": ALL_ACCEPTED, "fired": 1}
    assert ALL_ACCEPTED[0] not in base["probabilistic"]["out"]
    assert mutant["no_draft_probs"] == base["no_draft_probs"]


@pytest.mark.vllm
def test_recovered_from_target_can_return_the_rejected_draft_only_with_draft_probabilities(sampling):
    base, mutant = sampling["recovered-from-target"]["base"], sampling["recovered-from-target"]["mutant"]
    assert base["probabilistic"]["out"] == 0          # max(0, p - q) is 0 at a one-hot draft
    assert mutant["probabilistic"]["out"] > 0 and mutant["probabilistic"]["fired"] == 1
    assert mutant["no_draft_probs"] == base["no_draft_probs"] == {"out": 0, "fired": 0}


@pytest.mark.vllm
def test_recovered_as_one_hot_differs_only_where_q_is_spread(sampling):
    base, mutant = sampling["recovered-as-one-hot"]["base"], sampling["recovered-as-one-hot"]["mutant"]
    # p(draft) = 0.9 against q(draft) = 0.5: max(0, p - q) is the draft alone at all 24 positions;
    # recovered as if q were one-hot, the draft is excluded.
    assert base["spread"]["out"] == 24 and mutant["spread"] == {"out": 0, "fired": 1}
    assert mutant["probabilistic"]["out"] == base["probabilistic"]["out"] == 0    # one-hot q: no difference
    assert mutant["no_draft_probs"] == base["no_draft_probs"] == {"out": 0, "fired": 0}


@pytest.mark.vllm
def test_rejected_draft_not_excluded_can_return_it_only_without_draft_probabilities(sampling):
    base, mutant = sampling["rejected-draft-not-excluded"]["base"], sampling["rejected-draft-not-excluded"]["mutant"]
    assert base["no_draft_probs"]["out"] == 0         # NO_DRAFT_PROBS masks the draft out of p
    assert mutant["no_draft_probs"]["out"] > 0 and mutant["no_draft_probs"]["fired"] == 1
    assert mutant["probabilistic"] == base["probabilistic"] == {"out": 0, "fired": 0}


@pytest.mark.vllm
def test_bonus_argmax_takes_the_argmax_for_sampling_rows_of_the_bonus_call_only(sampling):
    base, mutant = sampling["bonus-argmax"]["base"], sampling["bonus-argmax"]["mutant"]
    assert set(base["bonus"]["out"]["tokens"]) != {3}                 # the argmax 3 has p = 0.3
    assert mutant["bonus"]["out"] == {**base["bonus"]["out"], "tokens": [3] * 16}       # same dtype and shape
    assert 0 < mutant["bonus"]["fired"] <= 15                         # one per sampled row it changed
    assert mutant["not_bonus"]["fired"] == 0 and set(mutant["not_bonus"]["out"]["tokens"]) != {3}


@pytest.mark.vllm
def test_temperature_not_applied_leaves_the_logits_unscaled_but_top_k_applied(sampling):
    base, mutant = sampling["temperature-not-applied"]["base"], sampling["temperature-not-applied"]["mutant"]
    assert base["top_k"]["out"] == {"unscaled": False, "scaled": True, "masked": [6] * 5}
    assert mutant["top_k"] == {"out": {"unscaled": True, "scaled": False, "masked": [6] * 5}, "fired": 1}
    assert mutant["temperature_1"] == base["temperature_1"] and mutant["temperature_1"]["fired"] == 0


@pytest.mark.vllm
def test_top_k_top_p_not_applied_leaves_every_token_but_scales(sampling):
    base, mutant = sampling["top-k-top-p-not-applied"]["base"], sampling["top-k-top-p-not-applied"]["mutant"]
    assert base["top_k"]["out"]["masked"] == [6] * 5
    assert mutant["top_k"] == {"out": {"unscaled": False, "scaled": True, "masked": [0] * 5}, "fired": 1}
    assert mutant["no_top_k"] == base["no_top_k"] and mutant["no_top_k"]["fired"] == 0


@pytest.mark.vllm
def test_generators_ignored_leaves_the_seeded_streams_untouched_in_verification(sampling):
    base, mutant = sampling["generators-ignored"]["base"], sampling["generators-ignored"]["mutant"]
    assert base["uniform"]["out"] == [True] * 2 and base["recovery"]["out"] == [True] * 8
    assert mutant["uniform"] == {"out": [False] * 2, "fired": 1}
    assert mutant["recovery"] == {"out": [False] * 8, "fired": 1}
    assert mutant["undrafted"] == base["undrafted"] == {"out": [False], "fired": 0}   # its generator is not used


@pytest.mark.vllm
def test_draws_for_undrafted_takes_one_draw_from_a_request_without_drafts(sampling):
    base, mutant = sampling["draws-for-undrafted"]["base"], sampling["draws-for-undrafted"]["mutant"]
    assert base["advanced"]["out"] == [False, True] and not base["one_draw"]["out"]
    assert mutant["advanced"] == {"out": [True, True], "fired": 1} and mutant["one_draw"]["out"]
    assert mutant["uniform"]["out"] == base["uniform"]["out"]         # the drafted request's draws are unchanged


CHILD = """
import sys
import specgate.vllmside.engine as engine
engine.main(sys.argv[1:])
print("catalogue-loaded" if "specgate.vllmside.catalogue" in sys.modules else "catalogue-absent")
"""


@pytest.mark.parametrize("mutant", [None, "ngram-wrong-offset"])
@pytest.mark.vllm
def test_the_engine_child_installs_a_mutant_only_when_named(tmp_path, mutant):
    request = tmp_path / "request.json"
    request.write_text("[]")
    env = {k: v for k, v in os.environ.items() if k != MUTANT_VAR} | ({MUTANT_VAR: mutant} if mutant else {})
    out = subprocess.run([sys.executable, "-c", CHILD, str(request), str(tmp_path / "result.json")], cwd=REPO_ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == ("catalogue-loaded" if mutant else "catalogue-absent")


def _row(*tokens):
    import torch  # here, not at the top: collecting the fast tier need not import torch

    return torch.tensor(tokens, dtype=torch.int32)


def test_accept_one_extra_emits_the_rejected_draft_then_the_targets_next_token():
    import torch

    logits = torch.zeros(3, 10)
    logits[0, 1], logits[1, 9], logits[2, 7] = 1, 1, 1       # the target's argmax per draft position
    row = _row(1, 9, -1, -1)                                   # draft 0 accepted, draft 1 (5) rejected -> 9
    assert catalogue._accept_one_extra(row, _row(1, 5, 6), logits, torch.tensor(8))
    assert row.tolist() == [1, 5, 7, -1]
    full = _row(1, 5, 6, 8)
    assert not catalogue._accept_one_extra(full, _row(1, 5, 6), logits, torch.tensor(8))


def test_drop_bonus_only_on_fully_accepted_steps():
    row = _row(1, 5, 6, 8)
    assert catalogue._drop_bonus(row, _row(1, 5, 6), None, None) and row.tolist() == [1, 5, 6, -1]
    partial = _row(1, 9, -1, -1)
    assert not catalogue._drop_bonus(partial, _row(1, 5, 6), None, None) and partial.tolist() == [1, 9, -1, -1]


def test_verify_blocks_find_the_requests_with_drafts():
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b", "c"]))
    output = SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2, 3], "c": [4]})
    assert list(catalogue._verify_blocks(runner, output, np.array([4, 1, 2]))) == [(0, 4, 3), (5, 2, 1)]
    import torch

    positions = torch.arange(7)
    catalogue._shift_draft_positions(SimpleNamespace(positions=positions), 0, 4, 3)
    assert positions.tolist() == [0, 2, 3, 4, 4, 5, 6]


def test_summary_entries_pass_a_killed_mutant_and_fail_a_survivor():
    killed = {"name": "m", "killed_by": ["tests/e2e/test_spec_decode.py::test_known_answer[ngram]"],
              "survived": False, "fired": 3, "time_s": 180.2}
    assert session._entry(killed) == {"nodeid": "mutant:m", "outcome": "passed", "cause": None,
                                      "reason": "killed by 1 check(s): test_known_answer[ngram]", "time_s": 180.2}
    unexercised = {"name": "n", "killed_by": [], "survived": True, "fired": 0, "time_s": 1.0}
    assert session._entry(unexercised)["outcome"] == "failed"
    assert "never fired" in session._entry(unexercised)["reason"]
    for entry in (session._entry(killed), session._entry(unexercised)):
        assert not entry_errors(entry)
    assert "mutants" in VALIDATOR.schema["properties"]["session"]["enum"]


def test_a_control_seed_set_with_a_false_alarm_is_a_failed_entry_naming_the_check():
    clean = {"seed_base": 2000, "pytest_exit_code": 0, "failed": [], "passed": 12, "clean": True, "time_s": 300.0}
    alarm = {**clean, "seed_base": 3000, "pytest_exit_code": 1, "passed": 11, "clean": False,
             "failed": ["tests/e2e/test_sampling.py::test_sampling_distribution[eagle3-v1/greedy]"]}
    crashed = {**clean, "seed_base": 4000, "pytest_exit_code": 3, "passed": 0, "clean": False}
    entries = [session._control_entry(s) for s in (clean, alarm, crashed)]
    assert [(e["nodeid"], e["outcome"]) for e in entries] == [("control:seed_base=2000", "passed"),
                                                            ("control:seed_base=3000", "failed"),
                                                            ("control:seed_base=4000", "failed")]
    assert entries[0]["reason"] == "12 checks passed"
    assert entries[1]["reason"] == "false alarm(s): test_sampling_distribution[eagle3-v1/greedy]"
    assert entries[2]["reason"] == "pytest exit 3 with no check failed"
    for entry in entries:
        assert not entry_errors(entry)


TIMEOUT_REASON = ("specgate.vllmside.engine.EngineProcessError: EngineProcessError: engine process timed out "
                  "(600 s per engine) and was killed")   # what cpu_e2e's rows say when the host kills a slow engine


def test_a_check_that_lost_its_engine_to_the_timeout_is_neither_a_kill_nor_a_false_alarm():
    """Measured here: two sessions beside a third on 2 cores slowed an eagle3 engine past 600 s,
    and every check on it 'failed'. Load is no kill, and no false alarm either."""
    from specgate.vllmside import engine

    assert engine.TIMED_OUT in TIMEOUT_REASON
    rows = [{"nodeid": "t::test_sampling_distribution[eagle3-v1/greedy]", "outcome": "failed",
             "reason": TIMEOUT_REASON},
            {"nodeid": "t::test_sampling_distribution[eagle3-v1/probabilistic]", "outcome": "failed",
             "reason": "AssertionError: eagle3-v1/probabilistic: chi-square 80.2 on 3 df, p = 2.7e-17 < 1e-06"},
            {"nodeid": "t::test_sampling_acceptance[eagle3-v1/greedy]", "outcome": "passed", "reason": None}]
    assert session._failed(rows) == ["t::test_sampling_distribution[eagle3-v1/probabilistic]"]
    assert session._lost(rows) == ["t::test_sampling_distribution[eagle3-v1/greedy]"]
    lost_only = {"name": "m", "killed_by": [], "timed_out": [rows[0]["nodeid"]], "survived": True, "fired": 12,
                 "time_s": 700.0}
    entry = session._entry(lost_only)
    assert entry["outcome"] == "failed" and entry["reason"].startswith("not scored: 1 check(s) lost their engine")
    seed_set = {"seed_base": 2000, "pytest_exit_code": 1, "failed": [], "timed_out": [rows[0]["nodeid"]],
                "passed": 6, "clean": False, "time_s": 900.0}
    assert session._control_entry(seed_set)["reason"] == "not judged: 1 check(s) lost their engine to the timeout"


def test_a_mutant_whose_patched_function_moved_says_so_and_is_never_a_kill():
    gone = catalogue.Mutant("gone", "what", "why", lambda: None, ("json:dumps", "json.decoder:NoSuchDecoder.decode"))
    assert catalogue.moved(gone) == ("json.decoder:NoSuchDecoder.decode is not in this vLLM (AttributeError: module "
                                     "'json.decoder' has no attribute 'NoSuchDecoder')")
    assert catalogue.moved(catalogue.Mutant("here", "what", "why", lambda: None, ("json:dumps",))) is None
    entry = session._entry({"name": "gone", "killed_by": [], "survived": True, "fired": 0, "time_s": 0.0,
                            "moved": catalogue.moved(gone)})
    assert entry["outcome"] == "failed" and entry["reason"].startswith("not scored: the function it patches moved")


@pytest.mark.vllm
def test_every_mutant_fits_the_pinned_vllm():
    """What the mutants session asks the build under test before it runs a mutant."""
    out = subprocess.run([sys.executable, "-m", "specgate.vllmside.catalogue", *catalogue.MUTANTS], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == dict.fromkeys(catalogue.MUTANTS)


def test_each_mutants_checks_select_the_checks_meant_to_score_it():
    """A mutant is scored by the cpu_e2e checks its entry names (pytest -k): the greedy path's by
    the greedy checks, the random path's by sampling checks only; none selects nothing."""
    for expr in dict.fromkeys(m.checks for m in catalogue.CATALOGUE):
        found = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "-m", "e2e", "tests/e2e", "-k", expr], cwd=REPO_ROOT, capture_output=True, text=True)
        ids = [line for line in found.stdout.splitlines() if "::" in line]
        assert ids, f"-k {expr!r} selects no cpu_e2e check: {found.stdout[-500:]}"
        sampling = [i for i in ids if "test_sampling" in i]
        assert sampling == ([] if expr == "not test_sampling" else ids), expr
        if expr == catalogue.BONUS_CHECKS:      # its tokens are mostly undrafted ngram steps' (see the entry)
            assert "tests/e2e/test_sampling.py::test_sampling_distribution[ngram/greedy]" in ids, ids
            assert not [i for i in ids if "known_defect" in i or "release" in i], ids


@pytest.mark.parametrize("value", ["0", "many"])
def test_a_seed_set_count_below_one_is_one_line_of_bad_input(tmp_path, value):
    env = hermetic.env_without("SPECGATE_", "HF_")
    proc = subprocess.run([sys.executable, "-m", "specgate.sessions.mutants", "--seed-sets", value], cwd=REPO_ROOT,
                          env={**env, "SPECGATE_ARTIFACTS": str(tmp_path / "artifacts")},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("error:")]
    assert line.startswith("error: nox -s mutants -- argument --seed-sets:") and (value in line or "at least 1" in line)
    summary = read_valid(tmp_path / "artifacts" / "mutants" / "summary.json")
    assert summary["exit_code"] == 2 and summary["tests"] == []


@pytest.mark.vllm
def test_the_moved_probe_leaves_nothing_in_the_temp_dir_the_session_was_given(tmp_path, monkeypatch):
    """Its vLLM import creates <temp dir>/torchinductor_<user>: in the step's private temp dir,
    gone with the step (it was left in /tmp, 12-07)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with processes.session_tempdir():
        assert session._moved([catalogue.MUTANTS["ngram-wrong-offset"]]) == {"ngram-wrong-offset": None}
    assert list(tmp_path.iterdir()) == []
