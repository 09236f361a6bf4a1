"""The custom ops' fake implementations (meta device, FakeTensor under ``torch.compile``) run the
same contract as their real ones (``sglang_prr.fake_contracts``).

A fake only gives output shapes; without the contract a bad argument passed on the meta device
or failed while tracing with an unrelated message ("not enough values to unpack", "RuntimeError
when making fake tensor call"). Here: valid arguments give the CPU call's output shapes and
dtypes on meta for every op; bad ones raise on meta the very ``ValueError`` the CPU call raises,
naming the argument (each beside its valid control); under ``torch.compile`` the contract's
message reaches the caller, and ints traced as ``SymInt`` (dynamic) still pass the check.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._library.custom_ops import CustomOpDef

from paged import make_paged
from sglang_prr import calibration, contracts, custom_ops, custom_ops_predictor, fake_contracts
from sglang_prr import reference as ref

META = torch.device("meta")


def _valid_args() -> dict:
    """op name -> keyword arguments of one valid CPU call (small; fresh tensors per call)."""
    P = make_paged(0, [70, 37])
    kmin, kmax = P.quest_summary()
    B, _, _ = P.q.shape
    Hk, NB, page = P.k_buf.shape[1], P.nb, P.page
    scores = ref.quest_scores(P.q, kmin, kmax, P.table, P.nblk)
    a_idx, a_cnt = ref.select_topk(scores, P.nblk, 2, 1, 1, 4)
    p_idx = torch.tensor([[[0, 1, 2, -1]] * Hk] * B, dtype=torch.int32)
    p_cnt = torch.full((B, Hk), 3, dtype=torch.int32)
    m_idx, m_cnt = ref.set_difference(a_idx, a_cnt, p_idx, p_cnt, NB)
    attn = dict(q=P.q, k_buf=P.k_buf, v_buf=P.v_buf, table=P.table, seq_lens=P.seq_lens,
                page_size=page, sm_scale=P.sm_scale)
    o_s, l_s = ref.sparse_attn_partials(idx=p_idx, cnt=p_cnt, **attn)
    o_r, l_r = ref.sparse_attn_partials(idx=m_idx, cnt=m_cnt, **attn)
    level, trend = torch.randn(B, Hk, NB), torch.randn(B, Hk, NB)
    theta, n_init = torch.tensor([[0.5, 0.3, 1.0], [0.7, 0.2, 0.5]]), torch.tensor([4, 2])
    R, rows = 5, torch.tensor([1, 3])
    pool = dict(level=torch.randn(R, Hk, NB), trend=torch.randn(R, Hk, NB),
                n_init=torch.tensor([0, 4, 2, 3, 1]), theta=torch.rand(R, 3),
                p_idx=torch.full((R, Hk, 6), -1, dtype=torch.int32),
                p_cnt=torch.zeros(R, Hk, dtype=torch.int32))
    s4 = torch.randn(2, 4, Hk, NB)
    n2 = torch.tensor([[3, 4, 5, 6], [5, 6, 7, 7]])
    wa, am = calibration.a_weights(s4, n2, 2, 1, 1)
    cand = torch.tensor([0.2, 0.5, 0.8])
    sel = dict(k=2, sink_blocks=1, local_blocks=1, n_out=4)
    pred = dict(n_pred=2, sink_blocks=1, local_blocks=1)
    last = (P.seq_lens - 1)
    return {
        "quest_update": dict(kmin=kmin, kmax=kmax, k=P.k_buf[16:20].clone(),
                             out_loc=torch.arange(16, 20), positions=torch.arange(4),
                             page_size=page),
        "infllm_update": dict(ck=P.infllm_summary(), k_buf=P.k_buf, req_to_token=P.req_to_token,
                              req_idx=P.rows, out_loc=P.req_to_token[P.rows, last].long(),
                              positions=last, page_size=page),
        "quest_scores": dict(q=P.q, kmin=kmin, kmax=kmax, table=P.table, nblk=P.nblk),
        "infllm_scores": dict(q=P.q, ck=P.infllm_summary(), table=P.table, seq_lens=P.seq_lens,
                              page_size=page, sm_scale=P.sm_scale),
        "select_topk": dict(scores=scores, nblk=P.nblk, **sel),
        "set_difference": dict(a_idx=a_idx, a_cnt=a_cnt, p_idx=p_idx, p_cnt=p_cnt, nb=NB,
                               stats=contracts.new_stats()),
        "select_lists": dict(scores=scores, nblk=P.nblk, p_idx=p_idx, p_cnt=p_cnt,
                             p_rows=torch.tensor([1, 0]), dense_row=torch.tensor([False, True]),
                             stats=contracts.new_stats(), **sel),
        "accumulate_stats": dict(stats=contracts.new_stats(), a_cnt=a_cnt, m_cnt=m_cnt,
                                 p_cnt=p_cnt, dense_row=None),
        "quest_select": dict(q=P.q, kmin=kmin, kmax=kmax, table=P.table, nblk=P.nblk,
                             p_idx=p_idx, p_cnt=p_cnt, new_k=P.q[:, :Hk].clone(),
                             new_pos=last, page_size=page, new_loc=last, **sel),
        "holt_update": dict(level=level, trend=trend, n_init=n_init, scores=scores,
                            nblk=P.nblk, alpha=theta[:, 0], beta=theta[:, 1]),
        "predict_set": dict(level=level, trend=trend, gamma=theta[:, 2], n_init=n_init,
                            nblk_next=P.nblk, **pred),
        "calib_grid_terms": dict(scores=s4, nblk=n2, wa=wa, am=am, alphas=cand, betas=cand[:2],
                                 gammas=cand[1:], **pred),
        "predict_update": dict(level=level, trend=trend, n_init=n_init, scores=scores,
                               nblk=P.nblk, theta=theta, nblk_next=P.nblk, **pred),
        "predict_update_rows": dict(rows=rows, scores=scores, nblk=P.nblk, nblk_next=P.nblk,
                                    **pool, **pred),
        "quest_select_predict": dict(q=P.q, kmin=kmin, kmax=kmax, table=P.table, nblk=P.nblk,
                                     nblk_next=P.nblk, p_rows=rows, p_next_rows=rows, rows=rows,
                                     n_pred=2, **pool, **sel),
        "select_lists_predict": dict(scores=scores, nblk=P.nblk, nblk_next=P.nblk,
                                     p_rows=torch.tensor([0, 2]), p_next_rows=torch.tensor([1, 4]),
                                     rows=rows, n_pred=2, **pool, **sel),
        "calibrate": dict(scores=s4, nblk=n2, k=2, alphas=cand, betas=cand, gammas=cand, **pred),
        "sparse_attn_partials": dict(idx=a_idx, cnt=a_cnt, **attn),
        "prr_merge": dict(o_spec=o_s, lse_spec=l_s, p_idx=p_idx, p_cnt=p_cnt, a_idx=a_idx,
                          a_cnt=a_cnt, o_rep=o_r, lse_rep=l_r, nb=NB, exact=True),
        "sparse_attn_merge": dict(idx=m_idx, cnt=m_cnt, o_spec=o_s, lse_spec=l_s, p_idx=p_idx,
                                  p_cnt=p_cnt, a_idx=a_idx, a_cnt=a_cnt, nb=NB, exact=True,
                                  out_dtype=torch.bfloat16, **attn),
        "merge_partials": dict(o=o_s, lse=l_s),
    }


VALID = _valid_args()


def _copy(kw: dict, device) -> dict:
    """Fresh tensors (the mutating ops write their arguments) on ``device``."""
    return {n: v.detach().clone().to(device) if isinstance(v, torch.Tensor) else v
            for n, v in kw.items()}


def _call(name: str, kw: dict, device="cpu"):
    out = getattr(custom_ops, name)(**_copy(kw, device))
    out = () if out is None else (out,) if isinstance(out, torch.Tensor) else out
    return [(tuple(t.shape), t.dtype, t.device.type) for t in out]


def _ops_defined():
    """Every op ``custom_ops`` and ``custom_ops_predictor`` define (``_quest_select`` is
    ``quest_select``'s op)."""
    return sorted({n.lstrip("_") for mod in (custom_ops, custom_ops_predictor)
                   for n, v in vars(mod).items() if isinstance(v, CustomOpDef)})


def test_every_op_has_valid_arguments_here():
    assert _ops_defined() == sorted(VALID)


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_arguments_on_meta_give_the_cpu_shapes(name):
    cpu = _call(name, VALID[name])
    meta = _call(name, VALID[name], META)
    assert [s[:2] for s in meta] == [s[:2] for s in cpu]
    assert all(s[2] == "meta" for s in meta)


def _bad(kw: dict, **over) -> dict:
    return {**kw, **over}


# (op, the argument the message names, the corruption): each runs beside its valid control.
BAD = [
    ("select_topk", "k", lambda a: _bad(a, k=-1)),
    ("select_topk", "n_out", lambda a: _bad(a, n_out=1)),
    ("select_topk", "scores.shape", lambda a: _bad(a, scores=a["scores"][:, 0])),
    ("select_topk", "nblk.shape", lambda a: _bad(a, nblk=a["nblk"][:1])),
    ("select_lists", "n_out", lambda a: _bad(a, n_out=1)),
    ("select_lists", "p_idx.shape", lambda a: _bad(a, p_idx=a["p_idx"][:, :1])),
    ("select_lists", "stats", lambda a: _bad(a, stats=a["stats"][:3])),
    ("quest_select", "k", lambda a: _bad(a, k=-1)),
    ("quest_select", "new_loc.shape", lambda a: _bad(a, new_loc=a["new_loc"][:1])),
    ("quest_select_predict", "n_pred", lambda a: _bad(a, n_pred=-1)),
    ("select_lists_predict", "p_rows/p_next_rows", lambda a: _bad(a, p_next_rows=None)),
    ("select_lists_predict", "scores.shape", lambda a: _bad(a, level=a["level"][..., :3],
                                                          trend=a["trend"][..., :3])),
    ("select_lists_predict", "n_out", lambda a: _bad(a, n_out=1)),
    ("sparse_attn_partials", "page_size", lambda a: _bad(a, page_size=0)),
    ("sparse_attn_partials", "idx.shape", lambda a: _bad(a, idx=a["idx"][:, :1])),
    ("sparse_attn_partials", "sm_scale", lambda a: _bad(a, sm_scale=float("inf"))),
    ("infllm_scores", "page_size", lambda a: _bad(a, page_size=0)),
    ("sparse_attn_merge", "p_idx width", lambda a: _bad(a, p_idx=a["p_idx"][..., :3])),
    ("prr_merge", "nb", lambda a: _bad(a, nb=-1)),
    ("calibrate", "k", lambda a: _bad(a, k=-1)),
    ("calibrate", "candidate counts", lambda a: _bad(a, gammas=a["gammas"][:2])),
    ("calib_grid_terms", "am", lambda a: _bad(a, am=a["am"].float())),
    ("holt_update", "scores.shape", lambda a: _bad(a, scores=a["scores"][:, :, :3])),
    ("predict_update_rows", "n_pred", lambda a: _bad(a, n_pred=-1)),
    ("quest_update", "page_size", lambda a: _bad(a, page_size=0)),
    ("infllm_update", "positions.shape", lambda a: _bad(a, positions=a["positions"][:1])),
    ("accumulate_stats", "m_cnt", lambda a: _bad(a, m_cnt=a["m_cnt"][:1])),
    ("merge_partials", "o/lse shapes", lambda a: _bad(a, lse=a["lse"][..., :1])),
]


@pytest.mark.parametrize("name, arg, corrupt", BAD, ids=[f"{n}-{a}" for n, a, _ in BAD])
def test_bad_arguments_on_meta_raise_the_cpu_contract(name, arg, corrupt):
    bad = corrupt(VALID[name])
    with pytest.raises(ValueError) as cpu:
        _call(name, bad)
    with pytest.raises(ValueError) as meta:
        _call(name, bad, META)
    assert str(meta.value) == str(cpu.value)  # the same check, the same message
    assert str(meta.value).startswith(f"{name}: {arg} ")
    # Control: the same arguments uncorrupted give the CPU call's shapes on meta.
    assert [s[:2] for s in _call(name, VALID[name], META)] == \
        [s[:2] for s in _call(name, VALID[name])]


def test_every_check_parameter_is_taken_from_the_op():
    """A check parameter the op's fake does not fill would keep its default there (a weaker
    check than the real op's, silently): each one is an op argument, under its own name or
    ``fake_contracts.CHECK_ARG``'s, except ``op`` (the message's op name)."""
    for name in _ops_defined():
        op_args = {a.name for a in getattr(torch.ops.sglang_prr, name).default._schema.arguments}
        check = fake_contracts.find_check(name)
        missing = [p for p in inspect.signature(check).parameters
                   if p != "op" and fake_contracts.CHECK_ARG.get(p, p) not in op_args]
        assert not missing, f"check_{name}: {missing} not among the op's arguments"
    # Control: a check with a parameter the op lacks is not filled.
    assert fake_contracts.check_args(lambda k, rows_p=None: None, {"k": 1, "p_rows": 2}) == \
        {"k": 1}


def test_compiled_bad_arguments_raise_the_contract_message():
    torch._dynamo.reset()
    kw = VALID["select_topk"]
    f = torch.compile(lambda s, n, k: custom_ops.select_topk(s, n, k, 1, 1, 4), backend="eager",
                      fullgraph=True)
    with pytest.raises(Exception) as e:  # dynamo may wrap the fake's ValueError
        f(kw["scores"][:, 0], kw["nblk"], 2)
    assert "select_topk: scores.shape is (2, 7)" in str(e.value)
    idx, cnt = f(kw["scores"], kw["nblk"], 2)  # control: the valid call runs
    assert idx.shape == (2, 2, 4) and cnt.shape == (2, 2)
    # A second k makes it a SymInt (automatic dynamic): the fake checks its traced value and the
    # compiled call still runs; a bad k is refused with the contract's message.
    idx, _ = f(kw["scores"], kw["nblk"], 1)
    assert idx.shape == (2, 2, 4)
    with pytest.raises(ValueError, match="select_topk: k is -1"):
        f(kw["scores"], kw["nblk"], -1)


def test_compiled_dynamic_shapes_pass_the_checks():
    """Symbolic sizes and ints in every check of a whole PRR selection + merge (control of the
    check's SymInt handling: valid dynamic inputs are not refused)."""
    torch._dynamo.reset()
    qs, merge = VALID["quest_select_predict"], VALID["sparse_attn_merge"]

    def step(qs, merge, k):
        out = custom_ops.quest_select_predict(**{**qs, "k": k, "n_out": k + 2})
        o, lse = custom_ops.sparse_attn_merge(**merge)
        return out[1].shape[-1], o.shape, lse.shape
    f = torch.compile(step, backend="eager", dynamic=True, fullgraph=True)
    assert f(_copy(qs, "cpu"), _copy(merge, "cpu"), 2) == (4, (2, 8, 16), (2, 8))
