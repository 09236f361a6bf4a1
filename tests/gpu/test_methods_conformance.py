"""Every registered DSA method with SM90 kernels (``DSAMethod.kernels``), its kernel path against
its reference, through the method's interface (the CPU half of the suite, and the methods
without kernels, are ``tests/unit/test_methods_conformance.py``):

* ``update`` (a whole prefill, then one decode token per request) builds the reference's
  summaries;
* ``scores`` equal the reference's up to fp32 rounding; ``select`` (P at pool rows, a dense row,
  the counters) gives the top-K of its own scores and ``M = A \\ P`` exactly;
* ``step.DecodeStep`` captured in a CUDA graph (PRR on two streams, state in place) gives
  serial DSA's bits, step after step, and serial DSA attends the method's own A (control:
  dense attention differs).

Conventions as in ``test_kernels.py``: printed seeds, a negative control beside each equality.
Skipped with a reason without a CUDA SM90 device.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from sglang_prr import contracts, methods
from sglang_prr import reference as ref

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402  (the SM90 gate, tests/gpu/sm90.py)

require_sm90()

from sglang_prr.methods import SelectSpec  # noqa: E402
from sglang_prr.step import DecodeStep, new_layer_state  # noqa: E402
from sglang_prr.step import p_rows as p_rows_of  # noqa: E402
from test_kernels import DEV, capture, rel_err, seeded  # noqa: E402

CPU = torch.device("cpu")
KERNEL_METHODS = [n for n in methods.names() if methods.get(n).kernels]
K, N_PRED, SINK, LOCAL = 4, 6, 1, 1


def _pool(B, hk, d, page, lens, dtype, g):
    """Requests in slots 1..B owning shuffled pages (page 0: SGLang's padding page), room for
    ``page`` more tokens each: ``(req_to_token [B+1, ctx] int32, rows [B], k_buf, v_buf)``."""
    ctx = max(lens) + page
    per = -(-ctx // page)
    n_pages = 1 + B * per
    pages = (torch.randperm(n_pages - 1, generator=g) + 1).view(B, per)
    r2t = (pages[:, :, None] * page + torch.arange(page)).view(B, -1)[:, :ctx]
    r2t = torch.cat([torch.zeros(1, ctx, dtype=torch.long), r2t]).int()
    k_buf = (torch.randn(n_pages * page, hk, d, generator=g) * 1.5).to(dtype)
    v_buf = torch.randn(n_pages * page, hk, d, generator=g).to(dtype)
    return r2t, torch.arange(1, B + 1), k_buf, v_buf


def _summaries(m, r2t, rows, k_buf, lens, page, dev):
    """The method's summaries of every request's ``lens`` tokens (one prefill update), then one
    decode token each (``decode=True``), built on ``dev``."""
    hk, d = k_buf.shape[1:]
    summary = [t[0] for t in m.allocate(1, k_buf.shape[0] // page, hk, d, page, dev)]
    kb, r2 = k_buf.to(dev), r2t.to(dev)
    req = torch.cat([torch.full((L,), int(r)) for r, L in zip(rows, lens)])
    pos = torch.cat([torch.arange(L) for L in lens])
    loc = r2t[req, pos].long()
    m.update(summary, kb[loc.to(dev)], loc.to(dev), pos.to(dev), page, decode=False,
             key_buffer=kb, req_to_token=r2, token_req_idx=lambda: req.to(dev))
    pos1 = torch.tensor(lens)
    loc1 = r2t[rows, pos1].long()
    m.update(summary, kb[loc1.to(dev)], loc1.to(dev), pos1.to(dev), page, decode=True,
             key_buffer=kb, req_to_token=r2, token_req_idx=lambda: rows.to(dev))
    return summary


@pytest.mark.parametrize("name", KERNEL_METHODS)
@pytest.mark.parametrize("B,group,page,dtype", [(3, 4, 64, torch.bfloat16),
                                                (5, 8, 16, torch.float16)])
def test_update_scores_and_selection_kernels_equal_the_reference(name, B, group, page, dtype):
    g = torch.Generator().manual_seed(seeded(f"{name} B={B} group={group} page={page}"))
    m, hk, d = methods.get(name), 2, 128
    lens = [random.randint(6 * page, 30 * page) for _ in range(B)]
    r2t, rows, k_buf, v_buf = _pool(B, hk, d, page, lens, dtype, g)
    want_s = _summaries(m, r2t, rows, k_buf, lens, page, CPU)
    got_s = _summaries(m, r2t, rows, k_buf, lens, page, DEV)
    fresh = [t[0] for t in m.allocate(1, k_buf.shape[0] // page, hk, d, page, CPU)]
    for got, want, f in zip(got_s, want_s, fresh):
        # Page 0 is SGLang's padding page: the reference sends the writes that go nowhere there,
        # the kernels skip them; no request reads it.
        torch.testing.assert_close(got.cpu()[1:], want[1:], rtol=1e-5, atol=1e-6,
                                   equal_nan=True)
        assert not torch.equal(want[1:], f[1:]), "control: the updates wrote"
    # Scores and selection of one decode step over the CPU-built summaries (the same inputs).
    seq = torch.tensor(lens) + 1
    table = ref.block_table(r2t, rows, page)
    q = (torch.randn(B, hk * group, d, generator=g) * 3).to(dtype)
    sm = 1.0 / math.sqrt(d)
    summ = [t.to(DEV) for t in want_s]
    s_ref = m.scores(q, want_s, table=table, seq_lens=seq, page_size=page, sm_scale=sm)
    s = m.scores(q.to(DEV), summ, table=table.to(DEV), seq_lens=seq.to(DEV), page_size=page,
                 sm_scale=sm).cpu()
    fin = torch.isfinite(s_ref)
    assert torch.equal(torch.isfinite(s), fin) and rel_err(s[fin], s_ref[fin]) < 1e-5
    R, width = 2 * B + 3, N_PRED + SINK + LOCAL
    p_idx = torch.randint(-1, 4, (R, hk, width), dtype=torch.int32)  # garbage but in p_rows
    p_cnt = torch.randint(0, width + 1, (R, hk), dtype=torch.int32)
    p_rows = torch.randperm(R)[:B]
    for b, r in enumerate(p_rows.tolist()):  # P of the batch: ascending distinct block ids
        nb_b = -(-int(seq[b]) // page)
        for h in range(hk):
            ids = sorted(random.sample(range(nb_b), random.randint(0, min(width, nb_b))))
            p_idx[r, h] = torch.tensor(ids + [-1] * (width - len(ids)), dtype=torch.int32)
            p_cnt[r, h] = len(ids)
    dense = torch.zeros(B, dtype=torch.bool)
    dense[-1] = True
    spec = SelectSpec.of(K, SINK, LOCAL, page, n_out=max(K + SINK + LOCAL, int(table.shape[1])))
    stats = contracts.new_stats(DEV)
    sel = m.select(q.to(DEV), summ, table=table.to(DEV), seq_lens=seq.to(DEV), spec=spec,
                   sm_scale=sm, p_idx=p_idx.to(DEV), p_cnt=p_cnt.to(DEV),
                   p_rows=p_rows.to(DEV), dense_row=dense.to(DEV), stats=stats)
    nblk = ref.num_blocks(seq, page)
    want_stats = contracts.new_stats()
    want = ref.select_from_scores(sel.scores.cpu(), nblk, table.shape[1], p_idx, p_cnt, K, SINK,
                                  LOCAL, spec.n_out, p_rows, dense, want_stats)
    for x, y in zip(sel[1:], want[1:]):
        assert torch.equal(x.cpu(), y)
    assert torch.equal(stats.cpu(), want_stats)
    a_bad, _ = ref.select_topk(sel.scores.cpu(), nblk, K + 1, SINK, LOCAL, spec.n_out, dense)
    assert not torch.equal(sel.a_idx.cpu(), a_bad), "control: K + 1 selects more"


# Where PRR's predictor step runs: the selection's epilogue (a method that has it), its own launch
# right after the selection (beside the repair), after the repair, on its own stream once the
# scores exist, or at the next sparse layer's fork (SGLANG_PRR_PREDICT_ORDER).
PLACES = [(n, p) for n in KERNEL_METHODS
          for p in ("epilogue", "selection", "repair", "next", "scores")
          if p != "epilogue" or methods.get(n).fuses_predictor]
LAYERS = 2  # a forward of two sparse layers: the first's step may wait for the second's fork


@pytest.mark.parametrize("name,place", PLACES)
def test_decode_step_graph_replay_gives_serial_dsa_bits(name, place):
    """PRR's step in a CUDA graph of a two-layer forward, replayed at a growing length, gives
    serial DSA's output bits in every layer and counts the P(t) of the length's parity, wherever
    its predictor runs (``place``); in the selection's launch (Quest's epilogue, InfLLM-v2's
    CTAs beside its top-K's), after the repair, forked after the scores or at the next layer's
    fork, the states and the outputs equal those of the predictor's launch right after the selection, bit for bit,
    replay for replay (a predictor step never launched, or launched over another layer's scores,
    leaves a state that differs)."""
    g = torch.Generator().manual_seed(seeded(f"{name} step {place}"))
    m, B, hk, group, d, page = methods.get(name), 3, 2, 4, 128, 64
    lens = [random.randint(20 * page, 40 * page) for _ in range(B)]
    r2t, rows, k_buf, v_buf = _pool(B, hk, d, page, lens, torch.bfloat16, g)
    summary = _summaries(m, r2t, rows, k_buf, lens, page, DEV)  # the kernels' summaries
    r2t, rows, k_buf, v_buf = r2t.to(DEV), rows.to(DEV), k_buf.to(DEV), v_buf.to(DEV)
    R, nb = B + 1, -(-r2t.shape[1] // page)
    prr, serial, twin = (DecodeStep(name, K, N_PRED, SINK, LOCAL, page, 0, exact=True,
                                    serial=s, device=DEV, fuse_predictor=f)
                         for s, f in ((False, place == "epilogue"), (True, True),
                                      (False, False)))
    prr.predict_at = "selection" if place == "epilogue" else place
    twin.predict_at = "selection"
    states = [new_layer_state(R, hk, nb, N_PRED + SINK + LOCAL, (0.6, 0.3, 0.5), DEV)
              for _ in range(LAYERS)]
    twin_states = [type(st)(*(x.clone() for x in st)) for st in states]
    qs = [torch.empty(B, hk * group, d, device=DEV, dtype=torch.bfloat16) for _ in range(LAYERS)]
    seq = torch.tensor(lens, device=DEV) + 1
    outs = [torch.empty_like(q) for q in qs]
    twin_outs = [torch.empty_like(q) for q in qs]
    stats = contracts.new_stats(DEV)
    sm = 1.0 / math.sqrt(d)

    def forward(step, sts, os, counters):
        b = step.plan(r2t, rows, seq)
        for i in range(LAYERS):
            os[i].copy_(step.run(qs[i], k_buf, v_buf, summary, b, sts[i], counters, sm,
                                 qs[i].dtype, join=i == LAYERS - 1))

    def new_queries():
        for q in qs:
            q.copy_((torch.randn(q.shape, generator=g) * 3).to(DEV))

    new_queries()
    graph = capture(lambda: forward(prr, states, outs, stats))
    # the twin: the predictor's own launch right after the selection
    twinned = place in ("epilogue", "repair", "next", "scores")
    twin_graph = capture(lambda: forward(twin, twin_states, twin_outs, None)) if twinned else None
    stats.zero_()
    for t in range(4):
        # One more token a step (the pool has room for a page more): P(t) is then the half of
        # P's pair the previous step wrote (the length's parity), as in the server.
        seq.copy_(torch.tensor(lens, device=DEV) + 1 + t)
        new_queries()
        for o in outs:
            o.fill_(float("nan"))
        read = sum(st.p_cnt[p_rows_of(rows, seq)].clamp(min=0).sum() for st in states)
        pairs = [st.p_cnt.view(R, 2, hk)[rows].clone() for st in states]  # both halves
        before = stats.clone()
        graph.replay()
        if twin_graph is not None:
            twin_graph.replay()
        torch.cuda.synchronize()
        if twin_graph is not None:
            for o, to in zip(outs, twin_outs):
                assert torch.equal(o, to), t
            for st, ts in zip(states, twin_states):
                for x, y in zip(st, ts):
                    assert torch.equal(x, y), t
        # The counters count the P(t) of the length's parity: the step's own P(t + 1), in the
        # other half, is read by the next step only. From the second step on, P(t) is non-empty.
        why = (t, (seq % 2).tolist(), [p.tolist() for p in pairs])
        assert int(stats[2] - before[2]) == int(read), why  # host-ok: test readout
        assert t == 0 or int(read) > 0, why  # host-ok: the previous step wrote P(t)
        bs = serial.plan(r2t, rows, seq)
        for i, q in enumerate(qs):
            want = serial.run(q, k_buf, v_buf, summary, bs, None, None, sm, q.dtype)
            assert torch.equal(outs[i], want), (t, i)  # the same partials, merged in one order
            a = m.select(q, summary, table=bs.table, seq_lens=seq, spec=serial.spec,
                         sm_scale=sm, nblk=bs.nblk)
            own = ref.attend_set(q.float().cpu(), k_buf.cpu(), v_buf.cpu(), bs.table.cpu(),
                                 seq.cpu(), a.a_idx.cpu(), a.a_cnt.cpu(), page, sm)[0]
            dense = ref.dense_attention(q.float().cpu(), k_buf.cpu(), v_buf.cpu(),
                                        bs.table.cpu(), seq.cpu(), page, sm)
            assert rel_err(want, own) < 1e-2, (t, i)
            assert rel_err(dense, own) > 3e-2, (t, i)  # control: the selection matters
    assert 0 < int(stats[2]) and int(stats[1]) < int(stats[0])  # host-ok: P was used and hit
    # control: the layers' states differ (their queries do), so a predictor step launched over
    # the other layer's scores could not give the twin's
    assert not torch.equal(states[0].level, states[1].level)
