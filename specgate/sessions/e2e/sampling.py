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

import math
from collections import Counter
from collections.abc import Sequence
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
    best = math.inf
    for mask in range(1, 2 ** len(support) - 1):
        gain = sum(p for i, p in enumerate(support) if mask >> i & 1)
        lose = 1.0 - gain
        if tv <= lose:
            best = min(best, tv * tv * (1 / gain + 1 / lose))
    return best


def power(probs: Sequence[float], n: float, alpha: float, tv: float) -> float:
    """Probability that the goodness-of-fit test at level alpha rejects a shift of size tv, n samples."""
    from scipy import stats

    df = sum(p > 0 for p in probs) - 1
    if df < 1 or n <= 0:
        return 0.0
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, n * least_favourable(probs, tv)))


def sample_size(probs: Sequence[float], alpha: float, target_power: float, tv: float) -> int:
    """The fewest samples whose power reaches target_power (a doubling, then a bisection)."""
    high = 16
    while power(probs, high, alpha, tv) < target_power:
        high *= 2
    low = high // 2 if high > 16 else 0       # power(low) < target_power: 0 when 16 is already enough
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if power(probs, mid, alpha, tv) < target_power else (low, mid)
    return high


def goodness_of_fit(values: Sequence[int | str], design: Design, alpha: float, tv: float) -> dict[str, Any]:
    """Pearson's chi-square of the offsets against the design's distribution. A token outside
    the support (probability `other`, below 1e-9 for the fixtures) is judged by its exact binomial
    tail, and the smaller of the two p-values is the test's: either rejects (a union bound keeps the
    false-alarm rate <= alpha + n other)."""
    from scipy import stats

    probs, other = design.probs()
    k = len(design.answer_logits)
    counts, off = histogram(values, k)
    n = len(values)
    cells = [(c, p) for c, p in zip(counts, probs, strict=True) if p > 0]
    outside = sum(c for c, p in zip(counts, probs, strict=True) if p == 0) + off   # truncated away, or beyond
    statistic = sum((c - n * p) ** 2 / (n * p) for c, p in cells) if n else 0.0
    df = len(cells) - 1
    p_value = float(stats.chi2.sf(statistic, df)) if df >= 1 else 1.0
    if outside:
        p_value = min(p_value, float(stats.binom.sf(outside - 1, n, other)))
    return {"n": n, "counts": counts, "outside_support": outside, "expected": [round(n * p, 1) for p in probs],
            "statistic": round(statistic, 3), "df": df, "p_value": p_value, "alpha": alpha,
            "power": round(power(probs, n, alpha, tv), 6), "tv_shift": tv, "passed": p_value >= alpha}


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
    """Per draft position: how many drafts were verified there, how many accepted, and the
    sum and variance of their acceptance probabilities; plus what no correct sampler does."""
    trials: list[int]
    informative: list[int]      # trials whose acceptance probability is between 1e-9 and 1
    accepted: list[int]
    expected: list[float]
    variance: list[float]
    impossible: list[str]       # accepted drafts the target gives probability < 1e-9, and other breaks


def acceptance(prompt: Sequence[int], tokens: Sequence[int], drafts: Sequence[Sequence[int]],
               per_step_accepted: Sequence[int], design: Design, k: int, label: str,
               starts: Sequence[int] | None = None) -> Acceptance:
    """Replay one request: every verification step's drafts (as the scheduler sent them) against
    the tokens the request emitted. A draft d at a position with answer a is accepted with
    probability p(d - a) (one-hot drafts). The emitted tokens must be the accepted drafts, then
    one token that differs from the first rejected draft (recovery excludes it). `starts`: how
    many tokens the request had emitted before each drafted step (None: every step after the
    prefill drafted, as the model-based drafters do; ngram skips steps)."""
    probs, other = design.probs()
    out = Acceptance([0] * k, [0] * k, [0] * k, [0.0] * k, [0.0] * k, [])
    emitted = 1                                              # the prefill step emits one token
    for step, (proposal, taken) in enumerate(zip(drafts, per_step_accepted, strict=False)):
        if starts is not None:
            emitted = starts[step]
        seq = list(prompt) + list(tokens[:emitted])
        for position, draft in enumerate(proposal):
            if position > taken:
                break
            j = (draft - answer(seq + list(proposal[:position]), design.vocab)) % design.vocab
            p = probs[j] if j < len(probs) else other / (design.vocab - len(probs))   # one of the zero logits
            out.trials[position] += 1
            out.informative[position] += 1e-9 < p < 1
            out.expected[position] += p
            out.variance[position] += p * (1 - p)
            if position < taken:
                out.accepted[position] += 1
                if p < 1e-9:
                    out.impossible.append(f"{label} step {step}: draft {draft} accepted at position {position}, "
                                          f"where the target gives it probability {p:.1e}")
        step_tokens = list(tokens[emitted:emitted + taken + 1])    # shorter only where max_tokens ended it
        if step_tokens[:taken] != list(proposal[:len(step_tokens[:taken])]):
            out.impossible.append(f"{label} step {step}: emitted {step_tokens} but accepted {taken} of the drafts "
                                  f"{list(proposal)}")
        elif taken < len(proposal) and len(step_tokens) > taken and step_tokens[taken] == proposal[taken]:
            out.impossible.append(f"{label} step {step}: the token after {taken} accepted drafts is the rejected "
                                  f"draft {proposal[taken]} itself")
        emitted += len(step_tokens)
    return out


def acceptance_test(parts: Sequence[Acceptance], k: int, alpha: float, tv: float) -> dict[str, Any]:
    """Per position, the accepted count against the sum of the acceptance probabilities, scaled
    by its variance; summed over positions that is chi-square with one degree of freedom per
    position (each count is a sum of Bernoulli draws given the past). The power is for every
    acceptance probability between 1e-9 and 1 shifted by tv (an accepted draft of probability
    below 1e-9 fails on its own)."""
    from scipy import stats

    trials = [sum(a.trials[i] for a in parts) for i in range(k)]
    accepted = [sum(a.accepted[i] for a in parts) for i in range(k)]
    expected = [sum(a.expected[i] for a in parts) for i in range(k)]
    variance = [sum(a.variance[i] for a in parts) for i in range(k)]
    used = [i for i in range(k) if variance[i] > 0]
    statistic = sum((accepted[i] - expected[i]) ** 2 / variance[i] for i in used)
    df = len(used)
    p_value = float(stats.chi2.sf(statistic, df)) if df else 1.0
    impossible = [line for a in parts for line in a.impossible]
    informative = [sum(a.informative[i] for a in parts) for i in range(k)]
    shift = sum((tv * informative[i]) ** 2 / variance[i] for i in used)
    reach = float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, shift)) if df else 0.0
    return {"trials": trials, "accepted": accepted, "expected": [round(e, 1) for e in expected],
            "statistic": round(statistic, 3), "df": df, "p_value": p_value, "alpha": alpha,
            "power": round(reach, 6), "tv_shift": tv, "impossible": impossible[:20],
            "passed": p_value >= alpha and not impossible}
