"""Indices outside their pool in the kernels (``in_pool``): a request slot, a table's page id or a
KV slot below 0 or at/after its pool's size is 0, SGLang's padding row, page or slot, as the
reference's ``in_pool`` (the reference's own test: ``tests/unit/test_pool_indices.py``). Before,
the kernels read and wrote past the pools. Each kernel that takes such indices: the attention's
lists (``idx_rows``) and pages, the fused merge's P (``p_rows``), the set difference, the
predictor, selection + predictor in one launch, the Quest scores, selection and summary update,
InfLLM-v2's scores and update. Fresh seeds; beside each equality a control (another index gives
another result). Row 0's own values are not compared where two entries write it (SGLang's padding
row: any writer may win)."""

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


def _pages_case():
    B, Hq, Hk, D, page = 3, 16, 4, 128, 64
    seq_lens = [random.randint(4 * page, 9 * page) for _ in range(B)]
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq_lens, torch.bfloat16)
    n_pages = k_buf.shape[0] // page
    nblk = (sl + page - 1) // page
    kmin = torch.randn(n_pages, Hk, D)
    kmax = kmin + torch.rand(n_pages, Hk, D)
    ck = torch.randn(n_pages, page // 16, Hk, D)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    return B, Hk, D, page, k_buf, v_buf, table, sl, nblk, n_pages, kmin, kmax, ck, q


def test_a_table_page_outside_the_pool_reads_page_0():
    """Attention, Quest scores and selection, InfLLM-v2 scores: a table's page outside the pool
    gives the bits of page 0 there; the control, a real page there, other bits."""
    seeded("pool pages table")
    B, Hk, D, page, k_buf, v_buf, table, sl, nblk, n_pages, kmin, kmax, ck, q = _pages_case()
    idx = torch.arange(4, dtype=torch.int32).expand(B, Hk, 4).contiguous()
    cnt = torch.full((B, Hk), 4, dtype=torch.int32)
    sm = 1.0 / math.sqrt(D)

    def run(t):
        kv = _dev(q, k_buf, v_buf, t, sl)
        attn = CUDA.sparse_attn_partials(*kv, *_dev(idx, cnt), page, sm, None)
        qs = CUDA.quest_scores(*_dev(q, kmin, kmax, t, nblk))
        sel = CUDA.quest_select(*_dev(q, kmin, kmax, t, nblk), None, None, 2, 1, 1, 4)
        inf = CUDA.infllm_scores(*_dev(q, ck, t, sl), page, sm)
        return [x.cpu() for x in (*attn, qs, *sel, inf)]

    for bad in (-1, -n_pages, n_pages, n_pages + 7):
        t, z = table.clone(), table.clone()
        t[1, 2], z[1, 2] = bad, 0
        got, want = run(t), run(z)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), (bad, i)
        r = ref.quest_scores(q, kmin, kmax, t, nblk)
        assert torch.allclose(got[2], r, rtol=1e-5, atol=1e-3), bad
    w = table.clone()
    w[1, 2] = table[0, 0]
    other = run(w)
    for i in (1, 2, 8):  # attention's lse, the Quest scores, the InfLLM-v2 scores
        assert not torch.equal(other[i], got[i]), f"control {i}: the page matters"


@pytest.mark.parametrize("one_per_page", [False, True])
def test_a_kv_slot_outside_the_pool_writes_page_0(one_per_page):
    """Quest's summary update (``out_loc``), the selection's decode update (``new_loc``) and
    InfLLM-v2's update (``req_idx``, ``req_to_token``'s slots, ``out_loc``): each index outside
    its pool acts as 0, and every page no valid index names keeps its values."""
    seeded(f"pool pages slots {one_per_page}")
    B, Hk, D, page, k_buf, v_buf, table, sl, nblk, n_pages, kmin, kmax, ck, q = _pages_case()
    slots = n_pages * page
    for bad in (-1, -slots, slots, slots + 5):
        k = torch.randn(3, Hk, D)
        loc = torch.tensor([5 * page + 3, bad, 7 * page])
        pos = torch.tensor([3, page, 2 * page])  # two of them a page's first token
        runs = []
        for l_ in (loc, torch.where(loc == bad, 0, loc)):
            lo, hi = _dev(kmin, kmax)
            CUDA.quest_update(lo, hi, *_dev(k, l_, pos), page, one_per_page)
            runs.append((lo.cpu(), hi.cpu()))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), bad
        assert torch.equal(runs[0][0][-1], kmin[-1]), bad
        assert not torch.equal(runs[0][0][0], kmin[0]), "control: page 0 took the key"
        new_k = torch.randn(B, Hk, D, dtype=torch.bfloat16)
        new_pos = sl - 1
        nl = table[torch.arange(B), new_pos // page] * page + new_pos % page
        nl[1] = bad
        outs = []
        for l_ in (nl, torch.where(nl == bad, 0, nl)):
            lo, hi = _dev(kmin, kmax)
            CUDA.quest_select(*_dev(q), lo, hi, *_dev(table, nblk), None, None, 2, 1, 1, 4,
                              None, None, None, *_dev(new_k, new_pos), page, l_.to(DEV))
            outs.append(lo.cpu())
        written = {0} | set((nl[nl != bad] // page).tolist())
        keep = [p for p in range(n_pages) if p not in written]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0][keep], kmin[keep]), bad
    # InfLLM-v2: request slots, window slots and out_loc outside their pools
    max_ctx = int(nblk.max()) * page
    rtt = torch.zeros(B + 1, max_ctx, dtype=torch.int64)
    for b in range(B):
        cols = torch.arange(max_ctx)
        rtt[b + 1] = table[b, cols // page] * page + cols % page
    pos = torch.tensor([47, 95])
    req = torch.tensor([1, 3])
    out_loc = torch.stack([rtt[1, 47], rtt[3, 95]])
    for name in ("req_idx", "slot", "out_loc"):
        r_, q_, o_ = rtt.clone(), req.clone(), out_loc.clone()
        zr, zq, zo = rtt.clone(), req.clone(), out_loc.clone()
        if name == "req_idx":
            q_[0], zq[0] = -1, 0
        elif name == "slot":
            r_[1, 40], zr[1, 40] = k_buf.shape[0] + 3, 0
        else:
            o_[0], zo[0] = -(2 * page), 0
        a, b_ = _dev(ck, ck)
        CUDA.infllm_update(a, *_dev(k_buf, r_, q_, o_, pos), page)
        CUDA.infllm_update(b_, *_dev(k_buf, zr, zq, zo, pos), page)
        assert torch.equal(a, b_), name
        written = {0} | set((out_loc // page).tolist())
        keep = [p for p in range(n_pages) if p not in written]
        assert torch.equal(a.cpu()[keep], ck[keep]), name
    # a window past the request's row (positions the caller got wrong): column 0 there
    p2 = torch.tensor([max_ctx + 15])
    o2 = torch.tensor([int(rtt[1, 5])])  # a slot of request 0: its page takes the key
    got = _dev(ck)[0]
    CUDA.infllm_update(got, *_dev(k_buf, rtt, torch.tensor([1]), o2, p2), page)
    want = ck.clone()
    ref.infllm_update(want, k_buf, rtt, torch.tensor([1]), o2, p2, page)
    assert torch.allclose(got.cpu(), want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want, ck), "control: the key was written"
