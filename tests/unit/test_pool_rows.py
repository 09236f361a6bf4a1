"""Request slots outside their pool (``rows``, ``p_rows``, ``idx_rows`` of the public ops): the
reference's defined result, row 0 (SGLang's padding row), as the kernels' ``pool_row`` does
(``tests/gpu/test_pool_rows_kernels.py``). Before, Python's negative indexing read and wrote
another request's row (-1: the pool's last), and a slot past the pool was an IndexError. Fresh
seeds; a control beside each equality: the wrapped row would have given another result."""

from __future__ import annotations

import random

import torch

from paged import make_paged
from sglang_prr import reference as R


def _seed() -> int:
    s = random.randrange(2 ** 31)
    torch.manual_seed(s)
    return s


def _bad(n: int) -> list:
    """Slots outside a pool of n rows: negative (Python would wrap them), n and past it."""
    return [-1, -n, n, n + 5]


def test_pool_rows_maps_slots_outside_the_pool_to_row_0():
    n = 7
    rows = torch.tensor([3, -1, 0, 7, 6, -7, 12], dtype=torch.int32)
    assert R.pool_rows(rows, n).tolist() == [3, 0, 0, 0, 6, 0, 0]
    assert R.pool_rows(rows, n).dtype == torch.int64


def _lists(Rn, Hk, N, nb):
    idx = torch.stack([torch.randperm(nb)[:N] for _ in range(Rn * Hk)]).view(Rn, Hk, N)
    return idx.sort(-1).values.int(), torch.randint(1, N + 1, (Rn, Hk), dtype=torch.int32)


def test_lists_read_at_a_slot_outside_the_pool_are_row_0s():
    """``sparse_attn_partials(idx_rows)``, ``sparse_attn_merge(p_rows)`` and
    ``set_difference_counted(p_rows)``: each bad slot reads row 0."""
    seed = _seed()
    P = make_paged(seed, [70, 45, 90, 33])
    B, Hk, nb = len(P.seq_lens), P.k_buf.shape[1], P.nb
    Rn, N = 6, 3
    lists = _lists(Rn, Hk, N, min(int(P.nblk.min()), nb))
    for bad in _bad(Rn):
        rows = torch.tensor([2, bad, 5, 1])
        zero = torch.where(rows == bad, torch.zeros_like(rows), rows)
        wrap = torch.where(rows == bad, torch.full_like(rows, bad % Rn), rows)
        args = (P.q, P.k_buf, P.v_buf, P.table, P.seq_lens)
        got = R.sparse_attn_partials(*args, *lists, P.page, P.sm_scale, idx_rows=rows)
        want = R.sparse_attn_partials(*args, *lists, P.page, P.sm_scale, idx_rows=zero)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (seed, bad)
        if bad % Rn != 0:  # control: the row Python's indexing would have read differs
            other = R.sparse_attn_partials(*args, *lists, P.page, P.sm_scale, idx_rows=wrap)
            assert not torch.equal(other[1], got[1]), (seed, bad)
        a_idx, a_cnt = _lists(B, Hk, N, min(int(P.nblk.min()), nb))
        m = R.set_difference_counted(a_idx, a_cnt, *lists, nb, p_rows=rows)
        assert all(torch.equal(g, w) for g, w in
                   zip(m, R.set_difference_counted(a_idx, a_cnt, *lists, nb, p_rows=zero)))
        o_spec, lse_spec = R.sparse_attn_partials(*args, *lists, P.page, P.sm_scale,
                                                  idx_rows=zero)
        merged = [R.sparse_attn_merge(*args, *m, P.page, P.sm_scale, o_spec, lse_spec, *lists,
                                      a_idx, a_cnt, nb, True, p_rows=r) for r in (rows, zero)]
        assert torch.equal(merged[0][0], merged[1][0]), (seed, bad)
        # exact: P read at row 0 for both the difference and the merge gives attention over A
        dense = R.attend_set(*args, a_idx, a_cnt, P.page, P.sm_scale)
        assert torch.allclose(merged[0][0], dense[0], atol=1e-5, rtol=1e-4), (seed, bad)


def test_predictor_state_at_a_slot_outside_the_pool_is_row_0s():
    """``predict_update_rows``: a bad state slot updates row 0 (the padding row) and leaves every
    other row, the pool's last included (-1 wrapped there before), as it was."""
    seed = _seed()
    Rn, B, Hk, NB, n_pred = 7, 3, 2, 40, 5
    for bad in _bad(Rn):
        level = torch.randn(Rn, Hk, NB)
        trend = torch.randn(Rn, Hk, NB) * 0.1
        n_init = torch.randint(5, NB, (Rn,))
        theta = torch.rand(Rn, 3) * 0.8 + 0.1
        p_idx = torch.full((Rn, Hk, n_pred + 2), -1, dtype=torch.int32)
        p_cnt = torch.zeros(Rn, Hk, dtype=torch.int32)
        scores = torch.randn(B, Hk, NB)
        nblk = torch.randint(20, NB, (B,))
        state = (level, trend, n_init, p_idx, p_cnt)
        runs = {}
        for name, rows in (("bad", [3, bad, 5]), ("zero", [3, 0, 5])):
            s = [t.clone() for t in state]
            R.predict_update_rows(*s, theta, torch.tensor(rows), scores, nblk, nblk, n_pred, 1,
                                  1)
            runs[name] = s
        for g, w in zip(runs["bad"], runs["zero"]):
            assert torch.equal(g, w), (seed, bad)
        kept = [1, 2, 4, 6]
        assert torch.equal(runs["bad"][0][kept], level[kept]), (seed, bad)
        assert not torch.equal(runs["bad"][0][0], level[0]), "control: row 0 was the one updated"
