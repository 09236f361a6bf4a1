"""The two-stream PRR step on the GPU: equal to serial DSA, inside a captured CUDA graph replayed
with new queries and lengths (the side stream is forked and joined within the capture)."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from sglang_prr import ops  # noqa: E402
from sglang_prr.pipeline import PRRStep  # noqa: E402
from sglang_prr.synthetic import paged_kv  # noqa: E402
from test_kernels import capture  # noqa: E402


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("batch,group,page", [(1, 4, 64), (3, 8, 16), (17, 1, 32)])
def test_prr_step_graph_replay_equals_serial_dsa(batch, group, page):
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    hk, d, ctx = 2, 128, 40 * page + 7
    kv = paged_kv(batch, ctx + 16, page, hk, d, dtype=torch.bfloat16, device=dev, generator=g)
    k_buf, v_buf, table, kmin, kmax = kv.k_buf, kv.v_buf, kv.table, kv.kmin, kv.kmax
    nb, k, n_pred = table.shape[1], 4, 6
    level = torch.zeros(batch, hk, nb, device=dev)
    trend, n_init = torch.zeros_like(level), torch.zeros(batch, dtype=torch.long, device=dev)
    theta = torch.tensor([[0.6, 0.3, 0.5]] * batch, device=dev)
    p_idx = torch.full((batch, hk, n_pred + 2), -1, dtype=torch.int32, device=dev)
    p_cnt = torch.zeros(batch, hk, dtype=torch.int32, device=dev)
    q = torch.empty(batch, hk * group, d, device=dev, dtype=torch.bfloat16)
    seq = torch.full((batch,), ctx, device=dev, dtype=torch.long)
    scale = 1.0 / math.sqrt(d)
    step = PRRStep(dev)
    out = torch.empty(batch, hk * group, d, device=dev)

    def body():
        out.copy_(step.run(q, k_buf, v_buf, [kmin, kmax], table, seq, p_idx, p_cnt, level, trend,
                           n_init, theta, "quest", k, n_pred, 1, 1, page, scale)[0])

    q.copy_(torch.randn(q.shape, generator=g).to(dev) * 3)
    graph = capture(body)
    for t in range(6):
        q.copy_(torch.randn(q.shape, generator=g).to(dev) * 3)
        seq.copy_(torch.full((batch,), ctx + t, dtype=torch.long))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = ops.dsa_decode(q, k_buf, v_buf, [kmin, kmax], table, seq, "quest", k, 1, 1, page,
                              scale)[0]
        assert torch.isfinite(out).all()
        assert _rel(out, want) < 1e-5, t
        # Negative control: dense attention differs (the selection matters on these inputs).
        dense = ops.dsa_decode(q, k_buf, v_buf, [kmin, kmax], table, seq, "quest", nb, 1, 1,
                               page, scale)[0]
        assert _rel(dense, want) > 1e-3
    assert int(p_cnt.min()) > 0  # host-ok: test readout
