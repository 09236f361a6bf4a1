"""``step.DecodeStep`` on CPU over several decode steps, the state in the request pool as the server
holds it: PRR (exact) == serial DSA with a fresh query every step, the Holt state updated in place
at the batch's slots and P(t+1) written into the other half of P's double buffer (and nowhere
else), with negative controls: DSA != dense, PRR without repair != serial DSA.

The budget per batch size is in ``test_budget.py``; the backend end to end in
``tests/integration/test_backend_inproc.py``; two streams in CUDA graphs in
``tests/gpu/test_decode_step.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from paged import make_paged, rel_err
from sglang_prr import ops
from sglang_prr import reference as ref
from sglang_prr.step import DecodeStep, LayerState

PAGE, K, N_PRED, SINK, LOCAL = 16, 2, 3, 1, 1
# Query change per step, relative to each request's direction: P(t) hits part of A and misses
# part (checked below), so both the reuse and the repair matter.
DRIFT = 1.0
WIDTH = N_PRED + SINK + LOCAL + 3  # the pool's P is wider than this step's |P| (a larger budget)


def _garbage_state(R, hk, nb, g):
    """Pool-wide state with recognisable values in every row (rows outside a batch must keep
    them): P = 7 in both halves of its double buffer, random history and theta."""
    return LayerState(torch.full((2 * R, hk, WIDTH), 7, dtype=torch.int32),
                      torch.full((2 * R, hk), 1, dtype=torch.int32),
                      torch.randn(R, hk, nb, generator=g),
                      torch.randn(R, hk, nb, generator=g) * 0.1,
                      torch.randint(1, nb, (R,), generator=g),
                      torch.rand(R, 3, generator=g) * 0.6 + 0.2)


def _same(got, want, msg):
    """Bit for bit; NaN == NaN (InfLLM-v2's -inf scores of blocks without a complete compressed
    key make NaN trends)."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=msg)


def _clone(st):
    return LayerState(*(t.clone() for t in st))


@pytest.mark.parametrize("method,fuse", [("quest", True), ("quest", False), ("infllm_v2", True)])
def test_prr_exact_equals_serial_dsa_and_writes_p_in_place(method, fuse, monkeypatch):
    """``fuse``: ``--prr-predictor fused`` (Quest: the selection's epilogue) or ``side`` (its own
    op after the selection); the path not taken raises, so each case runs the one it names."""
    if method == "quest":
        from sglang_prr.methods.quest import Quest

        def taken_instead(*a, **k):
            raise AssertionError(f"--prr-predictor {'fused' if fuse else 'side'} ran the other path")
        if fuse:
            monkeypatch.setattr("sglang_prr.step.ops.predict_update_rows", taken_instead)
        else:
            monkeypatch.setattr(Quest, "select_predict", taken_instead)
    seed = random.randrange(1 << 30)
    print("seed", seed)
    lens = [200, 97, 150, 181]  # not multiples of the page
    P = make_paged(seed, lens, hk=2, group=4, page=PAGE)
    g = torch.Generator().manual_seed(seed + 1)
    # Summaries over each request's whole length, past the tokens the steps below reach.
    summary = list(P.quest_summary()) if method == "quest" else [P.infllm_summary()]
    R, hk, nb = P.req_to_token.shape[0], 2, -(-P.req_to_token.shape[1] // PAGE)

    def mk(serial, skip_repair=False):
        return DecodeStep(method, K, N_PRED, SINK, LOCAL, PAGE, 0, exact=True, serial=serial,
                          device=torch.device("cpu"), skip_repair=skip_repair,
                          fuse_predictor=fuse)

    prr, serial, norep = mk(False), mk(True), mk(False, skip_repair=True)
    st = _garbage_state(R, hk, nb, g)
    # The requests start with no history (as a fresh slot after prefill without calibration).
    both = torch.cat([2 * P.rows, 2 * P.rows + 1])
    st.p_idx[both], st.p_cnt[both], st.n_init[P.rows] = -1, 0, 0
    st.level[P.rows], st.trend[P.rows] = 0.0, 0.0
    n_done = [0] * len(lens)  # tokens decoded per request
    wrote = torch.full((R,), -1, dtype=torch.long)  # the row of P each request's last step wrote
    q0 = torch.randn(len(lens), 8, 16, generator=g)
    repaired = middle_hits = 0
    # Batches: every request out of slot order, then a subset (the others must stay untouched).
    for t, batch in enumerate([[2, 0, 3, 1], [3, 1, 0, 2], [1, 3], [0, 2, 1, 3], [2, 3, 0, 1],
                               [3, 0, 1, 2]]):
        b_ids = torch.tensor(batch)
        rows = P.rows[b_ids]
        seq = torch.tensor([lens[i] - 12 + n_done[i] for i in batch])
        for i in batch:
            n_done[i] += 1
        # A fresh query every step, drifting around each request's own direction; scaled up so
        # attention is peaked and the choice of blocks changes the output. At step 3 every
        # request turns to a new direction, so P(t), predicted from the old one, mostly misses
        # there (in ~1% of the seeds it still covers A), and the batch's first request has its
        # P(t) emptied: M = A there, so the repair's negative control is never vacuous.
        if t == 3:
            q0 = torch.randn(len(lens), 8, 16, generator=g)
            p0 = 2 * P.rows[batch[0]] + int(seq[0]) % 2  # P(t)'s row: the length's parity
            st.p_idx[p0], st.p_cnt[p0] = -1, 0
        q = (q0[b_ids] + DRIFT * torch.randn(len(batch), 8, 16, generator=g)) * 3
        before = _clone(st)
        b = prr.plan(P.req_to_token, rows, seq)
        # P(t) is the half of the pair the previous step of each request wrote (its length's
        # parity); P(t + 1) goes to the other half, which the next step reads.
        assert torch.equal(b.p_cur, 2 * rows + seq % 2)
        assert torch.equal(b.p_nxt, 2 * rows + (seq + 1) % 2)
        if t > 0:
            assert torch.equal(b.p_cur, wrote[rows]), "P(t) is last step's P(t+1)"
        wrote[rows] = b.p_nxt
        stats = torch.zeros(4, dtype=torch.int64)
        o = prr.run(q, P.k_buf, P.v_buf, summary, b, st, stats, P.sm_scale, torch.float32)
        want = serial.run(q, P.k_buf, P.v_buf, summary, serial.plan(P.req_to_token, rows, seq),
                          None, None, P.sm_scale, torch.float32)
        msg = f"seed {seed}, step {t}"
        assert torch.isfinite(o).all(), msg
        assert rel_err(o, want) < 1e-5, msg
        # Serial DSA is the reference composition, and the selection matters on these inputs.
        table = ref.block_table(P.req_to_token, rows, PAGE)
        dsa = ops.dsa_decode(q, P.k_buf, P.v_buf, summary, table, seq, method, K, SINK, LOCAL,
                             PAGE, P.sm_scale)[0]
        assert rel_err(want, dsa) < 1e-5, msg
        dense = ref.dense_attention(q, P.k_buf, P.v_buf, table, seq, PAGE, P.sm_scale)
        assert rel_err(dense, dsa) > 1e-2, msg  # negative control
        # P(t+1) and the Holt state, in place at the batch's slots: what the predictor writes
        # from the state before the step and this step's scores.
        expect = _clone(before)
        scores = ops.select_blocks(method, q, summary, b.table, seq, PAGE, P.sm_scale).float()
        ref.predict_update_rows(expect.level, expect.trend, expect.n_init, expect.p_idx,
                                expect.p_cnt, expect.theta, rows, scores, b.nblk, b.nblk_next,
                                N_PRED, SINK, LOCAL, p_rows=b.p_nxt)
        for name, got, exp in zip(LayerState._fields, st, expect):
            _same(got, exp, f"{msg}: {name}")
        out = torch.ones(R, dtype=torch.bool)
        out[rows] = False
        out_p = torch.ones(2 * R, dtype=torch.bool)
        out_p[b.p_nxt] = False  # P(t) (at p_cur) is read, never written
        for name, got, old in zip(LayerState._fields, st, before):
            mask = out_p if name in ("p_idx", "p_cnt") else out
            _same(got[mask], old[mask], f"{msg}: {name} changed outside the batch")
        assert not torch.equal(st.level[rows], before.level[rows]), msg  # control: it did update
        n_p = N_PRED + SINK + LOCAL  # P(t+1): non-empty, at most |P| + kept, -1 padded
        assert 0 < int(st.p_cnt[b.p_nxt].min()) and int(st.p_cnt[b.p_nxt].max()) <= n_p, msg
        assert (st.p_idx[b.p_nxt][..., n_p:] == -1).all(), msg
        # Negative control on the same state: without the repair over M = A \ P(t), PRR differs
        # from serial DSA whenever P(t) missed a block of A.
        if t > 0 and int(stats[1]) > 0:
            st_n = _clone(before)
            o_n = norep.run(q, P.k_buf, P.v_buf, summary,
                            norep.plan(P.req_to_token, rows, seq),
                            st_n, None, P.sm_scale, torch.float32)
            assert not (rel_err(o_n, want) < 1e-3), msg
            repaired += 1
        # Hits beyond the kept blocks (always in P and A): the reuse of P(t)'s partials mattered.
        middle_hits += int(stats[0] - stats[1]) > (SINK + LOCAL) * int(stats[3])
    assert repaired >= 1, f"seed {seed}: the repair's negative control never ran"
    assert middle_hits >= 2, f"seed {seed}: P(t) (almost) never hit a middle block of A"


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The names of the aten ops dispatched inside the mode, in order (views included)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("budget", [None, lambda b: 0])
def test_a_speculating_plan_launches_what_a_serial_one_does(budget):
    """P's double buffer is addressed by the length's parity, so PRR's per-forward plan is the
    same ops as serial DSA's (on the GPU: the same launches; PRR's extra launches are per layer
    only); so is a plan whose budget gives |P| = 0 (serial DSA this forward). Control: the
    count sees the plan's ops (the block table's divide, the parity's bitwise and)."""
    R, ctx = 6, 512
    r2t = torch.randperm(R * ctx).to(torch.int32).reshape(R, ctx)
    rows, seq = torch.tensor([4, 1, 3]), torch.tensor([300, 77, 511])
    counts = {}
    for serial in (True, False):
        step = DecodeStep("quest", K, N_PRED, SINK, LOCAL, PAGE, 0, exact=True, serial=serial,
                          device=torch.device("cpu"), budget=None if serial else budget)
        with _CountOps() as c:
            b = step.plan(r2t, rows, seq)
        counts[serial] = c.ops
        assert b.n_pred == (0 if serial or budget is not None else N_PRED)
        assert torch.equal(b.p_cur, 2 * rows + seq % 2) and torch.equal(b.p_nxt, b.p_cur ^ 1)
    assert counts[False] == counts[True], (counts[False], counts[True])
    assert "div_" in counts[True] and "bitwise_and" in counts[False]  # control
