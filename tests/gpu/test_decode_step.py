"""The lean decode step on the GPU: the ops' pool-row, dense-row, statistics and output-dtype
contracts against the reference, and ``DecodeStep`` (serial DSA and PRR, two streams) replayed
in a CUDA graph with strided queries, rows out of order and a padding row, against serial DSA.

Conventions as in ``test_kernels.py``: printed seeds, poisoned outputs, a negative control beside
each equality. Skipped with a reason without a CUDA SM90 device.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from sglang_prr import contracts
from sglang_prr import reference as ref

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402  (the SM90 gate, tests/gpu/sm90.py)

require_sm90()

from sglang_prr import ops  # noqa: E402
from sglang_prr.step import DecodeStep, new_layer_state  # noqa: E402
from sglang_prr.tools.synthetic import paged_kv  # noqa: E402
from test_kernels import (DEV, capture, make_pool, poison, random_lists, rel_err,  # noqa: E402
                          seeded)


def _pool_lists(R, rows, idx, cnt):
    """Scatter batch lists into pool-wide lists ``[R, ...]`` at ``rows`` (other rows garbage)."""
    pi = torch.randint(0, 3, (R,) + idx.shape[1:], dtype=torch.int32)
    pc = torch.randint(0, 3, (R,) + cnt.shape[1:], dtype=torch.int32)
    pi[rows], pc[rows] = idx, cnt
    return pi, pc


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype", [
    (3, 32, 8, 128, 64, torch.bfloat16), (5, 8, 2, 64, 16, torch.float16),
    (2, 16, 4, 128, 32, torch.float32)])
def test_attention_reads_pool_rows_and_writes_model_dtype(B, Hq, Hk, D, page, dtype):
    seeded(f"pool rows B={B} Hq={Hq} page={page} {dtype}")
    seq = [random.randint(2 * page, 9 * page) + 3 for _ in range(B)]
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq, dtype)
    nblk = [(s + page - 1) // page for s in seq]
    N = max(nblk)
    p_idx, p_cnt = random_lists(B, Hk, N, nblk)
    a_idx, a_cnt = random_lists(B, Hk, N, nblk)
    m_idx, m_cnt = random_lists(B, Hk, N, nblk)
    R = 2 * B + 3
    rows = torch.randperm(R - 1)[:B] + 1  # out of order, not the batch order
    pool_pi, pool_pc = _pool_lists(R, rows, p_idx, p_cnt)
    # q as SGLang hands it over: a strided view of the fused qkv projection.
    qkv = torch.randn(B, (Hq + 2 * Hk) * D).to(dtype)
    q = qkv[:, :Hq * D].view(B, Hq, D)
    sm = 1.0 / math.sqrt(D)
    o_s, lse_s = ref.sparse_attn_partials(q.float(), k_buf, v_buf, table, sl, p_idx, p_cnt, page,
                                          sm)
    want, _ = ref.sparse_attn_merge(q.float(), k_buf, v_buf, table, sl, m_idx, m_cnt, page, sm,
                                    o_s, lse_s, p_idx, p_cnt, a_idx, a_cnt, NB, True)
    d = lambda *ts: [t.to(DEV) for t in ts]  # noqa: E731
    qd, kd, vd, td, sd, rd = d(qkv, k_buf, v_buf, table, sl, rows)
    qd = qd[:, :Hq * D].view(B, Hq, D)
    assert not qd.is_contiguous()
    poison(((B, Hq, N, D), torch.float32), ((B, Hq, D), dtype))
    go_s, glse_s = ops.sparse_attn_partials(qd, kd, vd, td, sd, *d(pool_pi, pool_pc), page, sm,
                                            idx_rows=rd)
    assert rel_err(go_s, o_s) < 3e-5
    o, _ = ops.sparse_attn_merge(qd, kd, vd, td, sd, *d(m_idx, m_cnt), page, sm, go_s, glse_s,
                                 *d(pool_pi, pool_pc, a_idx, a_cnt), NB, True, p_rows=rd,
                                 out_dtype=dtype)
    assert o.dtype == dtype and torch.isfinite(o).all()
    tol = 3e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(o, want) < tol
    # Negative control: the batch's own row order reads the wrong requests' P.
    bad, _ = ops.sparse_attn_partials(qd, kd, vd, td, sd, *d(pool_pi[:B], pool_pc[:B]), page, sm)
    assert rel_err(bad, o_s) > 1e-2


@pytest.mark.parametrize("B,Hq,Hk,D,page", [(1, 32, 8, 128, 64), (4, 8, 2, 64, 16)])
def test_quest_select_pool_rows_dense_rows_and_stats(B, Hq, Hk, D, page):
    g = torch.Generator().manual_seed(seeded(f"quest_select rows B={B} page={page}"))
    ctx = 30 * page + 5
    kv = paged_kv(B, ctx, page, Hk, D, dtype=torch.bfloat16, device=torch.device("cpu"),
                  generator=g)
    table = kv.table.int()
    seq = torch.tensor([ctx - 3 * b for b in range(B)])
    nblk = ref.num_blocks(seq, page)
    q = torch.randn(B, Hq, D).to(torch.bfloat16) * 3
    k, sink, local, n_out = 4, 1, 1, 40
    p_idx, p_cnt = random_lists(B, Hk, 12, nblk.tolist())
    R = B + 4
    rows = torch.randperm(R - 1)[:B] + 1
    pool_pi, pool_pc = _pool_lists(R, rows, p_idx, p_cnt)
    dense = torch.zeros(B, dtype=torch.bool)
    dense[0] = True
    st_ref = torch.zeros(4, dtype=torch.int64)
    want = ref.quest_select(q.float(), kv.kmin.cpu(), kv.kmax.cpu(), table, nblk, pool_pi,
                            pool_pc, k, sink, local, n_out, rows, dense, st_ref)
    st = torch.zeros(4, dtype=torch.int64, device=DEV)
    got = ops.quest_select(*[t.to(DEV) for t in (q, kv.kmin, kv.kmax, table, nblk, pool_pi,
                                                 pool_pc)], k, sink, local, n_out,
                           rows.to(DEV), dense.to(DEV), st)
    for w, o in zip(want[1:], got[1:]):
        assert torch.equal(w, o.cpu())
    assert torch.equal(st.cpu(), st_ref) and int(st_ref[3]) == (B - 1) * Hk
    assert int(got[2][0].min()) == int(nblk[0])  # the dense row attends every block
    # Negative control: without the dense flag row 0 takes only K + kept blocks.
    plain = ops.quest_select(*[t.to(DEV) for t in (q, kv.kmin, kv.kmax, table, nblk, pool_pi,
                                                   pool_pc)], k, sink, local, n_out, rows.to(DEV))
    assert int(plain[2][0].max()) == k + sink + local < int(nblk[0])


@pytest.mark.parametrize("extra_width", [0, 5])  # 5: the pool's P is wider (a smaller budget)
def test_predict_update_rows_and_quest_decode_update_match_reference(extra_width):
    seeded("predict rows")
    R, B, Hk, NB, n_pred = 9, 4, 2, 50, 6
    level = torch.randn(R, Hk, NB)
    trend = torch.randn(R, Hk, NB) * 0.1
    n_init = torch.randint(10, NB, (R,))
    theta = torch.rand(R, 3) * 0.8 + 0.1
    p_idx = torch.full((R, Hk, n_pred + 2 + extra_width), -7, dtype=torch.int32)
    p_cnt = torch.full((R, Hk), -7, dtype=torch.int32)
    rows = torch.tensor([7, 2, 0, 5])  # 0: a padding row
    scores = torch.randn(B, Hk, NB)
    nblk = torch.randint(20, NB - 1, (B,))
    state = [level, trend, n_init, p_idx, p_cnt]
    want = [t.clone() for t in state]
    ref.predict_update_rows(*want, theta, rows, scores, nblk, nblk + 1, n_pred, 1, 1)
    got = [t.to(DEV) for t in state]
    ops.predict_update_rows(*got, theta.to(DEV), rows.to(DEV), scores.to(DEV), nblk.to(DEV),
                            (nblk + 1).to(DEV), n_pred, 1, 1)
    for w, o in zip(want, got):
        assert torch.equal(w, o.cpu())  # rounded op by op like the reference
    untouched = [1, 3, 4, 6, 8]
    assert torch.equal(got[0].cpu()[untouched], level[untouched])
    assert not torch.equal(got[0].cpu()[[7, 2, 5]], level[[7, 2, 5]])  # negative control
    # Quest summaries in decode: one launch (no reset pass), the same summaries.
    Hk, D, page = 8, 128, 64
    kmin = torch.randn(20, Hk, D)
    kmax = kmin + 1
    loc = torch.tensor([5 * page, 7 * page + 9, 3 * page + 63])
    pos = torch.tensor([2 * page, 9, page + 63])  # a page's first token, then two others
    k = torch.randn(3, Hk, D).to(torch.bfloat16)
    w_lo, w_hi = kmin.clone(), kmax.clone()
    ref.quest_update(w_lo, w_hi, k, loc, pos, page)
    g_lo, g_hi = kmin.to(DEV), kmax.to(DEV)
    ops.quest_update(g_lo, g_hi, k.to(DEV), loc.to(DEV), pos.to(DEV), page, one_per_page=True)
    # Page 0 is SGLang's padding page: the reference resets it as a sink, no request reads it.
    assert torch.equal(g_lo.cpu()[1:], w_lo[1:]) and torch.equal(g_hi.cpu()[1:], w_hi[1:])
    assert not torch.equal(w_lo[5], kmin[5])


@pytest.mark.parametrize("B,Hk,NB,k", [(1, 8, 2048, 32), (3, 2, 77, 5), (5, 4, 513, 16)])
def test_select_lists_predict_equals_the_reference(B, Hk, NB, k):
    """The top-K's rows and the predictor's step in one launch (``select_lists_predict``: the
    predictor's CTAs beside the top-K's) give the reference's lists, counters, Holt state and
    P(t+1) bit for bit: ties, -inf scores, a dense row, P(t) and P(t+1) in the two halves of
    the pool's double buffer. Control: the top-K alone (``select_lists``) leaves the state and
    P(t+1) as they were."""
    seeded(f"select lists predict {B}x{Hk}x{NB}")
    R, n_pred, sink, local = B + 2, k + k // 2, 1, 1
    n_out, width = k + sink + local + 2, n_pred + sink + local + 3
    scores = torch.randn(B, Hk, NB)
    scores[..., 1::7] = scores[..., :1]  # ties
    scores[0, 0, 2::11] = float("-inf")
    nblk = torch.randint(NB // 2, NB + 1, (B,))
    nblk[-1] = NB
    dense = torch.zeros(B, dtype=torch.bool)
    dense[B // 2] = B > 1  # a dense row where the batch has room for one
    rows = (torch.randperm(R - 1)[:B] + 1).long()  # distinct state rows, not the padding one
    par = torch.randint(0, 2, (B,))
    p_rows, p_next_rows = 2 * rows + par, 2 * rows + 1 - par
    p_idx = torch.full((2 * R, Hk, width), -1, dtype=torch.int32)
    p_cnt = torch.zeros(2 * R, Hk, dtype=torch.int32)
    cur_idx, cur_cnt = random_lists(B, Hk, width, nblk.tolist())
    p_idx[p_rows], p_cnt[p_rows] = cur_idx, cur_cnt
    level, trend = torch.randn(R, Hk, NB), torch.randn(R, Hk, NB) * 0.1
    n_init = torch.randint(0, NB, (R,))
    theta = torch.rand(R, 3) * 0.8 + 0.1
    stats = contracts.new_stats()
    state = [p_idx, p_cnt, level, trend, n_init, stats]
    want_state = [t.clone() for t in state]
    wp, wc, wl, wt, wn, ws = want_state
    want = ref.select_lists_predict(scores, nblk, nblk + 1, wp, wc, p_rows, p_next_rows, wl, wt,
                                    wn, theta, rows, k, n_pred, sink, local, n_out, dense, ws)
    got_state = [t.clone().to(DEV) for t in state]
    gp, gc, gl, gt, gn, gs = got_state
    got = ops.select_lists_predict(scores.to(DEV), nblk.to(DEV), (nblk + 1).to(DEV), gp, gc,
                                   p_rows.to(DEV), p_next_rows.to(DEV), gl, gt, gn,
                                   theta.to(DEV), rows.to(DEV), k, n_pred, sink, local, n_out,
                                   dense.to(DEV), gs)
    for w, g in zip(want, got):
        assert torch.equal(w, g.cpu())
    for name, w, g in zip(("p_idx", "p_cnt", "level", "trend", "n_init", "stats"), want_state,
                          got_state):
        assert torch.equal(w, g.cpu()), name  # rounded op by op like the reference
    assert int(want_state[5][3]) == Hk * int((~dense).sum())
    # Control: the top-K alone writes no state and no P(t + 1).
    alone = [t.clone().to(DEV) for t in state]
    ops.select_lists(scores.to(DEV), nblk.to(DEV), alone[0], alone[1], k, sink, local, n_out,
                     p_rows.to(DEV), dense.to(DEV), alone[5])
    assert not torch.equal(alone[2].cpu(), want_state[2])
    assert not torch.equal(alone[0].cpu()[p_next_rows], want_state[0][p_next_rows])


class DecodeGraph:
    """PRR (two streams, state in place) and serial DSA over one paged KV cache, captured in one
    CUDA graph (``DecodeStep``: Quest, K = ``k`` blocks, |P| = ``n_pred``, one sink and one local
    block, min_context 8 pages + 1; ``fuse_predictor``: ``--prr-predictor fused`` or ``side``; the
    predictor state is ``state``). The batch: the ``batch`` requests in reverse slot order, then
    one padding row (slot 0). ``replay(lens)`` draws new queries from ``g`` and returns
    ``{"prr", "ser"}`` outputs ``[batch + 1, Hq, D]`` (NaN-filled before each replay)."""

    def __init__(self, g, batch, group, page, dtype, hk=2, ctx=None, k=4, n_pred=6,
                 fuse_predictor=True):
        dev, d = torch.device("cuda"), 128
        self.g, self.page, self.hk, self.d, self.dtype, self.k = g, page, hk, d, dtype, k
        self.ctx = ctx or 40 * page + 7
        self.kv = kv = paged_kv(batch, self.ctx + 16, page, hk, d, dtype=dtype, device=dev,
                                generator=g)
        R, nb = batch + 1, kv.table.shape[1]
        mk = lambda serial: DecodeStep("quest", k, n_pred, 1, 1, page,  # noqa: E731
                                       min_context=8 * page + 1, exact=True, serial=serial,
                                       device=dev, fuse_predictor=fuse_predictor)
        prr, serial = mk(False), mk(True)
        self.state = state = new_layer_state(R, hk, nb, n_pred + 2, (0.6, 0.3, 0.5), dev)
        self.rows = torch.cat([kv.rows.flip(0), torch.zeros(1, dtype=torch.long, device=dev)])
        B = batch + 1
        self.qkv = torch.empty(B, (hk * group + 2 * hk) * d, device=dev, dtype=dtype)
        self.q = self.qkv[:, :hk * group * d].view(B, hk * group, d)
        self.seq = torch.full((B,), self.ctx, device=dev, dtype=torch.long)
        self.scale = 1.0 / math.sqrt(d)
        self.outs = {n: torch.empty(B, hk * group, d, device=dev, dtype=dtype)
                     for n in ("prr", "ser")}
        self.stats = torch.zeros(4, dtype=torch.int64, device=dev)

        rows, q, seq, outs, stats, scale = self.rows, self.q, self.seq, self.outs, self.stats, \
            self.scale

        def body():  # closes over the tensors, not over self: no cycle through the graph
            for name, step in (("prr", prr), ("ser", serial)):
                b = step.plan(kv.req_to_token, rows, seq)
                outs[name].copy_(step.run(q, kv.k_buf, kv.v_buf, [kv.kmin, kv.kmax], b,
                                          state if name == "prr" else None,
                                          stats if name == "prr" else None, scale, dtype))

        self.qkv.copy_(torch.randn(self.qkv.shape, generator=g).to(dev) * 3)
        self.graph = capture(body)
        self.stats.zero_()

    def replay(self, lens):
        self.qkv.copy_(torch.randn(self.qkv.shape, generator=self.g).to(self.qkv.device) * 3)
        self.seq.copy_(torch.tensor(lens))
        for o in self.outs.values():
            o.fill_(float("nan"))
        self.graph.replay()
        torch.cuda.synchronize()
        return self.outs


@pytest.mark.parametrize("batch,group,page,dtype", [
    (1, 4, 64, torch.bfloat16), (3, 8, 16, torch.bfloat16), (5, 1, 32, torch.float32)])
def test_decode_step_graph_replay_equals_serial_dsa(batch, group, page, dtype):
    """PRR (two streams, state in place) and serial DSA captured in one CUDA graph each, replayed
    with new queries and lengths: PRR == serial DSA (exact), every step; a short row (below
    min_context) equals dense attention; a padding row (slot 0, length 1) is harmless; the
    statistics count the long rows only."""
    g = torch.Generator().manual_seed(seeded(f"step batch={batch} group={group} page={page} {dtype}"))
    dg = DecodeGraph(g, batch, group, page, dtype)
    kv, rows, q, seq, scale, stats, hk = dg.kv, dg.rows, dg.q, dg.seq, dg.scale, dg.stats, dg.hk
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    steps = 6
    for t in range(steps):
        lens = [dg.ctx + t] * batch + [1]
        if batch > 1:
            lens[-2] = 5 * page + t  # a short row: dense through the sparse kernels
        outs = dg.replay(lens)
        for o in outs.values():
            assert torch.isfinite(o[:batch]).all()
        if dtype == torch.float32:  # float32 KV runs the reference: equal up to fp32 rounding
            assert rel_err(outs["prr"][:batch], outs["ser"][:batch]) < tol, t
        else:  # the kernels: the same bits (same per-block partials, merged in one order)
            assert torch.equal(outs["prr"][:batch], outs["ser"][:batch]), t
        table = ref.block_table(kv.req_to_token, rows[:batch], page)
        want = ops.dsa_decode(q[:batch].float(), kv.k_buf, kv.v_buf, [kv.kmin, kv.kmax], table,
                              seq[:batch], "quest", 4, 1, 1, page, scale)[0]
        dense = ref.dense_attention(q[:batch].float(), kv.k_buf, kv.v_buf, table, seq[:batch],
                                    page, scale)
        long_rows = [i for i in range(batch) if lens[i] > 8 * page]
        assert rel_err(outs["ser"][long_rows], want[long_rows]) < tol
        # Negative control: dense attention differs on the long rows (selection matters).
        assert rel_err(dense[long_rows], want[long_rows]) > 3e-2
        if batch > 1:  # lens[-2]: the last request, batch entry batch - 1
            assert rel_err(outs["ser"][batch - 1], dense[batch - 1]) < tol
    n_long = batch - 1 if batch > 1 else 1
    assert int(stats[3]) == steps * n_long * hk  # host-ok: test readout
    assert int(stats[0]) == steps * n_long * hk * 6  # |A| = K + sink + local
    assert 0 < int(stats[2]) and int(stats[1]) < int(stats[0])  # P and hits were counted


@pytest.mark.parametrize("fuse_predictor", [True, False])
def test_decode_graph_survives_a_later_capture(fuse_predictor):
    """A DecodeGraph replays correctly after the caching allocator is emptied (what the next
    graph's capture does: torch.cuda.graph calls empty_cache) and freed memory is re-handed out
    poisoned: everything the graph reads must be owned by the DecodeGraph."""
    import gc
    g = torch.Generator().manual_seed(seeded(f"keepalive fuse={fuse_predictor}"))
    dg = DecodeGraph(g, 1, 4, 64, torch.bfloat16, fuse_predictor=fuse_predictor)
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    poison_buf = torch.full((min(free // 2, 1 << 30) // 8,), -(1 << 40), dtype=torch.long,
                            device="cuda")  # reused addresses now hold huge row ids
    for t in range(3):
        outs = dg.replay([dg.ctx + t, 1])
        assert torch.equal(outs["prr"][:1], outs["ser"][:1]), t
    del poison_buf


@pytest.mark.parametrize("batch,group,page", [(1, 4, 64), (4, 8, 16)])
def test_side_predictor_equals_fused_in_graphs(batch, group, page):
    """``--prr-predictor side`` (the selection, then the predictor's own launch on the side
    stream) against ``fused`` (the selection's epilogue), both in CUDA graphs on the same KV
    cache and queries: the same output bits (each also serial DSA's) and the same predictor
    state, P(t+1) included, after every step; the state moved (control)."""
    seed = seeded(f"side predictor batch={batch} group={group} page={page}")
    graphs = {f: DecodeGraph(torch.Generator().manual_seed(seed), batch, group, page,
                             torch.bfloat16, fuse_predictor=f) for f in (True, False)}
    start = [t.clone() for t in graphs[True].state]
    for t in range(5):
        lens = [graphs[True].ctx + t] * batch + [1]
        outs = {f: {n: o.clone() for n, o in dg.replay(lens).items()} for f, dg in graphs.items()}
        for f in graphs:
            assert torch.equal(outs[f]["prr"][:batch], outs[f]["ser"][:batch]), (f, t)
        assert torch.equal(outs[True]["prr"][:batch], outs[False]["prr"][:batch]), t
        for name, a, b in zip(type(graphs[True].state)._fields, graphs[True].state,
                              graphs[False].state):
            assert torch.equal(a, b), f"step {t}: {name}"
    assert not torch.equal(graphs[True].state.level, start[2])  # control: the state moved
    assert not torch.equal(graphs[True].state.p_idx, start[0])


def test_state_row_resets_do_not_wait_for_the_device():
    """``PRRState.apply_resets`` (at a prefill that brings new requests) queues its row resets
    without synchronising the host: under torch's sync debug mode ``error`` nothing raises, and
    exactly the new rows are reset. Negative controls: the pageable copy it replaced,
    ``torch.tensor(rows, device=...)``, and the indexed assignment of a Python number it replaced
    (``level[:, rows] = 0.0``) raise in the same mode."""
    from sglang_prr.config import PRRConfig
    from sglang_prr.state import PRRState

    class Pool:  # SGLang's ReqToTokenPool as the state reads it (weakly referenced)
        req_to_token = torch.zeros(7, 200, dtype=torch.int32, device=DEV)

    pool = Pool()
    st = PRRState(PRRConfig(top_k=3, top_k_unit="blocks", block_size=16).validate(), 3, 2, pool,
                  DEV)
    st.apply_resets()  # the first forward resets every row
    st.level.fill_(1.0)
    st.n_init.fill_(5)
    new = random.sample(range(7), 3)
    print(f"new rows {new}")
    st.mark_new(new)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = st.apply_resets()
        with pytest.raises(RuntimeError):
            torch.tensor(new, dtype=torch.long, device=DEV)
        with pytest.raises(RuntimeError):  # a Python number assigned through a device index
            st.level[:, torch.zeros(1, dtype=torch.long, device=DEV)] = 0.0
    finally:
        torch.cuda.set_sync_debug_mode(0)
    kept = [r for r in range(7) if r not in new]
    assert rows == sorted(new)
    assert float(st.level[:, new].abs().sum()) == 0 and int(st.n_init[:, new].sum()) == 0
    assert bool((st.level[:, kept] == 1).all()) and bool((st.n_init[:, kept] == 5).all())
