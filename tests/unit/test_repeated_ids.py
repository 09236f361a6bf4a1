"""Block lists are sets: an id listed twice counts once (the repeat is padding), in the
attention over a list and in the PRR merge (exact and union), against the fp64 oracle over the
distinct ids; the same lists merged with every entry counted (negative control) differ.
The kernels are held to the same definition in tests/gpu/test_repeated_ids.py."""

from __future__ import annotations

import random

import pytest
import torch

import oracle
from paged import list_from_sets, make_paged, rel_err, sets_from_list
from sglang_prr import ops
from sglang_prr import reference as ref


def _lists_with_repeats(rng, nblk, Hk, width, reps):
    """Ascending lists of random blocks with ``reps`` ids listed again, and their sets."""
    B = len(nblk)
    idx = torch.full((B, Hk, width), -1, dtype=torch.int32)
    cnt = torch.zeros(B, Hk, dtype=torch.int32)
    for b in range(B):
        for h in range(Hk):
            ids = rng.sample(range(int(nblk[b])), min(int(nblk[b]), width - reps))
            ids = sorted(ids + rng.sample(ids, min(reps, len(ids))))
            idx[b, h, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            cnt[b, h] = len(ids)
    return idx, cnt


def test_repeated_entries_marks_later_copies_only():
    idx = torch.tensor([[[2, 2, 5, 5, 5, 9, -1, 2]]], dtype=torch.int32)
    cnt = torch.tensor([[6]], dtype=torch.int32)
    got = ref.repeated_entries(idx, cnt)[0, 0].tolist()
    assert got == [False, True, False, True, True, False, False, False]  # past cnt: padding


@pytest.mark.parametrize("lens", [(70, 37), (131, 96, 50)])
def test_attention_over_a_list_with_repeats(lens):
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    P = make_paged(seed, list(lens))
    Hk = P.k_buf.shape[1]
    idx, cnt = _lists_with_repeats(rng, P.nblk.tolist(), Hk, 6, reps=2)
    want = oracle.attention(P.q, P.k_buf, P.v_buf, P.req_to_token, P.rows, P.seq_lens, P.page,
                            P.sm_scale, sets_from_list(idx, cnt))
    o, _ = ops.attend_set(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, idx, cnt, P.page,
                          P.sm_scale)
    assert rel_err(o, want) < 1e-5, f"seed {seed}"
    # Negative control: every entry's partial merged (the repeats counted twice).
    o_p, l_p = ref.sparse_attn_partials(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, idx, cnt,
                                        P.page, P.sm_scale)
    dup = ref.expand_heads(ref.repeated_entries(idx, cnt), P.q.shape[1] // Hk)
    assert bool(dup.any()) and bool(torch.isinf(l_p[dup]).all())  # repeats are padding
    first = torch.argmax((idx.unsqueeze(-1) == idx.unsqueeze(-2)).int(), -1)  # first copy
    src = ref.expand_heads(first, P.q.shape[1] // Hk)
    l_all = torch.where(dup, torch.gather(l_p, -1, src), l_p)
    o_all = torch.where(dup.unsqueeze(-1), torch.gather(
        o_p, 2, src.unsqueeze(-1).expand_as(o_p)), o_p)
    twice, _ = ref.merge_partials(o_all, l_all)
    assert rel_err(twice, want) > 1e-3, f"seed {seed}: counting repeats twice went unnoticed"


@pytest.mark.parametrize("exact", [True, False])
def test_prr_merge_counts_a_repeated_prediction_once(exact):
    seed = random.randrange(1 << 30)
    print(f"seed={seed} exact={exact}")
    rng = random.Random(seed)
    P = make_paged(seed, [150, 97])
    Hk, G = P.k_buf.shape[1], P.q.shape[1] // P.k_buf.shape[1]
    nblk = P.nblk.tolist()
    p_idx, p_cnt = _lists_with_repeats(rng, nblk, Hk, 7, reps=3)
    # A holds P's ids (so the exact merge keeps the repeats' blocks) and a few more (M).
    sp = sets_from_list(p_idx, p_cnt)
    a_sets = [[sp[b][h] | set(rng.sample(range(nblk[b]), 2)) for h in range(Hk)]
              for b in range(2)]
    a_idx, a_cnt = list_from_sets(a_sets, 8)
    m_idx, m_cnt = ref.set_difference(a_idx, a_cnt, p_idx, p_cnt, P.nb)
    # Speculative partials of every entry of P, repeats carrying their block's partial.
    o_s = torch.zeros(2, P.q.shape[1], p_idx.shape[-1], P.q.shape[2])
    l_s = torch.full(o_s.shape[:3], float("-inf"))
    for j in range(p_idx.shape[-1]):
        one = p_idx[:, :, j:j + 1].contiguous()
        o1, l1 = ref.sparse_attn_partials(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, one,
                                          (one[..., 0] >= 0).int() * (j < p_cnt).int(), P.page,
                                          P.sm_scale)
        o_s[:, :, j], l_s[:, :, j] = o1[:, :, 0], l1[:, :, 0]
    o, _ = ops.sparse_attn_merge(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, m_idx, m_cnt,
                                 P.page, P.sm_scale, o_s, l_s, p_idx, p_cnt, a_idx, a_cnt, P.nb,
                                 exact)
    sa = sets_from_list(a_idx, a_cnt)
    sets = [[sa[b][h] if exact else sa[b][h] | sp[b][h] for h in range(Hk)] for b in range(2)]
    want = oracle.attention(P.q, P.k_buf, P.v_buf, P.req_to_token, P.rows, P.seq_lens, P.page,
                            P.sm_scale, sets)
    assert rel_err(o, want) < 1e-5, f"seed {seed}"
    # Negative control: P's entries all merged, repeats included.
    o_r, l_r = ref.sparse_attn_partials(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, m_idx,
                                        m_cnt, P.page, P.sm_scale)
    keep = (ref.expand_heads(ref.list_isin(p_idx, p_cnt, a_idx, a_cnt, P.nb), G) if exact
            else torch.ones_like(l_s, dtype=torch.bool))
    o_all, _ = ref.merge_partials(torch.cat([o_s, o_r], 2),
                                  torch.cat([l_s.masked_fill(~keep, float("-inf")), l_r], 2))
    assert rel_err(o_all, want) > 1e-3, f"seed {seed}: counting repeats twice went unnoticed"
