"""The public ops refuse, by name, what the bad-input audit found them to accept silently or to
fail on deep inside (``sglang_prr.contracts``, ``contracts_predictor``, ``contracts_infllm``).

One test per finding: each bad call raises ``ValueError`` whose message names the argument, and
beside it the same call with the valid argument runs (the negative control: the check refuses
the corruption, not the case). Fresh random data per run (``seed`` is printed on failure).
"""

from __future__ import annotations

import math

import pytest
import torch

from paged import make_paged
from sglang_prr import contracts, ops

I32 = torch.int32
BIG = 2**31  # one past the kernels' int32 bound


def _paged(seed):
    P = make_paged(seed, [70, 37])
    kmin, kmax = P.quest_summary()
    return P, kmin, kmax


def _lists(rows, hk, ids, width):
    idx = torch.full((rows, hk, width), -1, dtype=I32)
    idx[..., :len(ids)] = torch.tensor(ids, dtype=I32)
    return idx, torch.full((rows, hk), len(ids), dtype=I32)


def _merge_case(P):
    """A = {0, 2, 3}, P = {0, 1, 2}, M = A \\ P and the speculative partials over P."""
    B, Hk = P.q.shape[0], P.k_buf.shape[1]
    a_idx, a_cnt = _lists(B, Hk, [0, 2, 3], 4)
    p_idx, p_cnt = _lists(B, Hk, [0, 1, 2], 4)
    m_idx, m_cnt = ops.set_difference(a_idx, a_cnt, p_idx, p_cnt, P.nb)
    o_s, l_s = ops.sparse_attn_partials(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, p_idx, p_cnt,
                                        P.page, P.sm_scale)
    return dict(q=P.q, k_buf=P.k_buf, v_buf=P.v_buf, table=P.table, seq_lens=P.seq_lens,
                idx=m_idx, cnt=m_cnt, page_size=P.page, sm_scale=P.sm_scale, o_spec=o_s,
                lse_spec=l_s, p_idx=p_idx, p_cnt=p_cnt, a_idx=a_idx, a_cnt=a_cnt, nb=P.nb)


def _raises(name, fn, *args, **kw):
    with pytest.raises(ValueError, match=name) as e:
        fn(*args, **kw)
    return str(e.value)


def test_d2_exact_merge_nb_is_the_table_width(seed):
    P, _, _ = _paged(seed)
    args = _merge_case(P)
    for nb in (P.nb - 1, 0, P.nb + 1):
        msg = _raises("nb", ops.sparse_attn_merge, **dict(args, nb=nb, exact=True))
        assert f"nb is {nb}" in msg and str(P.nb) in msg
    o = ops.sparse_attn_merge(**args, exact=True)[0]  # control: the table's width
    want = ops.attend_set(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, args["a_idx"],
                          args["a_cnt"], P.page, P.sm_scale)[0]
    assert torch.allclose(o, want, rtol=1e-5, atol=1e-6)


def _state(B, Hk, NB):
    return dict(level=torch.randn(B, Hk, NB), trend=torch.randn(B, Hk, NB),
                n_init=torch.full((B,), NB, dtype=torch.long))


def test_d6_smoothing_factors_are_one_float_per_request(seed):
    torch.manual_seed(seed)
    B, Hk, NB = 1, 2, 6
    n = torch.full((B,), NB)
    ps = dict(_state(B, Hk, NB), gamma=torch.ones(B), nblk_next=n, n_pred=2, sink_blocks=1,
              local_blocks=1)
    _raises("gamma.shape", ops.predict_set, **dict(ps, gamma=torch.tensor([[1.0, 0.0]])))
    _raises("gamma.dtype", ops.predict_set, **dict(ps, gamma=torch.ones(B, dtype=torch.long)))
    assert ops.predict_set(**ps)[0].shape == (B, Hk, 4)  # control
    hu = dict(_state(B, Hk, NB), scores=torch.randn(B, Hk, NB), nblk=n,
              alpha=torch.full((B,), 0.5), beta=torch.full((B,), 0.3))
    _raises("alpha.shape", ops.holt_update, **dict(hu, alpha=torch.tensor([[0.5, 0.1]])))
    _raises("beta.dtype", ops.holt_update, **dict(hu, beta=torch.ones(B, dtype=I32)))
    ops.holt_update(**hu)  # control
    pu = dict(_state(B, Hk, NB), scores=torch.randn(B, Hk, NB), nblk=n, nblk_next=n,
              theta=torch.tensor([[0.5, 0.3, 1.0]]), n_pred=2, sink_blocks=1, local_blocks=1)
    _raises("theta.dtype", ops.predict_update, **dict(pu, theta=torch.ones(B, 3, dtype=I32)))
    _raises("theta.shape", ops.predict_update, **dict(pu, theta=torch.rand(B, 3, 1)))
    ops.predict_update(**pu)  # control


def _rows_case(P, kmin):
    """The pool's predictor state (R = 3 rows, P double-buffered) and a quest_select_predict
    call of the batch on rows 1 and 2."""
    B, Hk, NB = P.q.shape[0], kmin.shape[1], P.nb
    R = 3
    pool = dict(level=torch.randn(R, Hk, NB), trend=torch.randn(R, Hk, NB),
                n_init=torch.tensor([0, 3, 2]), theta=torch.rand(R, 3))
    p_idx, p_cnt = _lists(2 * R, Hk, [0, 1], 6)
    rows = torch.tensor([1, 2])
    return dict(q=P.q, kmin=kmin, kmax=kmin + 1, table=P.table, nblk=P.nblk,
                nblk_next=P.nblk, p_idx=p_idx, p_cnt=p_cnt, p_rows=2 * rows,
                p_next_rows=2 * rows + 1, rows=rows, k=2, n_pred=2, sink_blocks=1,
                local_blocks=1, n_out=4, **pool), B


def test_d7_pool_state_of_the_row_ops_is_checked_as_predict_update(seed):
    P, kmin, _ = _paged(seed)
    qsp, B = _rows_case(P, kmin)
    pur = {k: qsp[k] for k in ("level", "trend", "n_init", "p_idx", "p_cnt", "theta", "rows",
                               "nblk", "nblk_next", "n_pred", "sink_blocks", "local_blocks")}
    pur.update(scores=torch.randn(B, kmin.shape[1], P.nb), p_rows=qsp["p_next_rows"])
    lv = qsp["level"]
    bad = {"level": dict(level=lv.int(), trend=lv.int()),
           "trend": dict(trend=lv.half()),
           "theta": dict(theta=qsp["theta"].double()),
           "n_init": dict(n_init=qsp["n_init"].float())}
    for name, over in bad.items():
        for fn, args in ((ops.predict_update_rows, pur), (ops.quest_select_predict, qsp)):
            state = {k: v.clone() for k, v in over.items()}
            _raises(name, fn, **dict(args, **state))
    ops.predict_update_rows(**pur)  # controls: the float32 state runs
    ops.quest_select_predict(**qsp)


def test_d9_page_size_of_the_helpers_and_select_blocks(seed):
    P, kmin, kmax = _paged(seed)
    for page in (0, -16, True, 16.0):
        _raises("page_size", ops.num_blocks, seq_lens=P.seq_lens, page_size=page)
        _raises("page_size", ops.block_table, req_to_token=P.req_to_token,
                req_pool_indices=P.rows, page_size=page)
        _raises("page_size", ops.select_blocks, method="quest", q=P.q, summary=[kmin, kmax],
                table=P.table, seq_lens=P.seq_lens, page_size=page, sm_scale=P.sm_scale)
    assert torch.equal(ops.num_blocks(P.seq_lens, P.page), P.nblk)  # controls
    assert torch.equal(ops.block_table(P.req_to_token, P.rows, P.page), P.table)
    ops.select_blocks("quest", P.q, [kmin, kmax], P.table, P.seq_lens, P.page, P.sm_scale)


def test_c2_union_merge_checks_what_it_reads(seed):
    P, _, _ = _paged(seed)
    args = dict(_merge_case(P), exact=False)
    _raises("p_idx/p_cnt", ops.sparse_attn_merge, **dict(args, p_idx=None, p_cnt=None))
    _raises("p_idx width", ops.sparse_attn_merge,
            **dict(args, p_idx=args["p_idx"][..., :3].contiguous()))
    _raises("p_idx width", ops.sparse_attn_merge,
            **dict(args, p_idx=args["p_idx"][..., :1].contiguous()))
    _raises("p rows", ops.sparse_attn_merge, **dict(args, p_rows=torch.zeros(1, dtype=I32)))
    _raises("lse_spec.dtype", ops.sparse_attn_merge,
            **dict(args, lse_spec=args["lse_spec"].nan_to_num(0, 0, 0).int()))
    ops.sparse_attn_merge(**args)  # control: union mode without A
    ops.sparse_attn_merge(**dict(args, a_idx=None, a_cnt=None, nb=0))
    o_r, l_r = ops.sparse_attn_partials(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, args["idx"],
                                        args["cnt"], P.page, P.sm_scale)
    pm = dict(o_spec=args["o_spec"], lse_spec=args["lse_spec"], p_idx=args["p_idx"],
              p_cnt=args["p_cnt"], a_idx=args["a_idx"], a_cnt=args["a_cnt"], o_rep=o_r,
              lse_rep=l_r, nb=P.nb)
    for exact in (False, True):
        _raises("lse_rep.dtype", ops.prr_merge, **dict(pm, lse_rep=l_r.long(), exact=exact))
        _raises("lse_spec.dtype", ops.prr_merge,
                **dict(pm, lse_spec=args["lse_spec"].nan_to_num(0, 0, 0).int(), exact=exact))
        ops.prr_merge(**pm, exact=exact)  # control


def test_c3_infllm_update_checks_out_loc_rank_first(seed):
    P, _, _ = _paged(seed)
    last = P.seq_lens - 1
    args = dict(ck=P.infllm_summary(), k_buf=P.k_buf, req_to_token=P.req_to_token,
                req_idx=P.rows, out_loc=P.req_to_token[P.rows, last].long(), positions=last,
                page_size=P.page)
    _raises("out_loc.shape", ops.infllm_update, **dict(args, out_loc=args["out_loc"][0]))
    ops.infllm_update(**args)  # control


def test_c4_summary_tensors_match_the_methods_layout(seed):
    P, kmin, kmax = _paged(seed)
    ck = P.infllm_summary()
    common = dict(q=P.q, table=P.table, seq_lens=P.seq_lens, page_size=P.page,
                  sm_scale=P.sm_scale)
    sel = dict(common, k=2, sink_blocks=1, local_blocks=1)
    dec = dict(sel, k_buf=P.k_buf, v_buf=P.v_buf)
    for method, bad, good in (("quest", [kmin], [kmin, kmax]),
                              ("quest", [kmin, kmax, kmax], [kmin, kmax]),
                              ("infllm_v2", [ck, ck], [ck]), ("infllm_v2", [], [ck])):
        for fn, args in ((ops.select_blocks, common), (ops.select_fused, sel),
                         (ops.dsa_decode, dec)):
            msg = _raises("summary", fn, method=method, summary=bad, **args)
            assert f"is {len(bad)}" in msg
            fn(method=method, summary=good, **args)  # control
    B, Hk = P.q.shape[0], kmin.shape[1]
    p_idx, p_cnt = _lists(B, Hk, [0, 1], 4)
    prr = dict(dec, p_idx=p_idx, p_cnt=p_cnt, theta=torch.rand(B, 3), n_pred=2,
               **_state(B, Hk, P.nb))
    prr["n_init"] = torch.zeros(B, dtype=torch.long)
    _raises("summary", ops.prr_decode, method="quest", summary=[kmin], **prr)
    ops.prr_decode(method="quest", summary=[kmin, kmax], **prr)  # control


def test_c5_zero_blocks_slots_and_candidates(seed):
    P, _, _ = _paged(seed)
    B, Hk = P.q.shape[0], P.k_buf.shape[1]
    idx, cnt = _lists(B, Hk, [], 2)
    attn = dict(q=P.q, k_buf=P.k_buf, v_buf=P.v_buf, table=P.table, seq_lens=P.seq_lens,
                idx=idx, cnt=cnt, page_size=P.page, sm_scale=P.sm_scale)
    _raises("table.shape", ops.attend_set, **dict(attn, table=P.table[:, :0]))
    _raises("KV slots", ops.attend_set, **dict(attn, k_buf=P.k_buf[:0], v_buf=P.v_buf[:0],
                                               seq_lens=P.seq_lens * 0))
    _raises("table.shape", ops.sparse_attn_partials, **dict(attn, table=P.table[:, :0]))
    o, lse = ops.attend_set(**attn)  # control: an empty list over a real table and pool
    assert torch.equal(o, torch.zeros_like(o)) and lse.isneginf().all()
    torch.manual_seed(seed)
    cal = dict(scores=torch.randn(1, 3, 1, 6), nblk=torch.full((1, 3), 6), k=2, n_pred=2,
               sink_blocks=1, local_blocks=1)
    _raises("alphas", ops.calibrate, **cal, alphas=torch.zeros(0), betas=torch.zeros(0),
            gammas=torch.zeros(0))
    _raises("alphas.dtype", ops.calibrate, **cal, alphas=torch.ones(1, dtype=I32),
            betas=torch.ones(1), gammas=torch.ones(1))
    H = ops.calibrate(**cal, alphas=torch.tensor([.2, .5]), betas=torch.full((2,), .3),
                      gammas=torch.ones(2))  # control
    _raises("H.shape", ops.best_theta, H=torch.zeros(2, 0))
    assert ops.best_theta(H).shape == (1,)  # control


def test_c6_int_arguments_are_bounded_by_the_kernels_int32(seed):
    torch.manual_seed(seed)
    scores, nblk = torch.randn(2, 2, 6), torch.tensor([6, 4])
    st = dict(scores=scores, nblk=nblk, k=2, sink_blocks=1, local_blocks=1, n_out=4)
    for name in ("k", "sink_blocks", "local_blocks", "n_out"):
        for big, n_out in ((BIG, 4 * BIG), (2**62, 2**63 - 1)):
            over = {"n_out": n_out, name: big}  # n_out wide enough: the argument is refused
            msg = _raises(name, ops.select_topk, **dict(st, **over))
            assert f"{name} is {big}" in msg and "2**31 - 1" in msg
    ops.select_topk(**st)  # control
    a, ac = _lists(2, 2, [0, 2], 3)
    _raises("nb", ops.set_difference, a_idx=a, a_cnt=ac, p_idx=a, p_cnt=ac, nb=BIG)
    ops.set_difference(a, ac, a, ac, 6)  # control
    ps = dict(_state(2, 2, 6), gamma=torch.ones(2), nblk_next=nblk, n_pred=2, sink_blocks=1,
              local_blocks=1)
    _raises("n_pred", ops.predict_set, **dict(ps, n_pred=BIG))
    _raises("n_pred \\+ sink_blocks", ops.predict_set, **dict(ps, n_pred=BIG - 1))  # the sum
    ops.predict_set(**ps)  # control
    cal = dict(scores=torch.randn(1, 3, 1, 6), nblk=torch.full((1, 3), 6), k=2, n_pred=2,
               sink_blocks=1, local_blocks=1, alphas=torch.ones(1), betas=torch.ones(1),
               gammas=torch.ones(1))
    _raises("k", ops.calibrate, **dict(cal, k=2**40))
    ops.calibrate(**cal)  # control
    contracts.nonneg("op", k=BIG - 1)  # the bound itself is accepted


def test_minor_sm_scale_q_dtype_and_bools(seed):
    P, kmin, kmax = _paged(seed)
    dec = dict(q=P.q, k_buf=P.k_buf, v_buf=P.v_buf, summary=[kmin, kmax], table=P.table,
               seq_lens=P.seq_lens, method="quest", k=2, sink_blocks=1, local_blocks=1,
               page_size=P.page)
    for bad in (math.nan, math.inf, -math.inf, True, "0.25"):
        _raises("sm_scale", ops.dsa_decode, **dec, sm_scale=bad)
    ops.dsa_decode(**dec, sm_scale=P.sm_scale)  # control
    # The contracts themselves (the ops' fakes pass sm_scale to them by name).
    idx, cnt = _lists(P.q.shape[0], P.k_buf.shape[1], [0], 2)
    args = (P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, idx, cnt, P.page)
    _raises("sm_scale", contracts.check_sparse_attn_partials, *args, sm_scale=math.inf)
    contracts.check_sparse_attn_partials(*args, sm_scale=P.sm_scale)  # control
    # q of the scoring ops: the float dtypes the attention ops take.
    ck = P.infllm_summary()
    for q in (P.q.double(), (P.q * 10).int()):
        _raises("q.dtype", ops.quest_scores, q=q, kmin=kmin, kmax=kmax, table=P.table,
                nblk=P.nblk)
        _raises("q.dtype", ops.quest_select, q=q, kmin=kmin, kmax=kmax, table=P.table,
                nblk=P.nblk, p_idx=None, p_cnt=None, k=2, sink_blocks=1, local_blocks=1,
                n_out=4)
        _raises("q.dtype", ops.infllm_scores, q=q, ck=ck, table=P.table, seq_lens=P.seq_lens,
                page_size=P.page, sm_scale=P.sm_scale)
    for q in (P.q, P.q.bfloat16()):  # controls
        ops.quest_scores(q, kmin, kmax, P.table, P.nblk)
        ops.quest_select(q, kmin, kmax, P.table, P.nblk, None, None, 2, 1, 1, 4)
        ops.infllm_scores(q, ck, P.table, P.seq_lens, P.page, P.sm_scale)
    # A bool is not a count where the check sees it (a custom op's schema turns True into 1
    # before its check runs): the compositions, SelectSpec, the contracts themselves.
    sel = dict(method="quest", q=P.q, summary=[kmin, kmax], table=P.table, seq_lens=P.seq_lens,
               page_size=P.page, sm_scale=P.sm_scale, k=2, sink_blocks=1, local_blocks=1)
    _raises("local_blocks", ops.select_fused, **dict(sel, local_blocks=True))
    _raises("sink_blocks", contracts.nonneg, "op", sink_blocks=False)
    ops.select_fused(**sel)  # control
