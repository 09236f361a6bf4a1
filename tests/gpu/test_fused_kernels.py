"""The fused SM90 kernels (one launch each) against the pure-torch reference, on the GPU.

* ``sparse_attn_merge``: attention over a block list and the merge of its partials, optionally with
  speculative partials filtered to ``P n A`` (the PRR repair + exact merge) or all kept (union);
* ``quest_select``: Quest scores + top-K (A) + ``M = A \\ P``, each shape through every selection
  path (``SGLANG_PRR_SELECT_KERNEL``: the one-pass kernel where it fits, the row-tail kernels,
  the scores and the rows' tails in two launches);
* ``predict_update``: Holt update + P(t+1).

The kernels finish with "the last CTA of a group merges", through counters that must return to
zero after every launch: the graph test replays all three with changing counts. Conventions as in
``test_kernels.py`` (printed seeds, poisoned outputs, the CUDA op called directly, a negative
control beside each equality). Skipped with a reason without a CUDA SM90 device.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from sglang_prr import reference as ref

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402  (the SM90 gate, tests/gpu/sm90.py)

require_sm90()

from sglang_prr import ops  # noqa: E402
from test_kernels import (ATTN_CASES, DEV, capture, make_pool, poison, random_lists,  # noqa: E402
                          rel_err, seeded, set_select_path, _scores_with_ties)

CUDA = torch.ops.sglang_prr_cuda


@pytest.fixture(params=["auto", "onepass", "rowtail", "split", "split-scan", "onepass-grid2",
                        "split-grid3", "auto-gridrows", "auto-gridtable"])
def select_kernel(request, monkeypatch):
    """The selection kernel the launcher is asked for (read at each launch; sizes the one-pass
    kernel does not take run the row-tail kernels either way); ``auto``: the launcher's shape
    rule (serial DSA's selection over batch x blocks >= 8192 takes the two launches);
    ``onepass-grid2`` / ``split-grid3``: grids of at most 2
    (3) CTAs a row that loop over the row's chunks (blocks), ``auto-gridrows`` /
    ``auto-gridtable``: the shape rule with every grid at two waves / at the table's width
    (``SGLANG_PRR_SELECT_GRID``; by default the scores kernel takes two waves, the one-pass
    kernel the table; ``set_select_path``); ``split-scan``: the two launches with the rows'
    lists by CTA scans instead of warp walks (``SGLANG_PRR_TOPK=scan``)."""
    set_select_path(monkeypatch, request.param)
    return request.param


def _dev(*ts):
    return [t.to(DEV) if t is not None else None for t in ts]


def _attn_case(B, Hq, Hk, D, page, dtype, pages=9):
    """``pages``: the longest request in pages; above 9, every request has at least half of it
    (lists of A, P and M wider than a CTA's 128 threads)."""
    lo = 1 if pages <= 9 else pages * page // 2
    seq_lens = [random.randint(lo, pages * page) + random.randint(0, page - 1) for _ in range(B)]
    seq_lens[0] = max(seq_lens[0], 3 * page + page // 2 + 1)  # a partial last block
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq_lens, dtype, table64=(B % 2 == 1))
    nblk = [(s + page - 1) // page for s in seq_lens]
    q = torch.randn(B, Hq, D).to(dtype)
    return q, k_buf, v_buf, table, sl, NB, nblk


def _check_state(o, lse, o_ref, lse_ref, tol=3e-5):
    o, lse = o.cpu(), lse.cpu()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "unwritten output"
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), fin), "empty rows differ"
    assert (o[~fin] == 0).all(), "an empty state must be (0, -inf)"
    e_o, e_l = rel_err(o, o_ref), rel_err(lse[fin], lse_ref[fin])
    print(f"rel err o={e_o:.2e} lse={e_l:.2e}")
    assert e_o < tol and e_l < tol


# The kernel reads 16-bit KV; float32 KV runs the reference (test_kernels checks that path).
KERNEL_ATTN_CASES = [c for c in ATTN_CASES if c[-1] != torch.float32]


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype", KERNEL_ATTN_CASES)
def test_sparse_attn_merge_is_attend_set(B, Hq, Hk, D, page, dtype):
    seeded(f"attn_merge B={B} Hq={Hq} Hk={Hk} D={D} page={page} {dtype}")
    q, k_buf, v_buf, table, sl, NB, nblk = _attn_case(B, Hq, Hk, D, page, dtype)
    N = max(nblk) + 3  # K larger than the blocks available
    idx, cnt = random_lists(B, Hk, N, nblk)
    cnt[-1, -1] = 0  # an empty row: (0, -inf)
    idx[-1, -1] = -1
    sm = 1.0 / math.sqrt(D)
    o_ref, lse_ref = ref.attend_set(q.float(), k_buf, v_buf, table, sl, idx, cnt, page, sm)
    poison(((B, Hq, D), torch.float32), ((B, Hq), torch.float32))
    o, lse = CUDA.sparse_attn_merge(*_dev(q, k_buf, v_buf, table, sl, idx, cnt), page, sm,
                                    None, None, None, None, None, None, 0, True)
    _check_state(o, lse, o_ref, lse_ref)
    # Negative control: one more block in one row changes that row's output.
    b = 0
    c = int(cnt[b, 0])  # host-ok: test
    if c < nblk[b]:
        extra = sorted(set(range(nblk[b])) - set(idx[b, 0, :c].tolist()))[0]
        idx2, cnt2 = idx.clone(), cnt.clone()
        ids = sorted(idx[b, 0, :c].tolist() + [extra])
        idx2[b, 0, :c + 1] = torch.tensor(ids, dtype=torch.int32)
        cnt2[b, 0] = c + 1
        o_bad, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, idx2, cnt2, page, sm)
        assert rel_err(o.cpu()[b, :Hq // Hk], o_bad[b, :Hq // Hk]) > 1e-4


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype,pages", [
    (1, 32, 8, 128, 64, torch.bfloat16, 9), (3, 8, 8, 128, 16, torch.bfloat16, 9),
    (17, 32, 8, 128, 32, torch.float16, 9), (3, 64, 8, 128, 128, torch.bfloat16, 9),
    (3, 16, 4, 64, 64, torch.bfloat16, 9),
    (2, 16, 4, 128, 16, torch.bfloat16, 600)])  # lists of 150-300 entries: wider than a CTA
@pytest.mark.parametrize("exact", [True, False])
def test_repair_merge_with_arbitrary_prediction(B, Hq, Hk, D, page, dtype, pages, exact):
    """PRR's repair + merge in one launch, for arbitrary P: exact == attention over A whatever P
    was; union == attention over P u A."""
    seeded(f"repair_merge B={B} GQA={Hq // Hk} page={page} pages={pages} exact={exact}")
    q, k_buf, v_buf, table, sl, NB, nblk = _attn_case(B, Hq, Hk, D, page, dtype, pages)
    Na = min(nblk) // 2 + 2
    Np = Na + 3
    a_idx, a_cnt = random_lists(B, Hk, Na, nblk)
    p_idx, p_cnt = random_lists(B, Hk, Np, nblk)
    a_idx[0, 0], a_cnt[0, 0] = p_idx[0, 0, :Na], p_cnt[0, 0].clamp(max=Na)  # a perfect hit row
    a_idx[0, 0, a_cnt[0, 0]:] = -1
    a_idx[0, -1], a_cnt[0, -1] = -1, 0  # a row that selected nothing: P \ A = P
    if p_cnt[0, -1] == 0:
        p_idx[0, -1, 0], p_cnt[0, -1] = 0, 1
    m_idx, m_cnt = ref.set_difference(a_idx, a_cnt, p_idx, p_cnt, NB)
    sm = 1.0 / math.sqrt(D)
    qd, kd, vd, td, sld = _dev(q, k_buf, v_buf, table, sl)
    o_s, lse_s = CUDA.sparse_attn_partials(qd, kd, vd, td, sld, *_dev(p_idx, p_cnt), page, sm)
    o_ref, lse_ref = ref.sparse_attn_merge(q.float(), k_buf, v_buf, table, sl, m_idx, m_cnt, page,
                                           sm, o_s.cpu(), lse_s.cpu(), p_idx, p_cnt, a_idx, a_cnt,
                                           NB, exact)
    poison(((B, Hq, D), torch.float32), ((B, Hq), torch.float32))
    o, lse = CUDA.sparse_attn_merge(qd, kd, vd, td, sld, *_dev(m_idx, m_cnt), page, sm, o_s,
                                    lse_s, *_dev(p_idx, p_cnt, a_idx, a_cnt), NB, exact)
    _check_state(o, lse, o_ref, lse_ref)
    # The property PRR rests on, straight from the definition (no merge code involved).
    if exact:
        o_a, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, a_idx, a_cnt, page, sm)
    else:
        u = ref.list_to_mask(a_idx, a_cnt, NB) | ref.list_to_mask(p_idx, p_cnt, NB)
        u_idx, u_cnt = ref.mask_to_list(u, NB)
        o_a, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, u_idx, u_cnt, page, sm)
    assert rel_err(o, o_a) < 3e-5
    # Negative control: the other mode differs wherever P \ A is non-empty.
    o_other, _ = CUDA.sparse_attn_merge(qd, kd, vd, td, sld, *_dev(m_idx, m_cnt), page, sm, o_s,
                                        lse_s, *_dev(p_idx, p_cnt, a_idx, a_cnt), NB, not exact)
    extra = (ref.list_to_mask(p_idx, p_cnt, NB) & ~ref.list_to_mask(a_idx, a_cnt, NB)).any(-1)
    assert extra.any()
    G = Hq // Hk
    rows = extra.repeat_interleave(G, dim=1)
    assert rel_err(o_other.cpu()[rows], o.cpu()[rows]) > 1e-4


# The attention launch's knobs: the grid's order (KV heads first by default, list entries first
# forced) and the merge (split off by the grid's size by default, forced either way); the last
# setting is the launch before the shape rule.
LAUNCH_KNOBS = {"default": {}, "grid entries": {"SGLANG_PRR_ATTN_GRID": "entries"},
                "merge split": {"SGLANG_PRR_ATTN_MERGE": "split"},
                "merge split, one CTA a group": {"SGLANG_PRR_ATTN_MERGE": "split",
                                                 "SGLANG_PRR_ATTN_MERGE_SPLITS": "1"},
                "merge split, 3 CTAs a group": {"SGLANG_PRR_ATTN_MERGE": "split",
                                                "SGLANG_PRR_ATTN_MERGE_SPLITS": "3"},
                "merge fused": {"SGLANG_PRR_ATTN_MERGE": "fused"},
                "merge ticket": {"SGLANG_PRR_ATTN_MERGE": "ticket"},
                "spread withdraw": {"SGLANG_PRR_ATTN_SPREAD_WAIT": "0"},
                "spread row": {"SGLANG_PRR_ATTN_SPREAD": "row"},
                "entries, fused": {"SGLANG_PRR_ATTN_GRID": "entries",
                                   "SGLANG_PRR_ATTN_MERGE": "fused"},
                "pages one entry": {"SGLANG_PRR_ATTN_PACK": "0"},
                "pages packed": {"SGLANG_PRR_ATTN_PACK": "1"},
                "pages packed, merge fused": {"SGLANG_PRR_ATTN_PACK": "1",
                                              "SGLANG_PRR_ATTN_MERGE": "fused"}}


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype,pages", [
    (3, 32, 8, 128, 64, torch.bfloat16, 40), (2, 16, 4, 64, 16, torch.float16, 9),
    (5, 8, 2, 256, 128, torch.bfloat16, 12), (2, 16, 4, 128, 16, torch.bfloat16, 600)])
def test_launch_knobs_keep_the_bits(B, Hq, Hk, D, page, dtype, pages, monkeypatch):
    """Every setting of the attention's launch knobs (SGLANG_PRR_ATTN_GRID=entries,
    SGLANG_PRR_ATTN_MERGE=split|fused, the split merge's CTAs a group: by shape, one, three, whose
    item ranges are uneven, SGLANG_PRR_ATTN_PACK=0|1 on the 16-token pages) gives the default
    launch's bits (the cases' grids fall on both sides of the split merge's shape rule): the
    partials, serial DSA's attention + merge, PRR's repair + exact merge (which also equals serial
    DSA bit for bit) and the union merge."""
    seeded(f"launch knobs B={B} D={D} page={page} pages={pages}")
    q, k_buf, v_buf, table, sl, NB, nblk = _attn_case(B, Hq, Hk, D, page, dtype, pages)
    N = min(nblk) // 2 + 5
    idx, cnt = random_lists(B, Hk, N, nblk)
    if cnt[0, 0] == 0:  # the negative control drops row (0, 0)'s last entry
        idx[0, 0, 0], cnt[0, 0] = 0, 1
    cnt[-1, -1] = 0  # an empty row
    p_idx, p_cnt = random_lists(B, Hk, N + 2, nblk)
    m_idx, m_cnt = ref.set_difference(idx, cnt, p_idx, p_cnt, NB)
    sm = 1.0 / math.sqrt(D)
    qd, kd, vd, td, sld = _dev(q, k_buf, v_buf, table, sl)
    outs = {}
    for name, env in LAUNCH_KNOBS.items():
        for k in ("SGLANG_PRR_ATTN_GRID", "SGLANG_PRR_ATTN_MERGE", "SGLANG_PRR_ATTN_SPREAD_WAIT",
                  "SGLANG_PRR_ATTN_SPREAD", "SGLANG_PRR_ATTN_MERGE_SPLITS",
                  "SGLANG_PRR_ATTN_PACK"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        poison(((B, Hq, N, D), torch.float32), ((B, Hq, D), torch.float32))
        o_p, l_p = CUDA.sparse_attn_partials(qd, kd, vd, td, sld, *_dev(idx, cnt), page, sm)
        o_m, l_m = CUDA.sparse_attn_merge(qd, kd, vd, td, sld, *_dev(idx, cnt), page, sm,
                                          None, None, None, None, None, None, 0, True)
        o_s, l_s = CUDA.sparse_attn_partials(qd, kd, vd, td, sld, *_dev(p_idx, p_cnt), page, sm)
        rep = [CUDA.sparse_attn_merge(qd, kd, vd, td, sld, *_dev(m_idx, m_cnt), page, sm, o_s,
                                      l_s, *_dev(p_idx, p_cnt, idx, cnt), NB, exact)
               for exact in (True, False)]
        outs[name] = [x.cpu() for x in (o_p, l_p, o_m, l_m, *rep[0], *rep[1])]
    listed = (torch.arange(N)[None, None, :] < cnt[:, :, None]).repeat_interleave(Hq // Hk, 1)
    base = outs["default"]
    for name, got in outs.items():
        assert torch.equal(got[0][listed], base[0][listed]), f"partials o, {name}"
        assert torch.equal(got[1][listed], base[1][listed]), f"partials lse, {name}"
        for i in range(2, 8):
            assert torch.equal(got[i], base[i]), f"output {i}, {name}"
        assert torch.equal(got[4], got[2]), f"PRR (exact) != serial DSA, {name}"
    o_ref, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, idx, cnt, page, sm)
    assert rel_err(base[2], o_ref) < 3e-5
    # Negative controls: union differs from exact where P adds blocks; a row without its last
    # entry differs (under the split merge, the knob that changes the most code).
    assert not torch.equal(base[6], base[4])
    monkeypatch.setenv("SGLANG_PRR_ATTN_MERGE", "split")
    cnt2 = cnt.clone()
    cnt2[0, 0] -= 1
    o_c, _ = CUDA.sparse_attn_merge(qd, kd, vd, td, sld, *_dev(idx, cnt2), page, sm,
                                    None, None, None, None, None, None, 0, True)
    assert not torch.equal(o_c.cpu()[0, :Hq // Hk], base[2][0, :Hq // Hk])


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype,pages", [
    (1, 32, 8, 128, 64, torch.bfloat16, 40),   # G = 4, 128 items: ~4 a CTA
    (1, 4, 4, 64, 16, torch.float16, 80),      # G = 1, 16 items: more CTAs than items
    (2, 16, 2, 256, 32, torch.bfloat16, 30),   # G = 8, 512 items: passes of 128 a CTA
    (1, 28, 4, 128, 16, torch.float16, 9)])    # G = 7, short lists
def test_spread_merge_gives_the_ticket_bits(B, Hq, Hk, D, page, dtype, pages, monkeypatch):
    """Where the grid is one wave the fused merge is spread over the group's CTAs (a barrier over
    the group, each CTA merging its share of the output items); SGLANG_PRR_ATTN_MERGE=ticket forces
    the last CTA's merge, and SGLANG_PRR_ATTN_SPREAD_WAIT=0 makes every waiting CTA withdraw at
    once (the fallback of a member that cannot be scheduled: the last CTA merges every item);
    SGLANG_PRR_ATTN_SPREAD=row spreads it over every CTA of the row, those of entries past the
    count included (rows with |M| = 0 and 1 below). All give the same bits for serial DSA's
    attention + merge and PRR's repair (exact and union), the launch counter says which form
    ran, and graph replays with new lists (the barrier's counters back at zero, withdrawals
    included) still agree."""
    seeded(f"spread merge B={B} Hq={Hq} Hk={Hk} D={D} page={page} pages={pages}")
    q, k_buf, v_buf, table, sl, NB, nblk = _attn_case(B, Hq, Hk, D, page, dtype, pages)
    N = min(nblk) // 2 + 5
    sm = 1.0 / math.sqrt(D)
    qd, kd, vd, td, sld = _dev(q, k_buf, v_buf, table, sl)

    def lists():
        idx, cnt = random_lists(B, Hk, N, nblk)
        idx[0, 0, 0], cnt[0, 0] = max(int(idx[0, 0, 0]), 0), max(int(cnt[0, 0]), 1)
        p_idx, p_cnt = random_lists(B, Hk, N + 2, nblk)
        # Row (0, 0): P = A (M empty: the repair is a merge); row (0, 1): P = A less its last
        # entry (|M| = 1): the repairs whose merge the other entries' CTAs share.
        for h, drop in ((0, 0), (min(1, Hk - 1), 1)):
            c = min(N, nblk[0], 6)
            ids = torch.tensor(sorted(random.sample(range(nblk[0]), c)), dtype=torch.int32)
            idx[0, h] = -1
            idx[0, h, :c] = ids
            cnt[0, h] = c
            p_idx[0, h] = -1
            p_idx[0, h, :c - drop] = ids[:c - drop]
            p_cnt[0, h] = c - drop
        m_idx, m_cnt = ref.set_difference(idx, cnt, p_idx, p_cnt, NB)
        return [x.to(DEV) for x in (idx, cnt, p_idx, p_cnt, m_idx, m_cnt)]

    def run(idx, cnt, p_idx, p_cnt, m_idx, m_cnt):
        o_m, l_m = CUDA.sparse_attn_merge(qd, kd, vd, td, sld, idx, cnt, page, sm,
                                          None, None, None, None, None, None, 0, True)
        o_s, l_s = CUDA.sparse_attn_partials(qd, kd, vd, td, sld, p_idx, p_cnt, page, sm)
        rep = [CUDA.sparse_attn_merge(qd, kd, vd, td, sld, m_idx, m_cnt, page, sm, o_s, l_s,
                                      p_idx, p_cnt, idx, cnt, NB, exact)
               for exact in (True, False)]
        return [o_m, l_m, *rep[0], *rep[1]]

    from sglang_prr import kernels
    L = lists()
    forms = {"spread": {}, "withdraw": {"SGLANG_PRR_ATTN_SPREAD_WAIT": "0"},
             "row": {"SGLANG_PRR_ATTN_SPREAD": "row"},
             "row withdraw": {"SGLANG_PRR_ATTN_SPREAD": "row", "SGLANG_PRR_ATTN_SPREAD_WAIT": "0"},
             "ticket": {"SGLANG_PRR_ATTN_MERGE": "ticket"}}

    def use(form):
        for k in ("SGLANG_PRR_ATTN_MERGE", "SGLANG_PRR_ATTN_SPREAD_WAIT", "SGLANG_PRR_ATTN_SPREAD"):
            monkeypatch.delenv(k, raising=False)
        for k, v in forms[form].items():
            monkeypatch.setenv(k, v)

    outs, spread = {}, {}
    for form in forms:
        use(form)
        poison(((B, Hq, D), torch.float32))
        n0 = kernels.attn_spread_launches()
        outs[form] = [x.cpu() for x in run(*L)]
        spread[form] = kernels.attn_spread_launches() - n0
    want = {"spread": 3, "withdraw": 3, "row": 3, "row withdraw": 3, "ticket": 0}
    assert spread == want, spread
    for form in ("withdraw", "row", "row withdraw", "ticket"):
        for i, (x, y) in enumerate(zip(outs["spread"], outs[form])):
            assert torch.equal(x, y), f"output {i}, {form}"
    assert torch.equal(outs["spread"][2], outs["spread"][0]), "PRR (exact) != serial DSA"
    idx, cnt = L[0].cpu(), L[1].cpu()
    o_ref, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, idx, cnt, page, sm)
    assert rel_err(outs["spread"][0], o_ref) < 3e-5
    # Negative control: row (0, 0) without its last entry changes that group's output.
    cnt2 = L[1].clone()
    cnt2[0, 0] -= 1
    use("spread")
    o_c, _ = CUDA.sparse_attn_merge(qd, kd, vd, td, sld, L[0], cnt2, page, sm,
                                    None, None, None, None, None, None, 0, True)
    G = Hq // Hk
    assert not torch.equal(o_c.cpu()[0, :G], outs["spread"][0][0, :G])
    # CUDA graphs of the spread launches (waiting, and withdrawing), replayed with new lists in
    # the same buffers: the barrier's counters must be back at zero after every launch, or a
    # replay would hang or merge early. The eager launches they are checked against: the ticket.
    for form in ("spread", "withdraw", "row"):
        use(form)
        static = lists()
        got = []
        g = capture(lambda: got.__setitem__(slice(None), run(*static)))
        use("ticket")
        for _ in range(3):
            new = lists()
            for dst, src in zip(static, new):
                dst.copy_(src)
            g.replay()
            want = run(*new)
            torch.cuda.synchronize()
            for i, (x, y) in enumerate(zip(got, want)):
                assert torch.equal(x, y), f"replay output {i}, {form}"


@pytest.mark.parametrize("B,Hq,Hk,D,NB,k,sink,local", [
    (1, 32, 8, 128, 2048, 32, 1, 2), (3, 8, 8, 64, 77, 5, 1, 1), (17, 32, 4, 128, 300, 64, 0, 0),
    (3, 64, 8, 128, 9000, 700, 4, 4), (2, 4, 1, 128, 50, 100, 2, 3), (1, 32, 8, 128, 1, 4, 1, 1),
    (1, 32, 8, 128, 4000, 32, 1, 1), (2, 32, 8, 128, 2047, 128, 1, 1)])
@pytest.mark.parametrize("with_p,sdt", [(True, torch.bfloat16), (False, torch.float32)])
def test_quest_select(B, Hq, Hk, D, NB, k, sink, local, with_p, sdt, select_kernel):
    seeded(f"quest_select B={B} NB={NB} k={k} p={with_p} {sdt} {select_kernel}")
    P = NB * B + 5
    kmin = torch.randn(P, Hk, D)
    kmax = kmin + torch.rand(P, Hk, D)
    if sdt == torch.bfloat16:
        kmin, kmax = _bf16_bounds(kmin, kmax)
    table = torch.randint(1, P, (B, NB))
    nblk = torch.randint(0, NB + 1, (B,))
    nblk[0] = NB
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    n_out = k + sink + local
    p_idx, p_cnt = random_lists(B, Hk, n_out + 4, nblk.tolist()) if with_p else (None, None)
    poison(((B, Hk, NB), torch.float32), ((B, Hk, n_out), torch.int32), ((B, Hk), torch.int32))
    s, a_idx, a_cnt, m_idx, m_cnt = [x.cpu() for x in CUDA.quest_select(
        *_dev(q, kmin, kmax, table, nblk.int(), p_idx, p_cnt), k, sink, local, n_out)]
    s_ref = ref.quest_scores(q, kmin, kmax, table, nblk)
    fin = torch.isfinite(s_ref)
    assert torch.equal(torch.isfinite(s), fin)
    assert rel_err(s[fin], s_ref[fin]) < 1e-5
    # A and M bit for bit from the kernel's own scores (ties are ulp-sensitive).
    ai, ac = ref.select_topk(s, nblk, k, sink, local, n_out)
    assert torch.equal(a_cnt, ac) and torch.equal(a_idx, ai)
    if with_p:
        mi, mc = ref.set_difference(a_idx, a_cnt, p_idx, p_cnt, NB)
    else:
        mi, mc = ai, ac
    assert torch.equal(m_cnt, mc) and torch.equal(m_idx, mi)
    # Negative controls: M differs from A when P hits; a smaller k changes A when it can.
    if with_p and (mc < ac).any():
        assert not torch.equal(m_idx, a_idx)
    if 1 < k < NB - sink - local - 1:
        ai2, _ = ref.select_topk(s, nblk, k - 1, sink, local, n_out)
        assert not torch.equal(a_idx, ai2)


@pytest.mark.parametrize("B,NB,k", [(2, 2048, 32), (3, 300, 17), (1, 5000, 200)])
def test_quest_select_messy_prediction(B, NB, k, select_kernel):
    """P(t) as a row may hold it after a bad write or a shorter table: repeats, -1 entries, ids
    past the row's blocks or negative, out of order, a count past the list's width or negative.
    M = A \\ P treats it as the set of its valid ids (the reference's list_to_mask), on every
    selection path (the row tails mark P in their keys, or as bits with the walks; the one-pass
    kernel compares entries)."""
    seeded(f"messy P B={B} NB={NB} k={k} {select_kernel}")
    Hq, Hk, D, sink, local = 32, 8, 128, 1, 2
    P = NB * B + 5
    kmin = torch.randn(P, Hk, D)
    kmin, kmax = _bf16_bounds(kmin, kmin + torch.rand(P, Hk, D))
    table = torch.randint(1, P, (B, NB))
    nblk = torch.randint(NB // 2, NB + 1, (B,))
    nblk[0] = NB
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    n_out = k + sink + local
    Np = n_out + 6
    p_idx = torch.randint(-3, NB + 40, (B, Hk, Np), dtype=torch.int32)
    p_idx[..., 1::4] = p_idx[..., 0::4][..., : p_idx[..., 1::4].shape[-1]]  # repeats
    p_idx[..., 2] = -1
    p_cnt = torch.randint(-2, Np + 3, (B, Hk), dtype=torch.int32)
    # Row (0, 0) predicts the sink block (always in A), so the control below cannot miss.
    p_idx[0, 0, 0], p_cnt[0, 0] = 0, p_cnt[0, 0].clamp(min=1)
    s, a_idx, a_cnt, m_idx, m_cnt = [x.cpu() for x in CUDA.quest_select(
        *_dev(q, kmin, kmax, table, nblk.int(), p_idx, p_cnt), k, sink, local, n_out)]
    ai, ac = ref.select_topk(s, nblk, k, sink, local, n_out)
    assert torch.equal(a_cnt, ac) and torch.equal(a_idx, ai)
    mi, mc = ref.set_difference(ai, ac, p_idx, p_cnt.clamp(0, Np), NB)
    assert torch.equal(m_cnt, mc) and torch.equal(m_idx, mi)
    # Negative control: the prediction hits A (row (0, 0)'s sink at least), so M = A would differ.
    assert (mc < ac).any() and not torch.equal(m_idx, ai)


@pytest.mark.parametrize("B,Hk,NB,n_pred,sink,local,idt", [
    (1, 8, 2048, 48, 1, 2, torch.int64), (3, 4, 61, 7, 1, 1, torch.int32),
    (17, 2, 500, 40, 0, 2, torch.int64), (2, 8, 9000, 600, 4, 4, torch.int32)])
def test_predict_update(B, Hk, NB, n_pred, sink, local, idt):
    seeded(f"predict_update B={B} NB={NB}")
    level = torch.randn(B, Hk, NB)
    trend = torch.randn(B, Hk, NB) * 0.1
    # InfLLM-v2 levels stuck at -inf (scored before a complete compressed key), trend +-inf
    # (NaN would defeat torch.equal): they restart like new blocks, as in the reference.
    dead = torch.rand(B, Hk, NB) < 0.05
    level[dead] = float("-inf")
    infs = torch.tensor([float("inf"), float("-inf")])
    trend[dead] = infs[torch.randint(0, 2, (int(dead.sum()),))]
    n_init = torch.randint(0, NB, (B,)).to(idt)
    n_init[0] = 0  # a fresh request
    scores = _scores_with_ties(B, Hk, NB).nan_to_num(0.0).clamp(-1e30, 1e30)
    nblk = torch.minimum(n_init.long() + torch.randint(0, 3, (B,)), torch.tensor(NB))
    nblk[0] = NB // 2 + 1
    nxt = torch.minimum(nblk + 1, torch.tensor(NB))
    theta = torch.rand(B, 3)
    l_ref, t_ref, n_ref = level.clone(), trend.clone(), n_init.clone()
    pi_ref, pc_ref = ref.predict_update(l_ref, t_ref, n_ref, scores, nblk, theta, nxt, n_pred,
                                        sink, local)
    l_d, t_d, n_d = _dev(level, trend, n_init)
    poison(((B, Hk, n_pred + sink + local), torch.int32), ((B, Hk), torch.int32))
    pi, pc = CUDA.predict_update(l_d, t_d, n_d, *_dev(scores, nblk, theta, nxt), n_pred, sink,
                                 local)
    assert torch.equal(n_d.cpu(), n_ref)
    assert torch.equal(l_d.cpu(), l_ref), "level must match the reference bit for bit"
    assert torch.equal(t_d.cpu(), t_ref), "trend must match the reference bit for bit"
    upd = dead & (torch.arange(NB) < torch.minimum(n_init.long(), nblk.long()).view(B, 1, 1))
    if upd.any():  # the restarted blocks hold this step's score, a finite level again
        assert torch.isfinite(l_d.cpu()[upd]).all() and (t_d.cpu()[upd] == 0).all()
    assert torch.equal(pc.cpu(), pc_ref) and torch.equal(pi.cpu(), pi_ref)
    # Negative control: the prediction depends on the scores it learns from.
    l2, t2, n2 = level.clone(), trend.clone(), n_init.clone()
    pi2, _ = ref.predict_update(l2, t2, n2, scores + 5 * torch.randn_like(scores), nblk, theta,
                                nxt, n_pred, sink, local)
    assert not torch.equal(pi2, pi_ref)


def test_fused_kernels_in_one_graph_replayed_with_new_counts():
    """All three fused kernels captured in one CUDA graph and replayed with new inputs, counts
    (empty rows included) and lengths: every replay matches the reference, so the group counters
    return to zero after each launch."""
    seeded("fused graph")
    B, Hq, Hk, D, page, dtype = 3, 32, 8, 128, 32, torch.bfloat16
    k_top, sink, local, n_pred = 6, 1, 1, 9
    max_len = 40 * page
    k_buf, v_buf, table, _, NB = make_pool(B, Hk, D, page, [max_len] * B, dtype, extra_pages=4)
    num_pages = k_buf.shape[0] // page
    kf = k_buf.float().view(num_pages, page, Hk, D)
    kmin, kmax = kf.amin(1), kf.amax(1)
    sm = 1.0 / math.sqrt(D)
    n_a, n_p = k_top + sink + local, n_pred + sink + local
    st = dict(q=torch.randn(B, Hq, D, dtype=dtype), sl=torch.tensor([max_len] * B),
              p_idx=torch.full((B, Hk, n_p), -1, dtype=torch.int32),
              p_cnt=torch.zeros(B, Hk, dtype=torch.int32),
              level=torch.zeros(B, Hk, NB), trend=torch.zeros(B, Hk, NB),
              n_init=torch.zeros(B, dtype=torch.int64), theta=torch.rand(B, 3))
    d = {key: v.to(DEV) for key, v in st.items()}
    kd, vd, td, kmind, kmaxd = _dev(k_buf, v_buf, table, kmin, kmax)

    def step():
        nblk = ref.num_blocks(d["sl"], page)
        o_s, lse_s = ops.sparse_attn_partials(d["q"], kd, vd, td, d["sl"], d["p_idx"], d["p_cnt"],
                                              page, sm)
        # The fused CUDA ops themselves (ops.* may pick the unfused kernels by shape).
        s, ai, ac, mi, mc = CUDA.quest_select(d["q"], kmind, kmaxd, td, nblk, d["p_idx"],
                                              d["p_cnt"], k_top, sink, local, n_a)
        pi, pc = CUDA.predict_update(d["level"], d["trend"], d["n_init"], s, nblk, d["theta"],
                                     ref.num_blocks(d["sl"] + 1, page), n_pred, sink, local)
        o, lse = CUDA.sparse_attn_merge(d["q"], kd, vd, td, d["sl"], mi, mc, page, sm, o_s, lse_s,
                                        d["p_idx"], d["p_cnt"], ai, ac, NB, True)
        return o, s, ai, ac, mi, mc, pi, pc

    s0 = torch.cuda.Stream()
    s0.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s0):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for it in range(5):
        q = torch.randn(B, Hq, D, dtype=dtype)
        sl = torch.tensor([max_len - it * 37, 1 + it * 5, page * (3 + it) + 1])
        p_idx, p_cnt = random_lists(B, Hk, n_p, ref.num_blocks(sl, page).tolist())
        p_cnt[1] = 0  # empty predictions for one request
        p_idx[1] = -1
        for key, v in (("q", q), ("sl", sl), ("p_idx", p_idx), ("p_cnt", p_cnt)):
            d[key].copy_(v)
        lv, tr, ni = d["level"].cpu(), d["trend"].cpu(), d["n_init"].cpu()
        g.replay()
        torch.cuda.synchronize()
        o, s, ai, ac, mi, mc, pi, pc = [x.cpu() for x in out]
        nblk = ref.num_blocks(sl, page)
        ai_r, ac_r = ref.select_topk(s, nblk, k_top, sink, local, n_a)
        assert torch.equal(ai, ai_r) and torch.equal(ac, ac_r), f"replay {it}: A"
        mi_r, mc_r = ref.set_difference(ai, ac, p_idx, p_cnt, NB)
        assert torch.equal(mi, mi_r) and torch.equal(mc, mc_r), f"replay {it}: M"
        pi_r, pc_r = ref.predict_update(lv, tr, ni, s, nblk, st["theta"], ref.num_blocks(sl + 1, page),
                                        n_pred, sink, local)
        assert torch.equal(pi, pi_r) and torch.equal(pc, pc_r), f"replay {it}: P(t+1)"
        assert torch.equal(d["n_init"].cpu(), ni), f"replay {it}: n_init"
        assert torch.equal(d["level"].cpu(), lv) and torch.equal(d["trend"].cpu(), tr)
        o_a, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, ai, ac, page, sm)
        assert rel_err(o, o_a) < 3e-5, f"replay {it}: output"
        if mc.sum() > 0:  # negative control: attention over P alone is not the answer
            o_p, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, p_idx, p_cnt, page, sm)
            assert rel_err(o, o_p) > 1e-3


def test_ops_dispatch_fused_and_unfused_paths_agree():
    """ops.attend_set runs the one-launch attention + merge; ops.quest_select gives the same
    results through the fused single launch and the unfused kernels it chooses between by shape."""
    seeded("dispatch")
    B, Hq, Hk, D, page = 3, 32, 8, 128, 64
    q, k_buf, v_buf, table, sl, NB, nblk = _attn_case(B, Hq, Hk, D, page, torch.bfloat16)
    idx, cnt = random_lists(B, Hk, 9, nblk)
    args = _dev(q, k_buf, v_buf, table, sl, idx, cnt)
    o = ops.attend_set(*args, page, 0.09)[0].cpu()
    o_ref, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, idx, cnt, page, 0.09)
    assert rel_err(o, o_ref) < 3e-5
    o_bad, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, idx, cnt, page, 0.2)
    assert rel_err(o, o_bad) > 1e-3  # negative control: another softmax scale
    # selection: a grid past one wave takes the unfused kernels; both match the reference rules
    Bq, NBq = 33, 4096
    P = 3 * NBq
    kmin = torch.randn(P, Hk, D, device=DEV)
    kmax = kmin + torch.rand(P, Hk, D, device=DEV)
    tab = torch.randint(1, P, (Bq, NBq), device=DEV)
    nb_ = torch.full((Bq,), NBq, device=DEV)
    qq = torch.randn(Bq, Hq, D, device=DEV, dtype=torch.bfloat16)
    big = ops.quest_select(qq, kmin, kmax, tab, nb_, None, None, 16, 1, 1, 18)
    one = [CUDA.quest_select(qq[i:i + 1], kmin, kmax, tab[i:i + 1], nb_[i:i + 1], None, None, 16,
                             1, 1, 18) for i in (0, Bq - 1)]
    for j, i in enumerate((0, Bq - 1)):
        assert torch.allclose(big[0][i], one[j][0][0], rtol=1e-5, atol=1e-4)
        ai, ac = ref.select_topk(big[0][i:i + 1].cpu(), nb_[:1].cpu(), 16, 1, 1, 18)
        assert torch.equal(big[1][i:i + 1].cpu(), ai) and torch.equal(big[2][i:i + 1].cpu(), ac)


# ----------------------------------------------------------------------------- one-pass selection
def _bf16_bounds(kmin, kmax):
    return ref.round_bf16(kmin, down=True), ref.round_bf16(kmax, down=False)


@pytest.mark.parametrize("B,Hq,Hk,D,NB,k,n_pred,sink,local,sdt", [
    (1, 32, 8, 128, 2048, 32, 48, 1, 1, torch.bfloat16),   # the serving shape
    (2, 32, 8, 128, 2048, 200, 300, 1, 1, torch.bfloat16),  # P(t) wider than the CTA
    (3, 8, 8, 64, 77, 5, 9, 1, 1, torch.float32),          # GQA 1, head dim 64
    (5, 64, 8, 128, 300, 64, 96, 0, 2, torch.bfloat16),    # GQA 8, K >= the chunk
    (2, 16, 2, 256, 130, 7, 3, 2, 0, torch.float32),       # head dim 256, no local block
    (3, 64, 8, 128, 9000, 700, 1000, 4, 4, torch.bfloat16),  # too wide: the row-tail kernels
    (1, 8, 2, 64, 250, 70, 90, 3, 2, torch.bfloat16),     # K, |P| above a chunk's blocks
    (1, 32, 8, 128, 4000, 32, 48, 1, 1, torch.bfloat16),  # 63 chunks: six merge rounds
    (2, 32, 8, 128, 1999, 129, 20, 1, 1, torch.bfloat16),  # K above two chunks' blocks
    (2, 12, 4, 96, 200, 8, 12, 1, 1, torch.float32),       # head dim 96: the row-tail kernels
])
@pytest.mark.parametrize("hot", [False, True])
def test_quest_select_predict(B, Hq, Hk, D, NB, k, n_pred, sink, local, sdt, hot, select_kernel):
    """Selection and the predictor's step in one launch against the reference, bit for bit from
    the kernel's own scores: A, M = A \\ P(t) (P read at pool rows p_rows), the Holt state of the
    state rows, n_init, and P(t+1) written at rows p_next_rows (the other half of a double
    buffer); every other row untouched. Ties, -inf and NaN scores, levels stuck at -inf. ``hot``:
    the best blocks in one run of 64 (most of the top K and |P| from few chunks' candidate lists:
    the one-pass tail's threshold is low and most candidates survive it)."""
    seeded(f"select_predict B={B} NB={NB} k={k} P={n_pred} D={D} {sdt} hot={hot} {select_kernel}")
    P = NB * B + 5
    kmin = torch.randn(P, Hk, D)
    kmax = kmin + torch.rand(P, Hk, D)
    if sdt == torch.bfloat16:
        kmin, kmax = _bf16_bounds(kmin, kmax)
    kmin[::7] = kmin[3]  # equal summaries: tied scores
    kmax[::7] = kmax[3]
    table = torch.randint(1, P, (B, NB))
    if hot:
        kmax[table[:, NB // 3:NB // 3 + 64]] += 4.0
    nblk = torch.randint(0, NB + 1, (B,))
    nblk[0] = NB - 1
    nxt = torch.minimum(nblk + torch.randint(0, 2, (B,)), torch.tensor(NB))
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    n_out = k + sink + local + 2
    R = B + 2
    rows = torch.randperm(R)[:B]
    W = n_pred + sink + local + 3  # the pool's P is wider than this step's
    p_idx = torch.full((2 * R, Hk, W), 7, dtype=torch.int32)
    p_cnt = torch.full((2 * R, Hk), 3, dtype=torch.int32)
    par = torch.randint(0, 2, (R,))
    p_rows = 2 * rows + par[rows]
    pb, pc = random_lists(B, Hk, W, nblk.tolist())
    p_idx[p_rows], p_cnt[p_rows] = pb, pc
    level = torch.randn(R, Hk, NB)
    trend = torch.randn(R, Hk, NB) * 0.1
    dead = torch.rand(R, Hk, NB) < 0.05
    level[dead] = float("-inf")
    n_init = torch.randint(0, NB, (R,))
    n_init[rows[0]] = 0  # a fresh request
    theta = torch.rand(R, 3)
    state = [p_idx, p_cnt, level, trend, n_init]
    d = _dev(*state)
    poison(((B, Hk, NB), torch.float32), ((B, Hk, n_out), torch.int32), ((B, Hk), torch.int32))
    s, a_idx, a_cnt, m_idx, m_cnt = [x.cpu() for x in CUDA.quest_select_predict(
        *_dev(q, kmin.to(sdt), kmax.to(sdt), table, nblk, nxt), d[0], d[1], *_dev(p_rows,
        p_rows ^ 1), d[2], d[3], d[4], *_dev(theta, rows), k, n_pred, sink, local, n_out)]
    s_ref = ref.quest_scores(q, kmin.to(sdt), kmax.to(sdt), table, nblk)
    fin = torch.isfinite(s_ref)
    assert torch.equal(torch.isfinite(s), fin)
    assert rel_err(s[fin], s_ref[fin]) < 1e-5
    ai, ac = ref.select_topk(s, nblk, k, sink, local, n_out)
    assert torch.equal(a_cnt, ac) and torch.equal(a_idx, ai), "A"
    mi, mc = ref.set_difference(ai, ac, pb, pc, NB)
    assert torch.equal(m_cnt, mc) and torch.equal(m_idx, mi), "M"
    want = [t.clone() for t in state]
    ref.predict_update_rows(want[2], want[3], want[4], want[0], want[1], theta, rows, s, nblk,
                            nxt, n_pred, sink, local, p_rows=p_rows ^ 1)
    for name, got, exp in zip(("p_idx", "p_cnt", "level", "trend", "n_init"), d, want):
        torch.testing.assert_close(got.cpu(), exp, rtol=0, atol=0, equal_nan=True, msg=name)
    # Controls: the predictor wrote something new, and P(t) (read for M) is left as it was.
    assert not torch.equal(d[0].cpu()[p_rows ^ 1], p_idx[p_rows ^ 1])
    assert torch.equal(d[0].cpu()[p_rows], p_idx[p_rows])
    if (mc < ac).any():
        assert not torch.equal(m_idx, a_idx)
