"""Speculative sampling at temperature > 0, judged against an exact oracle.

The oracle is the theorem behind speculative sampling (Leviathan et al. 2023; Chen et al.
2023): whatever the drafts, the tokens a correct implementation emits follow the target's
distribution. The sampling targets (fixtures with `answer_logits`) make that distribution
known at every position: after prefix x the target's logits are answer_logits[j] on
a + j, a = knownanswer's greedy answer for x, and 0 elsewhere. So each emitted token's
offset j = token - a is, under a correct implementation, an independent draw from
softmax(answer_logits / T), truncated by top-k / top-p. And a draft d the target verifies
is accepted with probability min(1, p(d) / q(d)), which is p(d) for the one-hot drafts the
successor drafters produce (greedy drafts, or probabilistic ones whose own distribution is
one-hot), so per-position acceptance is known too.

Tests here are chi-square tests (scipy); each rejects at p-value < alpha (the false-alarm
probability, 1e-6 in the manifest). The power against a total-variation shift `tv` is the
noncentral chi-square tail at the least favourable alternative of that size (the sample size
is chosen so that this is >= the manifest's power). Stdlib at import: scipy loads on use.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specgate.vllmside import knownanswer

OFF_SUPPORT = "other"      # a token outside a + 0 .. a + len(answer_logits) - 1


@dataclass(frozen=True)
class Design:
    """What one request samples from: the target's answer logits and its sampling parameters."""
    answer_logits: tuple[float, ...]
    vocab: int
    temperature: float
    top_k: int = 0            # 0: off (vLLM's -1)
    top_p: float = 1.0

    def logits(self) -> list[float]:
        """The full-vocabulary logits over offsets 0 .. vocab - 1 (answer first)."""
        return [*self.answer_logits, *[0.0] * (self.vocab - len(self.answer_logits))]

    def probs(self) -> tuple[list[float], float]:
        """(probabilities of offsets 0 .. K-1, probability of every other token together)
        after temperature, top-k and top-p, the way vLLM's sampler applies them."""
        scaled = [x / self.temperature for x in self.logits()]
        top = max(scaled)
        weights = [math.exp(x - top) for x in scaled]
        keep = list(range(self.vocab))
        if self.top_k:
            keep = sorted(keep, key=lambda i: -weights[i])[:self.top_k]
        if self.top_p < 1.0:
            total = sum(weights[i] for i in keep)
            ranked, mass = sorted(keep, key=lambda i: -weights[i]), 0.0
            keep = []
            for i in ranked:          # the smallest head whose mass reaches top_p
                keep.append(i)
                mass += weights[i] / total
                if mass >= self.top_p:
                    break
        total = sum(weights[i] for i in keep)
        k = len(self.answer_logits)
        probs = [weights[i] / total if i in keep else 0.0 for i in range(k)]
        return probs, sum(weights[i] for i in keep if i >= k) / total

    def raw_logprobs(self) -> list[float]:
        """log softmax of the raw logits (T = 1, no truncation): what vLLM returns as logprobs."""
        logits = self.logits()
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        return [x - norm for x in self.answer_logits]


def answer(prefix: Sequence[int], vocab: int) -> int:
    """The sampling target's offset-0 token after `prefix` (its greedy answer)."""
    return knownanswer.continuation(knownanswer.CONTEXT_RULE, prefix, 1, vocab)[0]


def offsets(prompt: Sequence[int], tokens: Sequence[int], vocab: int, k: int) -> list[int | str]:
    """Each emitted token's offset from the answer at its position (OFF_SUPPORT beyond k - 1)."""
    seq, out = list(prompt), []
    for token in tokens:
        j = (token - answer(seq, vocab)) % vocab
        out.append(j if j < k else OFF_SUPPORT)
        seq.append(token)
    return out


def histogram(values: Sequence[int | str], k: int) -> tuple[list[int], int]:
    return [sum(v == j for v in values) for j in range(k)], sum(v == OFF_SUPPORT for v in values)


MAX_EXACT = 16      # cells up to which least_favourable tries every split


def _least_favourable_split(support: Sequence[float], tv: float) -> tuple[float, int]:
    """(noncentrality per sample, gaining cells as a bit mask) of the hardest split (least_favourable)."""
    best = (math.inf, 0)
    for mask in range(1, 2 ** len(support) - 1):
        gain = sum(p for i, p in enumerate(support) if mask >> i & 1)
        lose = 1.0 - gain
        if tv <= lose:
            best = min(best, (tv * tv * (1 / gain + 1 / lose), mask))
    return best


def least_favourable(probs: Sequence[float], tv: float) -> float:
    """min over distributions q at total variation `tv` from p of sum (q - p)^2 / p: the
    chi-square noncentrality per sample of the hardest shift of that size to see. For a
    fixed split of the support into gaining and losing sets A and B the minimum moves the
    mass in proportion to p within each: tv^2 (1 / P(A) + 1 / P(B)). Beyond MAX_EXACT cells
    the splits are too many to try, and 4 tv^2 (P(A) = 1/2, the least any split gives) is
    used: a power computed from it understates the true one, never overstates it."""
    support = [p for p in probs if p > 0]
    if len(support) > MAX_EXACT:
        return 4 * tv * tv
    return _least_favourable_split(support, tv)[0]


def least_favourable_shifts(support: Sequence[float], tv: float) -> list[list[float]]:
    """The two distributions at total variation `tv` from `support` (all > 0) with that
    noncentrality: mass moved across the least favourable split, one way and the other (the limit
    cannot tell them apart; the exact test can)."""
    _, mask = _least_favourable_split(support, tv)
    shifts = []
    for gaining in (mask, ~mask):
        gain = sum(p for i, p in enumerate(support) if gaining >> i & 1)
        shifts.append([p + (tv / gain if gaining >> i & 1 else -tv / (1 - gain)) * p for i, p in enumerate(support)])
    return shifts


def power(probs: Sequence[float], n: float, alpha: float, tv: float) -> float:
    """Probability that Pearson's test at level alpha rejects a shift of size tv with n samples, in
    the chi-square limit (noncentral chi-square); exact_power is the exact test's."""
    from scipy import stats

    df = sum(p > 0 for p in probs) - 1
    if df < 1 or n <= 0:
        return 0.0
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, n * least_favourable(probs, tv)))


@functools.cache
def _exact_power(support: tuple[float, ...], n: int, alpha: float, tv: float) -> float:
    from scipy import stats

    # A statistic whose exact tail is below alpha: the exact test rejects it and every larger one.
    # Found upwards from the limit's critical value in steps of 0.2 %, so the power found is at
    # most that much of the critical value short of the true one, never above it.
    critical = float(stats.chi2.isf(alpha, len(support) - 1))
    while pearson_tail(n, critical, support) >= alpha:
        critical *= 1.002
    return min(pearson_tail(n, critical, support, shift) for shift in least_favourable_shifts(support, tv))


def exact_power(probs: Sequence[float], n: int, alpha: float, tv: float) -> float:
    """Probability that goodness_of_fit (its exact p-value) rejects at level alpha with n samples
    drawn from the shift of size tv the limit finds least favourable, in the direction the exact
    test sees worse (least_favourable_shifts): the power the checks state and require. Below the
    limit's at these sizes (0.99896 against 0.99911 at the former 7040 draws), so the manifest's
    draws are sized by this."""
    support = tuple(p for p in probs if p > 0)
    if len(support) < 2 or n <= 0:
        return 0.0
    return _exact_power(support, n, alpha, tv)


def limit_sample_size(probs: Sequence[float], alpha: float, target_power: float, tv: float) -> int:
    """The fewest samples whose power in the chi-square limit (power) reaches target_power."""
    return _fewest(lambda n: power(probs, n, alpha, tv) >= target_power, 16)


def sample_size(probs: Sequence[float], alpha: float, target_power: float, tv: float) -> int:
    """The samples at which the exact power (exact_power, what the checks state and require)
    reaches target_power: the manifest's draws are sized by it. Searched from the limit's size, up
    or down. The exact power wobbles with n at the lattice's scale (with two offsets, 5537 draws
    reach 0.999 and 5538 do not), so this is where the search sees it cross, n - 1 short, within
    a few draws of the fewest: the manifest's whole requests come out the same."""
    return _fewest(lambda n: exact_power(probs, n, alpha, tv) >= target_power,
                   limit_sample_size(probs, alpha, target_power, tv))


def _fewest(enough: Callable[[int], bool], start: int) -> int:
    """The fewest n >= 1 that is `enough`, for a test that is false below some n and true from
    it on: bracketed from `start` in doubling steps, then bisected."""
    low, high, step = start - 1, start, 1          # invariant: enough(high), not enough(low) (0: none)
    if enough(start):
        while low > 0 and enough(low):
            high, step = low, step * 2
            low = max(high - step, 0)
    else:
        while not enough(high):
            low, step = high, step * 2
            high = low + step
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if not enough(mid) else (low, mid)
    return high


def pearson(counts: Sequence[int], probs: Sequence[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True)) if n else 0.0


# pearson_tail enumerates counts within GRID_SIGMAS standard deviations plus GRID_SLACK of their
# mean. By Bernstein's inequality the mass beyond is at most 2 exp(-45) < BEYOND whatever n and p
# (the bound is weakest as the deviation goes to 0, where the slack alone is left).
GRID_SIGMAS, GRID_SLACK = 10, 30
BEYOND = 1e-19
MAX_GRID = 5_000_000       # outer-cell combinations it enumerates at most
NEGLIGIBLE = 1e-22         # outer combinations less likely than this count as in the tail


def exact_tail(counts: Sequence[int], probs: Sequence[float]) -> float:
    """P(Pearson's statistic >= the observed one) under multinomial(sum(counts), probs), exactly:
    the chi-square distribution is only its limit, and at alpha = 1e-6 the limit is off (with
    7040 draws at T = 0.6 its test rejects a correct sampler with probability 1.11e-6, with 5440
    truncated ones 1.06e-6). All probs > 0."""
    return pearson_tail(sum(counts), pearson(counts, probs), probs)


def pearson_tail(n: int, threshold: float, probs: Sequence[float], drawn_from: Sequence[float] | None = None) -> float:
    """P(Pearson's statistic against `probs` >= threshold) for n draws from `drawn_from` (default
    `probs`: the test's size; another distribution: its power there). Every cell but the two
    likeliest is enumerated (_outer_counts); given those, the likeliest two split the rest
    binomially, and the statistic is a quadratic in one of them, so their share is two binomial
    tails."""
    import numpy as np

    if len(probs) < 2 or n == 0:
        return 1.0
    outer = _outer_counts(n, tuple(probs), tuple(drawn_from if drawn_from is not None else probs))
    rest, e_i, e_j = outer.rest, outer.expected_i, outer.expected_j
    # Given the outer cells, x = count of cell i and rest - x of cell j: the statistic is
    # partial + a x^2 + b x + c0, at least the threshold outside the roots of that quadratic.
    need = threshold * (1 - 1e-12) - 1e-12 - outer.partial          # ties count as extreme
    a = 1 / e_i + 1 / e_j
    b = -2.0 - 2 * (rest - e_j) / e_j
    c0 = e_i + (rest - e_j) ** 2 / e_j - need
    disc = b * b - 4 * a * c0
    root = np.sqrt(np.maximum(disc, 0.0))
    low, high = np.floor((-b - root) / (2 * a)), np.ceil((-b + root) / (2 * a))
    # P(x <= low) + P(x >= high), x ~ binomial(rest, q), read off cumulative tables; the mass
    # beyond each window (the tables' and the outer cells') is bounded by BEYOND and counted as in
    # the tail, so float rounding of a sum near 1 does not floor the result.
    first = int(rest.min())
    starts, at_most, at_least = _binomial_tables(first, int(rest.max()), outer.split)
    row = rest - first
    start, last = starts[row], at_most.shape[1] - 1
    lower = np.where(low < start, 0.0, at_most[row, np.clip(low - start, 0, last).astype(np.int64)])
    upper = np.where(high > start + last, 0.0, at_least[row, np.clip(high - start, 0, last).astype(np.int64)])
    tail = np.where(disc > 0, np.minimum(lower + upper + BEYOND, 1.0), 1.0)
    return float(min(1.0, (outer.weight * tail).sum() + outer.unlikely + outer.cells * BEYOND))


@dataclass(frozen=True)
class _Outer:
    """The outer cells' joint counts pearson_tail sums over, for one (n, probs, drawn_from)."""
    rest: Any              # draws left to the likeliest two cells, per combination
    partial: Any           # the outer cells' share of the statistic
    weight: Any            # the combination's probability
    unlikely: float        # the probability of the combinations left out as negligible
    cells: int             # outer cells enumerated (each within its window, BEYOND outside)
    expected_i: float      # n * probs of the likeliest two
    expected_j: float
    split: float           # P(cell i | cell i or j) under drawn_from


@functools.lru_cache(maxsize=8)     # a power takes several tails of one design
def _outer_counts(n: int, probs: tuple[float, ...], drawn_from: tuple[float, ...]) -> _Outer:
    """Every combination of the outer cells' counts (all but the two likeliest), each within
    GRID_SIGMAS and GRID_SLACK of its mean, with its probability; combinations below NEGLIGIBLE
    are left out, their mass kept to count as in the tail."""
    import numpy as np
    from scipy import special

    e = n * np.asarray(probs, dtype=float)
    p = np.asarray(drawn_from, dtype=float)
    *outer, i, j = np.argsort(p)                   # the likeliest two last
    reach = [GRID_SIGMAS * math.sqrt(n * p[c] * (1 - p[c])) + GRID_SLACK for c in outer]
    spans = [np.arange(max(0, math.floor(n * p[c] - r)), min(n, math.ceil(n * p[c] + r)) + 1)
             for c, r in zip(outer, reach, strict=True)]
    if math.prod(len(s) for s in spans) > MAX_GRID:
        raise ValueError(f"{len(probs)} cells at n = {n}: too many for the exact test")
    grid = [g.ravel() for g in np.meshgrid(*spans, indexing="ij")] if outer else []
    rest: Any = n - sum(grid, np.zeros(1, dtype=np.int64))
    inside = rest >= 0
    grid, rest = [g[inside] for g in grid], rest[inside]
    share = 1.0 - sum(p[c] for c in outer)         # the likeliest two's, together
    log_weight = special.gammaln(n + 1) - special.gammaln(rest + 1) + rest * math.log(share)
    partial = np.zeros(len(rest))
    for g, c in zip(grid, outer, strict=True):
        log_weight += g * math.log(p[c]) - special.gammaln(g + 1)
        partial += (g - e[c]) ** 2 / e[c]
    weight = np.exp(log_weight)
    likely = weight > NEGLIGIBLE
    return _Outer(rest[likely], partial[likely], weight[likely], float(weight[~likely].sum()), len(outer),
                  float(e[i]), float(e[j]), float(p[i] / (p[i] + p[j])))


@functools.lru_cache(maxsize=8)     # a power takes several tails of one design, ~12 MB each at 7080 draws
def _binomial_tables(first: int, last: int, q: float) -> tuple[Any, Any, Any]:
    """For each r in first .. last, binomial(r, q) over a window of GRID_SIGMAS standard deviations
    plus GRID_SLACK either side of its mean: (the window's first x, P(X <= x), P(X >= x) within
    it). Summed from the window's own pmf in both directions, so neither tail loses digits to a
    difference."""
    import numpy as np
    from scipy import special

    rests = np.arange(first, last + 1)
    reach = GRID_SIGMAS * np.sqrt(rests * q * (1 - q)) + GRID_SLACK
    width = int(math.ceil(2 * float(reach.max()))) + 2
    starts = np.maximum(0, np.floor(rests * q - reach)).astype(np.int64)
    x, r = starts[:, None] + np.arange(width)[None, :], rests[:, None]
    xs = np.minimum(x, r)
    log_pmf = (special.gammaln(r + 1) - special.gammaln(xs + 1) - special.gammaln(r - xs + 1)
               + xs * math.log(q) + (r - xs) * math.log1p(-q))
    pmf = np.where(x <= r, np.exp(log_pmf), 0.0)
    return starts, np.cumsum(pmf, axis=1), np.cumsum(pmf[:, ::-1], axis=1)[:, ::-1]


def goodness_of_fit(values: Sequence[int | str], design: Design, alpha: float, tv: float) -> dict[str, Any]:
    """Pearson's chi-square of the offsets against the design's distribution, its p-value exact
    (exact_tail). A token outside the support (probability `other`, below 1e-9 for the fixtures)
    is judged by its exact binomial tail, and the smaller of the two p-values is the test's: either
    rejects (a union bound keeps the false-alarm rate <= alpha + n other)."""
    from scipy import stats

    probs, other = design.probs()
    k = len(design.answer_logits)
    counts, off = histogram(values, k)
    n = len(values)
    cells = [(c, p) for c, p in zip(counts, probs, strict=True) if p > 0]
    outside = sum(c for c, p in zip(counts, probs, strict=True) if p == 0) + off   # truncated away, or beyond
    within, kept = [c for c, _ in cells], [p for _, p in cells]
    p_value = exact_tail(within, kept)
    if outside:
        p_value = min(p_value, float(stats.binom.sf(outside - 1, n, other)))
    return {"n": n, "counts": counts, "outside_support": outside, "expected": [round(n * p, 1) for p in probs],
            "statistic": round(pearson(within, kept), 3), "df": len(cells) - 1, "p_value": p_value,
            "alpha": alpha, "power": round(exact_power(kept, n, alpha, tv), 6), "tv_shift": tv,
            "passed": p_value >= alpha}


def two_sample(a: Sequence[int | str], b: Sequence[int | str], k: int, alpha: float, tv: float) -> dict[str, Any]:
    """Chi-square test of homogeneity of two offset samples (no analytic answer needed)."""
    (ca, oa), (cb, ob) = histogram(a, k), histogram(b, k)
    return {"n": [len(a), len(b)], "counts": [[*ca, oa], [*cb, ob]],
            **_homogeneity([*ca, oa], [*cb, ob], len(a), len(b), alpha, tv)}


RARE = "rare"        # the continuations too seldom seen to have a cell of their own, together
MIN_EXPECTED = 5     # the fewest expected per sample that a cell of its own needs (chi-square's rule)


def two_sample_continuations(a: Sequence[Any], b: Sequence[Any], alpha: float, tv: float) -> dict[str, Any]:
    """Chi-square test of homogeneity of two samples of whole continuations, one per request
    (any hashable class: the prompt and the tokens it got). Needs no oracle, so it runs on hub
    checkpoints: the tokens within a continuation depend on each other, the requests do not.
    A class whose pooled count gives fewer than MIN_EXPECTED expected in the smaller sample
    joins RARE; that choice looks only at the pooled counts, blind to which sample a
    continuation came from, so under equal distributions the false-alarm bound holds."""
    counts_a, counts_b = Counter(a), Counter(b)
    share = min(len(a), len(b)) / max(len(a) + len(b), 1)
    pooled = counts_a + counts_b
    kept = sorted((c for c, n in pooled.items() if n * share >= MIN_EXPECTED), key=lambda c: -pooled[c])
    rare = set(pooled) - set(kept)
    row_a = [counts_a[c] for c in kept] + [sum(counts_a[c] for c in rare)]
    row_b = [counts_b[c] for c in kept] + [sum(counts_b[c] for c in rare)]
    return {"n": [len(a), len(b)], "classes": len(pooled), "cells": len(kept) + bool(rare),
            "top": [[repr(c), counts_a[c], counts_b[c]] for c in kept[:8]], RARE: [row_a[-1], row_b[-1]],
            **_homogeneity(row_a, row_b, len(a), len(b), alpha, tv)}


def _homogeneity(row_a: Sequence[int], row_b: Sequence[int], na: int, nb: int, alpha: float,
                 tv: float) -> dict[str, Any]:
    """Pearson's chi-square on the 2 x C table of two samples' cell counts (empty cells left
    out). Its power at a shift tv uses the effective sample size na nb / (na + nb) and the
    pooled distribution. Fewer than two filled cells: nothing to compare, p = 1, power 0."""
    from scipy import stats

    columns = [(x, y) for x, y in zip(row_a, row_b, strict=True) if x + y]
    if len(columns) < 2:
        statistic, p_value, df = 0.0, 1.0, 0
    else:
        result = stats.chi2_contingency([[x for x, _ in columns], [y for _, y in columns]], correction=False)
        statistic, p_value, df = float(result.statistic), float(result.pvalue), int(result.dof)
    pooled = [(x + y) / (na + nb) for x, y in columns]
    effective = na * nb / (na + nb) if na and nb else 0
    return {"statistic": round(statistic, 3), "df": df, "p_value": p_value, "alpha": alpha,
            "power": round(power(pooled, effective, alpha, tv), 6), "tv_shift": tv, "passed": p_value >= alpha}


@dataclass
class Acceptance:
    """Per draft position: how many drafts were verified there, how many accepted, and the sum
    of their acceptance probabilities; the informative ones (p between 1e-9 and 1) by p; plus
    what no correct sampler does."""
    trials: list[int]
    accepted: list[int]
    expected: list[float]
    tally: list[dict[float, list[int]]]   # p -> [trials, accepted], informative trials only
    impossible: list[str]       # accepted drafts the target gives probability < 1e-9, and other breaks


# A ratio p / q this close to 1 may fall either side of it in the engine's arithmetic (its target
# probabilities match the design to about 1e-5): neither a certain acceptance nor a clean recovery
# is demanded there.
RATIO_SLACK = 1e-3


def acceptance(prompt: Sequence[int], tokens: Sequence[int], drafts: Sequence[Sequence[int]],
               per_step_accepted: Sequence[int], design: Design, k: int, label: str,
               starts: Sequence[int] | None = None,
               draft_q: Sequence[Sequence[Sequence[Sequence[float]]] | None] | None = None) -> Acceptance:
    """Replay one request: every verification step's drafts (as the scheduler sent them) against
    the tokens the request emitted. A draft d at a position with answer a is accepted with
    probability min(1, p(d - a) / q(d)): p(d - a) where the drafts are one-hot (greedy drafts, no
    `draft_q` for the step), else with q the draft probabilities the rejection sampler got
    (enginehooks.draft_q_by_request: [token, q] pairs per position). The emitted tokens must be
    the accepted drafts, then one the residual max(0, p - q) can give: not the rejected draft (q
    one-hot), nor any token q gives more than p; and a draft p gives more than q is never
    rejected. `starts`: how many tokens the request had emitted before each drafted step (None:
    every step after the prefill drafted, as the model-based drafters do; ngram skips steps)."""
    probs, other = design.probs()

    def target(token: int, seq: list[int]) -> float:
        j = (token - answer(seq, design.vocab)) % design.vocab
        return probs[j] if j < len(probs) else other / (design.vocab - len(probs))   # one of the zero logits

    out = Acceptance([0] * k, [0] * k, [0.0] * k, [{} for _ in range(k)], [])
    emitted = 1                                              # the prefill step emits one token
    for step, (proposal, taken) in enumerate(zip(drafts, per_step_accepted, strict=False)):
        if starts is not None:
            emitted = starts[step]
        seq = list(prompt) + list(tokens[:emitted])
        step_q = draft_q[step] if draft_q else None
        q_rows = [dict((int(t), v) for t, v in row) for row in step_q] if step_q else None
        for position, draft in enumerate(proposal):
            if position > taken:
                break
            p = target(draft, seq + list(proposal[:position]))
            ratio = p / q_rows[position][draft] if q_rows else p
            accept = min(1.0, ratio)
            out.trials[position] += 1
            out.expected[position] += accept
            if 1e-9 < accept < 1:
                out.tally[position].setdefault(accept, [0, 0])[0] += 1
                out.tally[position][accept][1] += position < taken
            if position < taken:
                out.accepted[position] += 1
                if accept < 1e-9:
                    out.impossible.append(f"{label} step {step}: draft {draft} accepted at position {position}, "
                                          f"which a correct sampler accepts with probability {accept:.1e}")
            elif ratio > 1 + RATIO_SLACK:
                out.impossible.append(f"{label} step {step}: draft {draft} rejected at position {position}, "
                                      f"where p / q = {ratio:.4f} makes it certain")
        step_tokens = list(tokens[emitted:emitted + taken + 1])    # shorter only where max_tokens ended it
        if step_tokens[:taken] != list(proposal[:len(step_tokens[:taken])]):
            out.impossible.append(f"{label} step {step}: emitted {step_tokens} but accepted {taken} of the drafts "
                                  f"{list(proposal)}")
        elif taken < len(proposal) and len(step_tokens) > taken:
            recovered, rejected = step_tokens[taken], proposal[taken]
            if q_rows is None and recovered == rejected:
                out.impossible.append(f"{label} step {step}: the token after {taken} accepted drafts is the rejected "
                                      f"draft {rejected} itself")
            elif q_rows is not None:
                p = target(recovered, seq + list(proposal[:taken]))
                q = q_rows[taken].get(recovered, 0.0)
                if q and p < q * (1 - RATIO_SLACK):
                    out.impossible.append(f"{label} step {step}: the token after {taken} accepted drafts is "
                                          f"{recovered}, which max(0, p - q) excludes (p {p:.4f}, q {q:.4f})")
        emitted += len(step_tokens)
    return out


# The acceptance check's bets (acceptance_test): on a trial of probability p, bet
# scale * tv / (p (1 - p)), within [-1, 1] (so every factor 1 + bet (x - p) stays positive): about
# what a shift of every p by tv * scale calls for. Each scale bets on every draft position
# together, and on each position alone.
BET_SCALES = (-2.0, -1.0, -0.5, -0.25, 0.25, 0.5, 1.0, 2.0)


def acceptance_test(parts: Sequence[Acceptance], k: int, alpha: float, tv: float) -> dict[str, Any]:
    """Per draft position, whether drafts were accepted at the rate the target gives them. The
    trials' acceptance probabilities p depend on the path each request took, so no exact tail is
    at hand, and the chi-square limit of (accepted - sum p)^2 / variance errs upwards at 1e-6 by up
    to ten times where counts are small (docs/sampling.md). Instead each bet (BET_SCALES, on all
    positions or on one) makes a test martingale, the product over its trials of
    1 + bet (accepted - p): a correct sampler accepts each draft with its p given the past, so
    E[M] = 1 along any path, and so does the e-value E, the mean of M over the bets. By Ville's
    inequality a correct sampler reaches E >= 1 / alpha with probability at most alpha: the
    p-value 1 / E holds the bound whatever the path; `statistic` is log E and `df` the positions
    with an informative trial. The power, recorded, is for every acceptance probability between
    1e-9 and 1 shifted by tv (either way, the worse), from the best single bet, whose log-growth
    is a sum of independent terms there, taken as normal. An accepted draft of probability below
    1e-9 fails on its own."""
    from scipy import special

    trials = [sum(a.trials[i] for a in parts) for i in range(k)]
    accepted = [sum(a.accepted[i] for a in parts) for i in range(k)]
    expected = [sum(a.expected[i] for a in parts) for i in range(k)]
    tally: dict[tuple[int, float], list[int]] = {}     # (position, p) -> [trials, accepted]
    for a in parts:
        for position, counts in enumerate(a.tally[:k]):
            for p, (n, hits) in counts.items():
                pooled = tally.setdefault((position, p), [0, 0])
                pooled[0], pooled[1] = pooled[0] + n, pooled[1] + hits
    used = sorted({position for position, _ in tally})
    alone = [[position] for position in used] if len(used) > 1 else []
    groups = [[(p, n, hits) for (position, p), (n, hits) in tally.items() if position in chosen]
              for chosen in [used, *alone] if chosen]
    bets = [(group, scale) for group in groups for scale in BET_SCALES]
    logs = [_log_wealth(group, scale, tv) for group, scale in bets]
    log_e = float(special.logsumexp(logs) - math.log(len(logs))) if logs else 0.0
    p_value = min(1.0, math.exp(-log_e))
    threshold = math.log(len(bets) / alpha) if bets else math.inf
    reach = min(max((_bet_power(group, scale, tv, shift, threshold) for group, scale in bets), default=0.0)
                for shift in (tv, -tv))
    impossible = [line for a in parts for line in a.impossible]
    return {"trials": trials, "accepted": accepted, "expected": [round(e, 1) for e in expected], "test": "e-value",
            "statistic": round(log_e, 3), "df": len(used), "p_value": p_value, "alpha": alpha,
            "power": round(reach, 6), "tv_shift": tv, "impossible": impossible[:20],
            "passed": p_value >= alpha and not impossible}


def _log_factors(p: float, scale: float, tv: float) -> tuple[float, float]:
    """A trial's log-factor in the bet's martingale, accepted and rejected: log(1 + b (1 - p)) and
    log(1 - b p), the bet b = scale tv / (p (1 - p)) kept within [-1, 1]."""
    b = max(-1.0, min(1.0, scale * tv / (p * (1 - p))))
    return math.log1p(b * (1 - p)), math.log1p(-b * p)


def _log_wealth(group: Sequence[tuple[float, int, int]], scale: float, tv: float) -> float:
    """log of the bet's martingale over the group's trials."""
    total = 0.0
    for p, n, hits in group:
        win, loss = _log_factors(p, scale, tv)
        total += hits * win + (n - hits) * loss
    return total


def _bet_power(group: Sequence[tuple[float, int, int]], scale: float, tv: float, shift: float,
               threshold: float) -> float:
    """P(log M >= threshold) for one bet's martingale when each trial of probability p is
    accepted with p + shift instead (clipped to [0, 1]), log M taken as normal."""
    from scipy import stats

    mean = variance = 0.0
    for p, n, _ in group:
        q, (win, loss) = min(1.0, max(0.0, p + shift)), _log_factors(p, scale, tv)
        mean += n * (q * win + (1 - q) * loss)
        variance += n * q * (1 - q) * (win - loss) ** 2
    if variance == 0:
        return float(mean >= threshold)
    return float(stats.norm.sf((threshold - mean) / math.sqrt(variance)))
