"""The kernels' defined results for values the input checks cannot see, against the reference
(``tests/unit/test_nonfinite_values.py`` holds the reference's own): a NaN or inf V inside a
request reaches that request's output and nothing else (an inf as inf or NaN; the merge skips
entries of weight 0 instead of zeroing NaN values), a finite Holt level with a non-finite trend
restarts like a new block, a negative slot of the decode update writes the padding page, and
non-finite Quest scores follow the reference's rule. Fresh seeds, a control beside each
equality. Skipped without a CUDA SM90 device."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sglang_prr import reference as ref

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402  (the SM90 gate, tests/gpu/sm90.py)

require_sm90()

from test_kernels import DEV, make_pool, random_lists, seeded  # noqa: E402


def _attend(q, k, v, table, sl, idx, cnt, page, sm):
    """The fused attention + merge kernel (serial DSA's launch), called directly."""
    o, lse = torch.ops.sglang_prr_cuda.sparse_attn_merge(
        q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV), sl.to(DEV), idx.to(DEV), cnt.to(DEV),
        page, sm, None, None, None, None, None, None, 0, True, None, None)
    return o.cpu(), lse.cpu()


@pytest.mark.parametrize("B,Hq,Hk,D,page", [(2, 32, 8, 128, 64), (3, 8, 2, 64, 16)])
def test_a_nan_or_inf_v_inside_a_request_reaches_its_output_only(B, Hq, Hk, D, page):
    seeded(f"nan v B={B} D={D} page={page}")
    seq_lens = [random.randint(3 * page, 9 * page) for _ in range(B)]
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq_lens, torch.bfloat16)
    nblk = [(s + page - 1) // page for s in seq_lens]
    idx, cnt = random_lists(B, Hk, max(nblk), nblk, fill="full")
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    sm = 1.0 / math.sqrt(D)
    clean, _ = _attend(q, k_buf, v_buf, table, sl, idx, cnt, page, sm)
    b, h, dim = B - 1, random.randrange(Hk), random.randrange(D)
    blk = int(idx[b, h, random.randrange(int(cnt[b, h]))])
    pos = blk * page + random.randrange(min(page, seq_lens[b] - blk * page))
    slot = int(table[b, pos // page]) * page + pos % page
    G = Hq // Hk
    for bad in (float("nan"), float("inf")):
        v = v_buf.clone()
        v[slot, h, dim] = bad
        got, _ = _attend(q, k_buf, v, table, sl, idx, cnt, page, sm)
        want, _ = ref.attend_set(q, k_buf, v, table, sl, idx, cnt, page, sm)
        hit = torch.zeros_like(got, dtype=torch.bool)
        hit[b, h * G:(h + 1) * G, dim] = True
        reached = torch.isnan if math.isnan(bad) else torch.isposinf
        assert torch.equal(reached(want), hit), "the reference: its heads' dim only"
        # The kernels' P.V runs in two 16-bit parts of P (p's bf16 and its remainder): an inf V
        # times a zero or negative remainder is NaN or -inf, so an inf may arrive as NaN.
        assert torch.equal(~torch.isfinite(got), hit), "the bad value reaches its heads' dim only"
        if math.isnan(bad):
            assert torch.equal(torch.isnan(got), hit)
        assert torch.equal(got[~hit], clean[~hit]), "every other output keeps its bits"
        torch.testing.assert_close(got[~hit], want[~hit].float(), atol=2e-5, rtol=2e-5)
        # control: the same value in a slot past the request never reaches the output
        past = int(table[b, (seq_lens[b] - 1) // page]) * page + (seq_lens[b] - 1) % page + 1
        if seq_lens[b] % page:  # the last block has a slot past the request
            v = v_buf.clone()
            v[past] = bad
            assert torch.equal(_attend(q, k_buf, v, table, sl, idx, cnt, page, sm)[0], clean)


def test_a_finite_level_with_a_non_finite_trend_restarts_bit_for_bit():
    seeded("holt trend")
    B, Hk, NB = 3, 4, 300
    level = torch.randn(B, Hk, NB)
    trend = torch.randn(B, Hk, NB) * 0.1
    bad = torch.rand(B, Hk, NB) < 0.05
    trend[bad] = torch.tensor([float("inf"), float("-inf")])[torch.randint(0, 2, (int(bad.sum()),))]
    n_init = torch.full((B,), NB, dtype=torch.int64)
    nblk = torch.full((B,), NB, dtype=torch.int64)
    scores = torch.randn(B, Hk, NB)
    theta = torch.rand(B, 3)
    l_ref, t_ref, n_ref = level.clone(), trend.clone(), n_init.clone()
    ref.holt_update(l_ref, t_ref, n_ref, scores, nblk, theta[:, 0], theta[:, 1])
    assert torch.isfinite(t_ref).all() and torch.equal(l_ref[bad], scores[bad])
    l_d, t_d, n_d, th = level.to(DEV), trend.to(DEV), n_init.to(DEV), theta.to(DEV)
    torch.ops.sglang_prr_cuda.holt_update(l_d, t_d, n_d, scores.to(DEV), nblk.to(DEV),
                                          th[:, 0], th[:, 1])
    assert torch.equal(l_d.cpu(), l_ref) and torch.equal(t_d.cpu(), t_ref)
    assert not torch.equal(l_ref[~bad], scores[~bad]), "control: the others did not restart"


def test_a_negative_slot_writes_the_padding_page():
    """quest_select with the decode update: a row whose slot is negative writes page 0, as the
    reference does, and no other page; the valid row writes its own page in both."""
    seeded("negative slot")
    B, Hq, Hk, D, page = 2, 8, 2, 64, 16
    seq_lens = [5 * page + 3, 3 * page + 7]
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq_lens, torch.bfloat16)
    pages = k_buf.shape[0] // page
    kmin = torch.randn(pages, Hk, D).to(torch.bfloat16)
    kmax = (kmin.float() + torch.rand(pages, Hk, D)).to(torch.bfloat16)
    nblk = torch.tensor([(s + page) // page for s in seq_lens])
    new_k = torch.randn(B, Hk, D, dtype=torch.bfloat16)
    new_pos = sl.clone()
    new_loc = torch.tensor([-page - 3, int(table[1, seq_lens[1] // page]) * page + 7])
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    args = (None, None, 2, 1, 1, 4)
    lo_r, hi_r = kmin.clone(), kmax.clone()
    ref.quest_select(q, lo_r, hi_r, table, nblk, *args, new_k=new_k, new_pos=new_pos,
                     page_size=page, new_loc=new_loc)
    lo_d, hi_d = kmin.to(DEV), kmax.to(DEV)
    torch.ops.sglang_prr_cuda.quest_select(
        q.to(DEV), lo_d, hi_d, table.to(DEV), nblk.to(DEV), *args, None, None, None,
        new_k.to(DEV), new_pos.to(DEV), page, new_loc.to(DEV))
    for got, want, before in ((lo_d.cpu(), lo_r, kmin), (hi_d.cpu(), hi_r, kmax)):
        assert torch.equal(got[1:], want[1:]), "only the valid row's page changes"
        changed = {int(i) for i in torch.nonzero((got != before).flatten(1).any(1)).flatten()}
        assert changed <= {0, int(new_loc[1]) // page} and int(new_loc[1]) // page in changed


def test_quest_scores_of_a_zero_query_against_an_infinite_bound_and_of_a_nan_query():
    """A zero q_d against an infinite key bound counts the other bound (fmax, as the
    reference); a NaN query head makes its group's scores NaN, ranked last by the selection in
    the kernel as in the reference; the other KV heads keep their scores and selection."""
    seeded("quest non-finite")
    B, Hq, Hk, D, NB = 2, 16, 4, 128, 40
    P = NB * B + 5
    kmin = torch.randn(P, Hk, D).to(torch.bfloat16)
    kmax = (kmin.float() + torch.rand(P, Hk, D)).to(torch.bfloat16)
    table = torch.randint(1, P, (B, NB))
    nblk = torch.tensor([NB, NB - 7])
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    G, h, d = Hq // Hk, random.randrange(Hk), random.randrange(D)
    kmax[int(table[0, 5]), h, d] = float("inf")
    q[0, h * G:(h + 1) * G, d] = 0.0
    k, sink, local, n_out = 6, 1, 2, 9
    dev = [x.to(DEV) for x in (q, kmin, kmax, table, nblk.int())]
    s, a_idx, a_cnt = [x.cpu() for x in torch.ops.sglang_prr_cuda.quest_select(
        *dev, None, None, k, sink, local, n_out)[:3]]
    s_ref = ref.quest_scores(q, kmin, kmax, table, nblk)
    fin = torch.isfinite(s_ref)
    assert torch.equal(torch.isfinite(s), fin) and fin[0].all()
    torch.testing.assert_close(s[fin], s_ref[fin], rtol=1e-5, atol=1e-4)
    q2 = q.clone()
    q2[1, h * G, random.randrange(D)] = float("nan")
    dev[0] = q2.to(DEV)
    s2, a2, c2 = [x.cpu() for x in torch.ops.sglang_prr_cuda.quest_select(
        *dev, None, None, k, sink, local, n_out)[:3]]
    n = int(nblk[1])
    assert torch.isnan(s2[1, h, :n]).all() and torch.isneginf(s2[1, h, n:]).all()
    ai, ac = ref.select_topk(ref.quest_scores(q2, kmin, kmax, table, nblk), nblk, k, sink,
                             local, n_out)
    assert torch.equal(a2, ai) and torch.equal(c2, ac)
    want = sorted(set(range(sink)) | set(range(sink, sink + k)) | set(range(n - local, n)))
    assert a2[1, h, :int(c2[1, h])].tolist() == want  # NaN ranks last: the lowest middle ids
    rest = torch.ones(B, Hk, dtype=torch.bool)
    rest[1, h] = False
    assert torch.equal(a2[rest], a_idx[rest]) and torch.equal(s2[rest], s[rest])
    assert a_idx[1, h, :int(a_cnt[1, h])].tolist() != want  # control: finite scores differ
