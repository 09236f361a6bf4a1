"""SM90 kernels against the pure-torch reference (the oracle), on the GPU.

Each test draws fresh random inputs (the seed is printed), runs the CUDA op from
``torch.ops.sglang_prr_cuda`` directly (so no silent fallback can hide a kernel), and compares with
``sglang_prr.reference`` run on the CPU in float32 from the same inputs. Outputs the op allocates
are poisoned by first filling the caching allocator's blocks with NaN. Every equality has a
negative control beside it. Skipped with a reason without a CUDA SM90 device.
"""

from __future__ import annotations

import gc
import math
import os
import random

import pytest
import torch

from sglang_prr import reference as ref

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402  (the SM90 gate, tests/gpu/sm90.py)

require_sm90()

from sglang_prr import kernels, ops  # noqa: E402

DEV = torch.device("cuda")


def seeded(tag: str) -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[{tag}] seed={seed}")
    random.seed(seed)
    torch.manual_seed(seed)
    return seed


def set_select_path(monkeypatch, param: str) -> None:
    """The selection path a test parameter names, ``kernel[-knob]``: ``kernel`` is ``auto`` (the
    launcher's shape rule) or the path SGLANG_PRR_SELECT_KERNEL forces (``onepass``, ``rowtail``,
    ``split``); ``grid<v>`` sets SGLANG_PRR_SELECT_GRID=v (``rows``: every grid about two waves,
    its CTAs looping over a row's chunks; ``table``: the table's width; N: at most N CTAs a
    row); ``scan`` sets SGLANG_PRR_TOPK=scan (the rows' lists by CTA scans, not warp walks)."""
    for k in ("SGLANG_PRR_SELECT_KERNEL", "SGLANG_PRR_SELECT_GRID", "SGLANG_PRR_TOPK"):
        monkeypatch.delenv(k, raising=False)
    kernel, _, knob = param.partition("-")
    if kernel != "auto":
        monkeypatch.setenv("SGLANG_PRR_SELECT_KERNEL", kernel)
    if knob.startswith("grid"):
        monkeypatch.setenv("SGLANG_PRR_SELECT_GRID", knob[4:])
    if knob == "scan":
        monkeypatch.setenv("SGLANG_PRR_TOPK", "scan")


def poison(*shapes_dtypes) -> None:
    """Fill allocator blocks of these sizes with NaN / -1 and free them, so that outputs the op
    allocates next start as garbage rather than zeros."""
    keep = []
    for shape, dtype in shapes_dtypes:
        t = torch.empty(shape, dtype=dtype, device=DEV)
        t.fill_(float("nan") if dtype.is_floating_point else -7)
        keep.append(t)
    del keep


def capture(body) -> torch.cuda.CUDAGraph:
    """Run ``body`` once eagerly on a side stream (kernel load, allocator), then capture it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    # A graph kept alive by a reference cycle (an earlier graph's body closing over its owner)
    # must not be collected mid-capture: destroying a graph while a stream captures invalidates
    # the capture. Collect such garbage now, and let no collection run during the capture.
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            body()
    finally:
        gc.enable()
    # The graph holds raw pointers to every tensor it touches, some allocated eagerly in the
    # warm-up above (e.g. a DecodeStep's own P parity): keep what body closes over alive with
    # the graph, or the caching allocator frees it (and the next capture's empty_cache unmaps it).
    graph.keepalive = body
    return graph


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double().cpu()
    b = b.double().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()  # host-ok: test


# ----------------------------------------------------------------------------- paged pool helpers
def make_pool(B, Hk, D, page_size, seq_lens, dtype, extra_pages=3, table64=True):
    nblk = [(s + page_size - 1) // page_size for s in seq_lens]
    NB = max(nblk) + 2  # table wider than any request
    total = sum(nblk) + extra_pages
    perm = (torch.randperm(total) + 1).tolist()  # page 0 is never owned
    table = torch.zeros(B, NB, dtype=torch.int64)
    it = iter(perm)
    for b in range(B):
        for j in range(nblk[b]):
            table[b, j] = next(it)
        for j in range(nblk[b], NB):  # garbage past the request: must never be read as valid
            table[b, j] = random.randrange(total + 1)
    num_slots = (total + 1) * page_size
    k_buf = (torch.randn(num_slots, Hk, D) * 1.5).to(dtype)
    v_buf = torch.randn(num_slots, Hk, D).to(dtype)
    if not table64:
        table = table.to(torch.int32)
    return k_buf, v_buf, table, torch.tensor(seq_lens, dtype=torch.int64), NB


def random_lists(B, Hk, N, nblk, fill=None):
    """Ascending -1-padded lists of distinct block ids < nblk[b], counts <= N."""
    idx = torch.full((B, Hk, N), -1, dtype=torch.int32)
    cnt = torch.zeros(B, Hk, dtype=torch.int32)
    for b in range(B):
        for h in range(Hk):
            c = min(N, nblk[b]) if fill == "full" else random.randint(0, min(N, nblk[b]))
            ids = sorted(random.sample(range(nblk[b]), c))
            idx[b, h, :c] = torch.tensor(ids, dtype=torch.int32)
            cnt[b, h] = c
    return idx, cnt


ATTN_CASES = [
    # B, Hq, Hk, D, page, dtype, seq_lens rule
    (1, 32, 8, 128, 64, torch.bfloat16),
    (3, 8, 8, 128, 16, torch.bfloat16),    # GQA 1
    (17, 32, 8, 128, 32, torch.float16),   # GQA 4
    (3, 64, 8, 128, 128, torch.bfloat16),  # GQA 8
    (1, 8, 1, 128, 16, torch.float32),     # GQA 8, fp32 KV
    (3, 16, 4, 64, 64, torch.bfloat16),    # head dim 64
    (3, 8, 2, 256, 32, torch.float16),     # head dim 256
    (2, 12, 4, 128, 256, torch.bfloat16),  # block 256 (benchmark range), GQA 3
    (3, 16, 8, 64, 16, torch.float16),     # GQA 2, head dim 64, small pages
]


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype", ATTN_CASES)
def test_sparse_attn_partials(B, Hq, Hk, D, page, dtype):
    seeded(f"attn B={B} Hq={Hq} Hk={Hk} D={D} page={page} {dtype}")
    seq_lens = [random.randint(1, 9 * page) + random.randint(0, page - 1) for _ in range(B)]
    seq_lens[0] = max(seq_lens[0], 3 * page + page // 2 + 1)  # a partial last block
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq_lens, dtype,
                                            table64=(B % 2 == 1))
    nblk = [(s + page - 1) // page for s in seq_lens]
    N = max(nblk) + 3  # K larger than the blocks available: padding entries
    idx, cnt = random_lists(B, Hk, N, nblk)
    cnt[0, 0] = min(N, nblk[0])
    idx[0, 0, :cnt[0, 0]] = torch.arange(cnt[0, 0], dtype=torch.int32)
    # q in float32 for one case of each KV dtype (the kernel splits it into 16-bit parts).
    q = torch.randn(B, Hq, D).to(torch.float32 if B == 17 or dtype == torch.float32 else dtype)
    sm = 1.0 / math.sqrt(D)
    o_ref, lse_ref = ref.sparse_attn_partials(q, k_buf, v_buf, table, sl, idx, cnt, page, sm)
    poison(((B, Hq, N, D), torch.float32), ((B, Hq, N), torch.float32))
    dev_args = (q.to(DEV), k_buf.to(DEV), v_buf.to(DEV), table.to(DEV), sl.to(DEV), idx.to(DEV),
                cnt.to(DEV), page, sm)
    if dtype == torch.float32:
        # The kernel's MMAs are 16-bit: float32 KV is refused with a message, and the public op
        # runs the reference for it.
        with pytest.raises(RuntimeError, match="float16 or bfloat16 KV"):
            torch.ops.sglang_prr_cuda.sparse_attn_partials(*dev_args)
        o, lse = ops.sparse_attn_partials(*dev_args)
    else:
        o, lse = torch.ops.sglang_prr_cuda.sparse_attn_partials(*dev_args)
    o, lse = o.cpu(), lse.cpu()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "unwritten output"
    pad = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse), pad), "padding / masked entries differ"
    assert (o[pad.unsqueeze(-1).expand_as(o)] == 0).all(), "padding o must be 0"
    e_o, e_l = rel_err(o, o_ref), rel_err(lse[~pad], lse_ref[~pad])
    print(f"rel err o={e_o:.2e} lse={e_l:.2e}")
    assert e_o < 2e-5 and e_l < 2e-5
    # Negative control: the same comparison against a changed key must fail. One key of a listed
    # block turned towards query head 0 (logit ~ 4 sqrt(D)), so the partial it feeds must move (a
    # random shift of the key could leave its logit near where it was).
    k2 = k_buf.clone()
    k2[table[0, idx[0, 0, 0]] * page, 0] = (4 * q[0, 0].float()).to(k2.dtype)
    o_bad, _ = ref.sparse_attn_partials(q, k2, v_buf, table, sl, idx, cnt, page, sm)
    G = Hq // Hk
    assert rel_err(o[0, :G, 0], o_bad[0, :G, 0]) > 1e-3, \
        "negative control: a changed key must change the output"


def test_sparse_attn_through_ops_and_strided_kv():
    """ops.* dispatches to the kernel for CUDA tensors; KV as a strided view of a fused buffer."""
    seeded("attn ops")
    B, Hq, Hk, D, page = 3, 32, 8, 128, 32
    seq_lens = [1000, 77, 513]
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq_lens, torch.bfloat16)
    kv = torch.stack([k_buf, v_buf], 1).to(DEV)  # [slots, 2, Hk, D]: k/v are strided views
    kd, vd = kv[:, 0], kv[:, 1]
    nblk = [(s + page - 1) // page for s in seq_lens]
    idx, cnt = random_lists(B, Hk, 20, nblk)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    o, lse = ops.attend_set(q.to(DEV), kd, vd, table.to(DEV), sl.to(DEV), idx.to(DEV),
                            cnt.to(DEV), page, 0.088)
    o_ref, lse_ref = ref.attend_set(q, k_buf, v_buf, table, sl, idx, cnt, page, 0.088)
    assert rel_err(o, o_ref) < 2e-5
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert rel_err(lse.cpu()[fin], lse_ref[fin]) < 2e-5


# ----------------------------------------------------------------------------- selection
# The streamed kernel's shapes: Llama-3-8B's (8 KV heads, four piece groups), G = 8, SmolLM2's
# (3 KV heads of 64 dims: one piece group, 24 of its lanes), one head of 256 dims; "cap" caps a
# request's CTAs (SGLANG_PRR_SELECT_GRID) so that each warp streams hundreds of blocks (the ring
# wraps, the pages come in many batches of 32). Float32 summaries of 256 dims take the warp kernel.
# q in each dtype: its loads go out together, in raw form, then convert (G = 8: two batches).
@pytest.mark.parametrize("B,Hq,Hk,D,NB,sdt,cap,qdt", [
    (1, 32, 8, 128, 2048, "f32", "", torch.bfloat16), (3, 8, 8, 64, 77, "f32", "", torch.float16),
    (17, 32, 4, 128, 300, "f32", "", torch.float32),
    (8, 32, 8, 128, 2051, "bf16", "", torch.bfloat16),
    (5, 64, 8, 128, 700, "bf16", "1", torch.float32),
    (2, 9, 3, 64, 1000, "bf16", "2", torch.float16),
    (3, 16, 2, 256, 333, "bf16", "", torch.bfloat16),
    (2, 8, 2, 256, 90, "f32", "", torch.float32)])
@pytest.mark.parametrize("scores_kernel", ["stream", "warp"])
def test_quest_scores(B, Hq, Hk, D, NB, sdt, cap, qdt, scores_kernel, monkeypatch):
    seeded(f"quest_scores B={B} NB={NB} {sdt} cap={cap} {qdt} {scores_kernel}")
    monkeypatch.delenv("SGLANG_PRR_SELECT_GRID", raising=False)
    if cap:
        monkeypatch.setenv("SGLANG_PRR_SELECT_GRID", cap)
    monkeypatch.setenv("SGLANG_PRR_SCORES_KERNEL", scores_kernel)
    P = NB * B + 5
    kmin = torch.randn(P, Hk, D)
    kmax = kmin + torch.rand(P, Hk, D)
    if sdt == "bf16":
        kmin, kmax = ref.round_bf16(kmin, down=True), ref.round_bf16(kmax, down=False)
    table = torch.randint(1, P, (B, NB))
    nblk = torch.randint(1, NB + 1, (B,))
    nblk[0] = NB
    q = torch.randn(B, Hq, D).to(qdt)
    s_ref = ref.quest_scores(q, kmin, kmax, table, nblk)
    poison(((B, Hk, NB), torch.float32))
    n0 = kernels.scores_stream_launches()
    s = torch.ops.sglang_prr_cuda.quest_scores(q.to(DEV), kmin.to(DEV), kmax.to(DEV),
                                               table.to(DEV), nblk.to(DEV)).cpu()
    streamed = kernels.scores_stream_launches() - n0
    # The kernel that ran: the streamed one wherever it takes the shape and is not declined.
    assert streamed == (scores_kernel == "stream" and not (sdt == "f32" and D == 256)), streamed
    assert not torch.isnan(s).any()
    fin = torch.isfinite(s_ref)
    assert torch.equal(torch.isfinite(s), fin)
    assert rel_err(s[fin], s_ref[fin]) < 1e-5
    # negative control: swapping kmin/kmax roles changes the scores
    s_bad = ref.quest_scores(q, kmax, kmax, table, nblk)
    assert rel_err(s[fin], s_bad[fin]) > 1e-3


def _scores_with_ties(B, Hk, NB):
    s = torch.randn(B, Hk, NB)
    s = torch.where(torch.rand(B, Hk, NB) < 0.3, (s * 4).round() / 4, s)  # many exact ties
    s[torch.rand(B, Hk, NB) < 0.05] = float("-inf")
    s[torch.rand(B, Hk, NB) < 0.02] = float("nan")
    s[torch.rand(B, Hk, NB) < 0.02] = -0.0
    s[torch.rand(B, Hk, NB) < 0.01] = float("inf")
    return s


@pytest.mark.parametrize("B,Hk,NB,k,sink,local", [
    (1, 8, 2048, 32, 1, 2), (3, 4, 77, 5, 1, 1), (17, 8, 300, 64, 0, 0), (3, 2, 50, 100, 2, 3),
    (2, 1, 4100, 0, 1, 1), (3, 8, 9000, 700, 4, 4)])
def test_select_topk(B, Hk, NB, k, sink, local):
    seeded(f"topk B={B} NB={NB} k={k}")
    s = _scores_with_ties(B, Hk, NB)
    nblk = torch.randint(0, NB + 1, (B,))
    nblk[0] = NB
    i = _check_select_topk(s, nblk, k, sink, local)
    # negative control: a different k gives a different set whenever it can
    if 0 < k < NB - sink - local - 1:
        i_bad, _ = ref.select_topk(s, nblk, k + 1, sink, local, k + sink + local + 3)
        assert not torch.equal(i, i_bad)


def _check_select_topk(s, nblk, k, sink, local):
    """select_topk's lists (n_out = k + sink + local + 3, outputs poisoned first) equal the
    reference's bit for bit; returns the kernel's ids (CPU)."""
    B, Hk, _ = s.shape
    n_out = k + sink + local + 3
    i_ref, c_ref = ref.select_topk(s, nblk, k, sink, local, n_out)
    poison(((B, Hk, n_out), torch.int32), ((B, Hk), torch.int32))
    i, c = torch.ops.sglang_prr_cuda.select_topk(s.to(DEV), nblk.to(DEV).int(), k, sink, local,
                                                 n_out)
    assert torch.equal(c.cpu(), c_ref)
    assert torch.equal(i.cpu(), i_ref)
    return i.cpu()


def _scores_shaped(shape: str, B, Hk, NB, k):
    """Rows that steer the top-K's threshold search down each of its paths: one key value for
    every block (no histogram), consecutive floats (a bin two keys wide, the k-th key's bin
    ranked by one warp), a narrow cluster beside keys of the far ends of the float range (the
    first round's bins hold the whole cluster: a second round), and 40 exact ties at the k-th
    key (a bin of more than a warp's candidates, narrowed to one key value)."""
    if shape == "equal":
        return torch.full((B, Hk, NB), 2.5)
    if shape == "ulps":
        base = torch.full((B, Hk, NB), 1.0).view(torch.int32)
        steps = torch.stack([torch.randperm(NB) for _ in range(B * Hk)]).view(B, Hk, NB)
        return (base + steps.int()).view(torch.float32)
    if shape == "cluster":
        s = 100.0 + torch.rand(B, Hk, NB) * 1e-3
        s[torch.rand(B, Hk, NB) < 0.1] = -3e38 * torch.rand(())
        s[..., 5:8] = 1e38 * (1 + torch.rand(B, Hk, 3))  # three far above the cluster
        return s
    s = torch.randn(B, Hk, NB)  # "ties": the 40 values around the k-th best are one value
    order = s.sort(dim=-1, descending=True).indices
    tied = order[..., k - 20:k + 20]
    return s.scatter(-1, tied, torch.full(tied.shape, 0.125))


@pytest.mark.parametrize("shape", ["equal", "ulps", "cluster", "ties"])
@pytest.mark.parametrize("NB,k", [(2048, 32), (997, 40), (5000, 333)])
def test_select_topk_threshold_paths(shape, NB, k):
    seeded(f"topk paths {shape} NB={NB} k={k}")
    B, Hk, sink, local = 2, 4, 1, 2
    s = _scores_shaped(shape, B, Hk, NB, k)
    nblk = torch.tensor([NB, NB - 7])
    i = _check_select_topk(s, nblk, k, sink, local)
    # negative control: one fewer block selected differs (every row has more than k blocks)
    i_bad, _ = ref.select_topk(s, nblk, k - 1, sink, local, k + sink + local + 3)
    assert not torch.equal(i, i_bad)


@pytest.mark.parametrize("B,Hk,NB,n_pred,sink,local", [(1, 8, 2048, 48, 1, 2),
                                                        (3, 4, 61, 7, 1, 1), (17, 2, 500, 40, 0, 2)])
def test_holt_update_and_predict_set(B, Hk, NB, n_pred, sink, local):
    seeded(f"holt B={B} NB={NB}")
    level = torch.randn(B, Hk, NB)
    trend = torch.randn(B, Hk, NB) * 0.1
    # InfLLM-v2 levels stuck at -inf (scored before a complete compressed key), trend +-inf
    # (NaN would defeat torch.equal): they restart like new blocks, as in the reference.
    dead = torch.rand(B, Hk, NB) < 0.05
    level[dead] = float("-inf")
    infs = torch.tensor([float("inf"), float("-inf")])
    trend[dead] = infs[torch.randint(0, 2, (int(dead.sum()),))]
    n_init = torch.randint(0, NB, (B,), dtype=torch.int64)
    scores = _scores_with_ties(B, Hk, NB).nan_to_num(0.0).clamp(-1e30, 1e30)
    nblk = torch.minimum(n_init + torch.randint(0, 3, (B,)), torch.tensor(NB))
    nblk[0] = max(int(nblk[0]), 1)  # row 0 has a block to update (the negative control's)
    theta = torch.rand(B, 3)
    l_ref, t_ref, n_ref = level.clone(), trend.clone(), n_init.clone()
    ref.holt_update(l_ref, t_ref, n_ref, scores, nblk, theta[:, 0], theta[:, 1])
    l_d, t_d, n_d = level.to(DEV), trend.to(DEV), n_init.to(DEV)
    th = theta.to(DEV)
    torch.ops.sglang_prr_cuda.holt_update(l_d, t_d, n_d, scores.to(DEV), nblk.to(DEV),
                                          th[:, 0], th[:, 1])
    assert torch.equal(n_d.cpu(), n_ref)
    assert torch.equal(l_d.cpu(), l_ref), "level must match the reference bit for bit"
    assert torch.equal(t_d.cpu(), t_ref), "trend must match the reference bit for bit"
    upd = dead & (torch.arange(NB) < torch.minimum(n_init.long(), nblk.long()).view(B, 1, 1))
    if upd.any():  # the restarted blocks hold this step's score, a finite level again
        assert torch.isfinite(l_d.cpu()[upd]).all() and (t_d.cpu()[upd] == 0).all()
    assert not torch.equal(l_ref, level), "negative control: the update changed the state"
    nxt = torch.minimum(nblk + 1, torch.tensor(NB))
    gamma = th[:, 2].contiguous()
    pi_ref, pc_ref = ref.predict_set(l_ref, t_ref, theta[:, 2].contiguous(), n_ref, nxt, n_pred,
                                     sink, local)
    pi, pc = torch.ops.sglang_prr_cuda.predict_set(l_d, t_d, gamma, n_d, nxt.to(DEV), n_pred,
                                                   sink, local)
    assert torch.equal(pc.cpu(), pc_ref)
    assert torch.equal(pi.cpu(), pi_ref)


@pytest.mark.parametrize("B,Hk,Na,Np,nb", [(1, 8, 40, 60, 2048), (3, 4, 7, 11, 50),
                                           (17, 1, 100, 150, 300)])
def test_set_difference(B, Hk, Na, Np, nb):
    seeded(f"setdiff B={B} nb={nb}")
    nbl = [nb] * B
    a_idx, a_cnt = random_lists(B, Hk, Na, nbl)
    p_idx, p_cnt = random_lists(B, Hk, Np, nbl)
    # make P overlap A heavily in one row
    p_idx[0, 0, :a_cnt[0, 0]] = a_idx[0, 0, :a_cnt[0, 0]]
    p_idx[0, 0, a_cnt[0, 0]:] = -1
    p_cnt[0, 0] = a_cnt[0, 0]
    m_ref, c_ref = ref.set_difference(a_idx, a_cnt, p_idx, p_cnt, nb)
    poison(((B, Hk, Na), torch.int32), ((B, Hk), torch.int32))
    m, c = torch.ops.sglang_prr_cuda.set_difference(a_idx.to(DEV), a_cnt.to(DEV), p_idx.to(DEV),
                                                    p_cnt.to(DEV), nb)
    assert torch.equal(c.cpu(), c_ref) and torch.equal(m.cpu(), m_ref)
    assert c_ref[0, 0] == 0 and c_ref.sum() > 0, "control: M empty when P covers A, else not"


@pytest.mark.parametrize("B,Hk,Na,Np,nb,rows64,with_dense", [
    (1, 8, 34, 50, 2048, True, False), (3, 4, 7, 11, 50, False, True),
    (17, 2, 100, 150, 300, True, True)])
def test_set_difference_pool_rows_and_counters(B, Hk, Na, Np, nb, rows64, with_dense):
    """P read at pool rows ``p_rows`` and the counters added in the same launch: the lists of the
    reference over the gathered rows and ``reference.accumulate_stats``'s sums on counters that
    already hold values; control: other rows give another M."""
    seeded(f"setdiff rows B={B} nb={nb}")
    R = 2 * B + 3
    nbl = [nb] * B
    a_idx, a_cnt = random_lists(B, Hk, Na, nbl)
    p_idx, p_cnt = random_lists(R, Hk, Np, [nb] * R)
    p_cnt[0] = -1  # a negative count reads no entry and counts as 0
    rows = torch.randperm(R)[:B]
    if B > 1:  # the control's witness: batch 0's own row of P covers A[0, 0], the flipped one
        # (rows[-1]) holds nothing there, so M[0, 0] is empty against A[0, 0] (not empty)
        if a_cnt[0, 0] == 0:
            a_idx[0, 0, 0], a_cnt[0, 0] = 0, 1
        c, r0, rl = int(a_cnt[0, 0]), int(rows[0]), int(rows[-1])
        p_idx[r0, 0] = -1
        p_idx[r0, 0, :c] = a_idx[0, 0, :c]
        p_cnt[r0, 0], p_cnt[rl, 0] = c, 0
    rows = rows if rows64 else rows.int()
    dense = (torch.rand(B) < 0.4) if with_dense else None
    start = torch.randint(0, 1 << 40, (4,), dtype=torch.int64)
    want_stats = start.clone()
    m_ref, c_ref = ref.set_difference_counted(a_idx, a_cnt, p_idx, p_cnt, nb, rows, want_stats,
                                              dense)
    poison(((B, Hk, Na), torch.int32), ((B, Hk), torch.int32))
    stats = start.to(DEV)
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    m, c = torch.ops.sglang_prr_cuda.set_difference(
        a_idx.to(DEV), a_cnt.to(DEV), p_idx.to(DEV), p_cnt.to(DEV), nb, rows.to(DEV), stats,
        dev(dense))
    assert torch.equal(c.cpu(), c_ref) and torch.equal(m.cpu(), m_ref)
    assert torch.equal(stats.cpu(), want_stats), (stats, want_stats)
    other = torch.ops.sglang_prr_cuda.set_difference(
        a_idx.to(DEV), a_cnt.to(DEV), p_idx.to(DEV), p_cnt.to(DEV), nb, rows.flip(0).to(DEV))
    if B > 1:
        assert not torch.equal(other[0].cpu(), m_ref), "control: P's rows matter"


@pytest.mark.parametrize("B,Hk,NB,k,sink,local,Np,with_p,with_dense", [
    (1, 8, 2048, 32, 1, 2, 51, True, False), (3, 4, 77, 5, 1, 1, 9, True, True),
    (17, 2, 300, 64, 0, 0, 100, False, True), (2, 1, 4100, 0, 1, 1, 3, True, False),
    (3, 8, 9000, 700, 4, 4, 1000, True, True), (5, 3, 333, 20, 2, 2, 40, False, False)])
def test_select_lists(B, Hk, NB, k, sink, local, Np, with_p, with_dense):
    """``select_lists`` (one launch) == the reference's top-K, set difference and counters:
    scores with ties, +-inf, NaN and -0; P read at pool rows, with repeats, -1, ids past the row
    or negative, counts negative or past the width; dense rows (wider than the lists where NB
    is); counters that already hold values. Control: a row of P that holds nothing where batch
    0's own row covers its A gives another M."""
    seeded(f"select_lists B={B} NB={NB} k={k} p={with_p}")
    s = _scores_with_ties(B, Hk, NB)
    nblk = torch.randint(0, NB + 1, (B,))
    nblk[0] = NB
    n_out = k + sink + local + 3
    R = 2 * B + 3
    p_idx = torch.randint(-3, NB + 5, (R, Hk, Np), dtype=torch.int32)
    p_cnt = torch.randint(-2, Np + 4, (R, Hk), dtype=torch.int32)
    rows = torch.randperm(R - 1)[:B]  # row R - 1 (the control's) is no batch row's
    dense = None
    if with_dense:  # the last row dense over every block (wider than the lists), the first not
        dense = torch.rand(B) < 0.4
        dense[0], dense[-1], nblk[-1] = False, True, NB
    a_ref, ac_ref = ref.select_topk(s, nblk, k, sink, local, n_out, dense)
    c = int(ac_ref[0, 0])  # > 0: batch 0 has every block, A keeps K + sink + local of them
    p_idx[rows[0], 0] = -1
    p_idx[rows[0], 0, :min(c, Np)] = a_ref[0, 0, :min(c, Np)]
    p_cnt[rows[0], 0], p_cnt[R - 1, 0] = min(c, Np), 0
    start = torch.randint(0, 1 << 40, (4,), dtype=torch.int64)
    want = start.clone()
    pi, pc = (p_idx, p_cnt) if with_p else (None, None)
    r = ref.select_from_scores(s, nblk, NB, pi, pc, k, sink, local, n_out,
                               rows if with_p else None, dense, want)
    poison(((B, Hk, n_out), torch.int32), ((B, Hk), torch.int32))
    stats = start.clone().to(DEV)
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    got = torch.ops.sglang_prr_cuda.select_lists(
        s.to(DEV), nblk.to(DEV), dev(pi), dev(pc), k, sink, local, n_out,
        dev(rows) if with_p else None, dev(dense), stats)
    for name, g_, w_ in zip(("a_idx", "a_cnt", "m_idx", "m_cnt"), got, r[1:]):
        assert torch.equal(g_.cpu(), w_), name
    assert torch.equal(stats.cpu(), want), (stats, want)
    assert not torch.equal(want, start), "control: the counters moved"
    if with_p:
        other = torch.ops.sglang_prr_cuda.select_lists(
            s.to(DEV), nblk.to(DEV), dev(pi), dev(pc), k, sink, local, n_out,
            torch.full((B,), R - 1, device=DEV), dev(dense), None)
        if c <= Np:  # batch 0's own row covers its A: M is empty there, not against row R - 1
            assert int(got[3][0, 0]) == 0 and int(other[3][0, 0]) == c, "control: P's rows"


# ----------------------------------------------------------------------------- merge
def _partials(B, Hq, N, D, frac_pad=0.3):
    o = torch.randn(B, Hq, N, D)
    lse = torch.randn(B, Hq, N) * 3
    lse[torch.rand(B, Hq, N) < frac_pad] = float("-inf")
    return o, lse


@pytest.mark.parametrize("B,Hq,Hk,Np,Nm,D,nb", [(1, 32, 8, 48, 40, 128, 2048),
                                                (3, 8, 8, 7, 5, 64, 40),
                                                (17, 32, 4, 20, 20, 128, 100)])
@pytest.mark.parametrize("exact", [True, False])
def test_prr_merge(B, Hq, Hk, Np, Nm, D, nb, exact):
    seeded(f"merge B={B} exact={exact}")
    G = Hq // Hk
    nbl = [nb] * B
    p_idx, p_cnt = random_lists(B, Hk, Np, nbl)
    a_idx, a_cnt = random_lists(B, Hk, Nm, nbl)
    o_s, l_s = _partials(B, Hq, Np, D)
    o_r, l_r = _partials(B, Hq, Nm, D)
    l_r[0, 0] = float("-inf")  # a row with only speculative states
    o_ref, lse_ref = ref.prr_merge(o_s, l_s, p_idx, p_cnt, a_idx, a_cnt, o_r, l_r, nb, exact)
    poison(((B, Hq, D), torch.float32), ((B, Hq), torch.float32))
    o, lse = torch.ops.sglang_prr_cuda.prr_merge(
        o_s.to(DEV), l_s.to(DEV), p_idx.to(DEV), p_cnt.to(DEV), a_idx.to(DEV), a_cnt.to(DEV),
        o_r.to(DEV), l_r.to(DEV), nb, exact)
    o, lse = o.cpu(), lse.cpu()
    assert not torch.isnan(o).any()
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), fin)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(lse[fin], lse_ref[fin]) < 1e-5
    o_other, _ = ref.prr_merge(o_s, l_s, p_idx, p_cnt, a_idx, a_cnt, o_r, l_r, nb, not exact)
    assert rel_err(o, o_other) > 1e-3, "negative control: exact and union differ"


def test_merge_partials():
    seeded("merge_partials")
    o, lse = _partials(3, 17, 33, 128, frac_pad=0.5)
    lse[1, 2] = float("-inf")  # nothing to merge: (0, -inf)
    o_ref, l_ref = ref.merge_partials(o, lse)
    poison(((3, 17, 128), torch.float32))
    o_d, l_d = torch.ops.sglang_prr_cuda.merge_partials(o.to(DEV), lse.to(DEV))
    fin = torch.isfinite(l_ref)
    assert torch.equal(torch.isfinite(l_d.cpu()), fin)
    assert rel_err(o_d, o_ref) < 1e-5 and rel_err(l_d.cpu()[fin], l_ref[fin]) < 1e-5
    assert (o_d.cpu()[1, 2] == 0).all()


# ----------------------------------------------------------------------------- summary update
@pytest.mark.parametrize("page,sdt", [(16, torch.float32), (64, torch.float32),
                                      (16, torch.bfloat16), (64, torch.bfloat16)])
def test_quest_update(page, sdt):
    """Decode and prefill updates of the summaries, float32 or bfloat16 rounded outward (the
    keys are float32 here, so the rounding matters), bit for bit with the reference."""
    seeded(f"quest_update page={page} {sdt}")
    Hk, D, P = 8, 128, 40
    kmin = torch.randn(P, Hk, D).to(sdt)
    kmax = (kmin.float() + 1).to(sdt)
    N = 3 * page + 5
    # tokens of 2 requests: one fills fresh pages from position 0, one continues mid-page
    pages = torch.randperm(P - 1)[:8] + 1
    pos_a = torch.arange(0, 2 * page + 3)
    loc_a = pages[pos_a // page] * page + pos_a % page
    pos_b = torch.arange(page + 5, page + 5 + (N - len(pos_a)))
    loc_b = pages[4 + (pos_b - page) // page] * page + pos_b % page
    pos = torch.cat([pos_a, pos_b])
    loc = torch.cat([loc_a, loc_b])
    k = torch.randn(len(pos), Hk, D, dtype=torch.float32)
    a_min, a_max = kmin.clone(), kmax.clone()
    ref.quest_update(a_min, a_max, k, loc, pos, page)
    d_min, d_max = kmin.to(DEV), kmax.to(DEV)
    torch.ops.sglang_prr_cuda.quest_update(d_min, d_max, k.to(DEV), loc.to(DEV), pos.to(DEV),
                                           page)
    assert torch.equal(d_min.cpu(), a_min) and torch.equal(d_max.cpu(), a_max)
    assert not torch.equal(a_min, kmin), "control: the update changed the summaries"
    if sdt == torch.bfloat16:  # the bounds hold: kmin <= every key of its page <= kmax
        pg = loc // page
        assert (a_min[pg].float() <= k).all() and (a_max[pg].float() >= k).all()
        # control: round-to-nearest would break the bound somewhere
        assert ((k.to(sdt).float() > k).any() and (k.to(sdt).float() < k).any())
    # Decode: one token per page at a time (the one-launch kernel).
    d_min, d_max = kmin.to(DEV), kmax.to(DEV)
    w_min, w_max = kmin.clone(), kmax.clone()
    for i in range(0, 48):  # one token a call: no two tokens share a page
        ids = torch.tensor([i])
        ref.quest_update(w_min, w_max, k[ids], loc[ids], pos[ids], page, one_per_page=True)
        torch.ops.sglang_prr_cuda.quest_update(d_min, d_max, k[ids].to(DEV), loc[ids].to(DEV),
                                               pos[ids].to(DEV), page, True)
    assert torch.equal(d_min.cpu()[1:], w_min[1:]) and torch.equal(d_max.cpu()[1:], w_max[1:])
    # The prefill kernel folds runs of consecutive tokens of one page: tokens in any order (page
    # changes at every token) give the same summaries.
    perm = torch.randperm(len(pos))
    d_min, d_max = kmin.to(DEV), kmax.to(DEV)
    torch.ops.sglang_prr_cuda.quest_update(d_min, d_max, k[perm].to(DEV), loc[perm].to(DEV),
                                           pos[perm].to(DEV), page)
    assert torch.equal(d_min.cpu(), a_min) and torch.equal(d_max.cpu(), a_max)


# ----------------------------------------------------------------------------- end to end + graph
def _prr_inputs(B, Hq, Hk, D, page, seq_lens, dtype=torch.bfloat16):
    k_buf, v_buf, table, sl, NB = make_pool(B, Hk, D, page, seq_lens, dtype, extra_pages=8)
    num_pages = k_buf.shape[0] // page
    kmin = torch.full((num_pages, Hk, D), float("inf"))
    kmax = torch.full((num_pages, Hk, D), float("-inf"))
    kf = k_buf.float().view(num_pages, page, Hk, D)
    kmin = kf.amin(1)
    kmax = kf.amax(1)
    return k_buf, v_buf, table, sl, NB, kmin, kmax


def test_prr_decode_exact_and_graph_replay():
    """ops.prr_decode on CUDA (kernels) == serial DSA over A; captured in a CUDA graph and
    replayed with new q, lengths and predictions, each replay checked against the reference."""
    seeded("prr graph")
    B, Hq, Hk, D, page = 3, 32, 8, 128, 16
    k_top, n_pred, sink, local = 8, 12, 1, 2
    max_len = 900
    seq_lens = [max_len - 3, 333, 512]
    k_buf, v_buf, table, sl, NB, kmin, kmax = _prr_inputs(B, Hq, Hk, D, page, [max_len] * B)
    sm = 1.0 / math.sqrt(D)
    n_a = k_top + sink + local
    n_p = n_pred + sink + local
    st = {
        "q": torch.randn(B, Hq, D, dtype=torch.bfloat16, device=DEV),
        "sl": torch.tensor(seq_lens, device=DEV),
        "p_idx": torch.full((B, Hk, n_p), -1, dtype=torch.int32, device=DEV),
        "p_cnt": torch.zeros(B, Hk, dtype=torch.int32, device=DEV),
        "level": torch.zeros(B, Hk, NB, device=DEV),
        "trend": torch.zeros(B, Hk, NB, device=DEV),
        "n_init": torch.zeros(B, dtype=torch.int64, device=DEV),
        "theta": torch.tensor([[0.6, 0.3, 0.5]] * B, device=DEV),
    }
    kd, vd, td = k_buf.to(DEV), v_buf.to(DEV), table.to(DEV)
    summ = [kmin.to(DEV), kmax.to(DEV)]

    def step():
        return ops.prr_decode(st["q"], kd, vd, summ, td, st["sl"], st["p_idx"], st["p_cnt"],
                              st["level"], st["trend"], st["n_init"], st["theta"], "quest",
                              k_top, n_pred, sink, local, page, sm, True)

    def check(out, level_before, trend_before, ninit_before, p_idx, p_cnt):
        o, a_idx, a_cnt, m_idx, m_cnt, pn_idx, pn_cnt = [x.cpu() for x in out]
        q, slc = st["q"].cpu(), st["sl"].cpu()
        # exactness: the output is attention over exactly the kernel's A
        o_a, _ = ref.attend_set(q, k_buf, v_buf, table, slc, a_idx, a_cnt, page, sm)
        assert rel_err(o, o_a) < 3e-5, rel_err(o, o_a)
        # A is the reference selection from the kernel's own scores (ties are ulp-sensitive)
        scores = ref.quest_scores(q, kmin, kmax, table, ref.num_blocks(slc, page))
        ai_ref, ac_ref = ref.select_topk(scores, ref.num_blocks(slc, page), k_top, sink, local,
                                         n_a)
        agree = (ai_ref == a_idx).all(-1).float().mean().item()  # host-ok: test
        assert agree > 0.9, f"selection agrees with the reference on only {agree:.0%} of rows"
        m_ref, mc_ref = ref.set_difference(a_idx, a_cnt, p_idx, p_cnt, NB)
        assert torch.equal(m_idx, m_ref) and torch.equal(m_cnt, mc_ref)
        # negative control: without the repair partials the output differs when M is non-empty
        if m_cnt.sum() > 0:
            o_nr, _ = ref.attend_set(q, k_buf, v_buf, table, slc, p_idx, p_cnt, page, sm)
            assert rel_err(o, o_nr) > 1e-3
        return a_idx, a_cnt, pn_idx, pn_cnt

    # eager warm-up step (also initialises the predictor) then capture
    s0 = torch.cuda.Stream()
    s0.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s0):
        out = step()
    torch.cuda.current_stream().wait_stream(s0)
    st["p_idx"].copy_(out[5])
    st["p_cnt"].copy_(out[6])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for it in range(4):
        st["q"].copy_(torch.randn(B, Hq, D, dtype=torch.bfloat16))
        st["sl"].copy_(torch.tensor([max_len - 3 + (it % 3), 100 + 97 * it, 512 + it]))
        p_idx, p_cnt = st["p_idx"].cpu(), st["p_cnt"].cpu()
        if it == 2:  # an arbitrary (bad) prediction: exactness must not depend on it
            p_idx, p_cnt = random_lists(B, Hk, n_p, [20] * B)
            st["p_idx"].copy_(p_idx)
            st["p_cnt"].copy_(p_cnt)
        lb, tb, nb0 = st["level"].cpu(), st["trend"].cpu(), st["n_init"].cpu()
        g.replay()
        torch.cuda.synchronize()
        check(out, lb, tb, nb0, p_idx, p_cnt)
        st["p_idx"].copy_(out[5])
        st["p_cnt"].copy_(out[6])


def test_dispatch_uses_kernels():
    """The ops dispatch to the kernels on SM90 (not silently to the reference)."""
    assert kernels.active(DEV)
    q = torch.randn(1, 8, 128, device=DEV)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.merge_partials(torch.randn(1, 8, 4, 128, device=DEV), torch.randn(1, 8, 4, device=DEV))
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "merge_kernel" in names, names[:500]
    del q


# ----------------------------------------------------------------------------- counters
@pytest.mark.parametrize("B, Hk, with_p, with_dense", [
    (1, 8, True, False), (3, 5, False, True), (37, 7, True, True), (300, 3, True, False)])
def test_accumulate_stats_matches_reference(B, Hk, with_p, with_dense):
    """The counters of a composed selection (InfLLM-v2's) in one launch: the same int64 sums as
    ``reference.accumulate_stats`` over random counts (negative |P| entries clamp to 0, dense
    rows left out), added onto counters that already hold values; a changed count moves them."""
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    cnt = lambda lo: torch.randint(lo, 5000, (B, Hk), generator=g, dtype=torch.int32)  # noqa: E731
    a, m = cnt(0), cnt(0)
    p = cnt(-3) if with_p else None
    dense = (torch.rand(B, generator=g) < 0.4) if with_dense else None
    start = torch.randint(0, 1 << 40, (4,), generator=g, dtype=torch.int64)
    want = start.clone()
    ref.accumulate_stats(want, a, m, p, dense)
    got = start.to(DEV)
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    torch.ops.sglang_prr_cuda.accumulate_stats(got, dev(a), dev(m), dev(p), dev(dense))
    assert torch.equal(got.cpu(), want), (got, want)
    # Control: one more selected block in a row that is not dense changes the first slot.
    keep = 0 if dense is None else int((~dense).nonzero()[0, 0]) if (~dense).any() else None
    if keep is not None:
        a[keep, 0] += 1
        again = start.to(DEV)
        torch.ops.sglang_prr_cuda.accumulate_stats(again, dev(a), dev(m), dev(p), dev(dense))
        assert again[0].item() == want[0].item() + 1
