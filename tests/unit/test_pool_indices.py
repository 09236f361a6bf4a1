"""Indices outside their pool in the public ops: request slots (``rows``, ``p_rows``,
``idx_rows``, ``req_idx``), a table's page ids and KV slots (``out_loc``, ``new_loc``,
``req_to_token``'s). The reference's defined result is 0 (SGLang's padding row, page or slot), as
the kernels' ``in_pool`` does (``tests/gpu/test_pool_indices_kernels.py``). Before, Python's
negative indexing read and wrote another request's row or page (-1: the pool's last), and one
past the pool was an IndexError. Fresh seeds; a control beside each equality: the wrapped index
would have given another result."""

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


def test_in_pool_maps_indices_outside_the_pool_to_0():
    n = 7
    rows = torch.tensor([3, -1, 0, 7, 6, -7, 12], dtype=torch.int32)
    assert R.in_pool(rows, n).tolist() == [3, 0, 0, 0, 6, 0, 0]
    assert R.in_pool(rows, n).dtype == torch.int64


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
    lists[1][0], lists[1][Rn - 1] = 1, N  # row 0 and the pool's last differ (the control)
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


def _table_with_bad_page(P, bad):
    """P's table with one listed page (of request 1, its block 2) moved outside the pool, and the
    same table with page 0 there."""
    t, z = P.table.clone(), P.table.clone()
    t[1, 2], z[1, 2] = bad, 0
    return t, z


def test_a_table_page_outside_the_pool_reads_page_0():
    """Attention, Quest scores and InfLLM-v2 scores over a table whose page lies outside the
    pool (KV, summaries, compressed keys) read page 0 (before: the page counted from the pool's
    end, or an IndexError); the control: a real page there gives other results."""
    seed = _seed()
    P = make_paged(seed, [70, 60, 90], page=16)
    n_pages = P.k_buf.shape[0] // P.page
    kmin, kmax = P.quest_summary()
    ck = P.infllm_summary()
    B, Hk = len(P.seq_lens), P.k_buf.shape[1]
    idx = torch.arange(4, dtype=torch.int32).expand(B, Hk, 4).contiguous()
    cnt = torch.full((B, Hk), 4, dtype=torch.int32)
    for bad in (-1, -3, n_pages, n_pages + 11):
        t, z = _table_with_bad_page(P, bad)
        kv = (P.q, P.k_buf, P.v_buf)
        got = R.sparse_attn_partials(*kv, t, P.seq_lens, idx, cnt, P.page, P.sm_scale)
        want = R.sparse_attn_partials(*kv, z, P.seq_lens, idx, cnt, P.page, P.sm_scale)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (seed, bad)
        qs = R.quest_scores(P.q, kmin, kmax, t, P.nblk)
        assert torch.equal(qs, R.quest_scores(P.q, kmin, kmax, z, P.nblk)), (seed, bad)
        inf = R.infllm_scores(P.q, ck, t, P.seq_lens, P.page, P.sm_scale)
        assert torch.equal(inf, R.infllm_scores(P.q, ck, z, P.seq_lens, P.page, P.sm_scale))
    # control: another page there (request 0's first) changes all three
    w = P.table.clone()
    w[1, 2] = P.table[0, 0]
    other = R.sparse_attn_partials(*kv, w, P.seq_lens, idx, cnt, P.page, P.sm_scale)
    assert not torch.equal(other[1], got[1]), seed
    assert not torch.equal(R.quest_scores(P.q, kmin, kmax, w, P.nblk), qs), seed
    assert not torch.equal(R.infllm_scores(P.q, ck, w, P.seq_lens, P.page, P.sm_scale), inf)


def test_a_kv_slot_outside_the_pool_writes_page_0():
    """``quest_update``'s ``out_loc``, the selection's ``new_loc`` and ``infllm_update``'s
    ``out_loc``, ``req_idx`` and ``req_to_token`` slots outside their pools write (or read)
    page, row or slot 0; every other page keeps its summary (the control: a wrapped slot's page,
    the pool's last, would have changed)."""
    seed = _seed()
    P = make_paged(seed, [70, 60, 90], page=16)
    n_pages = P.k_buf.shape[0] // P.page
    Hk, D = P.k_buf.shape[1:]
    for bad in (-1, -(n_pages * P.page), n_pages * P.page, n_pages * P.page + 5):
        kmin, kmax = P.quest_summary()
        k = torch.randn(3, Hk, D)
        loc = torch.tensor([5 * P.page + 3, bad, 7 * P.page])
        pos = torch.tensor([19, 32, 48])
        runs = []
        for l_ in (loc, torch.where(loc == bad, 0, loc)):
            lo, hi = kmin.clone(), kmax.clone()
            R.quest_update(lo, hi, k, l_, pos, P.page)
            runs.append((lo, hi))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
        assert torch.equal(runs[0][0][-1], kmin[-1]), (seed, bad)  # the pool's last page kept
        assert not torch.equal(runs[0][0][0], kmin[0]), "control: page 0 took the key"
        # the selection's decode update (new_loc)
        B = len(P.seq_lens)
        new_k = torch.randn(B, Hk, D)
        new_pos = P.seq_lens - 1
        nl = (P.table[torch.arange(B), new_pos // P.page].long() * P.page + new_pos % P.page)
        nl[1] = bad
        outs = []
        for l_ in (nl, torch.where(nl == bad, 0, nl)):
            lo, hi = kmin.clone(), kmax.clone()
            R.quest_select(P.q, lo, hi, P.table, P.nblk, None, None, 2, 1, 1, 4,
                           new_k=new_k, new_pos=new_pos, page_size=P.page, new_loc=l_)
            outs.append(lo)
        written = {0} | set((nl[nl != bad] // P.page).tolist())
        keep = [p for p in range(n_pages) if p not in written]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0][keep], kmin[keep]), (seed, bad)
    # InfLLM-v2's update: a request slot, a window slot and an out_loc outside their pools
    ck0 = P.infllm_summary()
    base_rows = torch.full((1,), int(P.rows[0]))
    pos = torch.tensor([47])  # completes compressed key 1 (request 0 holds 70 tokens)
    out_loc = P.req_to_token[int(P.rows[0]), pos].long()
    for name in ("req_idx", "slot", "out_loc"):
        rtt, rq, ol = P.req_to_token.clone(), base_rows.clone(), out_loc.clone()
        zr, zq, zo = P.req_to_token.clone(), base_rows.clone(), out_loc.clone()
        if name == "req_idx":
            rq[0], zq[0] = -1, 0  # Python: the last row, request 2's
        elif name == "slot":
            rtt[int(P.rows[0]), 40], zr[int(P.rows[0]), 40] = P.k_buf.shape[0] + 3, 0
        else:
            ol[0], zo[0] = -(P.page * 2), 0
        a, b = ck0.clone(), ck0.clone()
        R.infllm_update(a, P.k_buf, rtt, rq, ol, pos, P.page)
        R.infllm_update(b, P.k_buf, zr, zq, zo, pos, P.page)
        assert torch.equal(a, b), (seed, name)
        keep = [p for p in range(n_pages) if p not in (0, int(out_loc[0]) // P.page)]
        assert torch.equal(a[keep], ck0[keep]), (seed, name)
        if name != "slot":  # control: the row or page Python's indexing would have used
            c = ck0.clone()
            wq = torch.full((1,), P.req_to_token.shape[0] - 1) if name == "req_idx" else rq
            wo = torch.full((1,), n_pages * P.page - 2 * P.page) if name == "out_loc" else ol
            R.infllm_update(c, P.k_buf, rtt, wq, wo, pos, P.page)
            assert not torch.equal(c, a), (seed, name)


def _window_mean(keys):
    """A compressed key as the reference writes it: the window's keys summed in position order
    in float32, then scaled by 1/32."""
    acc = torch.zeros_like(keys[0], dtype=torch.float32)
    for k in keys.float():
        acc += k
    return acc * (1.0 / keys.shape[0])


def test_an_infllm_window_past_the_request_row_reads_its_column_0():
    """A position whose window runs past ``req_to_token``'s row (an IndexError before) reads the
    row's column 0 there: the compressed key is the mean over those slots."""
    seed = _seed()
    P = make_paged(seed, [70, 60], page=16)
    width = P.req_to_token.shape[1]
    pos = (width // 16) * 16 + 15  # completes a key; its window's end lies past the row
    assert pos >= width > pos - 31
    row = int(P.rows[1])
    out_loc = torch.tensor([5 * P.page + pos % P.page])
    ck = P.infllm_summary()
    R.infllm_update(ck, P.k_buf, P.req_to_token, torch.tensor([row]), out_loc,
                    torch.tensor([pos]), P.page)
    raw = torch.arange(pos - 31, pos + 1)
    cols = torch.where(raw < width, raw, torch.zeros_like(raw))
    want = _window_mean(P.k_buf[P.req_to_token[row, cols].long()])
    i = (pos - 31) // 16
    j = i + 1 - (pos // P.page) * (P.page // 16)
    assert torch.equal(ck[5, j], want), seed
    other = _window_mean(P.k_buf[P.req_to_token[row, raw.clamp(max=width - 1)].long()])
    assert not torch.equal(other, want), "control: the clamped column reads another slot"
