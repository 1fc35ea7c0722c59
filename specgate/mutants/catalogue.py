"""The mutant catalogue: speculative-decoding faults a real vLLM change could introduce, each
installed by monkeypatching vLLM 0.32's CPU path inside the engine process (never the installed
files). `install(name)` runs in `python -m specgate.engine` before any engine starts, and only
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
    # cannot start an engine in this process (specgate.engine); so its class is patched from the
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
REJECTION_SAMPLE = "vllm.v1.sample.rejection_sampler:rejection_sample"
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
