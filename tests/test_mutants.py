"""The mutant catalogue and session logic that need no engine: every entry names a vLLM function
that exists in the installed vLLM with the arguments the patch relies on, the patches change
exactly what they say, nothing is patched unless a mutant is named, and the summary entries."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from contract import VALIDATOR

from specgate.manifest import REPO_ROOT
from specgate.mutants import MUTANT_VAR, catalogue, session


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
}

PROBE = """
import importlib, json, sys
from specgate.mutants import catalogue
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


def test_each_mutant_replaces_the_vllm_function_it_names_and_loads_no_numba():
    """In a fresh process (as in the engine child): each named function exists in the installed
    vLLM and install() replaces it; installing every mutant loads no llvmlite (numba), after
    which vLLM 0.32 CPU could not start an engine (specgate.engine). One process, one vLLM import."""
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


CHILD = """
import sys
import specgate.engine as engine
engine.main(sys.argv[1:])
print("catalogue-loaded" if "specgate.mutants.catalogue" in sys.modules else "catalogue-absent")
"""


@pytest.mark.parametrize("mutant", [None, "ngram-wrong-offset"])
def test_the_engine_child_installs_a_mutant_only_when_named(tmp_path, mutant):
    request = tmp_path / "request.json"
    request.write_text("[]")
    env = {k: v for k, v in os.environ.items() if k != MUTANT_VAR} | ({MUTANT_VAR: mutant} if mutant else {})
    out = subprocess.run([sys.executable, "-c", CHILD, str(request), str(tmp_path / "result.json")], cwd=REPO_ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == ("catalogue-loaded" if mutant else "catalogue-absent")


def _row(*tokens):
    return torch.tensor(tokens, dtype=torch.int32)


def test_accept_one_extra_emits_the_rejected_draft_then_the_targets_next_token():
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
    schema = {**VALIDATOR.schema["$defs"]["test"], "$defs": VALIDATOR.schema["$defs"]}
    for entry in (session._entry(killed), session._entry(unexercised)):
        assert not list(VALIDATOR.evolve(schema=schema).iter_errors(entry))
    assert "mutants" in VALIDATOR.schema["properties"]["session"]["enum"]


def test_a_mutant_whose_patched_function_moved_says_so_and_is_never_a_kill():
    gone = catalogue.Mutant("gone", "what", "why", lambda: None, ("json:dumps", "json.decoder:NoSuchDecoder.decode"))
    assert catalogue.moved(gone) == ("json.decoder:NoSuchDecoder.decode is not in this vLLM (AttributeError: module "
                                     "'json.decoder' has no attribute 'NoSuchDecoder')")
    assert catalogue.moved(catalogue.Mutant("here", "what", "why", lambda: None, ("json:dumps",))) is None
    entry = session._entry({"name": "gone", "killed_by": [], "survived": True, "fired": 0, "time_s": 0.0,
                            "moved": catalogue.moved(gone)})
    assert entry["outcome"] == "failed" and entry["reason"].startswith("not scored: the function it patches moved")


def test_every_mutant_fits_the_pinned_vllm():
    """What the mutants session asks the build under test before it runs a mutant."""
    out = subprocess.run([sys.executable, "-m", "specgate.mutants.catalogue", *catalogue.MUTANTS], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == dict.fromkeys(catalogue.MUTANTS)
