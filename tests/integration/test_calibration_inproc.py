"""The backend's prefill calibration (``calibration.Calibrator``) driven in-process, as in
test_backend_inproc: its grid search gives bit for bit what the reference grid search
(``reference.calibrate``) gives in its place (theta*, the accumulated objective, the replayed
state, P and the decode outputs), over a chunked prefill of a batch; its plan samples the queries
and reads the block table the reference way, and only for requests that will decode sparse.
Negative controls: the objective read in reverse candidate order changes theta*; a long request
beside the short ones calibrates."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("sglang")

from test_backend_inproc import PAGE, World, _backends, _forward, _seeded_prr  # noqa: E402

from sglang_prr import calibration as cal  # noqa: E402
from sglang_prr import reference as ref  # noqa: E402
from sglang_prr.config import PRRConfig  # noqa: E402


def _reference_grid(scores, nblk, k, n_pred, sink, local, alphas, betas, gammas):
    """``reference.calibrate`` over the product grid, alpha-major (what the backend ran before)."""
    A, B, G = alphas.numel(), betas.numel(), gammas.numel()
    cols = [x.view(*s).expand(A, B, G).reshape(-1) for x, s in
            ((alphas, (A, 1, 1)), (betas, (1, B, 1)), (gammas, (1, 1, G)))]
    return ref.calibrate(scores, nblk, k, n_pred, sink, local, *cols)


_GRID = cal.grid_hit_rates  # the product's, kept from the monkeypatching below


def _reversed_grid(*args):
    """The product's objective read in reverse candidate order (no candidate maps to itself)."""
    return _GRID(*args).flip(-1)


def _run(method, grid_fn, seed, monkeypatch):
    monkeypatch.setattr(cal, "grid_hit_rates", grid_fn)
    # Sizes where the objective tells the candidates apart for both methods (checked below).
    cfg = PRRConfig(method=method, block_size=PAGE, top_k=2, top_k_unit="blocks", min_context=40,
                    calib_queries=16).validate()
    w = World(2, 4, 2, cfg, seed)
    b = _backends(w, {"prr": cfg})["prr"]
    rows = [1, 2, 3]
    outs = []
    for new in ([200, 150, 250], [100, 60, 30], [1, 1, 1], [1, 1, 1]):
        fb, q, k, v = w.batch(rows, new)
        outs.append(_forward(b, w, fb, q, k, v))
    monkeypatch.undo()
    return b, torch.cat([o.flatten() for o in outs])


@pytest.mark.parametrize("method", ["quest", "infllm_v2"])
def test_backend_calibration_is_bitwise_the_reference_grid_search(method, monkeypatch):
    seed = random.randrange(1 << 30)
    print(f"seed={seed} method={method}")
    fast, o_fast = _run(method, _GRID, seed, monkeypatch)
    slow, o_slow = _run(method, _reference_grid, seed, monkeypatch)
    a, b = fast.state, slow.state
    assert float(a.h_cnt[:, 1:4].min()) > 0, "every request was calibrated"
    h = a.h_sum[:, 1:4]
    assert float((h.amax(-1) - h.amin(-1)).min()) > 0, "the objective tells candidates apart"
    for name in ("h_sum", "h_cnt", "theta", "level", "trend", "n_init", "p_cnt"):
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), name
    assert torch.equal(a.p_idx[:, 2:8], b.p_idx[:, 2:8])  # rows 1-3: both halves of P
    assert torch.equal(o_fast, o_slow)
    assert fast.stats.snapshot()["theta_chosen"] == slow.stats.snapshot()["theta_chosen"]
    assert sum(fast.stats.theta_counts.values()) > 0
    # Negative control: the same objective read in the wrong candidate order moves theta*.
    wrong, _ = _run(method, _reversed_grid, seed, monkeypatch)
    assert not torch.equal(wrong.state.theta[:, 1:4], a.theta[:, 1:4]), f"seed {seed}"


def test_plan_samples_the_chunk_and_reads_the_table_the_reference_way():
    """Offsets spaced evenly over each chunk (its first and last token included), distinct
    without ``unique``; the table is the request's pages for the blocks the chunk can see."""
    cfg = PRRConfig(block_size=PAGE, top_k=2, top_k_unit="blocks", min_context=0,
                    calib_queries=8).validate()
    w = World(1, 4, 2, cfg, 0)
    b = _backends(w, {"prr": cfg})["prr"]
    fb, *_ = w.batch([1, 2], [9, 70])  # 9 new tokens: phi = 8 < 9, the offsets are 1-2 apart
    fb2, *_ = w.batch([2, 1], [33, 5])
    for batch in (fb, fb2):
        plan = b.calibrator.plan(w.req.req_to_token, batch.req_pool_indices,
                                 batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu)
        start = 0
        for r, row, n_new, n_pre in zip(plan.reqs, batch.req_pool_indices.tolist(),
                                        batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu):
            phi = min(8, n_new)
            want = torch.linspace(0, n_new - 1, phi).round().long().unique()
            assert torch.equal(r.offs, want) and r.s0 == start and r.row == row
            assert r.offs[0] == 0 and r.offs[-1] == n_new - 1
            assert torch.equal(r.seq, n_pre + want + 1)
            table = ref.block_table(w.req.req_to_token, torch.full_like(want, row), PAGE)
            assert torch.equal(r.table, table[:, :r.nb_used])
            assert r.nb_used == -(-(n_pre + n_new) // PAGE) and r.total == n_pre + n_new
            start += n_new


def test_a_request_that_cannot_calibrate_starts_from_the_last_theta_star():
    """A request with one new token (a radix-cache hit but for its last token) samples a single
    query, which calibrates nothing: it takes the theta* last chosen per layer, not the default.
    Negative control: the default differs from that theta* in some layer."""
    for _ in range(4):  # theta* is the default in every layer for ~0.7% of the seeds: redraw
        seed, w, b = _seeded_prr(3, 16)
        st = b.state
        fb, q, k, v = w.batch([1, 2], [200, 150])
        _forward(b, w, fb, q, k, v)
        chosen = st.theta[:, 2].clone()  # the last calibrated request of the batch
        assert torch.equal(st.shared_theta, chosen)
        if not torch.equal(chosen, st.default_theta.expand_as(chosen)):
            break
    else:
        pytest.skip(f"theta* happened to be the default in every layer (4 seeds, last {seed})")
    b.state.mark_new([3])
    fb, q, k, v = w.batch([3], [1])
    _forward(b, w, fb, q, k, v)
    assert float(st.h_cnt[:, 3].max()) == 0, "one sampled query calibrates nothing"
    assert torch.equal(st.theta[:, 3], chosen)
    assert not torch.equal(st.theta[:, 3], st.default_theta.expand_as(chosen))


def test_only_requests_that_will_decode_sparse_calibrate():
    """Requests shorter than min_context decode over every block, so their calibration would be
    prefill work for nothing: they calibrate nothing, counted by ``Stats.calibrations`` (what
    ``/prr/stats`` reports) and by the objective's sample counts. Negative controls: a request
    of min_context tokens in the same kind of batch calibrates every layer, and a long prompt's
    chunked prefill calibrates from the first chunk that reaches min_context."""
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    L = 3
    cfg = PRRConfig(block_size=PAGE, top_k=2, top_k_unit="blocks", min_context=100,
                    calib_queries=8).validate()
    w = World(L, 4, 2, cfg, seed)
    b = _backends(w, {"prr": cfg})["prr"]
    st = b.state
    calibrations = lambda: b.stats.snapshot()["calibrations"]
    for rows, new in (([1, 2], [40, 99]), ([1, 2], [1, 1]), ([1, 2], [1, 1])):
        fb, q, k, v = w.batch(rows, new)  # 99 + 1 decoded: decode never calibrates
        _forward(b, w, fb, q, k, v)
    assert calibrations() == 0 and float(st.h_cnt.abs().sum()) == 0
    assert b.stats.extend_batches == 1  # the prefill did run through the backend
    fb, q, k, v = w.batch([3, 4], [100, 30])  # row 3: exactly min_context, it decodes sparse
    _forward(b, w, fb, q, k, v)
    assert calibrations() == L
    assert float(st.h_cnt[:, 3].min()) > 0 and float(st.h_cnt[:, 4].abs().sum()) == 0
    for n_new, want in ((64, L), (64, 2 * L)):  # row 5: 64 tokens (short), then 128 (long)
        fb, q, k, v = w.batch([5], [n_new])
        _forward(b, w, fb, q, k, v)
        assert calibrations() == want, (n_new, calibrations())
    assert float(st.h_cnt[:, 5].min()) > 0
