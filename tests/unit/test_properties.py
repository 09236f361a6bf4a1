"""Property tests (hypothesis) of the merge algebra and of PRR's exactness."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings, strategies as st

from paged import list_from_sets, make_paged, rel_err, sets_from_list
from sglang_prr import ops
from sglang_prr import reference as R

SETTINGS = settings(max_examples=60, deadline=None, derandomize=False)


def _state(seed: int, n: int, d: int = 8, empty_frac: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(n, d, generator=g)
    lse = torch.randn(n, generator=g) * 5
    empty = torch.rand(n, generator=g) < empty_frac
    return o.masked_fill(empty[:, None], 0.0), lse.masked_fill(empty, -math.inf)


def _close(a, b, tol=1e-5):
    (oa, la), (ob, lb) = a, b
    same_inf = torch.equal(torch.isneginf(la), torch.isneginf(lb))
    fin = torch.isfinite(la)
    return same_inf and torch.allclose(oa, ob, atol=tol, rtol=tol) and \
        torch.allclose(la[fin], lb[fin], atol=tol, rtol=tol)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 0.6))
def test_merge_is_associative_and_commutative(seed, empty_frac):
    (o1, l1), (o2, l2), (o3, l3) = (_state(seed + i, 5, empty_frac=empty_frac) for i in range(3))
    left = R.merge_state(*R.merge_state(o1, l1, o2, l2), o3, l3)
    right = R.merge_state(o1, l1, *R.merge_state(o2, l2, o3, l3))
    assert _close(left, right)
    assert _close(R.merge_state(o1, l1, o2, l2), R.merge_state(o2, l2, o1, l1))
    # Merging many at once equals folding pairwise.
    many = R.merge_partials(torch.stack([o1, o2, o3], -2), torch.stack([l1, l2, l3], -1))
    assert _close(many, left)


@SETTINGS
@given(st.integers(0, 2**31 - 1))
def test_empty_state_and_neg_inf_lse_are_identities(seed):
    o, l = _state(seed, 6)
    zero, ninf = torch.zeros_like(o), torch.full_like(l, -math.inf)
    assert _close(R.merge_state(o, l, zero, ninf), (o, l))
    # Garbage in o under lse=-inf must not leak (a kernel may leave padding unnormalised).
    junk = torch.full_like(o, 1e30)
    assert _close(R.merge_state(junk, ninf, o, l), (o, l))
    both = R.merge_state(zero, ninf, zero, ninf)
    assert (both[0] == 0).all() and torch.isneginf(both[1]).all()
    # Negative control: a finite lse is not an identity.
    assert not _close(R.merge_state(o, l, zero, l), (o, l))


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.sampled_from([1, 4]),
       st.data())
def test_prr_exact_equals_dsa_for_drawn_predictions(seed, batch, group, data):
    page, k = 16, 2
    lens = data.draw(st.lists(st.integers(3 * page + 1, 9 * page - 1), min_size=batch,
                              max_size=batch))
    P = make_paged(seed, lens, hk=2, group=group, page=page)
    kmin, kmax = P.quest_summary()
    o_dsa, _, a_idx, a_cnt = ops.dsa_decode(P.q, P.k_buf, P.v_buf, [kmin, kmax], P.table,
                                            P.seq_lens, "quest", k, 1, 1, page, P.sm_scale)
    width = 6
    p_sets = [[set(data.draw(st.lists(st.integers(0, int(P.nblk[b]) - 1), max_size=width)))
               for _ in range(2)] for b in range(batch)]
    p_idx, p_cnt = list_from_sets(p_sets, width)
    nb = P.nb
    o = ops.prr_decode(P.q, P.k_buf, P.v_buf, [kmin, kmax], P.table, P.seq_lens, p_idx, p_cnt,
                       torch.zeros(batch, 2, nb), torch.zeros(batch, 2, nb),
                       torch.zeros(batch, dtype=torch.long), torch.tensor([[0.5, 0.5, 0.5]] * batch),
                       "quest", k, width - 2, 1, 1, page, P.sm_scale)[0]
    assert rel_err(o, o_dsa) < 2e-5
