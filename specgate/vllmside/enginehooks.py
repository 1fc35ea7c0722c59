"""What the engine process adds to vLLM for the sampling checks, only for the engines that ask:

- a draft recorder: the draft token ids the scheduler sends each request at each verification
  step (the acceptance check needs the rejected drafts too, which no output carries), and with
  probabilistic drafts the draft probabilities q the rejection sampler gets for them (acceptance
  is min(1, p / q) and recovery draws from max(0, p - q));
- runtime repairs of declared vLLM defects, so a build with the defect can still show what the
  checks catch. The one known: vLLM #55005, whose CPU `_expand_kernel_impl` hands the C++ op an
  int64 *copy* of a float32/int32 output, so sampled requests verify drafts with uninitialised
  temperatures, top-k and top-p. The repair does the expansion in torch, into the caller's
  tensor (what PR #55006 proposes).

Both are installed once in the engine host (before any engine starts, so vLLM's CPU platform
registers the wrapped kernel) and act only while `active(...)` says so for the running phase.

Whether the build under test has a declared defect is decided by its probe (`probe_defects`),
on that build, in milliseconds: a repair is applied only where the probe finds its defect, so a
build that fixed it is tested as built.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

REPAIRS = ("vllm-55005",)
PRESENT, FIXED = "present", "fixed"     # a probe's verdicts; anything else is "changed: <what it saw>"
SENTINEL = -7

_state: dict[str, Any] = {"record": False, "repair": None}
_order: list[str] = []                                  # request ids, in the order first scheduled
_drafts: dict[str, list[tuple[int, list[int]]]] = defaultdict(list)   # (tokens computed, drafts) per step
_draft_q: dict[str, list[list[list[list[float]]] | None]] = defaultdict(list)   # q per step (None: no q)
Q_FLOOR = 1e-6   # q entries kept per draft position: the drafted token's, and every one at least this
_installed: set[str] = set()


def install(*, record: bool, repairs: set[str]) -> None:
    """Wrap what the requested hooks need (once per process)."""
    unknown = repairs - set(REPAIRS)
    if unknown:
        raise ValueError(f"unknown repair(s) {', '.join(sorted(unknown))} (known: {', '.join(REPAIRS)})")
    if record and "record" not in _installed:
        _install_recorder()
    if "vllm-55005" in repairs and "vllm-55005" not in _installed:
        _install_expand_repair()


@contextmanager
def active(*, record: bool, repair: str | None) -> Iterator[None]:
    """Turn the hooks on for one engine; the recorder starts empty."""
    _order.clear()
    _drafts.clear()
    _draft_q.clear()
    _state.update(record=record, repair=repair)
    try:
        yield
    finally:
        _state.update(record=False, repair=None)


def drafts_by_request() -> list[list[tuple[int, list[int]]]]:
    """Per request (in submission order), each step it was verified at: the number of its tokens
    (prompt and output) computed before that step, and the drafts."""
    return [_drafts.get(rid, []) for rid in _order]


def draft_q_by_request() -> list[list[list[list[list[float]]] | None]]:
    """Per request (as drafts_by_request), per verified step: None where the rejection sampler got
    no draft probabilities (greedy drafts: q one-hot), else per draft position the [token, q]
    pairs of the drafted token and of every token with q >= Q_FLOOR."""
    return [_draft_q.get(rid, []) for rid in _order]


def _install_recorder() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    execute = CPUModelRunner.execute_model
    draft_probs = CPUModelRunner._get_spec_decode_draft_probs

    def recording(self, scheduler_output, *args, **kwargs):
        if _state["record"]:
            _order.extend(r.req_id for r in scheduler_output.scheduled_new_reqs)
            cached = scheduler_output.scheduled_cached_reqs      # drafts only ever go to running requests
            computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            for rid, tokens in scheduler_output.scheduled_spec_decode_tokens.items():
                if tokens:
                    _drafts[rid].append((computed[rid], [int(t) for t in tokens]))
                    _draft_q[rid].append(None)   # filled in below if the sampler gets q this step
        return execute(self, scheduler_output, *args, **kwargs)

    def recording_q(self, spec_decode_metadata):
        q = draft_probs(self, spec_decode_metadata)
        if _state["record"] and q is not None:
            rows = _sparse_rows(q, spec_decode_metadata.draft_token_ids)
            start = 0
            for rid, n in zip(self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens, strict=False):
                if n:   # q's rows: the drafted positions of the requests with drafts, in batch order
                    _draft_q[rid][-1] = rows[start:start + n]
                    start += n
        return q

    CPUModelRunner.execute_model = recording
    CPUModelRunner._get_spec_decode_draft_probs = recording_q
    _installed.add("record")


def _sparse_rows(q: Any, drafted: Any) -> list[list[list[float]]]:
    """Each row of q ([drafted tokens, vocab]) as [token, q] pairs: its drafted token's and every
    one of at least Q_FLOOR."""
    import torch

    keep = q >= Q_FLOOR
    keep[torch.arange(len(drafted)), drafted.long()] = True
    rows: list[list[list[float]]] = [[] for _ in range(len(drafted))]
    for (row, token), value in zip(keep.nonzero().tolist(), q[keep].tolist(), strict=True):
        rows[row].append([token, value])
    return rows


def expand_in_torch(output, input_val, cu_num_tokens, replace_from, replace_to):
    """vLLM #55005's repair: what the released `_expand_kernel_impl` should do, in torch and
    into the caller's tensor (PR #55006). Self-contained, so tests/wheels.py can put this very
    source into a copy of the vLLM wheel: the repaired build."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output.copy_(torch.repeat_interleave(values, counts))


def _install_expand_repair() -> None:
    from vllm.utils import cpu_triton_utils

    released = cpu_triton_utils._expand_kernel_impl

    def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        if _state["repair"] != "vllm-55005":
            return released(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
        return expand_in_torch(output, input_val, cu_num_tokens, replace_from, replace_to)

    cpu_triton_utils._expand_kernel_impl = expand
    _installed.add("vllm-55005")


def probe_55005() -> str:
    """vLLM #55005 on this build: expand_batch_to_tokens (what the rejection sampler expands
    temperatures and top-k with), after vLLM's CPU platform registered its kernel overrides as
    a worker does, on a sentinel-filled output of each dtype the sampler expands (float32,
    int32). PRESENT: an output still holds the sentinel; FIXED: both are the expansion."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()
    cu_num_tokens = torch.tensor([1, 3, 4], dtype=torch.int32)
    new_empty = torch.Tensor.new_empty
    # expand_batch_to_tokens allocates its output with new_empty: filled here, an output the
    # kernel never writes is seen, not read as whatever the memory held.
    torch.Tensor.new_empty = lambda self, *a, **k: new_empty(self, *a, **k).fill_(SENTINEL)
    inputs = [torch.tensor([0.5, 0.0, 3.0]), torch.tensor([2, 0, 3], dtype=torch.int32)]
    try:
        seen = [rejection_sampler.expand_batch_to_tokens(x, cu_num_tokens, 4, replace_from=0, replace_to=2)
                for x in inputs]
    finally:
        torch.Tensor.new_empty = new_empty
    wanted = []
    for x in inputs:
        wanted.append(torch.empty(4, dtype=x.dtype))
        expand_in_torch(wanted[-1], x, cu_num_tokens, 0, 2)
    if any(bool((out == SENTINEL).any()) for out in seen):
        return PRESENT
    if all(torch.equal(out, want) for out, want in zip(seen, wanted, strict=True)):
        return FIXED
    return f"changed: expand_batch_to_tokens gave {[out.tolist() for out in seen]}, not {[w.tolist() for w in wanted]}"


PROBES = {"vllm-55005": probe_55005}


def probe_defects() -> dict[str, str]:
    """Each declared defect's probe verdict on this build, by the name of its repair; a probe
    that cannot run here (vLLM moved what it calls) says so, and nothing is repaired for it."""
    verdicts = {}
    for name, probe in PROBES.items():
        try:
            verdicts[name] = probe()
        except Exception as exc:
            verdicts[name] = f"unknown: the probe could not run on this vLLM ({type(exc).__name__}: {exc})"
    return verdicts
