"""Request slots outside their pool in the kernels (``pool_row``): a slot below 0 or at/after the
pool's rows is row 0, SGLang's padding row, as the reference's ``pool_rows`` (the reference's
own test: ``tests/unit/test_pool_rows.py``). Before, the kernels read and wrote past the pool.
Each kernel that takes slots: the attention's lists (``idx_rows``), the fused merge's P
(``p_rows``), the set difference, the predictor, and selection + predictor in one launch.
Fresh seeds; beside each equality a control (another row gives another result). Row 0's own
values are not compared where two entries write it (SGLang's padding row: any writer may win)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sglang_prr import reference as ref

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402  (the SM90 gate, tests/gpu/sm90.py)

require_sm90()

from test_kernels import DEV, make_pool, random_lists, seeded  # noqa: E402

CUDA = torch.ops.sglang_prr_cuda


def _dev(*ts):
    return [t.to(DEV) if t is not None else None for t in ts]


def _bad_rows(good, n):
    """``good`` with its second entry moved outside a pool of n rows, once per kind of bad slot
    (Python's indexing would wrap -1 and -n; n and past it are past the pool)."""
    for bad in (-1, -n, n, n + 9):
        rows = good.clone()
        rows[1] = bad
        zero = good.clone()
        zero[1] = 0
        yield bad, rows, zero


@pytest.mark.parametrize("rows64", [True, False])
def test_attention_lists_and_merged_p_at_bad_slots_are_row_0s(rows64):
    seeded(f"pool rows attention {rows64}")
    B, Hq, Hk, D, page = 3, 16, 4, 128, 64
    seq_lens = [random.randint(4 * page, 9 * page) for _ in range(B)]
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq_lens, torch.bfloat16)
    nblk = [(s + page - 1) // page for s in seq_lens]
    Rn, N = 6, 3
    lists = random_lists(Rn, Hk, N, [min(nblk)] * Rn)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    sm = 1.0 / math.sqrt(D)
    base = _dev(q, k_buf, v_buf, table, sl)
    good = torch.tensor([2, 3, 5]) if rows64 else torch.tensor([2, 3, 5], dtype=torch.int32)
    a_idx, a_cnt = random_lists(B, Hk, N + 2, nblk)
    for bad, rows, zero in _bad_rows(good, Rn):
        got = CUDA.sparse_attn_partials(*base, *_dev(*lists), page, sm, rows.to(DEV))
        want = CUDA.sparse_attn_partials(*base, *_dev(*lists), page, sm, zero.to(DEV))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), bad
        r = ref.sparse_attn_partials(q, k_buf, v_buf, table, sl, *lists, page, sm, idx_rows=rows)
        fin = torch.isfinite(r[1])
        assert torch.equal(torch.isfinite(got[1].cpu()), fin)
        assert torch.allclose(got[1].cpu()[fin], r[1][fin], atol=2e-2), bad
        # the fused merge: M from P at the same slots, P's spec partials merged at them
        m = CUDA.set_difference(*_dev(a_idx, a_cnt, *lists), NB, rows.to(DEV))
        m_ref = ref.set_difference_counted(a_idx, a_cnt, *lists, NB, p_rows=rows)
        assert torch.equal(m[0].cpu(), m_ref[0]) and torch.equal(m[1].cpu(), m_ref[1]), bad
        spec = CUDA.sparse_attn_partials(*base, *_dev(*lists), page, sm, zero.to(DEV))
        merged = [CUDA.sparse_attn_merge(*base, *m, page, sm, *spec, *_dev(*lists, a_idx, a_cnt),
                                         NB, True, r_.to(DEV), None)[0] for r_ in (rows, zero)]
        assert torch.equal(merged[0], merged[1]), bad
        exact = ref.attend_set(q, k_buf, v_buf, table, sl, a_idx, a_cnt, page, sm)[0]
        assert torch.allclose(merged[0].cpu(), exact, atol=2e-2), "exact: attention over A"
    other = CUDA.sparse_attn_partials(*base, *_dev(*lists), page, sm, good.flip(0).to(DEV))
    assert not torch.equal(other[1], want[1]), "control: the slots matter"


def test_predictor_at_bad_slots_updates_row_0_only():
    seeded("pool rows predictor")
    Rn, B, Hk, NB, n_pred = 9, 4, 2, 50, 6
    good = torch.tensor([7, 2, 4, 5])
    for bad, rows, _ in _bad_rows(good, Rn):
        level = torch.randn(Rn, Hk, NB)
        trend = torch.randn(Rn, Hk, NB) * 0.1
        n_init = torch.randint(10, NB, (Rn,))
        theta = torch.rand(Rn, 3) * 0.8 + 0.1
        p_idx = torch.full((Rn, Hk, n_pred + 2), -7, dtype=torch.int32)
        p_cnt = torch.full((Rn, Hk), -7, dtype=torch.int32)
        scores = torch.randn(B, Hk, NB)
        nblk = torch.randint(20, NB - 1, (B,))
        state = [level, trend, n_init, p_idx, p_cnt]
        want = [t.clone() for t in state]
        ref.predict_update_rows(*want, theta, rows, scores, nblk, nblk + 1, n_pred, 1, 1)
        got = _dev(*state)
        CUDA.predict_update_rows(*got, *_dev(theta, rows, scores, nblk, nblk + 1), n_pred, 1, 1,
                                 None)
        for w, o in zip(want, got):
            assert torch.equal(w, o.cpu()), bad  # one writer per row here: row 0 included
        kept = [1, 3, 6, 8]
        assert torch.equal(got[0].cpu()[kept], level[kept]), bad
        assert not torch.equal(got[0].cpu()[0], level[0]), "control: row 0 was updated"


def test_selection_and_predictor_at_bad_slots_are_row_0s():
    """The fused launch: P(t) read, the state updated and P(t+1) written at slots outside the
    pools, against the same launch with those slots at 0 (rows other than 0 compared)."""
    seeded("pool rows select_predict")
    B, Hq, Hk, D, NB, k, n_pred, sink, local = 3, 32, 8, 128, 300, 16, 24, 1, 1
    Pg = NB * B + 5
    kmin = torch.randn(Pg, Hk, D)
    kmax = kmin + torch.rand(Pg, Hk, D)
    table = torch.randint(1, Pg, (B, NB))
    nblk = torch.randint(NB // 2, NB + 1, (B,))
    nxt = torch.minimum(nblk + 1, torch.tensor(NB))
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    n_out = k + sink + local
    Rn = 6
    W = n_pred + sink + local
    good = torch.tensor([4, 2, 5])
    results = {}
    for bad, rows, zero in _bad_rows(good, Rn):
        p_idx, p_cnt = random_lists(Rn, Hk, W, [int(nblk.min())] * Rn)
        level = torch.randn(Rn, Hk, NB)
        trend = torch.randn(Rn, Hk, NB) * 0.1
        n_init = torch.randint(0, NB, (Rn,))
        theta = torch.rand(Rn, 3)
        for name, r in (("bad", rows), ("zero", zero)):
            d = _dev(p_idx, p_cnt, level, trend, n_init)
            out = CUDA.quest_select_predict(*_dev(q, kmin, kmax, table, nblk, nxt), d[0], d[1],
                                            *_dev(r, r), d[2], d[3], d[4], *_dev(theta, r), k,
                                            n_pred, sink, local, n_out)
            results[name] = ([x.cpu() for x in out], [x.cpu() for x in d], level)
        (o_b, s_b, lv), (o_z, s_z, _) = results["bad"], results["zero"]
        for x, y in zip(o_b, o_z):
            assert torch.equal(x, y), bad
        for x, y in zip(s_b, s_z):
            assert torch.equal(x[1:], y[1:]), bad  # row 0: the padding row
        assert torch.equal(s_b[2][[1, 3]], lv[[1, 3]]), "rows no slot names keep their state"
        assert not torch.equal(s_b[2][4], lv[4]), "control: a named row was updated"
