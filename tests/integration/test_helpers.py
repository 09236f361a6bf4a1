"""The logprob comparison the server tests rest on: equal outputs compare equal, a real change
compares unequal, and a greedy flip on a near-tie counts as rounding, not as a change."""

from __future__ import annotations

import math
import random

from helpers import TOP_N, max_logprob_diff


def _out(steps):
    """A /generate answer from per-step top-N lists [(id, logprob), ...], greedy = first."""
    return {"meta_info": {
        "output_token_logprobs": [(s[0][1], s[0][0], None) for s in steps],
        "output_top_logprobs": [[(lp, t, None) for t, lp in s] for s in steps]}}


def _steps(rng, n=6):
    steps = []
    for _ in range(n):
        ids = rng.sample(range(6, 500), TOP_N)
        lps = sorted((-rng.uniform(2.0, 6.0) for _ in ids), reverse=True)
        steps.append(list(zip(ids, lps)))
    return steps


def _nudge(steps, eps):
    return [[(t, lp + eps) for t, lp in s] for s in steps]


def test_equal_and_rounding_and_change():
    rng = random.Random(random.randrange(1 << 30))
    a = _steps(rng)
    assert max_logprob_diff(_out(a), _out(a)) == 0.0
    assert math.isclose(max_logprob_diff(_out(a), _out(_nudge(a, 3e-6))), 3e-6, rel_tol=1e-6)
    # negative control: another token at a later step is a different output
    b = [list(s) for s in a]
    b[3] = [b[3][1], b[3][0]] + b[3][2:]
    assert max_logprob_diff(_out(a), _out(b)) == math.inf
    # a different length is a different output
    assert max_logprob_diff(_out(a), _out(a[:-1])) == math.inf


def test_near_tie_flip_is_rounding_only_when_tied_in_both_runs():
    rng = random.Random(random.randrange(1 << 30))
    a = _steps(rng)
    (t0, lp0), (t1, _) = a[4][0], a[4][1]
    a[4] = [(t0, lp0), (t1, lp0 - 5e-6)] + a[4][2:]
    b = [list(s) for s in a]
    b[4] = [(t1, lp0 - 1e-6), (t0, lp0 - 2e-6)] + a[4][2:]   # flipped by 6e-6
    b[5] = _steps(rng, 1)[0]                                  # another context after the flip
    d = max_logprob_diff(_out(a), _out(b))
    assert 0 < d < 1e-5, d
    # negative control: the same flip with a gap of 0.1 in one run is a real change
    c = [list(s) for s in b]
    c[4] = [(t1, lp0 + 0.1), (t0, lp0)] + a[4][2:]
    assert max_logprob_diff(_out(a), _out(c)) == math.inf
    # and a flip to a token outside the other run's top-N is too
    e = [list(s) for s in b]
    e[4] = [(999, lp0)] + a[4][1:]
    assert max_logprob_diff(_out(a), _out(e)) == math.inf
