"""The reference ops against the independent fp64 oracle, over awkward sizes, with negative controls."""

from __future__ import annotations

import math
import random

import pytest
import torch

import oracle
import ref_steps
from paged import list_from_sets, make_paged, rel_err, score_series, sets_from_list
from sglang_prr import ops
from sglang_prr import reference as R

F32_TOL = 2e-5  # fp32 reassociation against fp64 over a few hundred tokens

# Awkward sizes, thinned pairwise: (batch, GQA group, page, lengths chosen per batch).
SIZES = [
    (1, 1, 16, None),
    (3, 4, 64, None),
    (17, 8, 16, None),
    (3, 8, 128, None),
    (1, 4, 32, None),
]


def _lens(seed: int, batch: int, page: int):
    rnd = random.Random(seed)
    # Contexts not multiples of the block, spanning 1 block to ~9 blocks.
    return [rnd.randint(1, 9 * page - 1) | 1 for _ in range(batch)]




# ----------------------------------------------------------------------------- summaries / scores
@pytest.mark.parametrize("batch,group,page,_", SIZES)
def test_quest_scores_match_oracle_and_bound_true_max(seed, batch, group, page, _):
    P = make_paged(seed, _lens(seed, batch, page), hk=2, group=group, page=page)
    kmin, kmax = P.quest_summary()
    got = ops.quest_scores(P.q, kmin, kmax, P.table, P.nblk)
    want = oracle.quest_scores(P.q, P.k_buf, P.req_to_token, P.rows, P.seq_lens, page)
    for b in range(batch):
        nb = int(P.nblk[b])
        w = torch.tensor(want[b], dtype=torch.float64)
        assert rel_err(got[b, :, :nb], w) < F32_TOL
        assert torch.isinf(got[b, :, nb:]).all() and (got[b, :, nb:] < 0).all()
        # Upper bound: per block, the group's summed score >= max over tokens of sum_g q_g . k.
        L = int(P.seq_lens[b])
        for h in range(2):
            for j in range(nb):
                slots = oracle.block_tokens(P.req_to_token, int(P.rows[b]), j, L, page)
                k = P.k_buf[slots, h].double()
                qg = P.q[b, h * group:(h + 1) * group].double()
                true_max = float((k @ qg.T).sum(-1).max())
                per_head_max = (k @ qg.T).max(0).values
                assert float(got[b, h, j]) >= true_max - 1e-4
                assert float(got[b, h, j]) >= float(per_head_max.sum()) - 1e-4


def test_quest_update_incremental_equals_bulk_and_resets_reused_pages(seed):
    P = make_paged(seed, [77, 40], page=16)
    bulk = P.quest_summary()
    n_pages = P.k_buf.shape[0] // 16
    # Poisoned summaries: a page reused from a previous owner must forget it at its first token.
    kmin = torch.full((n_pages, 2, 16), -1e9)
    kmax = torch.full((n_pages, 2, 16), 1e9)
    for pos in range(77):  # token by token, interleaving the two requests (decode order)
        for b, L in enumerate([77, 40]):
            if pos < L:
                loc = P.req_to_token[int(P.rows[b]), pos:pos + 1]
                R.quest_update(kmin, kmax, P.k_buf[loc.long()], loc, torch.tensor([pos]), 16)
    for b, L in enumerate([77, 40]):
        pages = P.table[b, :-(-L // 16)]
        assert torch.equal(kmin[pages], bulk[0][pages])
        assert torch.equal(kmax[pages], bulk[1][pages])
    # Negative control: the poisoned value survives where no first token was written.
    untouched = torch.ones(n_pages, dtype=torch.bool)
    untouched[P.table[0, :5]] = False
    untouched[P.table[1, :3]] = False
    untouched[0] = False
    assert (kmin[untouched] == -1e9).all()


@pytest.mark.parametrize("batch,group,page", [(1, 1, 16), (3, 4, 64), (2, 8, 32), (2, 2, 128)])
def test_infllm_scores_match_oracle(seed, batch, group, page):
    P = make_paged(seed, _lens(seed, batch, page), hk=2, group=group, page=page)
    ck = P.infllm_summary()
    got = ops.infllm_scores(P.q, ck, P.table, P.seq_lens, page, P.sm_scale)
    want = oracle.infllm_scores(P.q, P.k_buf, P.req_to_token, P.rows, P.seq_lens, page,
                                P.sm_scale)
    for b in range(batch):
        nb = int(P.nblk[b])
        w = torch.tensor(want[b], dtype=torch.float64)
        g = got[b, :, :nb].double()
        assert torch.equal(torch.isinf(g), torch.isinf(w))
        fin = torch.isfinite(w)
        if fin.any():
            assert rel_err(g[fin], w[fin]) < F32_TOL


# ----------------------------------------------------------------------------- top-K
@pytest.mark.parametrize("k,sink,local", [(1, 1, 1), (3, 1, 1), (5, 2, 0), (40, 1, 1), (2, 0, 3)])
def test_select_topk_matches_oracle_with_ties(seed, k, sink, local):
    g = torch.Generator().manual_seed(seed)
    B, Hk, NB = 5, 3, 23
    nblk = torch.tensor([1, 2, 7, 23, 15])
    scores = torch.randint(0, 4, (B, Hk, NB), generator=g).float()  # many ties
    scores[0, 0, 0] = float("nan")
    scores[3, 1, 4:9] = float("-inf")
    idx, cnt = ops.select_topk(scores, nblk, k, sink, local, k + sink + local)
    got = sets_from_list(idx, cnt)
    for b in range(B):
        for h in range(Hk):
            s = [float(x) for x in scores[b, h]]
            assert got[b][h] == oracle.topk_set(s, int(nblk[b]), k, sink, local), (b, h)
            row = idx[b, h, :int(cnt[b, h])]
            assert torch.all(row[1:] > row[:-1])  # ascending
            assert torch.all(idx[b, h, int(cnt[b, h]):] == -1)  # padded


def test_set_ops_roundtrip(seed):
    g = torch.Generator().manual_seed(seed)
    nb = 19
    a = torch.rand(4, 3, nb, generator=g) < 0.4
    p = torch.rand(4, 3, nb, generator=g) < 0.4
    a_idx, a_cnt = R.mask_to_list(a, nb + 3)
    p_idx, p_cnt = R.mask_to_list(p, 7)  # truncated list keeps the 7 lowest ids
    assert torch.equal(R.list_to_mask(a_idx, a_cnt, nb), a)
    p_trunc = R.list_to_mask(p_idx, p_cnt, nb)
    m_idx, m_cnt = ops.set_difference(a_idx, a_cnt, p_idx, p_cnt, nb)
    assert torch.equal(R.list_to_mask(m_idx, m_cnt, nb), a & ~p_trunc)
    isin = R.list_isin(p_idx, p_cnt, a_idx, a_cnt, nb)
    assert int(isin.sum()) == int((p_trunc & a).sum())


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("batch,group,page,_", SIZES)
def test_dense_and_set_attention_match_fp64_oracle(seed, batch, group, page, _):
    P = make_paged(seed, _lens(seed, batch, page), hk=2, group=group, page=page)
    full = [[set(range(int(P.nblk[b])))] * 2 for b in range(batch)]
    want = oracle.attention(P.q, P.k_buf, P.v_buf, P.req_to_token, P.rows, P.seq_lens, page,
                            P.sm_scale, full)
    got = R.dense_attention(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, page, P.sm_scale)
    assert rel_err(got, want) < F32_TOL
    # A random subset per (request, KV head), through the per-block partials and their merge.
    rnd = random.Random(seed)
    sets = [[{j for j in range(int(P.nblk[b])) if rnd.random() < 0.5} | {0} for _ in range(2)]
            for b in range(batch)]
    idx, cnt = list_from_sets(sets, P.nb + 2)
    o, lse = ops.attend_set(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, idx, cnt, page,
                            P.sm_scale)
    want_s = oracle.attention(P.q, P.k_buf, P.v_buf, P.req_to_token, P.rows, P.seq_lens, page,
                              P.sm_scale, sets)
    assert rel_err(o, want_s) < F32_TOL


def test_partials_padding_is_the_merge_identity(seed):
    P = make_paged(seed, [50, 9], page=16)
    idx = torch.tensor([[[0, 2, -1, -1], [1, -1, -1, -1]], [[0, -1, -1, -1], [-1, -1, -1, -1]]],
                       dtype=torch.int32)
    cnt = torch.tensor([[2, 1], [1, 0]], dtype=torch.int32)
    o, lse = ops.sparse_attn_partials(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, idx, cnt, 16,
                                      P.sm_scale)
    G = 4
    valid = torch.arange(4) < cnt.repeat_interleave(G, 1).unsqueeze(-1)
    assert torch.isneginf(lse[~valid]).all() and (o[~valid] == 0).all()
    assert torch.isfinite(lse[valid]).all()
    # A request whose set is empty for a head gives (0, -inf) for that head's queries.
    mo, mlse = ops.merge_partials(o, lse)
    assert (mo[1, G:] == 0).all() and torch.isneginf(mlse[1, G:]).all()


# ----------------------------------------------------------------------------- DSA and PRR
def _dsa_setup(seed, batch, group, page, method="quest"):
    lens = [max(L, 5 * page + 3) for L in _lens(seed, batch, page)]
    P = make_paged(seed, lens, hk=2, group=group, page=page)
    summary = list(P.quest_summary()) if method == "quest" else [P.infllm_summary()]
    return P, summary


@pytest.mark.parametrize("method", ["quest", "infllm_v2"])
@pytest.mark.parametrize("batch,group,page,_", SIZES[:4])
def test_dsa_with_k_covering_all_blocks_equals_dense(seed, method, batch, group, page, _):
    P, summary = _dsa_setup(seed, batch, group, page, method)
    dense = R.dense_attention(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, page, P.sm_scale)
    o, _, _, _ = ops.dsa_decode(P.q, P.k_buf, P.v_buf, summary, P.table, P.seq_lens, method,
                                P.nb, 1, 1, page, P.sm_scale)
    assert rel_err(o, dense) < F32_TOL
    # Negative control: K below the block count drops blocks and changes the output.
    o_small, _, _, _ = ops.dsa_decode(P.q, P.k_buf, P.v_buf, summary, P.table, P.seq_lens,
                                      method, 1, 1, 1, page, P.sm_scale)
    assert rel_err(o_small, dense) > 1e-3


def _prediction(kind: str, a_sets, nblk, rnd, width):
    """Arbitrary predictions against the true selection A."""
    out = []
    for b, per_head in enumerate(a_sets):
        nb = int(nblk[b])
        row = []
        for a in per_head:
            universe = set(range(nb))
            if kind == "disjoint":
                s = universe - a
            elif kind == "superset":
                s = a | {j for j in universe if rnd.random() < 0.5}
            elif kind == "equal":
                s = set(a)
            elif kind == "smaller":
                s = set(sorted(a)[: max(0, len(a) // 2)])
            elif kind == "empty":
                s = set()
            else:  # random
                s = {j for j in universe if rnd.random() < 0.4}
            row.append(set(sorted(s)[:width]))
        out.append(row)
    return out


@pytest.mark.parametrize("kind", ["disjoint", "superset", "equal", "smaller", "empty", "random"])
@pytest.mark.parametrize("method", ["quest", "infllm_v2"])
def test_prr_exact_equals_serial_dsa_for_any_prediction(seed, kind, method):
    batch, group, page, k = 3, 4, 16, 2
    P, summary = _dsa_setup(seed, batch, group, page, method)
    o_dsa, scores, a_idx, a_cnt = ops.dsa_decode(P.q, P.k_buf, P.v_buf, summary, P.table,
                                                 P.seq_lens, method, k, 1, 1, page, P.sm_scale)
    a_sets = sets_from_list(a_idx, a_cnt)
    want = oracle.attention(P.q, P.k_buf, P.v_buf, P.req_to_token, P.rows, P.seq_lens, page,
                            P.sm_scale, a_sets)
    assert rel_err(o_dsa, want) < F32_TOL
    rnd = random.Random(seed)
    width = 2 * k + 2
    p_sets = _prediction(kind, a_sets, P.nblk, rnd, width)
    p_idx, p_cnt = list_from_sets(p_sets, width)
    Hk, nb = 2, P.nb
    level, trend = torch.zeros(batch, Hk, nb), torch.zeros(batch, Hk, nb)
    n_init = torch.zeros(batch, dtype=torch.long)
    theta = torch.tensor([[0.6, 0.3, 0.5]] * batch)
    args = (P.q, P.k_buf, P.v_buf, summary, P.table, P.seq_lens, p_idx, p_cnt)
    o, a2_idx, a2_cnt, m_idx, m_cnt, _, _ = ops.prr_decode(
        *args, level, trend, n_init, theta, method, k, width - 2, 1, 1, page, P.sm_scale)
    assert torch.equal(a2_idx, a_idx) and torch.equal(a2_cnt, a_cnt)
    assert rel_err(o, o_dsa) < F32_TOL
    assert sets_from_list(m_idx, m_cnt) == [[a - p for a, p in zip(ar, pr)]
                                             for ar, pr in zip(a_sets, p_sets)]
    # Union mode attends P u A: equal to the oracle over the union; different from DSA whenever
    # some prediction falls outside A (negative control for the P n A filter).
    u_sets = [[a | p for a, p in zip(ar, pr)] for ar, pr in zip(a_sets, p_sets)]
    o_u = ops.prr_decode(*args, level.clone(), trend.clone(), n_init.clone(), theta, method, k,
                         width - 2, 1, 1, page, P.sm_scale, exact=False)[0]
    want_u = oracle.attention(P.q, P.k_buf, P.v_buf, P.req_to_token, P.rows, P.seq_lens, page,
                              P.sm_scale, u_sets)
    assert rel_err(o_u, want_u) < F32_TOL
    if u_sets != a_sets:
        assert rel_err(o_u, o_dsa) > 1e-4
    # Without the repair, the output is attention over P n A only: wrong whenever M is non-empty.
    if int(m_cnt.sum()) > 0:
        o_s, lse_s = ops.sparse_attn_partials(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, p_idx,
                                              p_cnt, page, P.sm_scale)
        empty = torch.full_like(m_idx, -1), torch.zeros_like(m_cnt)
        o_nr, lse_nr = ops.sparse_attn_partials(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens,
                                                *empty, page, P.sm_scale)
        o_norepair, _ = ops.prr_merge(o_s, lse_s, p_idx, p_cnt, a_idx, a_cnt, o_nr, lse_nr, nb,
                                      True)
        assert rel_err(o_norepair, o_dsa) > 1e-4


@pytest.mark.parametrize("batch,group,page", [(1, 1, 16), (17, 4, 16), (3, 8, 64), (2, 1, 128)])
def test_prr_decode_loop_stays_exact_over_steps(seed, batch, group, page):
    """Several decode steps with the real predictor feeding P(t+1) back: exact every step."""
    lens = [max(L, 4 * page + 1) for L in _lens(seed, batch, page)]
    P = make_paged(seed, [L + 6 for L in lens], hk=2, group=group, page=page)
    kmin, kmax = P.quest_summary()
    nb = P.nb
    level, trend = torch.zeros(batch, 2, nb), torch.zeros(batch, 2, nb)
    n_init = torch.zeros(batch, dtype=torch.long)
    theta = torch.tensor([[0.4, 0.2, 0.25]] * batch)
    k, n_pred = 2, 3
    p_idx = torch.full((batch, 2, n_pred + 2), -1, dtype=torch.int32)
    p_cnt = torch.zeros(batch, 2, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    for step in range(6):
        seq = torch.tensor(lens) + step
        q = torch.randn(P.q.shape, generator=g) * 3
        o_dsa, _, _, _ = ops.dsa_decode(q, P.k_buf, P.v_buf, [kmin, kmax], P.table, seq, "quest",
                                        k, 1, 1, page, P.sm_scale)
        o, _, _, m_idx, m_cnt, p_idx, p_cnt = ops.prr_decode(
            q, P.k_buf, P.v_buf, [kmin, kmax], P.table, seq, p_idx, p_cnt, level, trend, n_init,
            theta, "quest", k, n_pred, 1, 1, page, P.sm_scale)
        assert rel_err(o, o_dsa) < F32_TOL, step
        assert torch.all(n_init == R.num_blocks(seq, page))


# ----------------------------------------------------------------------------- predictor
def test_holt_update_and_predict_equal_scalar_loop(seed):
    rnd = random.Random(seed)
    B, Hk, NB, T = 3, 2, 12, 9
    thetas = [(rnd.choice([0.2, 0.6, 1.0]), rnd.choice([0.1, 0.5]), rnd.choice([0.0, 0.75]))
              for _ in range(B)]
    # Blocks appear over time (first-appearance initialisation) at different rates per request.
    start = [3, 5, 12]
    series = [[[[rnd.gauss(0, 3) for _ in range(min(NB, start[b] + t // (b + 1)))]
                for t in range(T)] for _ in range(Hk)] for b in range(B)]
    level, trend = torch.zeros(B, Hk, NB), torch.zeros(B, Hk, NB)
    n_init = torch.zeros(B, dtype=torch.long)
    th = torch.tensor(thetas)
    want = [[oracle.holt_loop(series[b][h], *thetas[b]) for h in range(Hk)] for b in range(B)]
    for t in range(T):
        nblk = torch.tensor([len(series[b][0][t]) for b in range(B)])
        if t > 0:
            pred = R.holt_predict(level, trend, th[:, 2], n_init)
            for b in range(B):
                for h in range(Hk):
                    ref = want[b][h][t - 1]
                    for j in range(NB):
                        if j in ref:
                            assert abs(float(pred[b, h, j]) - ref[j]) < 1e-4
                        else:
                            assert float(pred[b, h, j]) == -math.inf
        scores = torch.full((B, Hk, NB), float("-inf"))
        for b in range(B):
            for h in range(Hk):
                row = series[b][h][t]
                scores[b, h, :len(row)] = torch.tensor(row)
        ops.holt_update(level, trend, n_init, scores, nblk, th[:, 0], th[:, 1])


def test_predict_set_prefers_rising_blocks_with_trend(seed):
    """A constructed case where the trend term decides: gamma > 0 must pick the rising block."""
    B, Hk, NB = 1, 1, 6
    level, trend = torch.zeros(B, Hk, NB), torch.zeros(B, Hk, NB)
    n_init = torch.zeros(B, dtype=torch.long)
    one = torch.ones(B)
    for t in range(6):
        s = torch.tensor([[[0.0, 5.0, 3.0 + 0.8 * t, 0.0, 0.0, 0.0]]])  # block 2 rises past 1
        ops.holt_update(level, trend, n_init, s, torch.tensor([NB]), one * 0.2, one * 0.5)
    pick = lambda gamma: sets_from_list(*ops.predict_set(level, trend, one * gamma, n_init,
                                                         torch.tensor([NB]), 1, 1, 1))[0][0]
    assert 2 in pick(0.75) and 1 not in pick(0.75)
    assert 1 in pick(0.0)  # negative control: without the trend the lagging level wins


def test_block_first_scored_minus_inf_is_predicted_again_once_finite(seed):
    """InfLLM-v2 scores a block -inf until a complete compressed key covers it. That block must
    restart like a new one when its scores turn finite (and win P when it scores highest); under
    the rule without the restart (the oracle's negative control) its level stays -inf and it is
    never predicted again."""
    rnd = random.Random(seed)
    B, Hk, NB, T = 2, 3, 9, 6
    late = rnd.randrange(1, NB - 1)  # -inf for the first steps, then the best block
    alpha, beta, gamma = rnd.choice([0.3, 0.6]), rnd.choice([0.2, 0.5]), rnd.choice([0.0, 0.5])
    series = []
    for t in range(T):
        row = [rnd.uniform(-1, 1) for _ in range(NB)]
        row[late] = float("-inf") if t < 2 else 5.0 + t
        series.append(row)
    level, trend = torch.zeros(B, Hk, NB), torch.zeros(B, Hk, NB)
    n_init = torch.zeros(B, dtype=torch.long)
    th = torch.tensor([[alpha, beta, gamma]] * B)
    for t, row in enumerate(series):
        scores = torch.tensor(row).expand(B, Hk, NB).contiguous()
        ops.holt_update(level, trend, n_init, scores, torch.full((B,), NB), th[:, 0], th[:, 1])
    assert torch.isfinite(level).all() and torch.isfinite(trend).all()
    # P of one middle block (sink/local 0): the late block, which now scores highest.
    idx, cnt = ops.predict_set(level, trend, th[:, 2].contiguous(), n_init,
                               torch.full((B,), NB), 1, 0, 0)
    assert (cnt == 1).all() and (idx[..., 0] == late).all(), (late, idx)
    # holt_loop predicts each step before its update: one more step gives the state after T.
    want = oracle.holt_loop(series + series[-1:], alpha, beta, gamma)[-1]
    assert abs(float(level[0, 0, late] + gamma * trend[0, 0, late]) - want[late]) < 1e-4
    stuck = oracle.holt_loop(series + series[-1:], alpha, beta, gamma,
                             restart_nonfinite=False)[-1]
    assert not math.isfinite(stuck[late]) or stuck[late] != stuck[late]  # negative control


# ----------------------------------------------------------------------------- calibration
def test_calibration_equals_scalar_loop_for_every_candidate(seed):
    rnd = random.Random(seed)
    R_, Phi, Hk, NB = 2, 7, 2, 11
    scores, nblk = score_series(rnd, R_, Phi, Hk, NB)
    grid = [(a, b, g) for a in (0.2, 0.8) for b in (0.1, 0.5) for g in (0.0, 0.75)]
    al, be, ga = (torch.tensor([t[i] for t in grid]) for i in range(3))
    k, n_pred = 2, 3
    H = ops.calibrate(scores, nblk, k, n_pred, 1, 1, al, be, ga)
    for r in range(R_):
        for c, theta in enumerate(grid):
            want = sum(oracle.calibrate_one(
                [[float(x) for x in scores[r, phi, h, :int(nblk[r, phi])]] for phi in range(Phi)],
                k, n_pred, 1, 1, theta) for h in range(Hk)) / Hk
            assert abs(float(H[r, c]) - want) < 1e-5, (r, theta)


def test_calibration_recovers_the_best_theta_on_constructed_sequences():
    """Blocks on straight lines that cross (high intercepts falling, low ones rising): the next
    leaders are predicted only by following the trend, so theta* must have gamma > 0 and a fast
    level; on a static pattern every candidate ties and the first one is chosen."""
    Phi, NB, k = 16, 18, 4
    c, r = torch.linspace(10, 0, NB), torch.linspace(-1.3, 1.3, NB)
    lines = torch.stack([c + r * t for t in range(Phi)]).view(1, Phi, 1, NB)
    nblk = torch.full((1, Phi), NB)
    grid = [(a, b, g) for a in (0.2, 0.4, 0.6, 0.8) for b in (0.1, 0.3, 0.5)
            for g in (0.0, 0.25, 0.5, 0.75)]
    al, be, ga = (torch.tensor([t[i] for t in grid]) for i in range(3))
    H = ops.calibrate(lines, nblk, k, k, 1, 1, al, be, ga)
    best = grid[int(R.best_theta(H)[0])]
    assert best[2] > 0.0 and best[0] >= 0.4, (best, H.max())
    no_trend = float(H[0, [i for i, t in enumerate(grid) if t[2] == 0.0]].max())
    assert float(H.max()) > no_trend + 0.05, (float(H.max()), no_trend)
    static = lines[:, :1].expand(1, Phi, 1, NB).contiguous()
    Hs = ops.calibrate(static, nblk, k, k, 1, 1, al, be, ga)
    assert torch.allclose(Hs, torch.ones_like(Hs)) and int(R.best_theta(Hs)[0]) == 0


# ----------------------------------------------------------------------------- graph safety
def test_decode_step_runs_on_meta_tensors():
    """The whole PRR decode step, on the reference alone (``ref_steps``, Quest's scores), runs on
    the meta device: no reference op reads a tensor value on the host (a .item()/.tolist()/
    data-dependent shape would raise), so it is CUDA-graph capturable."""
    B, Hk, G, D, page, nb, slots = 3, 2, 4, 16, 16, 9, 16 * 40
    m = torch.device("meta")
    q = torch.empty(B, Hk * G, D, device=m)
    kv = torch.empty(slots, Hk, D, device=m)
    table = torch.empty(B, nb, dtype=torch.long, device=m)
    seq = torch.empty(B, dtype=torch.long, device=m)
    kmin = torch.empty(slots // page, Hk, D, device=m)
    p_idx = torch.empty(B, Hk, 6, dtype=torch.int32, device=m)
    p_cnt = torch.empty(B, Hk, dtype=torch.int32, device=m)
    level = torch.empty(B, Hk, nb, device=m)
    n_init = torch.empty(B, dtype=torch.long, device=m)
    theta = torch.empty(B, 3, device=m)
    scores = R.quest_scores(q, kmin, kmin, table, R.num_blocks(seq, page))
    out = ref_steps.prr_decode(q, kv, kv, scores, table, seq, p_idx, p_cnt, level, level.clone(),
                               n_init, theta, 2, 4, 1, 1, page, 0.25)
    assert out[0].shape == (B, Hk * G, D) and out[0].device.type == "meta"
    assert out[5].shape == (B, Hk, 6)
