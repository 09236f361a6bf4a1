"""Pages of 16 or 32 tokens packed 64 / page list entries a CTA (``SGLANG_PRR_ATTN_PACK=1``,
``block_attn_packed_kernel``) against the one-entry CTAs (``=0``): the same bits for every output
of every attention launch (the partials, serial DSA's attention + merge, PRR's repair + exact
and union merges) under each merge form, on lists that hold repeats, -1 padding, ids past the
table, negative ids, and counts past the list's width or below zero. Negative control beside the
equalities: one listed key changed moves the packed output.

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

from test_kernels import DEV, make_pool, poison, random_lists, rel_err, seeded  # noqa: E402

CUDA = torch.ops.sglang_prr_cuda
KNOBS = ("SGLANG_PRR_ATTN_PACK", "SGLANG_PRR_ATTN_MERGE", "SGLANG_PRR_ATTN_SPREAD",
         "SGLANG_PRR_ATTN_SPREAD_WAIT", "SGLANG_PRR_ATTN_MERGE_SPLITS")
# The merge forms the packed CTAs meet: the launch's shape rule, the merge kernel, the fused tail
# by the group's last CTA, the spread tail shared by the row's CTAs, a spread tail withdrawn.
MERGES = {"shape": {}, "split": {"SGLANG_PRR_ATTN_MERGE": "split"},
          "ticket": {"SGLANG_PRR_ATTN_MERGE": "ticket"},
          "row": {"SGLANG_PRR_ATTN_SPREAD": "row"},
          "withdraw": {"SGLANG_PRR_ATTN_SPREAD_WAIT": "0"}}


def _dev(*ts):
    return [t.to(DEV) if t is not None else None for t in ts]


def messy_lists(B, Hk, N, NB):
    """Lists of any ids (repeats, -1, negative, past the table) in any order, counts from -2 to
    N + 3: what a kernel must survive (reading a list's first min(count, N) entries, an id
    outside [0, NB) as padding, a repeat once)."""
    idx = torch.empty(B, Hk, N, dtype=torch.int32)
    cnt = torch.empty(B, Hk, dtype=torch.int32)
    for b in range(B):
        for h in range(Hk):
            pool = list(range(-2, NB + 3))
            row = [random.choice(pool) for _ in range(N)]
            for j in random.sample(range(N), min(3, N - 1)):  # repeats of earlier entries
                row[j] = row[random.randrange(0, max(j, 1))]
            idx[b, h] = torch.tensor(row, dtype=torch.int32)
            cnt[b, h] = random.randint(-2, N + 3)
    return idx, cnt


def _outputs(q, k, v, table, sl, idx, cnt, p_idx, p_cnt, m_idx, m_cnt, page, NB):
    """Every attention launch's outputs over the lists (host copies)."""
    B, Hq, D = q.shape
    N = idx.shape[-1]
    sm = D ** -0.5
    poison(((B, Hq, N, D), torch.float32), ((B, Hq, D), torch.float32))
    qd, kd, vd, td, sld = _dev(q, k, v, table, sl)
    o_p, l_p = CUDA.sparse_attn_partials(qd, kd, vd, td, sld, *_dev(idx, cnt), page, sm)
    o_m, l_m = CUDA.sparse_attn_merge(qd, kd, vd, td, sld, *_dev(idx, cnt), page, sm,
                                      None, None, None, None, None, None, 0, True)
    o_s, l_s = CUDA.sparse_attn_partials(qd, kd, vd, td, sld, *_dev(p_idx, p_cnt), page, sm)
    rep = [CUDA.sparse_attn_merge(qd, kd, vd, td, sld, *_dev(m_idx, m_cnt), page, sm, o_s, l_s,
                                  *_dev(p_idx, p_cnt, idx, cnt), NB, exact)
           for exact in (True, False)]
    return [x.cpu() for x in (o_p, l_p, o_m, l_m, *rep[0], *rep[1])]


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype,pages", [
    (3, 32, 8, 128, 16, torch.bfloat16, 40), (2, 16, 4, 64, 32, torch.float16, 12),
    (2, 8, 2, 256, 16, torch.bfloat16, 9), (1, 12, 4, 128, 32, torch.bfloat16, 300)])
@pytest.mark.parametrize("merge", list(MERGES))
@pytest.mark.parametrize("lists", ["clean", "messy"])
def test_packed_pages_keep_the_bits(B, Hq, Hk, D, page, dtype, pages, merge, lists,
                                    monkeypatch):
    seeded(f"packed B={B} D={D} page={page} merge={merge} lists={lists}")
    seq = [random.randint(pages * page // 2, pages * page) + random.randint(0, page - 1)
           for _ in range(B)]
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq, dtype)
    nblk = [(s + page - 1) // page for s in seq]
    q = torch.randn(B, Hq, D).to(dtype)
    N = min(nblk) // 2 + 7  # not a multiple of the pack: a CTA's last entries past the list
    if lists == "clean":  # M = A \ P, so PRR (exact) is serial DSA
        idx, cnt = random_lists(B, Hk, N, nblk)
        p_idx, p_cnt = random_lists(B, Hk, N + 3, nblk)
        m_idx, m_cnt = ref.set_difference(idx, cnt, p_idx, p_cnt, NB)
    else:  # any lists: the two forms' bits still agree
        idx, cnt = messy_lists(B, Hk, N, NB)
        p_idx, p_cnt = messy_lists(B, Hk, N + 3, NB)
        m_idx, m_cnt = messy_lists(B, Hk, N, NB)
    args = (q, k_buf, v_buf, table, sl, idx, cnt, p_idx, p_cnt, m_idx, m_cnt, page, NB)
    outs = {}
    for pack in ("0", "1"):
        for key in KNOBS:
            monkeypatch.delenv(key, raising=False)
        for key, val in MERGES[merge].items():
            monkeypatch.setenv(key, val)
        monkeypatch.setenv("SGLANG_PRR_ATTN_PACK", pack)
        outs[pack] = _outputs(*args)
    listed = (torch.arange(N)[None, None, :] < cnt.clamp(0, N)[:, :, None])
    listed = listed.repeat_interleave(Hq // Hk, 1)
    one, packed = outs["0"], outs["1"]
    assert torch.equal(packed[0][listed], one[0][listed]), "partials o"
    assert torch.equal(packed[1][listed], one[1][listed]), "partials lse"
    for i in range(2, 8):  # (torch.equal is False wherever a NaN was left unwritten)
        assert torch.equal(packed[i], one[i]), f"output {i}"
    if lists == "clean":
        assert torch.equal(packed[4], packed[2]), "PRR (exact) != serial DSA"
        o_ref, _ = ref.attend_set(q.float(), k_buf, v_buf, table, sl, idx, cnt, page, D ** -0.5)
        assert rel_err(packed[2], o_ref) < 3e-5
    # Negative control: one key of a listed block of row (0, 0) changed moves its output.
    blk = next((int(x) for x in idx[0, 0, :max(int(cnt[0, 0]), 0)].tolist()
                if 0 <= x < nblk[0]), None)
    if blk is None:
        return
    k2 = k_buf.clone()
    slot = int(table[0, blk]) * page
    k2[slot, 0] = -4 * k2[slot, 0] + 3
    changed = _outputs(q, k2, *args[2:])
    assert not torch.equal(changed[2][0, :Hq // Hk], packed[2][0, :Hq // Hk])
