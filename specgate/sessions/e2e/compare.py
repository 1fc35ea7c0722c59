"""Output comparisons and per-position acceptance: pure functions over token ids, logprobs
and vLLM's per-request spec-decode metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specgate.vllmside import knownanswer


def acceptance_len(drafts: int, accepted: int) -> float:
    """Mean acceptance length as vLLM's tests compute it: 1 + accepted / drafts (1 without drafts)."""
    return 1.0 if drafts <= 0 else 1.0 + accepted / drafts


def token_mismatches(expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                     names: tuple[str, str] = ("expected", "got"), labels: Sequence[int] | None = None) -> list[str]:
    """One line per request whose token ids differ: where, and what each side has there.
    `labels`: the requests' numbers in the lines (default: their places in these lists)."""
    lines = []
    if len(expected) != len(got):
        return [f"{len(expected)} {names[0]} sequences vs {len(got)} {names[1]}"]
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        a, b = list(a), list(b)
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        lines.append(f"request {labels[i] if labels else i}: first difference at output position {at}: "
                     f"{names[0]} {a[at:at + 5]}, {names[1]} {b[at:at + 5]} (lengths {len(a)} vs {len(b)})")
    return lines


def logprobs_not_close(ref: Sequence[tuple[Sequence[int], Sequence[dict[int, float]]]],
                       got: Sequence[tuple[Sequence[int], Sequence[dict[int, float]]]],
                       names: tuple[str, str] = ("baseline", "spec")) -> list[str]:
    """vLLM's check_logprobs_close (tests/models/utils.py) with always_check_logprobs: at
    every sampled position each side's token must be among the other's top-k logprobs.
    Returns one line per request that breaks it (empty: close)."""
    lines = []
    for i, ((ids0, lps0), (ids1, lps1)) in enumerate(zip(ref, got, strict=False)):
        for pos, (t0, t1) in enumerate(zip(ids0, ids1, strict=False)):
            top0, top1 = lps0[pos] or {}, lps1[pos] or {}
            if t0 not in top1 or t1 not in top0:
                lines.append(f"request {i} position {pos}: {names[0]} token {t0} (top-k {sorted(top0)}), "
                             f"{names[1]} token {t1} (top-k {sorted(top1)})")
                break
    return lines


def max_logprob_gap(ref: Sequence[tuple[Sequence[int], Sequence[dict[int, float]]]],
                    got: Sequence[tuple[Sequence[int], Sequence[dict[int, float]]]]) -> float:
    """Largest |logprob difference| of the sampled token where both sides sampled the same one."""
    gap = 0.0
    for (ids0, lps0), (ids1, lps1) in zip(ref, got, strict=False):
        for pos, (t0, t1) in enumerate(zip(ids0, ids1, strict=False)):
            if t0 == t1 and lps0[pos] and lps1[pos] and t0 in lps0[pos] and t0 in lps1[pos]:
                gap = max(gap, abs(lps0[pos][t0] - lps1[pos][t0]))
    return gap


def expected_outputs(rule: str, prompts: Sequence[Sequence[int]], n: int, vocab: int) -> list[list[int]]:
    """A known-answer target's greedy output for every prompt (specgate.vllmside.knownanswer)."""
    return [knownanswer.continuation(rule, p, n, vocab) for p in prompts]


def expected_accepts(exact: bool, wrong_at: int, per_step_drafted: Sequence[int]) -> list[int]:
    """What each draft step must accept with successor drafts: all of its drafts where the
    answer is a successor chain (exact), else those before the known wrong position."""
    return [d if exact else min(d, wrong_at) for d in per_step_drafted]


@dataclass
class PositionReport:
    """Per-position acceptance of one request from its per-step drafted/accepted counts."""
    drafted: list[int] = field(default_factory=list)     # drafts that reached position p
    accepted: list[int] = field(default_factory=list)    # of those, accepted at position p
    rejections: list[tuple[int, int]] = field(default_factory=list)  # (step, first rejected position)


def positions(per_step_drafted: Sequence[int], per_step_accepted: Sequence[int], k: int) -> PositionReport:
    """Acceptance is a prefix: a step that accepted a of d drafts accepted positions 0..a-1
    and rejected position a (when a < d)."""
    report = PositionReport([0] * k, [0] * k)
    for step, (d, a) in enumerate(zip(per_step_drafted, per_step_accepted, strict=False)):
        for p in range(min(d, k)):
            report.drafted[p] += 1
            report.accepted[p] += p < a
        if a < d:
            report.rejections.append((step, a))
    return report


def first_step_fully_rejected(per_step_drafted: Sequence[int], per_step_accepted: Sequence[int]) -> bool:
    """The symptom of the 1-token-prompt defect: the first draft step accepted none of its drafts."""
    return bool(per_step_drafted) and per_step_drafted[0] > 0 and per_step_accepted[0] == 0
