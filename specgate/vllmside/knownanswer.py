"""Known answers: what the known-answer fixtures continue a prompt with, and the positional
attention kernel that makes the target's answer depend on earlier tokens.

The context target's rule ("previous-plus-two"): greedy decoding appends x[t-1] + 2 (mod V)
after position t, reading x[t-1] through attention (x[0] itself at t = 0, where no earlier
token exists). On a prompt whose last two tokens are consecutive this is the successor chain
(t + 1, t + 2, ...), which the successor drafts propose exactly; on any other prompt it is
two interleaved chains, which those drafts get wrong at a position their design fixes.

The kernel: with RoPE (neox pairs, frequency theta_i = ROPE_THETA ** (-i / 32)) and a query and
key that are the same for every token, a head's score for a key d positions back is
    scale * g(d - c),   g(e) = sum_i w_i cos(e theta_i),  w_i proportional to DECAY ** i (i < PAIRS)
where the query's phases choose the centre c. g peaks at e = 0 (g(0) = 1) and stays at least
`margin` below its peak, and below g(1), for every other distance up to MAX_DISTANCE. So a
head centred at c = 1 reads the previous token, and one centred at c = -1 would read the next
token but, under a causal mask, reads itself: future leakage changes what it reads.
Stdlib only: the e2e tests and the fixture builder both import it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

HEAD_DIM = 64
ROPE_THETA = 10.0
PAIRS = 18
DECAY = 0.9
MAX_DISTANCE = 2048            # the fixtures' max_position_embeddings

CONTEXT_RULE = "previous-plus-two"
SUCCESSOR_RULE = "successor"


def frequency(pair: int) -> float:
    return ROPE_THETA ** (-pair / (HEAD_DIM // 2))


def weights() -> list[float]:
    raw = [DECAY ** i for i in range(PAIRS)]
    return [w / sum(raw) for w in raw]


def kernel(e: int) -> float:
    return sum(w * math.cos(e * frequency(i)) for i, w in enumerate(weights()))


def margins(max_distance: int = MAX_DISTANCE) -> tuple[float, float]:
    """(previous-token margin, self-head margin) over distances up to max_distance:
    g(0) - max g(e != 0), and min(g(0) - g(1), g(1) - max g(e >= 2))."""
    g = [kernel(e) for e in range(max_distance + 2)]
    return 1.0 - max(g[1:]), min(1.0 - g[1], g[1] - max(g[2:]))


def continuation(rule: str, prompt: Sequence[int], n: int, vocab: int) -> list[int]:
    """The n tokens greedy decoding appends to `prompt` under `rule`."""
    if not prompt:
        raise ValueError("a known-answer continuation needs a non-empty prompt")
    seq = list(prompt)
    for _ in range(n):
        if rule == SUCCESSOR_RULE:
            seq.append((seq[-1] + 1) % vocab)
        elif rule == CONTEXT_RULE:
            seq.append((seq[max(len(seq) - 2, 0)] + 2) % vocab)
        else:
            raise ValueError(f"unknown known-answer rule {rule!r}")
    return seq[len(prompt):]


def successor_drafts_exact(prompt: Sequence[int], n: int, vocab: int) -> bool:
    """Whether the context target continues `prompt` as the successor chain, so successor
    drafts are exact on it (else they are wrong at positions their design fixes)."""
    return continuation(CONTEXT_RULE, prompt, n, vocab) == continuation(SUCCESSOR_RULE, prompt, n, vocab)
