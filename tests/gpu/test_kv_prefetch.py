"""The one-pass selection's L2 prefetch of M's K/V rows (``kv_k`` / ``kv_v``; the decode step
passes them with ``SGLANG_PRR_KV_PREFETCH=1``) on the GPU: it changes no output bit (scores, A,
M, the predictor's state and P(t+1)), it runs where asked (the launch counter) and only there,
pools whose rows the bulk prefetch cannot take are skipped, and pools smaller than the table's
pages are read only inside. Skipped with a reason without a CUDA SM90 device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402

require_sm90()

from test_kernels import DEV, seeded  # noqa: E402

from sglang_prr import kernels, ops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kernel_stages as stages  # noqa: E402

PAGE = 16
# (batch, the rows' blocks, the tables' blocks, |P|, K in blocks): rows of 5 and 2 chunks of 64
# blocks, and a row of 3 blocks in one chunk (awkward: the lists are mostly sink and local).
CASES = [(2, 300, 420, 10, 12), (1, 70, 250, 40, 33), (3, 3, 9, 1, 1)]


def _pools(s, dim, slots=None, dtype=torch.bfloat16, seed=0):
    """K and V pools ``[slots, Hk, dim]`` for set s's pages (interleaved in one buffer, as
    SGLang's are not: strided views)."""
    g = torch.Generator().manual_seed(seed)
    n = slots if slots is not None else s["kmin"].shape[0] * PAGE
    kv = torch.randn(n, 2, stages.HK, dim, generator=g).to(DEV, dtype)
    return kv[:, 0], kv[:, 1]


def _run(form, s, k, n_pred, kv):
    """The form's outputs and the set's state after it, on a copy of set s (the pools kv given,
    or none); the launches that prefetched."""
    s = {key: v.clone() for key, v in s.items()}
    kw = {} if kv is None else dict(kv_k=kv[0], kv_v=kv[1], page_size=PAGE)
    n_out = k + 2
    n0 = kernels.select_kv_prefetch_launches()
    if form == "predictor":
        out = ops.quest_select_predict(
            s["q"], s["kmin"], s["kmax"], s["table"], s["nblk"], s["nblk_next"], s["p_idx"],
            s["p_cnt"], s["p_cur"], s["p_nxt"], s["level"], s["trend"], s["n_init"], s["theta"],
            s["rows"], k, n_pred, 1, 1, n_out, **kw)
    else:
        p = (s["p_idx"], s["p_cnt"], s["p_cur"]) if form == "prr" else (None, None, None)
        out = ops.quest_select(s["q"], s["kmin"], s["kmax"], s["table"], s["nblk"], p[0], p[1],
                               k, 1, 1, n_out, p[2], **kw)
    torch.cuda.synchronize()
    got = [x.cpu() for x in out] + [s[key].cpu() for key in ("level", "trend", "n_init",
                                                              "p_idx", "p_cnt")]
    return got, kernels.select_kv_prefetch_launches() - n0


@pytest.mark.parametrize("B,NB,NBt,n_pred,k", CASES)
@pytest.mark.parametrize("form", ["serial", "prr", "predictor"])
def test_the_prefetch_keeps_the_bits(B, NB, NBt, n_pred, k, form):
    g = torch.Generator().manual_seed(seeded(f"kv prefetch {B} {NB} {form}"))
    s = stages.selection_sets(B, NB, 1, n_pred, DEV, g, PAGE, NBt)[0]
    kv = _pools(s, stages.D, seed=NB)
    plain, n_plain = _run(form, s, k, n_pred, None)
    on, n_on = _run(form, s, k, n_pred, kv)
    assert (n_plain, n_on) == (0, 1)  # it ran where asked, and only there
    for i, (x, y) in enumerate(zip(plain, on)):
        assert torch.equal(x, y), f"output {i} changed by the prefetch"
    # Negative control: another query gives other lists.
    other, _ = _run(form, dict(s, q=torch.randn_like(s["q"])), k, n_pred, kv)
    assert not torch.equal(other[1], on[1])


@pytest.mark.parametrize("dim,slots,dtype,runs", [
    (stages.D, 100, torch.bfloat16, 1),   # fewer slots than the pages: only those inside
    (12, None, torch.bfloat16, 0),        # 24-byte rows: not a bulk prefetch's unit, skipped
    (64, None, torch.float32, 1),         # another row width and dtype
])
def test_pools_the_prefetch_cannot_or_need_not_fully_take(dim, slots, dtype, runs):
    g = torch.Generator().manual_seed(seeded(f"kv pools {dim} {slots}"))
    s = stages.selection_sets(2, 130, 1, 8, DEV, g, PAGE, 200)[0]
    kv = _pools(s, dim, slots, dtype)
    plain, _ = _run("prr", s, 9, 8, None)
    on, n_on = _run("prr", s, 9, 8, kv)
    assert n_on == runs
    for i, (x, y) in enumerate(zip(plain, on)):
        assert torch.equal(x, y), f"output {i} changed"


def test_bad_pools_are_named():
    g = torch.Generator().manual_seed(seeded("kv bad pools"))
    s = stages.selection_sets(1, 70, 1, 8, DEV, g, PAGE)[0]
    k_pool, v_pool = _pools(s, stages.D)
    args = (s["q"], s["kmin"], s["kmax"], s["table"], s["nblk"], None, None, 9, 1, 1, 11)
    with pytest.raises(ValueError, match="kv_v"):
        ops.quest_select(*args, kv_k=k_pool, page_size=PAGE)
    with pytest.raises(ValueError, match="kv_k"):
        ops.quest_select(*args, kv_k=k_pool[:, :3], kv_v=v_pool, page_size=PAGE)
    with pytest.raises(ValueError, match="page_size"):
        ops.quest_select(*args, kv_k=k_pool, kv_v=v_pool)
    ops.quest_select(*args, kv_k=k_pool, kv_v=v_pool, page_size=PAGE)  # control: accepted


@pytest.mark.parametrize("serial", [True, False])
def test_the_knob_in_a_captured_decode_step_keeps_the_bits(serial, monkeypatch):
    """SGLANG_PRR_KV_PREFETCH=1 in the decode step as the server captures it (a CUDA graph,
    the length advancing a token a replay): the launches that prefetched are counted at capture,
    and every replay's output and predictor state are the bits of the same step without it."""
    import math
    import random

    from test_methods_conformance import _pool, _summaries

    from sglang_prr import methods
    from sglang_prr.step import DecodeStep, new_layer_state
    from test_kernels import capture

    g = torch.Generator().manual_seed(seeded(f"kv prefetch step serial={serial}"))
    B, hk, group, d, page = 3, 2, 4, 128, 64
    lens = [random.randint(20 * page, 40 * page) for _ in range(B)]
    r2t, rows, k_buf, v_buf = _pool(B, hk, d, page, lens, torch.bfloat16, g)
    summary0 = _summaries(methods.get("quest"), r2t, rows, k_buf, lens, page, DEV)
    r2t, rows, k_buf, v_buf = r2t.to(DEV), rows.to(DEV), k_buf.to(DEV), v_buf.to(DEV)
    qs = [(torch.randn(B, hk * group, d, generator=g) * 3).to(DEV, torch.bfloat16)
          for _ in range(3)]
    runs = []
    for knob in ("0", "1"):
        monkeypatch.setenv("SGLANG_PRR_KV_PREFETCH", knob)
        step = DecodeStep("quest", 4, 6, 1, 1, page, 0, exact=True, serial=serial, device=DEV)
        state = new_layer_state(B + 1, hk, -(-r2t.shape[1] // page), 8, (0.6, 0.3, 0.5), DEV)
        summary = [t.clone() for t in summary0]
        q, out = torch.empty_like(qs[0]), torch.empty_like(qs[0])
        seq = torch.tensor(lens, device=DEV) + 1

        def body():
            b = step.plan(r2t, rows, seq)
            out.copy_(step.run(q, k_buf, v_buf, summary, b, None if serial else state, None,
                               1.0 / math.sqrt(d), q.dtype))

        q.copy_(qs[0])
        n0 = kernels.select_kv_prefetch_launches()
        graph = capture(body)
        got = [kernels.select_kv_prefetch_launches() - n0]
        for t, x in enumerate(qs):
            seq.copy_(torch.tensor(lens, device=DEV) + 1 + t)
            q.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            got.append(out.clone())
        got.append(state.p_idx.clone())
        runs.append(got)
    assert runs[0][0] == 0 and runs[1][0] >= 1, (runs[0][0], runs[1][0])
    for i, (x, y) in enumerate(zip(runs[0][1:], runs[1][1:])):
        assert torch.equal(x, y), f"replay {i}: the prefetch changed a bit"
    assert not torch.equal(runs[1][1], runs[1][2])  # control: the replays differ
