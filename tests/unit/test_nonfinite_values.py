"""Values the input checks cannot see (they read no tensor values): the defined results of a
non-finite V inside a request, of ids past ``nb``, of a non-finite Holt trend, of NaN hit rates
in eq 5, and of a negative slot for the decode update. Each against a clean run of the same
inputs (fresh seeds) or the fp64 oracle, with the control beside it."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from sglang_prr import ops
from sglang_prr import reference as R

import oracle
from oracle import holt_loop
from paged import list_from_sets, make_paged


def _full_lists(p):
    """Every block of every request, as lists ``[B, Hk, NB]``."""
    sets = [[set(range(int(n))) for _ in range(p.k_buf.shape[1])] for n in p.nblk]
    return list_from_sets(sets, p.nb)


def test_nan_or_inf_in_v_inside_a_request_reaches_its_output_only(seed):
    """A NaN (or +inf) V value inside request 1 makes that dim of its group's heads NaN (+inf),
    as dense attention does; its other dims and request 0 keep the clean run's bits. The old
    merge turned it into a finite, wrong number."""
    rnd = random.Random(seed)
    p = make_paged(seed, [rnd.randint(40, 70), rnd.randint(20, 39)])
    idx, cnt = _full_lists(p)
    clean = ops.attend_set(p.q, p.k_buf, p.v_buf, p.table, p.seq_lens, idx, cnt, p.page,
                           p.sm_scale)[0]
    pos = rnd.randrange(int(p.seq_lens[1]))  # inside request 1
    slot = int(p.req_to_token[int(p.rows[1]), pos])
    h, dim, G = rnd.randrange(2), rnd.randrange(16), p.q.shape[1] // 2
    for bad in (float("nan"), float("inf")):
        v = p.v_buf.clone()
        v[slot, h, dim] = bad
        out = ops.attend_set(p.q, p.k_buf, v, p.table, p.seq_lens, idx, cnt, p.page,
                             p.sm_scale)[0]
        group = out[1, h * G:(h + 1) * G, dim]
        if math.isnan(bad):
            assert torch.isnan(group).all(), group
        else:
            assert torch.isposinf(group).all(), group
        assert torch.equal(out[0], clean[0])  # another request: the same bits
        others = torch.ones_like(out[1], dtype=torch.bool)
        others[h * G:(h + 1) * G, dim] = False
        assert torch.equal(out[1][others], clean[1][others])
        # control: the same value past request 1's length never reaches the output
        past = int(p.req_to_token[int(p.rows[1]), int(p.seq_lens[1])])
        v = p.v_buf.clone()
        v[past] = bad
        out = ops.attend_set(p.q, p.k_buf, v, p.table, p.seq_lens, idx, cnt, p.page,
                             p.sm_scale)[0]
        assert torch.equal(out, clean)


def test_merge_skips_entries_of_weight_zero_and_keeps_a_kept_nan():
    o = torch.tensor([[[float("nan"), float("nan")], [3.0, 4.0]]])
    out, lse = ops.merge_partials(o, torch.tensor([[float("-inf"), 0.0]]))
    assert torch.equal(out, torch.tensor([[3.0, 4.0]])) and float(lse) == 0.0
    o = torch.tensor([[[1.0, float("nan")], [3.0, 4.0]]])
    out, _ = ops.merge_partials(o, torch.tensor([[0.0, 0.0]]))
    assert out[0, 0] == 2.0 and torch.isnan(out[0, 1])  # was 2.0: the NaN counted as 0
    out, _ = R.merge_partials(o, torch.tensor([[0.0, 0.0]]), keep=torch.tensor([[False, True]]))
    assert torch.equal(out, torch.tensor([[3.0, 4.0]]))  # not kept: its NaN adds nothing


@pytest.mark.parametrize("nb_extra", [0, 1, 3])
def test_ids_at_or_past_nb_are_padding_in_set_membership(seed, nb_extra):
    """list_isin: an id >= nb is never a member, even when the other list holds the id nb
    (the old clamp made every such id a member then)."""
    g = torch.Generator().manual_seed(seed)
    nb = 6
    ref_idx = torch.tensor([[nb + nb_extra, 2, 0]], dtype=torch.int32)
    idx = torch.randint(nb, nb + 5, (1, 4), generator=g, dtype=torch.int32)
    idx[0, 0] = 2  # control: a member below nb
    got = R.list_isin(idx, torch.tensor([4]), ref_idx, torch.tensor([3]), nb)
    assert got.tolist() == [[True, False, False, False]]


def test_exact_merge_equals_attention_over_a_with_ids_past_the_table(seed):
    """PRR's exact merge with P holding ids past the table (padding) and A's lists: the
    attention over A, whatever P holds past ``nb``."""
    rnd = random.Random(seed)
    p = make_paged(seed, [rnd.randint(100, 160)], hk=1)  # 7-10 blocks: some outside A
    n = int(p.nblk[0])
    a = set(rnd.sample(range(n), 4))
    pred = set(rnd.sample(sorted(a), 2)) | {p.nb, p.nb + 3}  # two hits, two ids past the table
    a_idx, a_cnt = list_from_sets([[a]], 4)
    p_idx, p_cnt = list_from_sets([[pred]], 4)
    m_idx, m_cnt = list_from_sets([[a - pred]], 4)
    o_s, l_s = ops.sparse_attn_partials(p.q, p.k_buf, p.v_buf, p.table, p.seq_lens, p_idx,
                                        p_cnt, p.page, p.sm_scale)
    got = ops.sparse_attn_merge(p.q, p.k_buf, p.v_buf, p.table, p.seq_lens, m_idx, m_cnt,
                                p.page, p.sm_scale, o_s, l_s, p_idx, p_cnt, a_idx, a_cnt,
                                p.nb, True)[0]
    want = ops.attend_set(p.q, p.k_buf, p.v_buf, p.table, p.seq_lens, a_idx, a_cnt, p.page,
                          p.sm_scale)[0]
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    # control: the union merge of the same lists keeps every entry of P, but P \ A is padding
    # alone here; with a real block of P outside A the union merge is no longer A's attention
    out = sorted(set(range(n)) - a)[0]
    p2_idx, p2_cnt = list_from_sets([[pred | {out}]], 5)
    o2, l2 = ops.sparse_attn_partials(p.q, p.k_buf, p.v_buf, p.table, p.seq_lens, p2_idx,
                                      p2_cnt, p.page, p.sm_scale)
    for exact in (True, False):
        got = ops.sparse_attn_merge(p.q, p.k_buf, p.v_buf, p.table, p.seq_lens, m_idx, m_cnt,
                                    p.page, p.sm_scale, o2, l2, p2_idx, p2_cnt, a_idx, a_cnt,
                                    p.nb, exact)[0]
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5) == exact


def _holt_state(series, alpha, beta):
    """The fp64 oracle's level and trend after ``series`` (its predictions one step later with
    gamma 0 and 1)."""
    more = series + [[0.0] * len(series[0])]
    l0 = holt_loop(more, alpha, beta, 0.0)[-1]
    l1 = holt_loop(more, alpha, beta, 1.0)[-1]
    return [l0[j] for j in sorted(l0)], [l1[j] - l0[j] for j in sorted(l0)]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_trend_restarts_the_block(seed, bad):
    """A finite level with a non-finite trend restarts like a new block (l = IS, v = 0), so
    the block is predicted by its scores again; the state near the float limits that finite
    scores reach (-3e38 then 3e38) restarts too. Other blocks follow the fp64 Holt loop."""
    rnd = random.Random(seed)
    nb, a_, b_ = 5, rnd.uniform(0.2, 0.8), rnd.uniform(0.2, 0.8)
    series = [[rnd.gauss(0, 1) for _ in range(nb)] for _ in range(6)]
    lv, tr = torch.zeros(1, 1, nb), torch.zeros(1, 1, nb)
    n_init, nblk = torch.tensor([0]), torch.tensor([nb])
    alpha, beta = torch.tensor([a_]), torch.tensor([b_])
    ops.holt_update(lv, tr, n_init, torch.tensor([[series[0]]]), nblk, alpha, beta)
    tr[0, 0, 2] = bad
    for s in series[1:]:
        ops.holt_update(lv, tr, n_init, torch.tensor([[s]]), nblk, alpha, beta)
    assert torch.isfinite(lv).all() and torch.isfinite(tr).all()
    # block 2 restarted at series[1]; the others never did
    for blocks, rows in (([2], series[1:]), ([0, 1, 3, 4], series)):
        want_l, want_v = _holt_state([[row[i] for i in blocks] for row in rows], a_, b_)
        assert lv[0, 0, blocks].tolist() == pytest.approx(want_l, rel=1e-5, abs=1e-5)
        assert tr[0, 0, blocks].tolist() == pytest.approx(want_v, rel=1e-5, abs=1e-5)
    # reachable from finite scores: a finite level with an infinite trend, restarted next step
    lv, tr, n_init = torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), torch.tensor([0])
    one = torch.tensor([1])
    half = torch.tensor([0.5])
    for s in (-3e38, 3e38):
        ops.holt_update(lv, tr, n_init, torch.tensor([[[s]]]), one, half, half)
    assert math.isfinite(lv.item()) and math.isinf(tr.item())
    ops.holt_update(lv, tr, n_init, torch.tensor([[[1.5]]]), one, half, half)
    assert lv.item() == 1.5 and tr.item() == 0.0


def test_best_theta_never_picks_a_nan_and_stays_a_candidate():
    nan = float("nan")
    H = torch.tensor([[0.1, nan, 0.3], [nan, nan, nan], [0.5, 0.5, nan], [nan, 0.2, 0.2]])
    assert ops.best_theta(H).tolist() == [2, 0, 0, 1]
    # control: finite rows pick the first max
    assert ops.best_theta(torch.tensor([[0.1, 0.4, 0.4]])).tolist() == [1]


def test_a_negative_slot_writes_the_padding_page_not_another_requests(seed):
    """The selection's decode update with a negative slot writes page 0 (the sink no request
    reads); before, slot -1 named the pool's last page, another request's block."""
    p = make_paged(seed, [37, 21], hk=1, group=2)
    kmin, kmax = p.quest_summary()
    new_k = torch.randn(2, 1, p.k_buf.shape[2])
    new_pos = p.seq_lens.clone()
    new_loc = torch.tensor([-1, int(p.req_to_token[int(p.rows[1]), int(p.seq_lens[1])])])
    lo, hi = kmin.clone(), kmax.clone()
    q = p.q.to(torch.float32)
    ops.quest_select(q, lo, hi, p.table, p.nblk + 1, None, None, 1, 1, 1, 3, new_k=new_k,
                     new_pos=new_pos, page_size=p.page, new_loc=new_loc)
    changed = {int(i) for i in torch.nonzero((lo != kmin).any(-1).any(-1)).flatten()}
    changed |= {int(i) for i in torch.nonzero((hi != kmax).any(-1).any(-1)).flatten()}
    assert changed <= {0, int(new_loc[1]) // p.page}, changed
    assert int(new_loc[1]) // p.page in changed  # control: the valid row writes its page


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_query_head_drops_out_of_its_infllm_group(seed, bad):
    """InfLLM-v2: a query head with a NaN or +inf logit has no softmax; it adds nothing to its
    group's sum (the fp64 oracle skips it), the group's other heads keep theirs, and the other
    KV heads keep their scores bit for bit."""
    rnd = random.Random(seed)
    p = make_paged(seed, [rnd.randint(90, 140), rnd.randint(50, 89)], hk=2, group=4)
    ck = p.infllm_summary()
    clean = R.infllm_scores(p.q, ck, p.table, p.seq_lens, p.page, p.sm_scale)
    q = p.q.clone()
    b, h, g = rnd.randrange(2), rnd.randrange(2), rnd.randrange(4)
    q[b, h * 4 + g, rnd.randrange(q.shape[2])] = bad
    got = R.infllm_scores(q, ck, p.table, p.seq_lens, p.page, p.sm_scale)
    assert not torch.isnan(got).any()
    for r, rows in enumerate(oracle.infllm_scores(q, p.k_buf, p.req_to_token, p.rows,
                                                   p.seq_lens, p.page, p.sm_scale)):
        want = torch.tensor(rows, dtype=torch.float64)  # [Hk, blocks of request r]
        mine = got[r, :, :want.shape[1]].double()
        assert torch.equal(torch.isneginf(mine), torch.isneginf(want))
        fin = torch.isfinite(want)
        assert torch.allclose(mine[fin], want[fin], rtol=1e-5, atol=1e-6)
    other = torch.ones_like(got, dtype=torch.bool)
    other[b, h] = False
    assert torch.equal(got[other], clean[other])
    # control: the dropped head counted before (its group's finite scores moved)
    f = torch.isfinite(clean[b, h])
    assert not torch.allclose(got[b, h][f], clean[b, h][f], rtol=1e-3, atol=1e-4)


def test_quest_scores_take_the_finite_bound_where_a_zero_query_meets_an_infinite_key(seed):
    """Quest: ``max(q_d * kmax_d, q_d * kmin_d)`` is an fmax, as the kernels' fmaxf: a zero
    q_d against an infinite key bound (0 * inf = NaN) counts the other bound's product, so the
    block's score stays finite and equals the fp64 oracle's; a NaN q_d makes the scores of its
    group NaN (ranked last by the selection)."""
    rnd = random.Random(seed)
    p = make_paged(seed, [rnd.randint(60, 90)], hk=2, group=2)
    h, d = rnd.randrange(2), rnd.randrange(p.k_buf.shape[2])
    blk = rnd.randrange(1, int(p.nblk[0]) - 1)
    slot = int(p.req_to_token[int(p.rows[0]), blk * p.page + rnd.randrange(p.page)])
    k_buf = p.k_buf.clone()
    k_buf[slot, h, d] = float("inf")
    q = p.q.clone()
    q[0, h * 2:(h + 1) * 2, d] = 0.0
    kmin, kmax = dataclasses.replace(p, k_buf=k_buf).quest_summary()
    assert math.isinf(float(kmax[int(p.table[0, blk]), h, d]))
    want = torch.tensor(oracle.quest_scores(q, k_buf, p.req_to_token, p.rows, p.seq_lens,
                                            p.page), dtype=torch.float64)
    got = R.quest_scores(q, kmin, kmax, p.table, p.nblk)[..., :want.shape[-1]]
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    # control: torch.maximum (NaN-propagating) loses the block
    lo, hi = kmin[p.table[0]].float(), kmax[p.table[0]].float()
    qg = q[0].float().view(2, 2, -1)
    plain = torch.maximum(torch.einsum("hgd,nhd->hgnd", qg, hi),
                          torch.einsum("hgd,nhd->hgnd", qg, lo)).sum(-1).sum(1)
    assert torch.isnan(plain[h, blk])
    q[0, h * 2, d] = float("nan")
    nan_s = R.quest_scores(q, kmin, kmax, p.table, p.nblk)[..., :want.shape[-1]]
    assert torch.isnan(nan_s[0, h]).all() and torch.equal(nan_s[0, 1 - h], got[0, 1 - h])
