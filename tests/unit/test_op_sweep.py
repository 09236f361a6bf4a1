"""Every public op (``sglang_prr.ops``) given a bad shape, dtype or integer: a ``ValueError``
naming the argument, never a raw ``RuntimeError``/``IndexError`` from deep inside, nor a result.

One table: per op, good arguments (fresh random CPU tensors of awkward sizes) and mutations, each
with the name the message must contain. The control beside every mutation: the same op on the
good arguments runs and returns.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_prr import ops

B, HQ, HK, D, NB, PAGE = 3, 12, 4, 16, 9, 16
SLOTS = (NB * B + 2) * PAGE


def _lists(n=5, heads=HK, batch=B):
    idx = torch.sort(torch.randint(0, NB, (batch, heads, n), dtype=torch.int32), -1).values
    return idx, torch.full((batch, heads), n, dtype=torch.int32)


def _good(op: str) -> dict:
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = rn(B, HQ, D)
    table = torch.randint(1, NB * B, (B, NB), generator=g)
    nblk = torch.randint(1, NB + 1, (B,), generator=g)
    seq = nblk * PAGE - 3
    kmin = rn(NB * B + 2, HK, D)
    kmax = kmin + 1
    if op == "quest_scores":
        return dict(q=q, kmin=kmin, kmax=kmax, table=table, nblk=nblk)
    if op == "infllm_scores":
        return dict(q=q, ck=rn(NB * B + 2, PAGE // 16, HK, D), table=table, seq_lens=seq,
                    page_size=PAGE, sm_scale=0.25)
    if op == "infllm_update":
        return dict(ck=rn(NB * B + 2, PAGE // 16, HK, D), k_buf=rn(SLOTS, HK, D),
                    req_to_token=torch.arange(SLOTS).view(1, -1).repeat(2, 1)[:, :NB * PAGE],
                    req_idx=torch.tensor([1, 1]), out_loc=torch.tensor([40, 41]),
                    positions=torch.tensor([40, 41]), page_size=PAGE)
    if op == "quest_update":
        return dict(kmin=kmin, kmax=kmax, k=rn(2, HK, D), out_loc=torch.tensor([40, 70]),
                    positions=torch.tensor([8, 6]), page_size=PAGE)
    if op == "select_topk":
        return dict(scores=rn(B, HK, NB), nblk=nblk, k=2, sink_blocks=1, local_blocks=1, n_out=4)
    if op == "select_lists":
        p, pc = _lists(7)
        return dict(scores=rn(B, HK, NB), nblk=nblk, p_idx=p, p_cnt=pc, k=2, sink_blocks=1,
                    local_blocks=1, n_out=4, stats=torch.zeros(4, dtype=torch.int64))
    if op == "set_difference":
        a, ac = _lists()
        p, pc = _lists(7)
        return dict(a_idx=a, a_cnt=ac, p_idx=p, p_cnt=pc, nb=NB)
    if op in ("holt_update", "predict_set", "predict_update"):
        st = dict(level=rn(B, HK, NB), trend=rn(B, HK, NB), n_init=torch.zeros(B, dtype=torch.long))
        if op == "holt_update":
            return dict(st, scores=rn(B, HK, NB), nblk=nblk, alpha=torch.full((B,), 0.5),
                        beta=torch.full((B,), 0.3))
        if op == "predict_set":
            return dict(st, gamma=torch.full((B,), 0.5), nblk_next=nblk, n_pred=2, sink_blocks=1,
                        local_blocks=1)
        return dict(st, scores=rn(B, HK, NB), nblk=nblk, theta=torch.rand(B, 3, generator=g),
                    nblk_next=nblk, n_pred=2, sink_blocks=1, local_blocks=1)
    if op == "calibrate":
        return dict(scores=rn(2, 4, HK, NB), nblk=torch.full((2, 4), NB), k=2, n_pred=3,
                    sink_blocks=1, local_blocks=1, alphas=torch.tensor([0.2, 0.6]),
                    betas=torch.tensor([0.1, 0.3]), gammas=torch.tensor([0.0, 0.5]))
    if op == "prr_merge":
        p, pc = _lists(6)
        a, ac = _lists(5)
        return dict(o_spec=rn(B, HQ, 6, D), lse_spec=rn(B, HQ, 6), p_idx=p, p_cnt=pc, a_idx=a,
                    a_cnt=ac, o_rep=rn(B, HQ, 5, D), lse_rep=rn(B, HQ, 5), nb=NB, exact=True)
    if op == "merge_partials":
        return dict(o=rn(B, HQ, 5, D), lse=rn(B, HQ, 5))
    if op == "sparse_attn_partials":
        idx, cnt = _lists()
        return dict(q=q, k_buf=rn(SLOTS, HK, D), v_buf=rn(SLOTS, HK, D), table=table,
                    seq_lens=seq, idx=idx, cnt=cnt, page_size=PAGE, sm_scale=0.25)
    raise KeyError(op)


I32 = dict(dtype=torch.int32)
# op -> [(what the message must name, mutation of the good arguments)]
SWEEP = {
    "quest_scores": [
        ("summary KV heads", lambda a: dict(q=a["q"][:, :10])),  # 4 KV heads, 10 query heads
        ("summary shape", lambda a: dict(kmin=a["kmin"][..., :8], kmax=a["kmax"][..., :8])),
        ("table.shape", lambda a: dict(table=a["table"][:2])),
        ("nblk.dtype", lambda a: dict(nblk=a["nblk"].float())),
        ("q.shape", lambda a: dict(q=a["q"][:, 0])),
    ],
    "infllm_scores": [
        ("page_size", lambda a: dict(page_size=0)),
        ("ck.shape[1]", lambda a: dict(page_size=32)),
        ("seq_lens.shape", lambda a: dict(seq_lens=a["seq_lens"][:1])),
        ("summary KV heads", lambda a: dict(q=a["q"][:, :10])),
    ],
    "infllm_update": [
        ("page_size", lambda a: dict(page_size=-16)),
        ("ck", lambda a: dict(ck=a["ck"][..., :8])),
        ("positions.shape", lambda a: dict(positions=a["positions"][:1])),
        ("req_to_token", lambda a: dict(req_to_token=a["req_to_token"][0])),
    ],
    "quest_update": [
        ("page_size", lambda a: dict(page_size=0)),
        ("summary KV heads", lambda a: dict(kmin=a["kmin"][:, :3], kmax=a["kmax"][:, :3])),
        ("out_loc.shape", lambda a: dict(out_loc=a["out_loc"][:1])),
    ],
    "select_topk": [
        ("k", lambda a: dict(k=-1)),
        ("n_out", lambda a: dict(n_out=1)),
        ("nblk", lambda a: dict(nblk=a["nblk"][:2])),
    ],
    "select_lists": [
        ("select_lists: k", lambda a: dict(k=-1)),
        ("nblk", lambda a: dict(nblk=a["nblk"][:2])),
        ("p_idx/p_cnt dtypes", lambda a: dict(p_cnt=a["p_cnt"].long())),
        ("p_idx.shape", lambda a: dict(p_idx=a["p_idx"][:, :2], p_cnt=a["p_cnt"][:, :2])),
        ("p_cnt", lambda a: dict(p_cnt=None)),
        ("p rows.shape", lambda a: dict(p_rows=torch.zeros(B + 1, dtype=torch.long))),
        ("stats", lambda a: dict(stats=torch.zeros(4, dtype=torch.int32))),
        ("dense_row", lambda a: dict(dense_row=torch.zeros(B, dtype=torch.int32))),
    ],
    "set_difference": [
        ("nb", lambda a: dict(nb=-1)),
        ("p_idx/p_cnt dtypes", lambda a: dict(p_idx=a["p_idx"].long())),
        ("p_idx.shape", lambda a: dict(p_idx=a["p_idx"][:, :2], p_cnt=a["p_cnt"][:, :2])),
        ("p_idx.shape", lambda a: dict(p_idx=a["p_idx"][:2], p_cnt=a["p_cnt"][:2])),
        ("p_idx rows.shape", lambda a: dict(p_rows=torch.zeros(B + 1, dtype=torch.long))),
        ("p_idx rows", lambda a: dict(p_rows=torch.zeros(B))),  # float rows
        ("stats", lambda a: dict(stats=torch.zeros(4, dtype=torch.int32))),
        ("dense_row", lambda a: dict(stats=torch.zeros(4, dtype=torch.int64),
                                     dense_row=torch.zeros(B, dtype=torch.int32))),
    ],
    "holt_update": [
        ("trend", lambda a: dict(trend=a["trend"][:, :, :4])),
        ("scores.shape", lambda a: dict(scores=a["scores"][:2])),
        ("alpha.shape", lambda a: dict(alpha=a["alpha"][:1])),
        ("n_init.dtype", lambda a: dict(n_init=a["n_init"].float())),
    ],
    "predict_set": [
        ("n_pred", lambda a: dict(n_pred=-2)),
        ("level", lambda a: dict(level=a["level"].double(), trend=a["trend"].double())),
        ("gamma.shape", lambda a: dict(gamma=a["gamma"][:2])),
    ],
    "predict_update": [
        ("theta.shape", lambda a: dict(theta=a["theta"][:, :2])),
        ("sink_blocks", lambda a: dict(sink_blocks=-1)),
        ("nblk_next.shape", lambda a: dict(nblk_next=a["nblk_next"][:1])),
    ],
    "calibrate": [
        ("scores.shape", lambda a: dict(scores=a["scores"][0])),
        ("nblk.shape", lambda a: dict(nblk=a["nblk"][:, :2])),
        ("candidate counts", lambda a: dict(gammas=torch.tensor([0.0, 0.25, 0.5]))),
        ("k", lambda a: dict(k=-3)),
    ],
    "prr_merge": [
        ("lse_spec.shape", lambda a: dict(lse_spec=a["lse_spec"][..., :5])),
        ("o_rep.shape", lambda a: dict(o_rep=a["o_rep"][..., :8])),
        ("p_idx.shape[2]", lambda a: dict(p_idx=a["p_idx"][..., :4], p_cnt=a["p_cnt"])),
        ("a_idx/a_cnt dtypes", lambda a: dict(a_cnt=a["a_cnt"].long())),
        ("nb", lambda a: dict(nb=-1)),
    ],
    "merge_partials": [
        ("o/lse shapes", lambda a: dict(lse=a["lse"][..., :4])),
    ],
    "sparse_attn_partials": [
        ("page_size", lambda a: dict(page_size=0)),
        ("KV head_dim", lambda a: dict(k_buf=a["k_buf"][..., :8], v_buf=a["v_buf"][..., :8])),
        ("num_kv_heads", lambda a: dict(q=a["q"][:, :10])),  # 4 KV heads, 10 query heads
        ("idx.shape", lambda a: dict(idx=a["idx"][:, :3], cnt=a["cnt"][:, :3])),
        ("table.shape[0]", lambda a: dict(table=a["table"][:1])),
    ],
}
CASES = [(op, name, i) for op, muts in SWEEP.items() for i, (name, _) in enumerate(muts)]


@pytest.mark.parametrize("op,name,i", CASES, ids=[f"{o}-{i}" for o, _, i in CASES])
def test_bad_argument_is_named(op, name, i):
    fn = getattr(ops, op)
    good = _good(op)
    fn(**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in good.items()})  # control
    bad = dict(good, **SWEEP[op][i][1](good))
    with pytest.raises((ValueError, TypeError)) as e:
        fn(**bad)
    assert name in str(e.value), f"{op}: {e.value!r} does not name {name!r}"
