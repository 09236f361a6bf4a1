"""Quest's selection kernels with the step's new keys folded in (``new_k`` / ``new_pos``), on the
GPU: every selection path (``SGLANG_PRR_SELECT_KERNEL``: one-pass, row-tail, split), bf16 and
float32 summaries, keys of every float dtype. The kernel's scores, A and M with the keys folded
equal, bit for bit, the kernel's own selection after the decode update (``quest_update``), whether
the update ran before, not at all, or on another stream at the same time (the fold is idempotent);
the scores match the reference's. With the keys' slots (``new_loc``) the same launch writes the
update: the summaries equal ``quest_update``'s bit for bit (page 0, the padding sink, aside), and
``DecodeStep`` in CUDA graphs gives the same outputs and summaries whether the selection writes
the keys, the update runs beside it, or first. Negative control: without the new keys the newest
blocks' scores differ. Conventions as in ``test_fused_kernels.py``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from sglang_prr import reference as ref

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402

require_sm90()

from sglang_prr import ops  # noqa: E402
from test_kernels import DEV, rel_err, seeded, set_select_path  # noqa: E402

CUDA = torch.ops.sglang_prr_cuda


@pytest.fixture(params=["auto", "onepass", "rowtail", "split", "onepass-grid2", "split-grid1"])
def select_kernel(request, monkeypatch):
    """``auto``: the launcher's shape rule; ``-gridN``: grids of at most N CTAs a row that loop
    over the row's chunks (blocks) (``set_select_path``)."""
    set_select_path(monkeypatch, request.param)
    return request.param


def _case(B, Hq, Hk, D, NB, page, sdt, kdt):
    P = B * NB + 3
    kmin = torch.randn(P, Hk, D)
    kmax = kmin + torch.rand(P, Hk, D)
    if sdt == torch.bfloat16:
        kmin, kmax = ref.round_bf16(kmin, down=True), ref.round_bf16(kmax, down=False)
    table = (torch.randperm(P - 1)[:B * NB] + 1).view(B, NB).int()
    nblk = torch.randint(1, NB + 1, (B,))
    nblk[0] = NB
    off = torch.randint(0, page, (B,))
    off[-1] = 0  # a fresh page: its stored bounds are another owner's
    pos = (nblk - 1) * page + off
    loc = table[torch.arange(B), nblk - 1].long() * page + off
    k = (torch.randn(B, Hk, D) * 3).to(kdt)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    return [t.to(DEV) for t in (q, kmin, kmax, table, nblk, k, loc, pos)]


@pytest.mark.parametrize("sdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kdt", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,Hq,Hk,D,NB,page", [
    (1, 32, 8, 128, 2048, 64), (3, 12, 3, 64, 300, 16), (5, 8, 2, 256, 77, 32),
    (4, 32, 8, 128, 2048, 64)])  # batch x blocks = 8192: auto takes the two launches
def test_quest_select_folds_new_keys(B, Hq, Hk, D, NB, page, sdt, kdt, select_kernel):
    seeded(f"fold B={B} D={D} NB={NB} {sdt} {kdt} {select_kernel}")
    q, kmin, kmax, table, nblk, k, loc, pos = _case(B, Hq, Hk, D, NB, page, sdt, kdt)
    args = (None, None, 16, 1, 1, 18)
    fold = dict(new_k=k, new_pos=pos, page_size=page)
    umin, umax = kmin.clone(), kmax.clone()
    CUDA.quest_update(umin, umax, k, loc, pos, page, True)
    want = CUDA.quest_select(q, umin, umax, table, nblk, *args)
    before = CUDA.quest_select(q, kmin, kmax, table, nblk, *args, **fold)
    twice = CUDA.quest_select(q, umin, umax, table, nblk, *args, **fold)
    for got in (before, twice):
        for x, y in zip(got, want):
            assert torch.equal(x, y)
    s_ref = ref.quest_scores(q.cpu(), umin.cpu(), umax.cpu(), table.cpu(), nblk.cpu())
    fin = torch.isfinite(s_ref)
    assert torch.equal(torch.isfinite(before[0].cpu()), fin)
    assert rel_err(before[0].cpu()[fin], s_ref[fin]) < 1e-5
    # Concurrently with the update on another stream: still the same bits.
    side = torch.cuda.Stream()
    for _ in range(3):
        cmin, cmax = kmin.clone(), kmax.clone()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            CUDA.quest_update(cmin, cmax, k, loc, pos, page, True)
        got = CUDA.quest_select(q, cmin, cmax, table, nblk, *args, **fold)
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(cmin, umin) and torch.equal(cmax, umax)
    # With the slots the launch is the update too (page 0, the padding sink, aside).
    wmin, wmax = kmin.clone(), kmax.clone()
    got = CUDA.quest_select(q, wmin, wmax, table, nblk, *args, **fold, new_loc=loc)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    assert torch.equal(wmin[1:], umin[1:]) and torch.equal(wmax[1:], umax[1:])
    assert not torch.equal(wmin[1:], kmin[1:])
    # Negative control: the stale summaries without the keys score the newest blocks otherwise.
    stale = CUDA.quest_select(q, kmin, kmax, table, nblk, *args)[0]
    last = torch.zeros_like(stale, dtype=torch.bool)
    last[torch.arange(B, device=DEV), :, nblk - 1] = True
    assert torch.equal(stale[~last], want[0][~last])
    assert not torch.equal(stale[last], want[0][last])


@pytest.mark.parametrize("B,Hk,NB,page", [(1, 8, 2048, 64), (4, 2, 130, 16)])
def test_quest_select_predict_folds_new_keys(B, Hk, NB, page, select_kernel):
    """The predictor's step reads the folded scores: its state after the launch is the state
    after the update."""
    seeded(f"fold predict B={B} NB={NB} {select_kernel}")
    q, kmin, kmax, table, nblk, k, loc, pos = _case(B, 4 * Hk, Hk, 128, NB, page,
                                                     torch.bfloat16, torch.float16)
    R, W = B + 1, 60
    rows = torch.randperm(R)[:B].to(DEV)
    nxt = torch.clamp(nblk + 1, max=NB)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))

    def run(summ, **fold):
        st = [torch.full((2 * R, Hk, W), -1, dtype=torch.int32),
              torch.zeros(2 * R, Hk, dtype=torch.int32),
              torch.randn(R, Hk, NB, generator=g.manual_seed(7)), torch.zeros(R, Hk, NB),
              torch.full((R,), NB // 2), torch.full((R, 3), 0.5)]
        st = [t.to(DEV) for t in st]
        out = CUDA.quest_select_predict(q, *summ, table, nblk, nxt, st[0], st[1], 2 * rows,
                                        2 * rows + 1, st[2], st[3], st[4], st[5], rows, 16, 40,
                                        1, 1, 18, **fold)
        return list(out) + st[:5]

    umin, umax = kmin.clone(), kmax.clone()
    CUDA.quest_update(umin, umax, k, loc, pos, page, True)
    want = run((umin, umax))
    got = run((kmin, kmax), new_k=k, new_pos=pos, page_size=page)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    wmin, wmax = kmin.clone(), kmax.clone()  # the slots: the update written by the same launch
    got = run((wmin, wmax), new_k=k, new_pos=pos, page_size=page, new_loc=loc)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(wmin[1:], umin[1:]) and torch.equal(wmax[1:], umax[1:])
    stale = run((kmin, kmax))
    assert not torch.equal(stale[0], want[0]) and not torch.equal(stale[7], want[7])


def _step_graph(seed, batch, group, page, where):
    """PRR and serial DSA (``DecodeStep``, Quest) in one CUDA graph whose every replay stores
    each row's new key into the KV cache and hands it to the steps (``new_keys`` with the summary
    update): ``where`` = ``select``: the selection writes the keys (no update launch); ``side``:
    the update on the side stream, the keys folded into the selection; ``first``: the update
    first (``SGLANG_PRR_FOLD_NEW_KEYS=0``); ``spec_first``: as ``select``, PRR's speculative pass
    recorded before the selection (``SGLANG_PRR_SPEC_ORDER=first``); ``kv_beside``: as ``select``,
    the KV store handed to the steps, which run it beside the selection
    (``SGLANG_PRR_KV_STORE=beside``); ``no_store``: as ``select`` without the KV store (a
    control: the new keys never reach the cache). The last row pads the batch
    as SGLang's graphs do (request slot 0, length 1, KV slot 0). Returns the graph, its inputs
    (q, the new keys, the lengths), its outputs and its KV cache."""
    from sglang_prr.methods import NewKeys
    from sglang_prr.step import DecodeStep, new_layer_state
    from sglang_prr.tools.synthetic import paged_kv
    from test_kernels import capture
    g = torch.Generator().manual_seed(seed)
    hk, d, dt = 2, 128, torch.bfloat16
    ctx = 40 * page + 7
    kv = paged_kv(batch, ctx + 16, page, hk, d, dtype=dt, device=DEV, generator=g)
    steps = {}
    for serial in (False, True):
        steps[serial] = DecodeStep("quest", 4, 6, 1, 1, page, min_context=8 * page + 1,
                                   exact=True, serial=serial, device=DEV)
        steps[serial].fold_keys = where != "first"
        steps[serial].write_keys = where in ("select", "spec_first", "kv_beside", "no_store")
        steps[serial].spec_first = where == "spec_first"
        steps[serial].store_beside = where == "kv_beside"
    state = new_layer_state(batch + 1, hk, kv.table.shape[1], 8, (0.6, 0.3, 0.5), DEV)
    rows = torch.cat([kv.rows.flip(0), torch.zeros(1, dtype=torch.long, device=DEV)])
    B = batch + 1
    q = torch.zeros(B, hk * group, d, device=DEV, dtype=dt)
    knew = torch.zeros(B, hk, d, device=DEV, dtype=dt)
    seq = torch.full((B,), ctx, device=DEV, dtype=torch.long)
    outs = {n: torch.empty_like(q) for n in ("prr", "ser")}

    def body():
        pos = seq - 1
        loc = kv.req_to_token[rows, pos].long()
        loc[batch:] = 0  # the padding row's KV slot, as SGLang pads out_cache_loc
        store = functools.partial(kv.k_buf.index_copy_, 0, loc, knew)  # the new keys' KV store
        if where not in ("kv_beside", "no_store"):
            store()
        nk = NewKeys(knew, loc, pos)

        def update():
            ops.quest_update(kv.kmin, kv.kmax, knew, loc, pos, page, one_per_page=True)

        for name, serial in (("prr", False), ("ser", True)):
            step = steps[serial]
            b = step.plan(kv.req_to_token, rows, seq)
            outs[name].copy_(step.run(q, kv.k_buf, kv.v_buf, [kv.kmin, kv.kmax], b,
                                      None if serial else state, None, 1 / math.sqrt(d), dt,
                                      new_keys=nk, update=update,
                                      store=store if where == "kv_beside" else None,
                                      keep=(loc, knew)))

    return capture(body), (q, knew, seq), outs, kv


@pytest.mark.parametrize("batch,group,page", [(1, 4, 64), (3, 8, 16)])
def test_decode_step_with_the_update_in_or_beside_equals_update_first(batch, group, page):
    """The selection writing the new keys, and the summary update on the side stream with the
    keys folded into the selection, and the writing selection recorded after PRR's speculative
    pass, and the writing selection with the KV store beside it, against the update first, all
    in CUDA graphs with new keys every replay: the same outputs, bit for bit (PRR == serial DSA
    in each), and the same summaries after every replay (page 0, the padding row's, aside); the
    summaries moved, and without the KV store the output differs (controls)."""
    seed = seeded(f"step fold batch={batch} group={group} page={page}")
    runs = {w: _step_graph(seed, batch, group, page, w)
            for w in ("select", "side", "spec_first", "kv_beside", "no_store", "first")}
    g = torch.Generator().manual_seed(seed + 1)
    ctx = 40 * page + 7
    start = runs["select"][3].kmin.clone()
    for t in range(4):
        qv = torch.randn(runs["select"][1][0].shape, generator=g) * 3
        kn = torch.randn(runs["select"][1][1].shape, generator=g) * 4
        for graph, (q, knew, seq), outs, kv in runs.values():
            q.copy_(qv)
            knew.copy_(kn)
            seq.copy_(torch.tensor([ctx + t] * batch + [1]))
            graph.replay()
        torch.cuda.synchronize()
        o = {w: runs[w][2] for w in runs}
        for w in runs:
            assert torch.equal(o[w]["prr"][:batch], o[w]["ser"][:batch]), (w, t)
        for w in ("select", "side", "spec_first", "kv_beside"):
            assert torch.equal(o[w]["prr"][:batch], o["first"]["prr"][:batch]), (w, t)
            assert torch.equal(runs[w][3].kmin[1:], runs["first"][3].kmin[1:]), (w, t)
            assert torch.equal(runs[w][3].kmax[1:], runs["first"][3].kmax[1:]), (w, t)
        # Control: without the KV store the new keys never reach the attention.
        assert not torch.equal(o["no_store"]["prr"][:batch], o["first"]["prr"][:batch]), t
    assert not torch.equal(runs["select"][3].kmin, start)  # control: the updates ran
