"""The mutant catalogue: speculative-decoding faults a real vLLM change could introduce, each
installed by monkeypatching vLLM 0.32's CPU path inside the engine process (never the installed
files). `install(name)` runs in `python -m specgate.vllmside.engine` before any engine starts, and only
when the session names a mutant. Every patch sits outside the torch.compile'd model graph (the
model runner's inputs, the attention metadata, the rejection sampler, the proposers), so the
compiled artifacts a mutant run shares with normal runs are the unpatched ones.

Each patch counts how often it changed something (`take_fired`): a mutant that never fires
was not exercised, and its survival would say nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# A verification step runs the target over a bonus token plus k <= 7 drafts per request.
VERIFY_BLOCK_MAX = 8
PAD_SLOT = -1                 # vLLM's padding slot: the KV write skips it
PLACEHOLDER = -1              # the rejection sampler's "no token here"

_fired = 0


def _fire(times: int = 1) -> None:
    global _fired
    _fired += times


def take_fired() -> int:
    """How often the installed mutant changed something since the last call."""
    global _fired
    fired, _fired = _fired, 0
    return fired


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    why_real: str
    install: Callable[[], None]
    patches: tuple[str, ...]    # "module:Attribute.path" of what install() replaces in vLLM
    checks: str = "not test_sampling"   # the cpu_e2e checks that score it (pytest -k): the greedy ones here


# The random path's faults are scored by the sampling checks of both eagle3 cases (greedy drafts
# and probabilistic ones: the kernels' two branches); draws-for-undrafted needs ngram's requests
# that never get a draft.
SAMPLING_CHECKS = "test_sampling and eagle3-v1 and not test_sampling_release"
UNDRAFTED_CHECKS = "test_sampling_undrafted"
# Every token of a step without drafts is a bonus token, and ngram rarely drafts at T > 0; on
# eagle3 a bonus token is emitted only after k accepted drafts (48 of 7630 steps measured).
BONUS_CHECKS = f"{SAMPLING_CHECKS} or test_sampling and ngram and not test_sampling_release and not known_defect"


def moved(mutant: Mutant) -> str | None:
    """Why the mutant cannot be installed on this vLLM (what it patches moved or went), or None.
    Such a mutant is not a kill and not a survivor: the catalogue no longer fits the build."""
    import importlib

    for target in mutant.patches:
        module, _, path = target.partition(":")
        try:
            found: Any = importlib.import_module(module)
            for name in path.split("."):
                found = getattr(found, name)
        except (ImportError, AttributeError) as exc:
            return f"{target} is not in this vLLM ({type(exc).__name__}: {exc})"
    return None


# --------------------------------------------------------------------------- target-side verification

def _noncausal_verify() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    build = CPUAttentionMetadataBuilder.build

    def patched(self, common_prefix_len, common_attn_metadata, fast_build=False):
        meta = common_attn_metadata
        if meta.causal is True and 1 < meta.max_query_len <= VERIFY_BLOCK_MAX:
            meta = dataclasses.replace(meta, causal=False)
            _fire()
        return build(self, common_prefix_len, meta, fast_build)

    CPUAttentionMetadataBuilder.build = patched


def _verify_blocks(runner: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Iterator[tuple[int, int, int]]:
    """(first token index, tokens, drafts) of every request the step verifies drafts for."""
    start = 0
    drafts_by_req = scheduler_output.scheduled_spec_decode_tokens
    for index, count in enumerate(num_scheduled_tokens.tolist()):
        drafts = len(drafts_by_req.get(runner.input_batch.req_ids[index], ()))
        if drafts:
            yield start, count, drafts
        start += count


def _after_prepare_inputs(change: Callable[[Any, int, int, int], None]) -> None:
    """Run `change(runner, start, tokens, drafts)` on every verification block once the model
    runner has computed the step's positions and KV slot mapping (outside the compiled graph)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    prepare = CPUModelRunner._prepare_inputs

    def patched(self, scheduler_output, num_scheduled_tokens):
        out = prepare(self, scheduler_output, num_scheduled_tokens)
        for start, tokens, drafts in _verify_blocks(self, scheduler_output, num_scheduled_tokens):
            change(self, start, tokens, drafts)
            _fire()
        return out

    CPUModelRunner._prepare_inputs = patched


def _slot_mappings(runner: Any) -> list[Any]:
    return [table.slot_mapping.gpu for table in runner.input_batch.block_table.block_tables]


def _shift_draft_positions(runner: Any, start: int, tokens: int, drafts: int) -> None:
    runner.positions[start + tokens - drafts:start + tokens] += 1


def _skip_first_kv_write(runner: Any, start: int, tokens: int, drafts: int) -> None:
    for slots in _slot_mappings(runner):
        slots[start] = PAD_SLOT


def _shift_draft_slots(runner: Any, start: int, tokens: int, drafts: int) -> None:
    for slots in _slot_mappings(runner):
        slots[start + tokens - drafts:start + tokens] += 1


# --------------------------------------------------------------------------- the rejection sampler

def _after_rejection(change: Callable[..., bool]) -> None:
    """Run `change(row, drafts, target_logits, bonus)` on every request's output row of the
    rejection sampler ([k + 1] token ids, -1 after the last emitted one)."""
    from vllm.v1.sample import rejection_sampler

    sample = rejection_sampler.rejection_sample

    def patched(draft_token_ids, num_draft_tokens, *args, **kwargs):
        out = sample(draft_token_ids, num_draft_tokens, *args, **kwargs)
        target_logits, bonus = args[3], args[4]
        start = 0
        for index, n in enumerate(num_draft_tokens):
            if n and change(out[index], draft_token_ids[start:start + n], target_logits[start:start + n],
                            bonus[index, 0]):
                _fire()
            start += n
        return out

    rejection_sampler.rejection_sample = patched


def _emitted(row: Any) -> int:
    return int((row != PLACEHOLDER).sum())


def _accept_one_extra(row: Any, drafts: Any, target_logits: Any, bonus: Any) -> bool:
    """The first rejected draft is emitted as if accepted; the target's token after it follows."""
    accepted = _emitted(row) - 1
    if accepted >= len(drafts):
        return False
    row[accepted] = drafts[accepted]
    row[accepted + 1] = target_logits[accepted + 1].argmax() if accepted + 1 < len(drafts) else bonus
    return True


def _drop_bonus(row: Any, drafts: Any, target_logits: Any, bonus: Any) -> bool:
    """A step that accepted every draft loses its bonus token."""
    if _emitted(row) != len(drafts) + 1:
        return False
    row[len(drafts)] = PLACEHOLDER
    return True


# --------------------------------------------------------------------------- random-sampling verification

# A request that samples (temperature > 0) verifies draft i by accepting it when u <= p/q (u uniform,
# p the target's and q the drafter's probability of the draft; q = 1 for drafts without
# probabilities), replaces the first rejected one by a draw from the residual max(0, p - q) (the
# draft itself excluded when q is one-hot), and appends a bonus token sampled from p when all pass.

def _sampling_mutant(install: Callable[[], None]) -> Callable[[], None]:
    """`install`, firing only outside the engine's profile run."""
    def installed() -> None:
        _uncounted_in_profile_runs()
        install()

    return installed


def _uncounted_in_profile_runs() -> None:
    """The CPU worker's warm-up profile run (vLLM's _dummy_sampler_run, in every engine that
    compiles, as specgate's do) sends dummy requests at temperature 0.5 through the rejection
    sampler: a change there is discarded and says nothing about the checks, so it does not count."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    run = CPUModelRunner._dummy_sampler_run

    def patched(self, *args, **kwargs):
        global _fired
        fired = _fired
        try:
            return run(self, *args, **kwargs)
        finally:
            _fired = fired

    CPUModelRunner._dummy_sampler_run = patched


def _uniform_constant() -> None:
    from vllm.v1.sample import rejection_sampler

    generate = rejection_sampler.generate_uniform_probs

    def patched(num_tokens, num_draft_tokens, generators, device):
        # Drawn as before, so the seeded streams stay as they were: only the acceptance test changes.
        uniform = generate(num_tokens, num_draft_tokens, generators, device)
        if num_tokens:
            uniform.fill_(0.5)
            _fire()
        return uniform

    rejection_sampler.generate_uniform_probs = patched


def _draws_for_undrafted() -> None:
    import torch
    from vllm.v1.sample import rejection_sampler

    generate = rejection_sampler.generate_uniform_probs

    def patched(num_tokens, num_draft_tokens, generators, device):
        for index, generator in generators.items():
            if not num_draft_tokens[index]:
                torch.empty(1, dtype=torch.float64, device=device).uniform_(generator=generator)
                _fire()
        return generate(num_tokens, num_draft_tokens, generators, device)

    rejection_sampler.generate_uniform_probs = patched


def _generators_ignored() -> None:
    from vllm.v1.sample import rejection_sampler

    generate, recover = rejection_sampler.generate_uniform_probs, rejection_sampler.sample_recovered_tokens

    def uses_one(num_draft_tokens: list[int], generators: dict[int, Any]) -> bool:
        return any(num_draft_tokens[index] for index in generators)

    def uniform(num_tokens, num_draft_tokens, generators, device):
        if uses_one(num_draft_tokens, generators):
            generators = {}
            _fire()
        return generate(num_tokens, num_draft_tokens, generators, device)

    def recovered(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                  sampling_metadata, *args, **kwargs):
        if uses_one(num_draft_tokens, sampling_metadata.generators):
            sampling_metadata = dataclasses.replace(sampling_metadata, generators={})
            _fire()
        return recover(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                       sampling_metadata, *args, **kwargs)

    rejection_sampler.generate_uniform_probs = uniform
    rejection_sampler.sample_recovered_tokens = recovered


def _constrained_with(change: Callable[[Any], dict[str, Any]]) -> None:
    """Run apply_sampling_constraints (temperature, top-k, top-p of the drafted positions' target
    logits) on sampling metadata with the fields `change(sampling_metadata)` returns replaced."""
    from vllm.v1.sample import rejection_sampler

    constrain = rejection_sampler.apply_sampling_constraints

    def patched(logits, cu_num_draft_tokens, sampling_metadata):
        fields = {} if sampling_metadata.all_greedy else change(sampling_metadata)
        if fields:
            sampling_metadata = dataclasses.replace(sampling_metadata, **fields)
            _fire()
        return constrain(logits, cu_num_draft_tokens, sampling_metadata)

    rejection_sampler.apply_sampling_constraints = patched


def _unit_temperature(sampling_metadata: Any) -> dict[str, Any]:
    temperature = sampling_metadata.temperature
    # Greedy rows (0) are verified at temperature 1 anyway; rows at 1 do not change.
    if not bool(((temperature != 0) & (temperature != 1)).any()):
        return {}
    return {"temperature": temperature.new_ones(temperature.shape)}


def _no_top_k_top_p(sampling_metadata: Any) -> dict[str, Any]:
    if sampling_metadata.top_k is None and sampling_metadata.top_p is None:
        return {}
    return {"top_k": None, "top_p": None}


def _around_cpu_kernel(name: str, change: Callable[[dict[str, Any]], bool]) -> None:
    """Let `change(arguments)` edit the arguments of every call of the CPU C++ shim `name` (True:
    it changed them). vLLM's CPU platform registers the shims in place of the Triton kernels at
    each LLM(...) init, reading these attributes then, so the wrapper is what runs."""
    from vllm.utils import cpu_triton_utils

    kernel = getattr(cpu_triton_utils, name)
    signature = inspect.signature(kernel)

    def patched(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if change(bound.arguments):
            _fire()
        return kernel(*bound.args, **bound.kwargs)

    setattr(cpu_triton_utils, name, patched)


def _swap_draft_and_target(arguments: dict[str, Any]) -> bool:
    if arguments["draft_probs"] is None:
        return False
    arguments["draft_probs"], arguments["target_probs"] = arguments["target_probs"], arguments["draft_probs"]
    return True


def _recover_from_target(arguments: dict[str, Any]) -> bool:
    """Probabilistic drafts: the residual max(0, p - 0) is p."""
    if arguments["draft_probs"] is None:
        return False
    arguments["draft_probs"] = arguments["draft_probs"].new_zeros(arguments["draft_probs"].shape)
    return True


def _recover_as_one_hot(arguments: dict[str, Any]) -> bool:
    """Probabilistic drafts recovered as greedy ones are: p without the draft, not max(0, p - q)."""
    if arguments["draft_probs"] is None or arguments.get("NO_DRAFT_PROBS"):
        return False
    arguments["NO_DRAFT_PROBS"] = True
    return True


def _keep_rejected_draft(arguments: dict[str, Any]) -> bool:
    """Drafts without probabilities: recovery from p with the draft no longer masked out."""
    if arguments["draft_probs"] is not None:
        return False
    arguments["draft_probs"] = arguments["target_probs"].new_zeros(arguments["target_probs"].shape)
    arguments["NO_DRAFT_PROBS"] = False
    return True


def _bonus_argmax() -> None:
    from vllm.v1.sample.sampler import Sampler

    forward = Sampler.forward

    def patched(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        # Taken before sampling, which may scale the logits in place. Only the rejection sampler
        # asks for a bonus token.
        argmax = logits.argmax(dim=-1) if predict_bonus_token and not sampling_metadata.all_greedy else None
        out = forward(self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)
        if argmax is not None:
            sampled = out.sampled_token_ids[:, 0]
            changed = (sampling_metadata.temperature > 0) & (sampled != argmax)
            sampled[changed] = argmax[changed].to(sampled.dtype)
            _fire(int(changed.sum()))
        return out

    Sampler.forward = patched


# --------------------------------------------------------------------------- the proposers

def _shift_draft_hidden_states() -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    propose = SpecDecodeBaseProposer.propose
    signature = inspect.signature(propose)

    def patched(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if self.method != "dflash":           # DFlash's drafts read the target's states through fc only
            states = bound.arguments["target_hidden_states"]
            bound.arguments["target_hidden_states"] = states.roll(1, dims=0)
            _fire()
        return propose(*bound.args, **bound.kwargs)

    SpecDecodeBaseProposer.propose = patched


def _ngram_wrong_offset() -> None:
    # Importing vLLM's ngram_proposer here would load numba (llvmlite), after which vLLM 0.32 CPU
    # cannot start an engine in this process (specgate.vllmside.engine); so its class is patched from the
    # first ngram engine's runner, which has imported it already.
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    propose_drafts = CPUModelRunner.propose_draft_token_ids

    def patched(self, *args, **kwargs):
        if self.speculative_config.method == "ngram":
            _short_ngram_context(type(self.drafter))
        return propose_drafts(self, *args, **kwargs)

    CPUModelRunner.propose_draft_token_ids = patched


def _short_ngram_context(proposer: Any) -> None:
    """Make the ngram proposer class search a context one token short (once per class)."""
    if getattr(proposer, "_specgate_mutant", False):
        return
    propose = proposer.propose

    def patched(self, num_speculative_tokens, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs):
        _fire()
        # A copy: the runner's own counts must stay right.
        return propose(self, num_speculative_tokens, sampled_token_ids, num_tokens_no_spec - 1, token_ids_cpu,
                       *args, **kwargs)

    proposer.propose = patched
    proposer._specgate_mutant = True


CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
CPU_RUNNER = "vllm.v1.worker.cpu_model_runner"
PREPARE_INPUTS = f"{CPU_RUNNER}:CPUModelRunner._prepare_inputs"
REJECTION_SAMPLER = "vllm.v1.sample.rejection_sampler"
REJECTION_SAMPLE = f"{REJECTION_SAMPLER}:rejection_sample"
CPU_KERNELS = "vllm.utils.cpu_triton_utils"
PROFILE_RUN = f"{CPU_RUNNER}:CPUModelRunner._dummy_sampler_run"
CATALOGUE = (
    Mutant("noncausal-verify",
           "attention is non-causal inside every query block of 2..8 tokens (the verification step)",
           "the CPU backend takes causal per batch, and DFlash's non-causal draft attention runs through "
           "the same builder: one flag applied to the wrong block lets draft positions see later drafts",
           _noncausal_verify, (f"{CPU_ATTN}:CPUAttentionMetadataBuilder.build",)),
    Mutant("draft-positions-shifted",
           "the draft tokens of a verification block get positions one too high (RoPE), KV slots unchanged",
           "positions are num_computed_tokens plus an offset per token; an off-by-one after a rejection "
           "rotates every verified draft's query and key wrongly",
           lambda: _after_prepare_inputs(_shift_draft_positions), (PREPARE_INPUTS,)),
    Mutant("kv-not-rewritten",
           "the KV write of each verification block's first token is skipped, so the slot keeps what a "
           "rejected draft (or nothing) left there",
           "rolling back rejected drafts is only correct if the next step rewrites their slots; a runner "
           "that treats written slots as filled serves the rejected draft's keys",
           lambda: _after_prepare_inputs(_skip_first_kv_write), (PREPARE_INPUTS,)),
    Mutant("kv-slots-shifted",
           "the drafts' KV is written one slot after the slot of their position",
           "slot mapping is block_table[pos // block_size] * block_size + pos % block_size per token; an "
           "off-by-one for draft tokens puts their keys where the next token expects its own",
           lambda: _after_prepare_inputs(_shift_draft_slots), (PREPARE_INPUTS,)),
    Mutant("accept-one-extra",
           "the rejection sampler emits the first rejected draft as accepted, then the target's next token",
           "an off-by-one in the accepted-prefix length (<= instead of <) accepts one draft the target "
           "rejected",
           lambda: _after_rejection(_accept_one_extra), (REJECTION_SAMPLE,)),
    Mutant("bonus-dropped",
           "a step that accepts every draft emits no bonus token",
           "the bonus token is sampled separately (bonus_logits_indices) and appended; losing that append "
           "costs a token per fully accepted step and shifts acceptance counts",
           lambda: _after_rejection(_drop_bonus), (REJECTION_SAMPLE,)),
    Mutant("draft-hidden-shifted",
           "the EAGLE-3/MTP drafter gets the target hidden states shifted by one token",
           "the drafter pairs token i+1 with hidden state i; an off-by-one in the hidden-state indices "
           "after rejections (prepare_inputs) feeds it the wrong position",
           _shift_draft_hidden_states, ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose",)),
    Mutant("ngram-wrong-offset",
           "the ngram proposer searches a context one token short of the real one",
           "num_tokens_no_spec is the length before drafts; using a stale or off-by-one length makes "
           "prompt lookup match and propose from the wrong offset",
           _ngram_wrong_offset, (f"{CPU_RUNNER}:CPUModelRunner.propose_draft_token_ids",
                                 "vllm.v1.spec_decode.ngram_proposer:NgramProposer.propose")),
    Mutant("uniform-constant",
           "the rejection sampler's uniform draws are 0.5 at every drafted position of a sampling request",
           "the draws are made per request with its own generator; a refactor that keeps the buffer persistent "
           "and fills it once (or leaves a torch.full placeholder) tests every draft against a constant u",
           _sampling_mutant(_uniform_constant), (f"{REJECTION_SAMPLER}:generate_uniform_probs", PROFILE_RUN),
           SAMPLING_CHECKS),
    Mutant("draft-target-swapped",
           "with draft probabilities, the acceptance test gets the target's as the draft's and vice versa",
           "the random-sample kernel takes draft_probs then target_probs, both [tokens, vocab]; passing them "
           "in the wrong order raises nothing and accepts with q/p instead of p/q",
           _sampling_mutant(lambda: _around_cpu_kernel("_rejection_random_sample_kernel_impl",
                                                       _swap_draft_and_target)),
           (f"{CPU_KERNELS}:_rejection_random_sample_kernel_impl", PROFILE_RUN), SAMPLING_CHECKS),
    Mutant("recovered-from-target",
           "with draft probabilities, a rejected draft's replacement is drawn from p, not max(0, p - q)",
           "the residual needs the draft's probabilities at recovery too; a refactor that zeroes or drops "
           "draft_probs there (it is optional) over-samples the tokens the drafter already proposed",
           _sampling_mutant(lambda: _around_cpu_kernel("_sample_recovered_tokens_kernel_impl",
                                                       _recover_from_target)),
           (f"{CPU_KERNELS}:_sample_recovered_tokens_kernel_impl", PROFILE_RUN), SAMPLING_CHECKS),
    Mutant("recovered-as-one-hot",
           "with draft probabilities, a rejected draft's replacement is drawn from p without the draft, "
           "as for greedy drafts, not from max(0, p - q)",
           "NO_DRAFT_PROBS is set from whether the batch carries draft probabilities; a flag taken from the "
           "drafting method's default (greedy) or left over from an earlier batch recovers as if q were "
           "one-hot, which only a spread q tells apart",
           _sampling_mutant(lambda: _around_cpu_kernel("_sample_recovered_tokens_kernel_impl",
                                                       _recover_as_one_hot)),
           (f"{CPU_KERNELS}:_sample_recovered_tokens_kernel_impl", PROFILE_RUN), SAMPLING_CHECKS),
    Mutant("rejected-draft-not-excluded",
           "without draft probabilities, a rejected draft's replacement is drawn from p with the draft included",
           "q is one-hot on such a draft, so the residual is p without it (the NO_DRAFT_PROBS mask); a kernel "
           "that drops the mask or passes zeros for q lets a rejected draft come back as its own replacement",
           _sampling_mutant(lambda: _around_cpu_kernel("_sample_recovered_tokens_kernel_impl",
                                                       _keep_rejected_draft)),
           (f"{CPU_KERNELS}:_sample_recovered_tokens_kernel_impl", PROFILE_RUN), SAMPLING_CHECKS),
    Mutant("bonus-argmax",
           "the bonus token of a sampling request is the argmax of its bonus logits instead of a sample",
           "the bonus token is sampled by a separate sampler call (predict_bonus_token); taking it from the "
           "target's argmax as the greedy path does makes every fully accepted step end greedily",
           _sampling_mutant(_bonus_argmax), ("vllm.v1.sample.sampler:Sampler.forward", PROFILE_RUN), BONUS_CHECKS),
    Mutant("temperature-not-applied",
           "the drafted positions' target logits are verified at temperature 1 (top-k and top-p still applied)",
           "temperatures are expanded per drafted token (expand_batch_to_tokens, cf. #55005) apart from the "
           "bonus path; losing that division verifies the drafts against p at temperature 1",
           _sampling_mutant(lambda: _constrained_with(_unit_temperature)),
           (f"{REJECTION_SAMPLER}:apply_sampling_constraints", PROFILE_RUN), SAMPLING_CHECKS),
    Mutant("top-k-top-p-not-applied",
           "the drafted positions' target logits are verified without top-k and top-p (temperature applied)",
           "spec decode once left top-k/top-p to the bonus token (the RejectionSampler docstring still says "
           "so); a path that filters only the bonus verifies drafts against p with tokens the filter removes",
           _sampling_mutant(lambda: _constrained_with(_no_top_k_top_p)),
           (f"{REJECTION_SAMPLER}:apply_sampling_constraints", PROFILE_RUN), SAMPLING_CHECKS),
    Mutant("generators-ignored",
           "seeded requests' uniform and recovery draws come from the global RNG, not their generators",
           "generators are keyed by batch index in sampling_metadata; dropping the dict (or keying it by "
           "request id after a batch reorder) verifies seeded requests unseeded, so a seed no longer reproduces",
           _sampling_mutant(_generators_ignored), (f"{REJECTION_SAMPLER}:generate_uniform_probs",
                                                  f"{REJECTION_SAMPLER}:sample_recovered_tokens", PROFILE_RUN),
           SAMPLING_CHECKS),
    Mutant("draws-for-undrafted",
           "a seeded request with no drafts in a step still takes one uniform draw from its generator",
           "the n == 0 skip in generate_uniform_probs keeps a seed's stream independent of drafting; a "
           "vectorised draw of max(n, 1) per request advances it anyway, so outputs depend on the batch",
           _sampling_mutant(_draws_for_undrafted), (f"{REJECTION_SAMPLER}:generate_uniform_probs", PROFILE_RUN),
           UNDRAFTED_CHECKS),
)
MUTANTS = {m.name: m for m in CATALOGUE}


def install(name: str) -> None:
    """Patch vLLM in this process with the named mutant (an unknown name is an error)."""
    try:
        mutant = MUTANTS[name]
    except KeyError:
        raise ValueError(f"unknown mutant {name!r} (known: {', '.join(MUTANTS)})") from None
    mutant.install()


if __name__ == "__main__":   # the mutants session asks the build under test, in its own process
    import json
    import sys

    print(json.dumps({name: moved(MUTANTS[name]) for name in sys.argv[1:]}))
