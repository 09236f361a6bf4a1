"""PRR (exact) gives serial DSA's output bits, not only its value, on the GPU.

Both paths end in the same launch (``sparse_attn_merge``): serial DSA attends over A and merges
the partials; PRR attends over P beside the selection, then over M = A \\ P, and merges the
partials of P n A with those of M. Every block's partial is computed by the same code in every
pass and the merge visits them in ascending block id, so the outputs are ``torch.equal`` for any
prediction: hits, misses, P n A empty, P a superset of A, repeated ids in P, an empty M. The
negative control is union mode (attention over P u A), which must differ wherever P \\ A holds a
block. Skipped with a reason without a CUDA SM90 device.
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
from test_kernels import DEV, make_pool, rel_err, seeded  # noqa: E402


def _sorted_list(ids, width):
    ids = sorted(ids)
    out = torch.full((width,), -1, dtype=torch.int32)
    out[:len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out, len(ids)


def _prediction(kind: str, a_ids: list, nblk: int, width: int) -> list:
    """A prediction P of at most ``width`` ids, of the given relation to A."""
    others = [x for x in range(nblk) if x not in a_ids]
    if kind == "superset":      # P ⊇ A: M empty
        extra = random.sample(others, min(len(others), width - len(a_ids)))
        return a_ids + extra
    if kind == "disjoint":      # P ∩ A empty: M = A
        return random.sample(others, min(len(others), width))
    if kind == "repeats":       # hits and misses, with ids listed twice
        hit = random.sample(a_ids, len(a_ids) // 2)
        p = hit + random.sample(others, min(len(others), width - 2 * len(hit)))
        return p + hit[: max(0, width - len(p))]
    hit = random.sample(a_ids, (len(a_ids) * 3) // 4)  # "mixed": the usual case
    return hit + random.sample(others, min(len(others), width - len(hit)))


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype,out_dtype", [
    (1, 32, 8, 128, 64, torch.bfloat16, torch.bfloat16),   # the serving shape
    (3, 32, 8, 128, 16, torch.bfloat16, torch.float32),
    (5, 28, 4, 64, 32, torch.float16, torch.float16),      # GQA 7
    (2, 16, 2, 256, 128, torch.bfloat16, torch.bfloat16),  # head dim 256, pages of two chunks
])
def test_prr_exact_is_serial_dsa_bit_for_bit(B, Hq, Hk, D, page, dtype, out_dtype):
    seeded(f"bitwise B={B} GQA={Hq // Hk} D={D} page={page}")
    _check_bitwise(B, Hq, Hk, D, page, dtype, out_dtype, 12, 18,
                   ["mixed", "superset", "disjoint", "repeats"])


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype,out_dtype,Na", [
    (1, 32, 8, 128, 64, torch.bfloat16, torch.bfloat16, 33),  # 6 of 8 rows: P covers A
    (3, 4, 4, 64, 32, torch.float16, torch.float32, 37),      # 16 output items < 37 CTAs a row
    (2, 24, 3, 256, 64, torch.bfloat16, torch.bfloat16, 9),   # 512 items over 9 CTAs
])
def test_rows_with_nothing_to_repair_keep_the_bits(B, Hq, Hk, D, page, dtype, out_dtype, Na):
    """A repair row whose M is empty merges P n A at once, spread over the row's CTAs (no partial,
    no ticket): still serial DSA's bits, with more CTAs than output items too; one row in four
    has a block to repair beside them."""
    seeded(f"bitwise nothing to repair B={B} GQA={Hq // Hk} D={D} Na={Na}")
    _check_bitwise(B, Hq, Hk, D, page, dtype, out_dtype, Na, Na + 7,
                   ["superset", "superset", "superset", "mixed"])


def _check_bitwise(B, Hq, Hk, D, page, dtype, out_dtype, Na, Np, kinds):
    """PRR (exact) against serial DSA over one random A a row (at most Na blocks), P (at most Np)
    of the given relations to A row by row: the same bits, the value of attention over A, and
    union mode differing where P \\ A holds a block."""
    seq_lens = [random.randint(max(20, Np + 4) * page, max(40, 2 * Np) * page)
                + random.randint(0, page - 1) for _ in range(B)]
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq_lens, dtype)
    nblk = [(s + page - 1) // page for s in seq_lens]
    a_idx = torch.full((B, Hk, Na), -1, dtype=torch.int32)
    a_cnt = torch.zeros(B, Hk, dtype=torch.int32)
    p_idx = torch.full((B, Hk, Np), -1, dtype=torch.int32)
    p_cnt = torch.zeros(B, Hk, dtype=torch.int32)
    for b in range(B):
        for h in range(Hk):
            a = random.sample(range(nblk[b]), Na - random.randint(0, 3))
            a_idx[b, h], a_cnt[b, h] = _sorted_list(a, Na)
            p = _prediction(kinds[(b * Hk + h) % len(kinds)], a, nblk[b], Np)
            p_idx[b, h], p_cnt[b, h] = _sorted_list(p, Np)
    m_idx, m_cnt = ref.set_difference(a_idx, a_cnt, p_idx, p_cnt, NB)
    assert (m_cnt == 0).any()  # M empty occurs; M = A too where a row's P misses A
    assert ("disjoint" not in kinds) or (m_cnt == a_cnt).any()
    q = torch.randn(B, Hq, D, dtype=dtype)
    sm = 1.0 / math.sqrt(D)
    qd, kd, vd, td, sld = (t.to(DEV) for t in (q, k_buf, v_buf, table, sl))
    ad, acd, pd, pcd, md, mcd = (t.to(DEV) for t in (a_idx, a_cnt, p_idx, p_cnt, m_idx, m_cnt))

    # Serial DSA: attention over A, merged.
    o_ser, lse_ser = ops.sparse_attn_merge(qd, kd, vd, td, sld, ad, acd, page, sm, None, None,
                                           None, None, None, None, 0, True, out_dtype=out_dtype)
    # PRR: speculative partials over P from pool rows (as the server reads them), then the repair
    # over M merged with P n A.
    rows = torch.randperm(B + 2)[:B]
    pool_p = torch.full((B + 2, Hk, Np), -1, dtype=torch.int32)
    pool_c = torch.zeros(B + 2, Hk, dtype=torch.int32)
    pool_p[rows], pool_c[rows] = p_idx, p_cnt
    pool_p, pool_c, rows_d = pool_p.to(DEV), pool_c.to(DEV), rows.to(DEV)
    o_s, lse_s = ops.sparse_attn_partials(qd, kd, vd, td, sld, pool_p, pool_c, page, sm,
                                          idx_rows=rows_d)
    o_prr, lse_prr = ops.sparse_attn_merge(qd, kd, vd, td, sld, md, mcd, page, sm, o_s, lse_s,
                                           pool_p, pool_c, ad, acd, NB, True, p_rows=rows_d,
                                           out_dtype=out_dtype)
    assert torch.equal(o_prr, o_ser), "PRR (exact) must give serial DSA's bits"
    assert torch.equal(lse_prr, lse_ser)
    # ... and both are attention over A (the value, against the float32 reference).
    o_ref, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, a_idx, a_cnt, page, sm)
    tol = 2e-5 if out_dtype == torch.float32 else 1e-2
    assert rel_err(o_ser.float().cpu(), o_ref) < tol
    # Negative control: union mode attends P u A, which differs where P \ A holds a block.
    o_uni, _ = ops.sparse_attn_merge(qd, kd, vd, td, sld, md, mcd, page, sm, o_s, lse_s, pool_p,
                                     pool_c, ad, acd, NB, False, p_rows=rows_d,
                                     out_dtype=out_dtype)
    extra = (ref.list_to_mask(p_idx, p_cnt, NB) & ~ref.list_to_mask(a_idx, a_cnt, NB)).any(-1)
    assert extra.any()
    rows_x = extra.repeat_interleave(Hq // Hk, dim=1).to(DEV)
    assert not torch.equal(o_uni[rows_x], o_ser[rows_x])
    assert rel_err(o_uni[rows_x].float().cpu(), o_ser[rows_x].float().cpu()) > 1e-3
