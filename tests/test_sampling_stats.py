"""The statistics behind the sampling checks (specgate.sessions.e2e.sampling), without vLLM.

The design's distribution is restated here in numpy the way vLLM's sampler computes it, a
correct speculative sampler (Leviathan et al. 2023) runs in numpy on the designed target with
the successor drafter's one-hot drafts, and so do samplers with the bugs the e2e checks exist
to catch. Correct samplers must pass every check over many seeds (false alarms at alpha = 1e-6:
none expected), the mutated ones must fail. Seeds are fixed, so every run is the same run.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import pytest

# scipy.stats and scipy.optimize load in the tests that use them: ~1.5 s per xdist worker's collection
from scipy import special

from specgate.core import manifest
from specgate.sessions.e2e import planning, sampling
from specgate.vllmside import fixtures, knownanswer

# Everything the e2e checks take from manifest.toml, read from it: the design, the bounds, the
# prompts and the request shapes (7080 draws, the fewest multiple of 40 with exact power 0.999; 5600 truncated).
_MANIFEST = manifest.load()
_SAMPLING = planning.Settings.parse(_MANIFEST).sampling
assert _SAMPLING is not None, "manifest.toml has no [e2e.sampling]"
_EAGLE3 = next(c for c in _MANIFEST.e2e if (c.raw.get("sampling") or {}).get("draft") == "eagle3-successor")
LOGITS = tuple(_MANIFEST.fixtures[_EAGLE3.raw["sampling"]["target"]].params["spread"])   # answer_logits
VOCAB = fixtures.VOCAB
K = len(LOGITS)
T = _SAMPLING.temperature
ALPHA, TV, POWER = _SAMPLING.false_alarm, _SAMPLING.tv_shift, _SAMPLING.power
DRAFTS = _EAGLE3.num_speculative_tokens     # the successor drafter simulated below drafts this many
PROMPTS = tuple(_SAMPLING.prompts)             # the manifest's prompts and the ngram run after them
SHORT_PROMPTS = tuple(_MANIFEST.e2e_settings["sampling"]["prompts"])   # the same, the ngram run aside
REQUESTS, MAX_TOKENS = _SAMPLING.sampled_requests, _SAMPLING.max_tokens
TRUNCATED, TRUNCATED_TOKENS = _SAMPLING.truncated_requests, _SAMPLING.truncated_max_tokens
TEXT_REQUESTS, TEXT_TOKENS = _SAMPLING.text_requests, _SAMPLING.text_max_tokens
SEEDS = range(30)

DESIGN = sampling.Design(LOGITS, VOCAB, T)


def reference_probs(logits, vocab: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The next-token distribution over offsets 0 .. vocab - 1, computed the way vLLM's
    apply_top_k_top_p does: logits / T sorted ascending; top-k masks what is below the k-th
    largest; top-p masks the prefix whose cumulative probability is <= 1 - p, the largest kept."""
    x = np.zeros(vocab)
    x[:len(logits)] = logits
    x /= temperature
    order = np.argsort(x, kind="stable")
    xs = x[order]
    if top_k:
        xs = np.where(xs < xs[vocab - top_k], -np.inf, xs)
    if top_p < 1.0:
        mask = np.cumsum(special.softmax(xs)) <= 1 - top_p
        mask[-1] = False
        xs = np.where(mask, -np.inf, xs)
    out = np.empty(vocab)
    out[order] = special.softmax(xs)
    return out


# --------------------------------------------------------------------------- 1. the design

@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (0, 0.5), (0, 0.7),
                                          (0, 0.8), (0, 0.9), (0, 0.97), (3, 0.7), (2, 0.9)])
def test_design_probs_match_vllms_temperature_top_k_top_p(temperature, top_k, top_p):
    """Temperature divides the logits before softmax; top-k keeps the k largest; top-p keeps
    the smallest head (of what top-k left) whose mass reaches top_p, renormalised; what no
    offset 0..K-1 holds is `other`. Catches a temperature applied after softmax or not at all,
    top-k keeping k - 1 or k + 1, top-p stopping before the head reaches top_p (or including one
    more), top-p normalised over the whole vocabulary instead of the top-k survivors."""
    probs, other = sampling.Design(LOGITS, VOCAB, temperature, top_k, top_p).probs()
    want = reference_probs(LOGITS, VOCAB, temperature, top_k, top_p)
    np.testing.assert_allclose(probs, want[:K], rtol=1e-9, atol=1e-300)
    assert other == pytest.approx(want[K:].sum(), rel=1e-9, abs=1e-300)
    assert sum(probs) + other == pytest.approx(1.0, abs=1e-12)


def test_design_probs_by_hand():
    """The manifest's numbers: at T = 0.6, p = softmax(answer_logits / 0.6) over the answer
    offsets, the 508 zero logits together ~1.3e-15; top_k = 2 and top_p = 0.8 both keep offsets
    0 and 1 (0.586 < 0.8 <= 0.586 + 0.255); top_p = 0.85 also keeps offset 2."""
    p = special.softmax(np.array(LOGITS) / T)
    probs, other = DESIGN.probs()
    np.testing.assert_allclose(probs, p, rtol=1e-12)
    assert other == pytest.approx((VOCAB - K) * np.exp(-LOGITS[0] / T) / np.exp(special.logsumexp(
        np.array(LOGITS) / T - LOGITS[0] / T)), rel=1e-9)
    assert 1e-16 < other < 1e-14
    head = [p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1]), 0.0, 0.0]
    for kw in ({"top_k": 2}, {"top_p": 0.8}):
        probs, other = sampling.Design(LOGITS, VOCAB, T, **kw).probs()
        np.testing.assert_allclose(probs, head, rtol=1e-12)
        assert other == 0.0
    probs, _ = sampling.Design(LOGITS, VOCAB, T, top_p=0.85).probs()
    np.testing.assert_allclose(probs, [*(p[:3] / p[:3].sum()), 0.0], rtol=1e-12)
    probs, _ = sampling.Design(LOGITS, VOCAB, T, top_p=0.5).probs()
    assert probs == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("logits, vocab", [(LOGITS, VOCAB), ((2.0, 1.5, 1.0, 0.5), 16), ((3.0, -1.0), 8)])
def test_raw_logprobs_are_the_log_softmax_over_the_whole_vocabulary(logits, vocab):
    """What vLLM returns as logprobs: T = 1, no truncation, normalised over all `vocab` tokens
    (not over the answer offsets only; a bug invisible at logit 24, so a small design too)."""
    design = sampling.Design(logits, vocab, 0.6, top_k=1, top_p=0.5)
    full = np.zeros(vocab)
    full[:len(logits)] = logits
    np.testing.assert_allclose(design.raw_logprobs(), special.log_softmax(full)[:len(logits)], rtol=0, atol=1e-12)


def test_offsets_follow_the_context_rule_mod_vocab():
    """The answer after x is x[-2] + 2 (x[0] + 2 after one token), mod V; offsets beyond K - 1
    are OFF_SUPPORT. Catches an answer read from x[-1] (the successor rule) or not wrapped."""
    # after [510]: 512 % 512 = 0; after [510, 1]: 510 + 2 = 0; after [510, 1, 3]: 1 + 2 = 3.
    assert sampling.offsets([510], [1, 3, 100, 6], VOCAB, K) == [1, 3, sampling.OFF_SUPPORT, 1]
    prompt, tokens = [7, 300, 9], [305, 11, 400]             # answers 302, 9 + 2, 305 + 2
    assert sampling.offsets(prompt, tokens, VOCAB, K) == [3, 0, sampling.OFF_SUPPORT]
    want = knownanswer.continuation(knownanswer.CONTEXT_RULE, prompt, 3, VOCAB)
    assert sampling.offsets(prompt, want, VOCAB, K) == [0, 0, 0]


# --------------------------------------------------------------------------- 2. power and sample size

def _chi2_distance(p, q):
    return float(np.sum((np.asarray(q) - p) ** 2 / p))


@pytest.mark.parametrize("p", [list(special.softmax(np.array(LOGITS) / T)), [0.97, 0.01, 0.01, 0.01],
                               [0.6970592839654063, 0.3029407160345937], [0.4, 0.3, 0.2, 0.1]])
def test_least_favourable_is_the_minimum_chi_square_distance_at_that_tv(p):
    """sum (q - p)^2 / p minimised over q at total variation exactly TV. Brute force (random q at
    TV exactly 0.05) never goes below it; per sign pattern, a numeric QP (SLSQP) reaches it
    within 1%. Catches tv instead of tv^2, a missing 1/P(A) or 1/P(B) term, a split that is not
    searched (p = [0.97, 0.01, ...]: only the heavy offset can lose 0.05)."""
    from scipy import optimize
    p = np.array(p)
    best = sampling.least_favourable(list(p), TV)
    rng = np.random.default_rng(0)
    d = rng.standard_normal((100_000, len(p))) * rng.exponential(size=(100_000, len(p))) ** 2
    d -= d.mean(axis=1, keepdims=True)
    d *= 2 * TV / np.abs(d).sum(axis=1, keepdims=True)
    q = p + d
    q = q[(q >= 0).all(axis=1)]
    random_min = float(np.min(np.sum((q - p) ** 2 / p, axis=1)))
    assert random_min >= best * (1 - 1e-9)
    qp_min = np.inf
    for signs in itertools.product((1, -1), repeat=len(p)):
        gain = [i for i, s in enumerate(signs) if s > 0]
        lose = [i for i, s in enumerate(signs) if s < 0]
        if not gain or not lose or p[lose].sum() < TV:     # nothing to gain, or too little to lose
            continue
        bounds = [(0, 1 - p[i]) if s > 0 else (-p[i], 0) for i, s in enumerate(signs)]
        result = optimize.minimize(lambda x: float(np.sum(x ** 2 / p)), np.array([s * TV / len(p) for s in signs]),
                                   method="SLSQP", bounds=bounds,
                                   constraints=[{"type": "eq", "fun": lambda x: float(np.sum(x))},
                                                {"type": "eq", "fun": lambda x, g=gain: float(np.sum(x[g]) - TV)}])
        if result.success and abs(np.sum(np.abs(result.x)) - 2 * TV) < 1e-6 and (p + result.x >= -1e-9).all():
            qp_min = min(qp_min, float(result.fun))
    assert qp_min >= best * (1 - 1e-6)
    assert qp_min == pytest.approx(best, rel=0.01)


def test_limit_sample_size_for_the_manifest_power_and_power_monotone_in_n():
    """In the chi-square limit ~7000 draws give power 0.999 against a TV 0.05 shift at alpha
    1e-6; the returned n is the fewest (n - 1 falls short) and power rises with n."""
    p = DESIGN.probs()[0]
    n = sampling.limit_sample_size(p, ALPHA, POWER, TV)
    assert 6500 <= n <= 7500
    assert sampling.power(p, n, ALPHA, TV) >= POWER > sampling.power(p, n - 1, ALPHA, TV)
    grid = [sampling.power(p, m, ALPHA, TV) for m in range(0, 20_001, 250)]
    assert all(b > a or a == 1.0 for a, b in itertools.pairwise(grid[1:])) and grid[0] == 0.0 < grid[1] < POWER


def test_the_manifest_draws_are_what_the_exact_sample_size_asks_for():
    """The checks' p-values are exact (sampling.exact_tail), and so is the power they state and
    require: the manifest's draws, plain and truncated, are the fewest whole requests (a top-k and
    a top-p one for the truncated) that cover sampling.sample_size, and reach the power. The
    limit overstates it (0.99911 at 7040 draws, exactly 0.99896): its size falls a request short."""
    for design, n, fewer in ((DESIGN, REQUESTS * MAX_TOKENS, MAX_TOKENS),
                             (sampling.Design(LOGITS, VOCAB, T, top_k=2), TRUNCATED * TRUNCATED_TOKENS,
                              2 * TRUNCATED_TOKENS)):
        probs = design.probs()[0]
        needed = sampling.sample_size(probs, ALPHA, POWER, TV)
        assert n - fewer < needed <= n and sampling.exact_power(probs, n, ALPHA, TV) >= POWER
        assert sampling.exact_power(probs, needed, ALPHA, TV) >= POWER > sampling.exact_power(probs, needed - 1,
                                                                                               ALPHA, TV)
        assert sampling.limit_sample_size(probs, ALPHA, POWER, TV) <= n - fewer


def test_sample_size_searches_from_the_limits_size_up_or_down():
    """Where the exact test needs more than the limit (the manifest's case) and where it needs
    less, sample_size is a size the exact power reaches and one draw fewer does not."""
    for probs, alpha, want, tv, more in (([0.7, 0.3], 0.01, 0.9, 0.2, True),
                                         ([0.55, 0.25, 0.12, 0.08], 0.001, 0.95, 0.15, False)):
        n, limit = sampling.sample_size(probs, alpha, want, tv), sampling.limit_sample_size(probs, alpha, want, tv)
        assert (n > limit) if more else (n < limit)
        assert sampling.exact_power(probs, n, alpha, tv) >= want > sampling.exact_power(probs, n - 1, alpha, tv)


@pytest.mark.parametrize("probs", [[0.7, 0.3], [0.5, 0.3, 0.2], [0.55, 0.25, 0.12, 0.08], [0.9, 0.06, 0.03, 0.01]])
def test_exact_tail_is_the_multinomial_tail_by_enumeration(probs):
    """P(statistic >= observed) summed over every outcome of n draws, against exact_tail, for
    observed counts from the centre to the far tail of small samples."""
    from scipy import stats
    n, k = 20, len(probs)
    outcomes = np.array([c for c in itertools.product(range(n + 1), repeat=k - 1) if sum(c) <= n])
    outcomes = np.column_stack([outcomes, n - outcomes.sum(axis=1)])
    expected = n * np.array(probs)
    statistics = ((outcomes - expected) ** 2 / expected).sum(axis=1)
    pmf = stats.multinomial.pmf(outcomes, n, probs)
    for observed in outcomes[np.linspace(0, len(outcomes) - 1, 25).astype(int)]:
        want = pmf[statistics >= sampling.pearson(list(observed), probs) * (1 - 1e-12) - 1e-12].sum()
        assert sampling.exact_tail(list(observed), probs) == pytest.approx(want, rel=1e-9, abs=1e-12), observed


def test_limit_sample_size_is_the_fewest_even_below_where_its_search_starts():
    """The search starts at 16: a design that needs fewer must still get the fewest."""
    for p, alpha, want, tv in (([0.5, 0.5], 0.05, 0.5, 0.4), ([0.5, 0.5], 0.05, 0.9, 0.4),
                               ([0.7, 0.3], 0.01, 0.9, 0.3)):
        fewest = next(m for m in range(1, 10_000) if sampling.power(p, m, alpha, tv) >= want)
        assert sampling.limit_sample_size(p, alpha, want, tv) == fewest


def test_power_is_the_rejection_rate_at_the_least_favourable_shift():
    """The noncentral chi-square power is what Pearson's test actually achieves, by Monte Carlo,
    at the least favourable q (mass moved in proportion to p, from the best split)."""
    from scipy import stats
    p = np.array(DESIGN.probs()[0])
    alpha, n = 1e-3, 4000
    split = min((m for m in itertools.product((0, 1), repeat=K) if 0 < sum(m) < K),
                key=lambda m: 1 / p[np.array(m) == 1].sum() + 1 / p[np.array(m) == 0].sum())
    gain = np.array(split) == 1
    q = p + np.where(gain, TV * p / p[gain].sum(), -TV * p / p[~gain].sum())
    assert _chi2_distance(p, q) == pytest.approx(sampling.least_favourable(list(p), TV), rel=1e-9)
    counts = np.random.default_rng(1).multinomial(n, q, size=20_000)
    statistic = np.sum((counts - n * p) ** 2 / (n * p), axis=1)
    rate = float(np.mean(statistic > stats.chi2.isf(alpha, K - 1)))
    assert rate == pytest.approx(sampling.power(list(p), n, alpha, TV), abs=0.03)


# --------------------------------------------------------------------------- 3. simulated speculative sampling

def context_answer(seq, vocab: int = VOCAB) -> int:
    """knownanswer.CONTEXT_RULE restated: x[len - 2] + 2, x[0] + 2 after one token."""
    return (seq[-2 if len(seq) >= 2 else 0] + 2) % vocab


@dataclass
class Sampler:
    """Target sampling plus Leviathan et al.'s verification of one-hot drafts: a draft d is
    accepted with probability p(d); on rejection the token comes from the residual
    max(0, p - q), here p without d, renormalised; after k acceptances a bonus token from p.
    The fields after `probs` are the bugs."""
    probs: np.ndarray                      # over offsets 0 .. V - 1 from the answer: what it samples from
    recover_with_draft: bool = False       # (a) recovery drawn from p, the rejected draft included
    fixed_u: float | None = None           # (b) the acceptance uniform is a constant
    # Python lists of the same float64 values: a simulation makes ~10^5 scalar lookups, which
    # numpy's scalar calls make several times slower.
    p: list[float] = field(init=False)
    cdf: list[float] = field(init=False)

    @property
    def vocab(self) -> int:
        return len(self.p)

    def __post_init__(self):
        self.p, self.cdf = np.asarray(self.probs).tolist(), np.cumsum(self.probs).tolist()

    def prob(self, seq, token) -> float:
        return self.p[(token - context_answer(seq, self.vocab)) % self.vocab]

    def draw(self, seq, rng, exclude: int | None = None) -> int:
        """A draw from p; with `exclude`, from the residual: p conditioned on not the draft."""
        a = context_answer(seq, self.vocab)
        while True:
            j = bisect.bisect_right(self.cdf, rng.random() * self.cdf[-1])   # np.searchsorted(side="right")
            token = (a + min(j, self.vocab - 1)) % self.vocab
            if token != exclude or self.recover_with_draft:
                return token


@dataclass
class Request:
    prompt: list[int]
    tokens: list[int]
    drafts: list[list[int]]
    accepted: list[int]


def generate(sampler: Sampler, prompt, max_tokens: int, rng) -> Request:
    """One request: a prefill step emits one token, then each step verifies the successor
    drafter's k drafts last + 1 .. last + k; max_tokens cuts the last step short (its
    accepted count is the engine's, as vLLM's per-step metrics record it)."""
    seq = list(prompt)
    tokens = [sampler.draw(seq, rng)]
    seq += tokens
    drafts, accepted = [], []
    while len(tokens) < max_tokens:
        proposal = [(seq[-1] + s) % sampler.vocab for s in range(1, DRAFTS + 1)]
        context, out = list(seq), []
        for draft in proposal:
            u = rng.random() if sampler.fixed_u is None else sampler.fixed_u
            if u < sampler.prob(context, draft):
                out.append(draft)
                context.append(draft)
            else:
                out.append(sampler.draw(context, rng, exclude=draft))
                break
        else:
            out.append(sampler.draw(context, rng))
        drafts.append(proposal)
        accepted.append(len(out) - 1)
        out = out[:max_tokens - len(tokens)]
        tokens += out
        seq += out
    return Request(list(prompt), tokens, drafts, accepted)


def batch(sampler: Sampler, seed: int, requests: int = REQUESTS, max_tokens: int = MAX_TOKENS,
          prompts: tuple[list[int], ...] = PROMPTS) -> list[Request]:
    return [generate(sampler, prompts[i % len(prompts)], max_tokens, np.random.default_rng([seed, i]))
            for i in range(requests)]


def judge(requests: list[Request], design: sampling.Design) -> tuple[list[int | str], dict, dict]:
    """What tests/e2e/test_sampling.py computes from one engine's sampled requests."""
    k = len(design.answer_logits)
    values = [v for r in requests for v in sampling.offsets(r.prompt, r.tokens, design.vocab, k)]
    parts = [sampling.acceptance(r.prompt, r.tokens, r.drafts, r.accepted, design, DRAFTS, f"request {i}")
             for i, r in enumerate(requests)]
    fit = sampling.goodness_of_fit(values, design, ALPHA, TV)
    return values, fit, sampling.acceptance_test(parts, DRAFTS, ALPHA, TV)


CORRECT = Sampler(reference_probs(LOGITS, VOCAB, T))


@cache
def correct_run(seed: int) -> tuple[list[int | str], dict, dict]:
    return judge(batch(CORRECT, seed), DESIGN)


def test_a_correct_speculative_sampler_passes_every_seed():
    """False alarms: none over 30 seeds (60 tests at alpha 1e-6). Each run's distribution check
    has the power the manifest asks for, drafts are verified at every position, and the
    distribution check's p-values look uniform (a Kolmogorov-Smirnov check: a miscalibrated
    statistic shows up there long before it gives a false alarm at 1e-6). The acceptance check's
    e-values average below 1, as a fair bet's must (0.64 over these seeds); its p-values 1 / E
    are conservative by design, not uniform.

    The acceptance check's own power is moderate here (0.36 to 0.54 over the seeds, against a tv
    0.05 shift of every acceptance probability, with the manifest's 177 requests of 40 tokens
    cycling its 5 prompts, the ngram run among them; 0.41 to 0.57 for the chi-square limit's
    test it replaced, whose false-alarm bound did not hold): on the context rule the successor
    drafts land on the support only while the last two tokens stay close, ~1% of position-0
    trials after each request's first few tokens, so its `impossible` lines catch a broken
    verifier first."""
    from scipy import stats
    failures, fit_p, acc_e = [], [], []
    for seed in SEEDS:
        values, fit, acc = correct_run(seed)
        assert fit["n"] == REQUESTS * MAX_TOKENS and fit["outside_support"] == 0
        assert fit["power"] >= POWER and 0.3 < acc["power"] < 0.7
        assert min(acc["trials"]) > 5 and acc["df"] == DRAFTS
        assert not acc["impossible"], acc["impossible"]
        failures += [f"seed {seed}: {name} p = {t['p_value']:.3g}" for name, t in (("fit", fit), ("acceptance", acc))
                     if not t["passed"]]
        fit_p.append(fit["p_value"])
        acc_e.append(np.exp(acc["statistic"]))
    assert not failures, failures
    assert stats.kstest(fit_p, "uniform").pvalue > 1e-3, sorted(fit_p)
    assert np.mean(acc_e) < 1.5, sorted(acc_e)


def test_the_acceptance_e_value_is_a_fair_bet_over_every_outcome():
    """E[E] = 1 for a correct sampler, exactly: every outcome of 8 trials at four acceptance
    probabilities over two positions, weighted by its probability. A factor that used p where
    it needs 1 - p, or counted a trial twice, would make the bet unfair (and its 1e-6 bound
    false); and no outcome of so few trials reaches the threshold."""
    probs = [(0, 0.587), (0, 0.111), (0, 0.587), (1, 0.255), (1, 0.048), (0, 0.048), (1, 0.587), (1, 0.111)]
    mean = 0.0
    for outcome in itertools.product((0, 1), repeat=len(probs)):
        part = sampling.Acceptance([0, 0], [0, 0], [0.0, 0.0], [{}, {}], [])
        weight = 1.0
        for (position, p), hit in zip(probs, outcome, strict=True):
            part.tally[position].setdefault(p, [0, 0])[0] += 1
            part.tally[position][p][1] += hit
            part.trials[position] += 1
            weight *= p if hit else 1 - p
        test = sampling.acceptance_test([part], 2, ALPHA, TV)
        assert test["passed"] and test["df"] == 2
        mean += weight * np.exp(test["statistic"])
    assert mean == pytest.approx(1.0, abs=1e-3)   # statistic is log E rounded to 3 decimals


def test_acceptance_expected_matches_what_the_simulation_accepted():
    """Per position, the replay's expected count is the sum of the p(d) the sampler used: the
    accepted counts land within a few standard deviations of it, pooled over the seeds."""
    accepted = np.sum([correct_run(s)[2]["accepted"] for s in SEEDS], axis=0)
    expected = np.sum([correct_run(s)[2]["expected"] for s in SEEDS], axis=0)
    trials = np.sum([correct_run(s)[2]["trials"] for s in SEEDS], axis=0)
    assert (trials > accepted).all() and (accepted > 0).all()
    assert np.all(np.abs(accepted - expected) < 5 * np.sqrt(expected)), (accepted, expected)


def test_recovery_that_can_return_the_rejected_draft_is_caught():
    """(a) The recovered token drawn from p itself: a rejected draft d comes back with
    probability p(d), so every run has hundreds of 'rejected draft itself' lines (power 1), and
    acceptance_test fails on them alone."""
    _, _, acc = judge(batch(Sampler(CORRECT.probs, recover_with_draft=True), 0), DESIGN)
    assert not acc["passed"]
    assert any("is the rejected draft" in line for line in acc["impossible"])


def test_acceptance_with_a_constant_uniform_is_caught():
    """(b) Accept iff p(d) >= 0.5 (the uniform fixed at 0.5): offset-0 drafts always accepted,
    the others never. Nothing impossible happens; the acceptance rates give it away: log E 70 to
    90 on the first six seeds, where rejecting takes log(1 / 1e-6) = 13.8. The emitted
    distribution moves too (p < 1e-6 on 27 of the 30 seeds, 2.9e-9 on this one)."""
    _, fit, acc = judge(batch(Sampler(CORRECT.probs, fixed_u=0.5), 0), DESIGN)
    assert not acc["passed"] and acc["statistic"] > math.log(1 / ALPHA)
    assert not acc["impossible"]


def test_temperature_ignored_is_caught():
    """(c) Sampling at T = 1 where the design says 0.6: TV 0.13 from the design, about 2.6 x
    the shift the sample size is powered for (noncentrality ~ 7080 x 0.07 ~ 490 against a
    threshold of ~31 on 3 df: power 1 to machine precision; the exact p-value is down at the
    bound it carries for the counts it does not enumerate, sampling.BEYOND). The acceptance
    check, with its low power here, need not see it."""
    wrong = Sampler(reference_probs(LOGITS, VOCAB, 1.0))
    tv = 0.5 * np.abs(wrong.probs[:K] - CORRECT.probs[:K]).sum()
    assert tv > 2.5 * TV
    _, fit, acc = judge(batch(wrong, 0), DESIGN)
    assert not fit["passed"] and fit["p_value"] < 10 * sampling.BEYOND
    assert not acc["impossible"]


@pytest.mark.parametrize("kw", [{"top_k": 2}, {"top_p": 0.8}])
def test_truncated_requests_pass_when_truncated_and_fail_when_not(kw):
    """(d) top-k / top-p ignored for the truncated requests: ~16% of their tokens land on the
    offsets truncation removed (probability 0, so one of them is enough: power 1), and accepted
    drafts there are impossible. The same requests sampled correctly pass."""
    design = sampling.Design(LOGITS, VOCAB, T, **kw)
    right = Sampler(reference_probs(LOGITS, VOCAB, T, **kw))
    for seed in range(3):
        _, fit, acc = judge(batch(right, seed, TRUNCATED, TRUNCATED_TOKENS), design)
        assert fit["passed"] and acc["passed"] and fit["outside_support"] == 0, (fit, acc)
        assert fit["power"] >= POWER
    _, fit, acc = judge(batch(CORRECT, 0, TRUNCATED, TRUNCATED_TOKENS), design)
    assert not fit["passed"] and fit["outside_support"] > 500 and fit["p_value"] == 0.0
    assert not acc["passed"] and any("probability 0.0e+00" in line for line in acc["impossible"])


def test_few_tokens_outside_the_truncated_support_still_fail():
    """A sampler that leaks only rarely past top-k (about one draw in 500 on offset 2): the
    chi-square barely moves, but a token of probability 0 must fail the check however few."""
    design = sampling.Design(LOGITS, VOCAB, T, top_k=2)
    values = [v for r in batch(Sampler(reference_probs(LOGITS, VOCAB, T, top_k=2)), 0, TRUNCATED, TRUNCATED_TOKENS)
              for v in sampling.offsets(r.prompt, r.tokens, VOCAB, K)]
    leak = np.random.default_rng(5).random(len(values)) < 1 / 500
    values = [2 if leaked else v for v, leaked in zip(values, leak, strict=True)]
    fit = sampling.goodness_of_fit(values, design, ALPHA, TV)
    assert 0 < leak.sum() < 30 and fit["outside_support"] == leak.sum()
    assert not fit["passed"] and fit["p_value"] == 0.0


def test_two_sample_passes_two_correct_runs_and_fails_a_temperature_change():
    """Homogeneity of two offset samples: two correct runs (different seeds) are alike; a
    correct run against a T = 1 one is not."""
    for a, b in ((0, 1), (2, 3), (4, 5)):
        test = sampling.two_sample(correct_run(a)[0], correct_run(b)[0], K, ALPHA, TV)
        assert test["passed"] and test["df"] == K - 1, test
        assert test["power"] > 0.5
    hot = [v for r in batch(Sampler(reference_probs(LOGITS, VOCAB, 1.0)), 0)
           for v in sampling.offsets(r.prompt, r.tokens, VOCAB, K)]
    test = sampling.two_sample(correct_run(0)[0], hot, K, ALPHA, TV)
    assert not test["passed"] and test["p_value"] < 1e-20
    leaky = [sampling.OFF_SUPPORT if i % 100 == 0 else v for i, v in enumerate(correct_run(1)[0])]
    test = sampling.two_sample(correct_run(0)[0], leaky, K, ALPHA, TV)        # 71 tokens off the support
    assert not test["passed"] and test["df"] == K, test


def target_alone(sampler: Sampler, prompt, max_tokens: int, rng) -> list[int]:
    seq, tokens = list(prompt), []
    for _ in range(max_tokens):
        tokens.append(sampler.draw(seq, rng))
        seq.append(tokens[-1])
    return tokens


def continuations_alone(seed: int, requests: int = TEXT_REQUESTS, length: int = TEXT_TOKENS) -> list[tuple]:
    return [(tuple(SHORT_PROMPTS[i % len(SHORT_PROMPTS)]), *target_alone(
        CORRECT, SHORT_PROMPTS[i % len(SHORT_PROMPTS)], length, np.random.default_rng([seed, 10**6 + i])))
            for i in range(requests)]


def continuations(requests: list[Request], length: int = TEXT_TOKENS) -> list[tuple]:
    return [(tuple(r.prompt), *r.tokens[:length]) for r in requests]


def test_two_sample_of_continuations_has_no_false_alarm_and_sees_a_gross_fault():
    """The two-sample check on whole continuations (the manifest's text_requests of
    text_max_tokens) on the four short prompts (the 300-token ngram run would split the classes
    further), the target alone against speculation: no false alarm over 30 seeds; always accepting
    drafts (a constant uniform of 0) fails. On this design's spread (222 classes, most of them
    rare) its power is tiny and says so: it is the hub checkpoints' check, whose continuations
    are far less spread."""
    for seed in SEEDS:
        speculated = batch(CORRECT, seed, TEXT_REQUESTS, TEXT_TOKENS, SHORT_PROMPTS)
        test = sampling.two_sample_continuations(continuations_alone(seed), continuations(speculated), ALPHA, TV)
        assert test["passed"], (seed, test)
        assert test["cells"] >= 3 and test["df"] == test["cells"] - 1 and test["n"] == [TEXT_REQUESTS] * 2
        assert sum(test["rare"]) + sum(a + b for _, a, b in test["top"]) <= 512
        assert test["power"] < 0.01
    always_accept = Sampler(CORRECT.probs, fixed_u=0.0)
    speculated = batch(always_accept, 0, TEXT_REQUESTS, TEXT_TOKENS, SHORT_PROMPTS)
    test = sampling.two_sample_continuations(continuations_alone(0), continuations(speculated), ALPHA, TV)
    assert not test["passed"] and test["p_value"] < 1e-20


def test_two_sample_of_continuations_pools_by_the_pooled_count_alone():
    """A class seen often enough in the two samples together keeps its own cell even if only
    one sample has it (that is the difference to see); classes seen too seldom join `rare`."""
    a = ["x"] * 40 + ["y"] * 40 + [f"a{i}" for i in range(20)]
    b = ["x"] * 40 + ["z"] * 40 + [f"b{i}" for i in range(20)]
    test = sampling.two_sample_continuations(a, b, ALPHA, TV)
    assert test["classes"] == 43 and test["cells"] == 4 and test["rare"] == [20, 20]
    assert not test["passed"]
    same = sampling.two_sample_continuations(a, list(a), ALPHA, TV)
    assert same["passed"] and same["p_value"] == pytest.approx(1.0) and same["statistic"] == 0


def test_least_favourable_beyond_the_exact_limit_is_a_lower_bound():
    """Past MAX_EXACT cells the noncentrality is 4 tv^2, at most the exact minimum (so the
    power computed from it never overstates)."""
    p = np.random.default_rng(3).dirichlet(np.ones(sampling.MAX_EXACT + 1))
    exact = min(TV * TV * (1 / g + 1 / (1 - g))
                for mask in range(1, 2 ** len(p) - 1)
                if 1 - (g := float(p[[i for i in range(len(p)) if mask >> i & 1]].sum())) >= TV)
    assert sampling.least_favourable(list(p), TV) == pytest.approx(4 * TV * TV)
    assert exact >= 4 * TV * TV


def test_acceptance_is_exact_where_off_support_drafts_are_likely():
    """A design whose off-support tokens are not negligible (logits 2 .. 0.5 against 12 zeros,
    T = 1): successor drafts often land off the support, where a draft's acceptance probability
    is that one token's p(d) = other / (V - K), not `other` (the mass of all of them). A correct
    sampler passes; the replay's expected counts are what it accepted."""
    logits, vocab = (2.0, 1.5, 1.0, 0.5), 16
    design = sampling.Design(logits, vocab, 1.0)
    sampler = Sampler(reference_probs(logits, vocab, 1.0))
    parts = []
    for i in range(16):
        r = generate(sampler, [[5, 6, 7], [3, 2], [14, 15]][i % 3], 200, np.random.default_rng([99, i]))
        assert sampling.offsets(r.prompt, r.tokens, vocab, len(logits)).count(sampling.OFF_SUPPORT) > 0
        parts.append(sampling.acceptance(r.prompt, r.tokens, r.drafts, r.accepted, design, DRAFTS, f"request {i}"))
    test = sampling.acceptance_test(parts, DRAFTS, ALPHA, TV)
    assert test["passed"], test
    assert np.all(np.abs(np.array(test["accepted"]) - np.array(test["expected"]))
                  < 5 * np.sqrt(np.array(test["expected"]))), test


# --------------------------------------------------------------------------- 4. acceptance by hand

# prompt [5, 6, 7]: the answer is 8, and after 8 the successor drafts 9, 10, 11 are each the
# answer at their position (offset 0, p0 = 0.586) while the emitted tokens stay consecutive.
PROMPT = [5, 6, 7]
P = DESIGN.probs()[0]


def _replay(tokens, drafts, accepted, design=DESIGN):
    return sampling.acceptance(PROMPT, tokens, drafts, accepted, design, DRAFTS, "r")


def test_acceptance_counts_a_consistent_request():
    """Two steps: 1 accepted then a recovery (12, not the rejected 10); then 3 accepted and a
    bonus. Positions verified: 0, 1 in the first step, 0, 1, 2 in the second."""
    # step 0 after [.., 8]: drafts 9 10 11, accepts 9, recovers 12 (answer after [.., 8, 9] is 10)
    # step 1 after [.., 8, 9, 12]: answer 11, drafts 13 14 15 (offsets 2, and so on)
    tokens = [8, 9, 12, 13, 14, 15, 16]
    out = _replay(tokens, [[9, 10, 11], [13, 14, 15]], [1, 3])
    assert not out.impossible, out.impossible
    assert out.trials == [2, 2, 1] and out.accepted == [2, 1, 1]
    seq = [*PROMPT, 8, 9, 12]
    want = [P[0] + P[(13 - context_answer(seq)) % VOCAB], 2 * P[0]]
    assert out.expected[:2] == pytest.approx(want)


def test_acceptance_replays_a_step_after_undrafted_ones_from_where_it_started():
    """ngram leaves steps undrafted: the same drafted step, verified after two plain steps (8 and
    9 emitted one by one), is consistent only when replayed from its start."""
    tokens = [8, 9, 10, 11, 13]           # after [.., 8, 9]: drafts 10 11 12, two accepted, then 13
    out = sampling.acceptance(PROMPT, tokens, [[10, 11, 12]], [2], DESIGN, DRAFTS, "r", starts=[2])
    assert not out.impossible and out.trials == [1, 1, 1] and out.accepted == [1, 1, 0]
    assert _replay(tokens, [[10, 11, 12]], [2]).impossible      # replayed as if it followed the prefill


def test_acceptance_flags_emitted_tokens_that_are_not_the_accepted_drafts():
    out = _replay([8, 10, 11], [[9, 10, 11]], [1])
    assert len(out.impossible) == 1 and "emitted [10, 11] but accepted 1" in out.impossible[0]


def test_acceptance_flags_the_rejected_draft_as_its_own_recovery():
    out = _replay([8, 9, 10], [[9, 10, 11]], [1])
    assert len(out.impossible) == 1 and "rejected draft 10 itself" in out.impossible[0]


def test_acceptance_flags_an_accepted_draft_the_target_cannot_emit():
    """Beyond the support (offset 12: p ~ 2.5e-18) and truncated away (offset 2 under top_k = 2:
    p = 0), an accepted draft is impossible; the same draft rejected is not."""
    out = _replay([8, 21, 9], [[21, 22, 23]], [1])                  # 21 - 9 = offset 12
    assert any("draft 21 accepted at position 0" in line for line in out.impossible)
    truncated = sampling.Design(LOGITS, VOCAB, T, top_k=2)
    out = _replay([8, 11, 9], [[11, 12, 13]], [1], truncated)       # 11 - 9 = offset 2
    assert any("draft 11 accepted at position 0" in line and "0.0e+00" in line for line in out.impossible)
    out = _replay([8, 9], [[11, 12, 13]], [0], truncated)
    assert not out.impossible and out.trials == [1, 0, 0] and out.expected == [0.0, 0.0, 0.0]


# Probabilistic drafts: q as enginehooks records it, [token, q] pairs per draft position. After
# [.., 8] the answer is 9 (offset 0, p = P[0]) and 10 would be offset 1.
def _with_q(tokens, accepted, q_rows):
    return sampling.acceptance(PROMPT, tokens, [[9, 10, 11]], [accepted], DESIGN, DRAFTS, "r", draft_q=[q_rows])


def test_acceptance_with_draft_probabilities_is_min_1_p_over_q():
    """q(9) = 0.9 > p(9): accepted with probability p / q; the recovery 10, which q does not
    favour over p, is consistent. A step recorded without q is one-hot (the probability is p)."""
    out = _with_q([8, 10], 0, [[[9, 0.9]], [[10, 1.0]], [[11, 1.0]]])
    assert not out.impossible, out.impossible
    assert out.trials == [1, 0, 0] and out.expected[0] == pytest.approx(P[0] / 0.9)
    assert list(out.tally[0]) == [pytest.approx(P[0] / 0.9)]
    one_hot = sampling.acceptance(PROMPT, [8, 10], [[9, 10, 11]], [0], DESIGN, DRAFTS, "r", draft_q=[None])
    assert one_hot.expected[0] == pytest.approx(P[0])


def test_acceptance_flags_a_rejected_draft_whose_p_is_at_least_its_q():
    """q(9) = 0.3 < p(9) = 0.59: min(1, p / q) = 1, so no correct sampler rejects it."""
    out = _with_q([8, 10], 0, [[[9, 0.3]], [[10, 1.0]], [[11, 1.0]]])
    assert len(out.impossible) == 1 and "draft 9 rejected at position 0" in out.impossible[0]
    assert out.expected[0] == 1.0 and not out.tally[0]     # certain: no bet is placed on it


def test_acceptance_flags_a_recovery_the_residual_excludes():
    """The recovery comes from max(0, p - q): 10 with q(10) = 0.6 above p(10) cannot be it
    (the recovered-as-one-hot mutant's signature); with q(10) at p(10) the slack allows it."""
    p10 = P[1]
    out = _with_q([8, 10], 0, [[[9, 0.9], [10, 0.6]], [[10, 1.0]], [[11, 1.0]]])
    assert len(out.impossible) == 1 and "10, which max(0, p - q) excludes" in out.impossible[0]
    assert not _with_q([8, 10], 0, [[[9, 0.9], [10, p10 * (1 + sampling.RATIO_SLACK / 2)]], [[10, 1.0]],
                                    [[11, 1.0]]]).impossible


def test_acceptance_does_not_flag_the_last_step_cut_short_by_max_tokens():
    """max_tokens = 3: the step accepted all three drafts, but only two tokens fit."""
    out = _replay([8, 9, 10], [[9, 10, 11]], [3])
    assert not out.impossible
    assert out.trials == [1, 1, 1] and out.accepted == [1, 1, 1]
    out = _replay([8, 9], [[9, 10, 11]], [1])                       # cut before the recovery
    assert not out.impossible and out.trials == [1, 1, 0]


def test_acceptance_of_an_off_support_draft_is_that_tokens_probability():
    """p(d) for one token beyond the support is other / (V - K) (the zero logits share `other`)."""
    design = sampling.Design((2.0, 1.5, 1.0, 0.5), 16, 1.0)
    probs, other = design.probs()
    out = sampling.acceptance(PROMPT, [8, 9], [[15, 10, 11]], [0], design, DRAFTS, "r")   # 15 - 9 = offset 6
    assert out.expected[0] == pytest.approx(other / (16 - 4))
    [(p, counts)] = out.tally[0].items()
    assert p == pytest.approx(other / 12) and counts == [1, 0]


# --------------------------------------------------------------------------- 5. goodness of fit by hand

def _perfect(design: sampling.Design, n: int) -> list[int | str]:
    probs, _ = design.probs()
    counts = [round(n * p) for p in probs]
    return [j for j, c in enumerate(counts) for _ in range(c)]


@pytest.mark.parametrize("kw", [{}, {"top_k": 2}, {"top_p": 0.8}, {"top_k": 3}])
def test_goodness_of_fit_on_a_perfect_sample_and_one_impossible_token(kw):
    """counts == expected: p ~ 1. One token off the support (probability ~1e-15, or 0 after
    truncation) added: p < 1e-6, its binomial tail, however perfect the rest."""
    design = sampling.Design(LOGITS, VOCAB, T, **kw)
    values = _perfect(design, 10_000)
    fit = sampling.goodness_of_fit(values, design, ALPHA, TV)
    assert fit["passed"] and fit["p_value"] > 0.99 and fit["outside_support"] == 0
    assert fit["df"] == sum(p > 0 for p in design.probs()[0]) - 1
    fit = sampling.goodness_of_fit([*values, sampling.OFF_SUPPORT], design, ALPHA, TV)
    assert fit["outside_support"] == 1 and fit["p_value"] < 1e-6 and not fit["passed"]
    if kw:                                    # an offset truncation removed counts as outside too
        removed = next(j for j, p in enumerate(design.probs()[0]) if p == 0)
        fit = sampling.goodness_of_fit([*values, removed], design, ALPHA, TV)
        assert fit["outside_support"] == 1 and fit["p_value"] == 0.0 and not fit["passed"]


def test_goodness_of_fit_statistic_is_pearsons():
    """Against scipy's chisquare on the same counts (the sample of seed 0)."""
    from scipy import stats
    values = correct_run(0)[0]
    fit = sampling.goodness_of_fit(values, DESIGN, ALPHA, TV)
    counts, _ = sampling.histogram(values, K)
    p = np.array(DESIGN.probs()[0])
    want = stats.chisquare(counts, len(values) * p / p.sum())
    assert fit["statistic"] == pytest.approx(want.statistic, abs=1e-3)
    assert fit["p_value"] == sampling.exact_tail(counts, list(p)) == pytest.approx(want.pvalue, rel=1e-3)
