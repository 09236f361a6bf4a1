"""Block lists are sets: an id listed twice counts once, in every kernel that reads a list
(attention partials, attention with its fused merge, the PRR merge in both modes), as in the
reference. Negative control beside each equality: the same list with the repeat counted twice
(the entries' partials merged by hand) differs.

Conventions as in ``test_kernels.py``. Skipped with a reason without a CUDA SM90 device.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_prr import reference as ref

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402  (the SM90 gate, tests/gpu/sm90.py)

require_sm90()

from sglang_prr import ops  # noqa: E402
from test_kernels import DEV, make_pool, poison, random_lists, rel_err, seeded  # noqa: E402


def with_repeats(idx, cnt, reps=2):
    """The lists with ``reps`` of each row's ids listed again (ascending order kept), widened."""
    B, Hk, N = idx.shape
    out = torch.full((B, Hk, N + reps), -1, dtype=torch.int32)
    oc = torch.zeros_like(cnt)
    for b in range(B):
        for h in range(Hk):
            ids = idx[b, h, :cnt[b, h]].tolist()
            ids = sorted(ids + random.sample(ids, min(reps, len(ids))))
            out[b, h, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            oc[b, h] = len(ids)
    return out, oc


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype", [(1, 32, 8, 128, 64, torch.bfloat16),
                                                  (3, 8, 2, 64, 16, torch.float16)])
def test_attention_counts_a_repeated_block_once(B, Hq, Hk, D, page, dtype):
    seeded(f"repeats attn B={B}")
    seq = [random.randint(4 * page, 9 * page) + 5 for _ in range(B)]
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq, dtype)
    nblk = [(s + page - 1) // page for s in seq]
    idx, cnt = random_lists(B, Hk, max(nblk), [max(2, n) for n in nblk], fill="full")
    rep, rcnt = with_repeats(idx, cnt)
    q = torch.randn(B, Hq, D).to(dtype)
    dev = lambda *ts: [t.to(DEV) for t in ts]
    want, _ = ref.attend_set(q, k_buf, v_buf, table, sl, idx, cnt, page, D ** -0.5)
    # Partials: the repeat's entry is the empty state (0, -inf), as in the reference.
    poison(((B, Hq, rep.shape[-1], D), torch.float32), ((B, Hq, rep.shape[-1]), torch.float32))
    o_p, l_p = ops.sparse_attn_partials(*dev(q, k_buf, v_buf, table, sl, rep, rcnt), page,
                                        D ** -0.5)
    r_o, r_l = ref.sparse_attn_partials(q, k_buf, v_buf, table, sl, rep, rcnt, page, D ** -0.5)
    assert torch.equal(torch.isfinite(l_p.cpu()), torch.isfinite(r_l))
    assert int((~torch.isfinite(l_p.cpu())).sum()) > int((~torch.isfinite(
        ref.sparse_attn_partials(q, k_buf, v_buf, table, sl, idx, cnt, page, D ** -0.5)[1])).sum())
    # Attention with its fused merge over the list with repeats == over the distinct ids.
    o, _ = ops.sparse_attn_merge(*dev(q, k_buf, v_buf, table, sl, rep, rcnt), page, D ** -0.5,
                                 None, None, None, None, None, None, 0, True)
    assert rel_err(o.cpu(), want) < 1e-4
    # Negative control: the repeats' partials merged too (what counting them twice gives).
    o_c, l_c = ref.sparse_attn_partials(q, k_buf, v_buf, table, sl, idx, cnt, page, D ** -0.5)
    o_twice, _ = ref.merge_partials(*_spread(o_c, l_c, idx, cnt, rep, rcnt))
    assert rel_err(o_twice, want) > 1e-3


def _spread(o, lse, idx, cnt, rep, rcnt):
    """Partials of the lists ``rep`` (with repeats) from those of ``idx`` (distinct ids): every
    entry, repeats included, carries its block's partial."""
    o2 = torch.zeros(o.shape[:2] + (rep.shape[-1],) + o.shape[3:])
    l2 = torch.full(lse.shape[:2] + (rep.shape[-1],), float("-inf"))
    G = o.shape[1] // idx.shape[1]
    for b in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            pos = {int(x): j for j, x in enumerate(idx[b, h, :cnt[b, h]].tolist())}
            g = slice(h * G, (h + 1) * G)
            for j, x in enumerate(rep[b, h, :rcnt[b, h]].tolist()):
                o2[b, g, j], l2[b, g, j] = o[b, g, pos[x]], lse[b, g, pos[x]]
    return o2, l2


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_prr_merge_counts_a_repeated_prediction_once(exact, fused):
    """Speculative partials given for a P with repeats (each repeat carrying its block's
    partial): the fused and the standalone merge keep one per id, which equals the merge over
    the distinct P (the reference's definition); merging every entry differs (negative
    control)."""
    seeded(f"repeats merge exact={exact} fused={fused}")
    B, Hq, Hk, D, page, dtype = 2, 16, 4, 128, 32, torch.bfloat16
    seq = [random.randint(6 * page, 12 * page) + 3 for _ in range(B)]
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq, dtype)
    nblk = [(s + page - 1) // page for s in seq]
    N = max(nblk)
    p_idx, p_cnt = random_lists(B, Hk, N // 2, nblk, fill="full")  # N/2 random blocks
    p_rep, p_rcnt = with_repeats(p_idx, p_cnt, reps=3)
    # A: P's blocks (so the exact merge keeps the repeats' blocks) and a few others (M).
    a_idx = torch.full((B, Hk, N), -1, dtype=torch.int32)
    a_cnt = torch.zeros(B, Hk, dtype=torch.int32)
    for b in range(B):
        for h in range(Hk):
            ids = sorted(set(p_idx[b, h, :p_cnt[b, h]].tolist())
                         | set(random.sample(range(nblk[b]), 3)))
            a_idx[b, h, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            a_cnt[b, h] = len(ids)
    m_idx, m_cnt = ref.set_difference(a_idx, a_cnt, p_idx, p_cnt, NB)
    q = torch.randn(B, Hq, D).to(dtype)
    s = D ** -0.5
    o_p, l_p = ref.sparse_attn_partials(q, k_buf, v_buf, table, sl, p_idx, p_cnt, page, s)
    o_s, l_s = _spread(o_p, l_p, p_idx, p_cnt, p_rep, p_rcnt)
    args = (q, k_buf, v_buf, table, sl, m_idx, m_cnt, page, s)
    want, _ = ref.sparse_attn_merge(*args, o_p, l_p, p_idx, p_cnt, a_idx, a_cnt, NB, exact)
    got_ref, _ = ref.sparse_attn_merge(*args, o_s, l_s, p_rep, p_rcnt, a_idx, a_cnt, NB, exact)
    assert rel_err(got_ref, want) < 1e-6  # the reference: a repeat counts once
    dev = lambda *ts: [t.to(DEV) for t in ts]
    if fused:
        o, _ = ops.sparse_attn_merge(*dev(*args[:7]), page, s,
                                     *dev(o_s, l_s, p_rep, p_rcnt, a_idx, a_cnt), NB, exact)
    else:
        o_r, l_r = ref.sparse_attn_partials(*args)
        o, _ = torch.ops.sglang_prr_cuda.prr_merge(*dev(o_s, l_s, p_rep, p_rcnt, a_idx, a_cnt,
                                                        o_r, l_r), NB, exact)
    assert rel_err(o.cpu(), want) < 1e-4
    # Negative control: every entry of P merged (repeats counted again).
    o_r, l_r = ref.sparse_attn_partials(*args)
    keep = (ref.expand_heads(ref.list_isin(p_rep, p_rcnt, a_idx, a_cnt, NB), Hq // Hk) if exact
            else torch.ones_like(l_s, dtype=torch.bool))
    o_all, _ = ref.merge_partials(torch.cat([o_s, o_r], 2),
                                  torch.cat([l_s.masked_fill(~keep, float("-inf")), l_r], 2))
    assert rel_err(o_all, want) > 1e-3, "negative control: merging the repeats differs"
