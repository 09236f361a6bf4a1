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
