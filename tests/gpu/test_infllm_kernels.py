"""InfLLM-v2 SM90 kernels (compressed-key update, block scores) against the pure-torch reference.

Each test draws fresh random inputs (the seed is printed), runs the CUDA op from
``torch.ops.sglang_prr_cuda`` directly (no silent fallback can hide a kernel) and compares with
``sglang_prr.reference`` run on the CPU from the same inputs. ``infllm_update`` writes only some
entries of ``ck`` in place, so ``ck`` starts as NaN and only what the reference defines is
compared (every page but the padding page 0, NaN where neither writes); the scores the op
allocates are poisoned through the caching allocator. Every equality has a negative control.

The library is the full kernel library (``kernels.load()``), or, when ``SGLANG_PRR_INFLLM_LIB``
names one, a library holding only the InfLLM ops (built from ``infllm_kernels.cu`` and
``infllm_binding.cpp``). Skipped with a reason without a CUDA SM90 device or a loadable library.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from sglang_prr import reference as ref

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402  (the SM90 gate, tests/gpu/sm90.py)

require_sm90()
# The module loads its library itself (the full one, or SGLANG_PRR_INFLLM_LIB's).
OWN_KERNEL_LIBRARY = True

from sglang_prr import kernels, ops  # noqa: E402
from sglang_prr.kernels import infllm  # noqa: E402

DEV = torch.device("cuda")
_STANDALONE = os.environ.get("SGLANG_PRR_INFLLM_LIB")


def _load() -> str:
    """Load the library; returns why it is unusable ('' when usable)."""
    if _STANDALONE:
        try:
            torch.ops.load_library(_STANDALONE)
        except Exception as e:  # noqa: BLE001
            return f"SGLANG_PRR_INFLLM_LIB={_STANDALONE!r} does not load: {e}"
    elif not kernels.load():
        return f"kernel library failed to build/load: {kernels.load_error()}"
    if not hasattr(torch.ops.sglang_prr_cuda, "infllm_scores"):
        return "the kernel library has no infllm ops"
    return ""


_why = _load()
if _why:
    pytest.skip(_why, allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _dispatch_to_standalone():
    """With the standalone library, let the dispatching ops see the kernels as loaded (only the
    InfLLM ops are exercised through them here)."""
    saved = kernels.loader._lib_state
    if _STANDALONE:
        kernels.loader._lib_state = True
    yield
    kernels.loader._lib_state = saved


def seeded(tag: str) -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[{tag}] seed={seed}")
    random.seed(seed)
    torch.manual_seed(seed)
    return seed


def poison(*shapes_dtypes) -> None:
    """Fill allocator blocks of these sizes with NaN and free them, so that outputs the op
    allocates next start as garbage rather than zeros."""
    keep = []
    for shape, dtype in shapes_dtypes:
        keep.append(torch.full(shape, float("nan"), dtype=dtype, device=DEV))
    del keep


# ----------------------------------------------------------------------------- paged pool
def make_pool(B, Hk, D, page, seq_lens, kv_dtype, idx_dtype=torch.int32, extra_pages=3):
    """SGLang-style pool: request slots (shuffled), pages (shuffled, never page 0), ``req_to_token``
    filled with garbage past each request, ``table`` = ``block_table`` of it."""
    nblk = [(s + page - 1) // page for s in seq_lens]
    NB = max(nblk) + 2
    total = sum(nblk) + extra_pages
    num_pages = total + 1
    perm = iter((torch.randperm(total) + 1).tolist())
    max_reqs = B + 2
    slots_of = torch.randperm(max_reqs)[:B]
    rtt = torch.randint(0, num_pages * page, (max_reqs, NB * page), dtype=torch.int64)
    for b in range(B):
        r = slots_of[b]
        for j in range(nblk[b]):
            p = next(perm)
            rtt[r, j * page:(j + 1) * page] = p * page + torch.arange(page)
    k_buf = (torch.randn(num_pages * page, Hk, D) * 1.5).to(kv_dtype)
    table = ref.block_table(rtt, slots_of, page)  # int64, garbage (in range) past the request
    return (k_buf, rtt.to(idx_dtype), slots_of.to(idx_dtype), table,
            torch.tensor(seq_lens, dtype=torch.int64), NB, num_pages)


def close_nan(a: torch.Tensor, b: torch.Tensor, rtol=1e-5, atol=1e-6) -> bool:
    return torch.allclose(a.cpu().double(), b.cpu().double(), rtol=rtol, atol=atol, equal_nan=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where the other is NaN (the entries neither op writes)."""
    a, b = a.cpu(), b.cpu()
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(0.0), b.nan_to_num(0.0))


# ----------------------------------------------------------------------------- update
UPDATE_CASES = [
    # B, Hk, D, page, kv dtype, index dtype
    (1, 8, 128, 64, torch.bfloat16, torch.int32),
    (3, 8, 128, 16, torch.float16, torch.int64),
    (17, 2, 64, 32, torch.bfloat16, torch.int32),
    (3, 4, 128, 128, torch.float32, torch.int64),
    (3, 1, 256, 48, torch.bfloat16, torch.int32),  # 3 compressed keys per page
]


@pytest.mark.parametrize("ck_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hk,D,page,kv_dtype,idx_dtype", UPDATE_CASES)
def test_infllm_update(B, Hk, D, page, kv_dtype, idx_dtype, ck_dtype):
    """The kernel writes the reference's compressed keys bit for bit, float32 or bfloat16 (both
    sum the window in position order in float32, then round once)."""
    seeded(f"update B={B} Hk={Hk} D={D} page={page} {kv_dtype} {idx_dtype} ck {ck_dtype}")
    seq_lens = [random.randint(1, 6 * page) + random.randint(0, 40) for _ in range(B)]
    seq_lens[0] = max(seq_lens[0], 3 * page + 17)  # several keys, a partial last block
    k_buf, rtt, slots_of, table, sl, NB, num_pages = make_pool(B, Hk, D, page, seq_lens,
                                                               kv_dtype, idx_dtype)
    # every token of every request in one call (a prefill), in shuffled order
    req, pos, loc = [], [], []
    for b in range(B):
        for t in range(seq_lens[b]):
            req.append(int(slots_of[b]))
            pos.append(t)
            loc.append(int(rtt[slots_of[b], t]))
    order = torch.randperm(len(pos))
    req_idx = torch.tensor(req, dtype=idx_dtype)[order]
    positions = torch.tensor(pos, dtype=idx_dtype)[order]
    out_loc = torch.tensor(loc, dtype=torch.int64)[order]

    ck_ref = torch.full((num_pages, page // 16, Hk, D), float("nan"), dtype=ck_dtype)
    ref.infllm_update(ck_ref, k_buf, rtt, req_idx, out_loc, positions, page)
    ck = torch.full_like(ck_ref, float("nan")).to(DEV)
    args = [x.to(DEV) for x in (k_buf, rtt, req_idx, out_loc, positions)]
    torch.ops.sglang_prr_cuda.infllm_update(ck, *args, page)
    torch.cuda.synchronize()
    written = torch.isfinite(ck_ref[1:]).all(-1).all(-1)
    assert written.sum() > 0
    assert same_bits(ck[1:], ck_ref[1:]), \
        (ck[1:].cpu().float() - ck_ref[1:].float()).abs().nan_to_num(0).max()
    if ck_dtype == torch.bfloat16:  # control: rounded, not the float32 mean
        ck32 = torch.full(ck_ref.shape, float("nan"))
        ref.infllm_update(ck32, k_buf, rtt, req_idx, out_loc, positions, page)
        assert not torch.equal(ck32[1:][written], ck_ref[1:][written].float())
        assert close_nan(ck32[1:], ck_ref[1:].float(), rtol=2 ** -8, atol=1e-30)

    # a decode-like call: one token per request at its last position (some complete a key)
    dec_pos = torch.tensor([s - 1 for s in seq_lens], dtype=idx_dtype)
    dec_loc = torch.stack([rtt[slots_of[b], seq_lens[b] - 1].long() for b in range(B)])
    ck_ref2 = torch.full_like(ck_ref, float("nan"))
    ref.infllm_update(ck_ref2, k_buf, rtt, slots_of, dec_loc, dec_pos, page)
    ck2 = torch.full_like(ck_ref, float("nan")).to(DEV)
    torch.ops.sglang_prr_cuda.infllm_update(ck2, args[0], args[1], slots_of.to(DEV),
                                            dec_loc.to(DEV), dec_pos.to(DEV), page)
    assert same_bits(ck2[1:], ck_ref2[1:])

    # negative control: change one key inside the window of a written compressed key
    pg, j = [int(x) for x in written.nonzero()[0]]
    pg += 1
    k2 = k_buf.clone()
    k2[pg * page:(pg + 1) * page] += 4.0  # the page holding the last token of that key
    ck3 = torch.full_like(ck_ref, float("nan")).to(DEV)
    torch.ops.sglang_prr_cuda.infllm_update(ck3, k2.to(DEV), *args[1:], page)
    assert not same_bits(ck3[1:], ck_ref[1:]), "a changed key must change some compressed key"


def test_infllm_update_dispatch_and_graph():
    """ops.infllm_update on CUDA goes to the kernel; captured in a CUDA graph and replayed with
    new positions (decode steps), each replay checked against the reference."""
    seeded("update graph")
    B, Hk, D, page = 3, 8, 128, 32
    max_len = 700
    k_buf, rtt, slots_of, table, sl, NB, num_pages = make_pool(B, Hk, D, page, [max_len] * B,
                                                               torch.bfloat16)
    kd, rd = k_buf.to(DEV), rtt.to(DEV)
    st = {"req": slots_of.to(DEV), "pos": torch.zeros(B, dtype=torch.int64, device=DEV),
          "loc": torch.zeros(B, dtype=torch.int64, device=DEV)}
    ck = torch.full((num_pages, page // 16, Hk, D), float("nan"), device=DEV)
    ops.infllm_update(ck, kd, rd, st["req"], st["loc"], st["pos"], page)  # warm-up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.infllm_update(ck, kd, rd, st["req"], st["loc"], st["pos"], page)
    for it in range(3):
        pos = torch.tensor([16 * random.randint(2, max_len // 16 - 1) - 1 for _ in range(B)])
        if it == 2:
            pos[0] = 40  # completes no key
        loc = torch.stack([rtt[slots_of[b], pos[b]].long() for b in range(B)])
        st["pos"].copy_(pos)
        st["loc"].copy_(loc)
        ck.fill_(float("nan"))
        g.replay()
        ck_ref = torch.full(ck.shape, float("nan"))
        ref.infllm_update(ck_ref, k_buf, rtt, slots_of, loc, pos, page)
        assert close_nan(ck[1:], ck_ref[1:]), f"replay {it}"
        n_written = int(torch.isfinite(ck[1:]).all(-1).all(-1).sum())
        assert n_written == (B if it < 2 else B - 1), n_written


# ----------------------------------------------------------------------------- scores
SCORE_CASES = [
    # B, Hq, Hk, D, page, q dtype
    (1, 32, 8, 128, 64, torch.bfloat16),
    (3, 8, 8, 128, 16, torch.float16),     # GQA 1
    (17, 32, 8, 128, 32, torch.bfloat16),  # GQA 4
    (3, 64, 8, 128, 128, torch.bfloat16),  # GQA 8
    (3, 16, 4, 64, 64, torch.float16),     # head dim 64
    (2, 8, 2, 256, 32, torch.bfloat16),    # head dim 256
    (3, 12, 4, 128, 48, torch.bfloat16),   # GQA 3, 3 compressed keys per page
    (1, 8, 1, 128, 16, torch.float32),     # GQA 8, fp32 q
    (2, 6, 6, 64, 32, torch.bfloat16),     # GQA 1, 6 KV heads (two a CTA), head dim 64
    (3, 9, 3, 64, 16, torch.bfloat16),     # SmolLM2's heads: GQA 3, one KV head a CTA
]


def _score_inputs(B, Hq, Hk, D, page, qdtype, seq_lens, table64, ck_dtype=torch.float32):
    k_buf, rtt, slots_of, table, sl, NB, num_pages = make_pool(B, Hk, D, page, seq_lens,
                                                               torch.bfloat16)
    # every entry random (invalid ones too), in the stored dtype
    ck = (torch.randn(num_pages, page // 16, Hk, D) * 1.2).to(ck_dtype)
    q = torch.randn(B, Hq, D).to(qdtype)
    if not table64:
        table = table.to(torch.int32)
    return q, ck, table, sl if table64 else sl.to(torch.int32), NB


def check_scores(out, exp):
    out = out.cpu()
    assert out.shape == exp.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in the scores"
    assert torch.equal(torch.isneginf(out), torch.isneginf(exp)), "-inf pattern differs"
    fin = torch.isfinite(exp)
    if fin.any():
        err = (out[fin].double() - exp[fin].double()).abs()
        tol = 2e-6 + 1e-4 * exp[fin].double().abs()
        assert (err <= tol).all(), f"max abs err {err.max().item():.3g}"  # host-ok: test


@pytest.mark.parametrize("ck_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hk,D,page,qdtype", SCORE_CASES)
def test_infllm_scores(B, Hq, Hk, D, page, qdtype, ck_dtype):
    seeded(f"scores B={B} Hq={Hq} Hk={Hk} D={D} page={page} {qdtype} ck {ck_dtype}")
    seq_lens = [random.randint(1, 40 * page) for _ in range(B)]
    seq_lens[0] = 37 * page + random.randint(1, page - 1)  # several chunks, partial last block
    if B > 1:
        seq_lens[1] = random.randint(1, 31)  # no complete compressed key: all -inf
    if B > 2:
        seq_lens[2] = 32 + 16 * random.randint(0, 3)  # exactly at a key boundary
    q, ck, table, sl, NB = _score_inputs(B, Hq, Hk, D, page, qdtype, seq_lens, B % 2 == 1,
                                         ck_dtype)
    sm = 1.0 / math.sqrt(D)
    exp = ref.infllm_scores(q, ck, table, sl, page, sm)
    qd, ckd, td, sld = q.to(DEV), ck.to(DEV), table.to(DEV), sl.to(DEV)
    poison(((B, Hk, NB), torch.float32), ((B, Hq, NB * (page // 16)), torch.float32))
    out = torch.ops.sglang_prr_cuda.infllm_scores(qd, ckd, td, sld, page, sm)
    check_scores(out, exp)
    assert torch.isfinite(exp).any()

    # the dispatching op reaches the same kernel (bit-identical)
    via_op = ops.infllm_scores(qd, ckd, td, sld, page, sm)
    assert torch.equal(via_op, out)

    # negative control: one compressed key aligned with q changes the scores of its block(s)
    n_ck = (seq_lens[0] - 32) // 16 + 1
    e = random.randint(1, n_ck)  # entry e of request 0 = key e - 1
    blk, j = divmod(e, page // 16)
    ck2 = ck.clone()
    ck2[int(table[0, blk]), j, 0] = (q[0, 0].float() * 3.0).to(ck_dtype)
    out2 = torch.ops.sglang_prr_cuda.infllm_scores(qd, ck2.to(DEV), td, sld, page, sm).cpu()
    assert not torch.allclose(out2[0, 0], out.cpu()[0, 0], rtol=1e-3, atol=1e-5)
    check_scores(out2, ref.infllm_scores(q, ck2, table, sl, page, sm))


def test_infllm_scores_long_context():
    """16K tokens at block 16 (1024 entries, 8 chunks of the logits pass) and at block 64."""
    for page, ck_dtype in ((16, torch.float32), (64, torch.float32), (64, torch.bfloat16)):
        seeded(f"scores long page={page} ck {ck_dtype}")
        B, Hq, Hk, D = 2, 32, 8, 128
        seq_lens = [16384 - random.randint(1, 15), random.randint(5000, 9000)]
        q, ck, table, sl, NB = _score_inputs(B, Hq, Hk, D, page, torch.bfloat16, seq_lens, True,
                                             ck_dtype)
        sm = 1.0 / math.sqrt(D)
        out = torch.ops.sglang_prr_cuda.infllm_scores(q.to(DEV), ck.to(DEV), table.to(DEV),
                                                      sl.to(DEV), page, sm)
        check_scores(out, ref.infllm_scores(q, ck, table, sl, page, sm))


# The scores' measuring knobs whose forms must write the same bits: (the bulk logits pass's
# ring fill, the pool's loads), defaults first.
LOAD_FORMS = [("serial", "late"), ("ids-first", "late"), ("serial", "loads-first"),
              ("ids-first", "loads-first")]


def _scores_in_every_load_form(monkeypatch, args):
    """The scores under each of LOAD_FORMS (``SGLANG_PRR_INFLLM_RING`` / ``_POOL``, read at each
    launch), the outputs poisoned before each."""
    outs = []
    q, ck, table, sl, page, sm = args
    B, Hq, Hk, NB = q.shape[0], q.shape[1], ck.shape[2], table.shape[1]
    for ring, pool in LOAD_FORMS:
        monkeypatch.setenv("SGLANG_PRR_INFLLM_RING", ring)
        monkeypatch.setenv("SGLANG_PRR_INFLLM_POOL", pool)
        poison(((B, Hk, NB), torch.float32), ((B, Hq, NB * (page // 16)), torch.float32))
        outs.append(torch.ops.sglang_prr_cuda.infllm_scores(q, ck, table, sl, page, sm))
    return outs


@pytest.mark.parametrize("ck_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [16, 64, 128])
def test_scores_with_their_loads_first_give_the_same_bits(monkeypatch, page, ck_dtype):
    """The bulk logits pass with ``SGLANG_PRR_INFLLM_RING=ids-first`` (the chunk's page ids in one
    round trip, the ring filled from S threads, refills from shared memory) and the pool with
    ``SGLANG_PRR_INFLLM_POOL=loads-first`` (the length, statistics and logits in one round trip)
    write the bits of the default forms, all the reference's values: rings that refill (page
    16: 16 stages of 32-128 pages; float32 at page 64: 4 stages of 8) and rings that hold the
    whole chunk (bf16 at page 64), requests of many chunks with a partial last one. Control: two
    page ids of request 0 swapped in the table change its output (the kernels read the ids they
    are given)."""
    seeded(f"load forms page={page} ck {ck_dtype}")
    monkeypatch.setenv("SGLANG_PRR_INFLLM_VARIANT", "bulk")  # bf16 keys: the ring, not the MMAs
    B, Hq, Hk, D = 2, 32, 8, 128
    seq_lens = [random.randint(300, 600) * page + random.randint(1, page - 1),
                random.randint(40, 200) * page]
    q, ck, table, sl, NB = _score_inputs(B, Hq, Hk, D, page, torch.bfloat16, seq_lens, page != 64,
                                         ck_dtype)
    sm = 1.0 / math.sqrt(D)
    qd, ckd, td, sld = q.to(DEV), ck.to(DEV), table.to(DEV), sl.to(DEV)
    outs = _scores_in_every_load_form(monkeypatch, (qd, ckd, td, sld, page, sm))
    for form, out in zip(LOAD_FORMS[1:], outs[1:]):
        assert torch.equal(out, outs[0]), form
    check_scores(outs[-1], ref.infllm_scores(q, ck, table, sl, page, sm))
    # control: both loads-first forms with two of request 0's page ids swapped
    t2 = table.clone()
    i, j = random.sample(range(1, seq_lens[0] // page), 2)
    t2[0, i], t2[0, j] = table[0, j], table[0, i]
    out2 = torch.ops.sglang_prr_cuda.infllm_scores(qd, ckd, t2.to(DEV), sld, page, sm)
    assert not torch.equal(out2[0], outs[-1][0])
    check_scores(out2, ref.infllm_scores(q, ck, t2, sl, page, sm))


# bf16 keys and bf16 q take the tensor-core logits by default; the CUDA-core variants stay
# reachable through SGLANG_PRR_INFLLM_VARIANT (read at each launch).
@pytest.mark.parametrize("B,Hq,Hk,D,page", [
    (2, 32, 8, 128, 64),    # Llama-3-8B's heads: GQA 4, all 8 KV heads a CTA
    (3, 64, 8, 128, 48),    # GQA 8, 3 entries a page (chunks start inside a page)
    (2, 8, 2, 256, 16),     # head dim 256 (one tile a warp at a time), pages of one entry
    (3, 9, 3, 64, 128),     # GQA 3, one KV head a CTA (8 warps a head)
])
def test_bf16_logits_on_tensor_cores_match_the_cuda_core_variants(monkeypatch, B, Hq, Hk, D,
                                                                  page):
    """The MMA logits (A: 16 entries' keys straight from global memory, k permuted within 32
    dims; B: the group's q with the same permutation) give the reference's scores as the bulk and
    register variants do, over requests of many chunks with a partial last page, one of no
    complete key, one at a key boundary. The variants sum in different orders, so their bits
    differ (the control that the knob picks another kernel); a key aligned with q changes its
    block's score under the MMAs (the control that they read the keys they are given)."""
    seeded(f"mma logits B={B} Hq={Hq} Hk={Hk} D={D} page={page}")
    seq_lens = [random.randint(40, 90) * page + random.randint(1, page - 1) for _ in range(B)]
    seq_lens[1] = random.randint(1, 31)
    if B > 2:
        seq_lens[2] = 32 + 16 * random.randint(0, 3)
    q, ck, table, sl, NB = _score_inputs(B, Hq, Hk, D, page, torch.bfloat16, seq_lens, B == 2,
                                         torch.bfloat16)
    sm = 1.0 / math.sqrt(D)
    exp = ref.infllm_scores(q, ck, table, sl, page, sm)
    qd, ckd, td, sld = q.to(DEV), ck.to(DEV), table.to(DEV), sl.to(DEV)
    outs = {}
    for variant in ("mma", "bulk", "regs"):
        monkeypatch.setenv("SGLANG_PRR_INFLLM_VARIANT", variant)
        poison(((B, Hk, NB), torch.float32), ((B, Hq, NB * (page // 16)), torch.float32))
        outs[variant] = torch.ops.sglang_prr_cuda.infllm_scores(qd, ckd, td, sld, page, sm).cpu()
        check_scores(outs[variant], exp)
    monkeypatch.delenv("SGLANG_PRR_INFLLM_VARIANT")
    default = torch.ops.sglang_prr_cuda.infllm_scores(qd, ckd, td, sld, page, sm).cpu()
    assert torch.equal(default, outs["mma"]), "bf16 keys and q take the MMAs by default"
    assert not torch.equal(outs["mma"], outs["regs"])
    # control: entry e of request 0 set to 3 q of its KV head 0's first query head
    e = random.randint(1, (seq_lens[0] - 32) // 16 + 1)
    blk, j = divmod(e, page // 16)
    ck2 = ck.clone()
    ck2[int(table[0, blk]), j, 0] = (q[0, 0].float() * 3.0).to(torch.bfloat16)
    out2 = torch.ops.sglang_prr_cuda.infllm_scores(qd, ck2.to(DEV), td, sld, page, sm).cpu()
    assert not torch.allclose(out2[0, 0], default[0, 0], rtol=1e-3, atol=1e-5)
    check_scores(out2, ref.infllm_scores(q, ck2, table, sl, page, sm))


def test_scores_loads_first_past_the_pools_prefetch(monkeypatch):
    """A request of over 320 chunks (~164K tokens at block 64): the pool's statistics past the
    kPoolStat = 8 a lane it loads first (NC > 256) come from its loop, in the same order, so
    every load form writes the default's bits, the reference's values."""
    seeded("load forms long")
    B, Hq, Hk, D, page = 1, 32, 8, 128, 64
    seq_lens = [163840 + random.randint(1, 4000)]
    q, ck, table, sl, NB = _score_inputs(B, Hq, Hk, D, page, torch.bfloat16, seq_lens, True)
    # batch 1 takes the smallest chunk, 32 entries (the grid aims at 528 CTAs): NC > 256 chunks
    assert NB * (page // 16) > 256 * 32, NB
    sm = 1.0 / math.sqrt(D)
    outs = _scores_in_every_load_form(
        monkeypatch, (q.to(DEV), ck.to(DEV), table.to(DEV), sl.to(DEV), page, sm))
    for form, out in zip(LOAD_FORMS[1:], outs[1:]):
        assert torch.equal(out, outs[0]), form
    check_scores(outs[-1], ref.infllm_scores(q, ck, table, sl, page, sm))


def test_infllm_scores_graph_replay():
    """Captured in a CUDA graph; replays with new q and changed seq_lens (more and fewer
    complete keys, one request with none) match the reference each time."""
    seeded("scores graph")
    B, Hq, Hk, D, page = 3, 32, 8, 128, 64
    max_len = 5000
    q, ck, table, sl, NB = _score_inputs(B, Hq, Hk, D, page, torch.bfloat16, [max_len] * B, True)
    sm = 1.0 / math.sqrt(D)
    st = {"q": q.to(DEV), "sl": sl.to(DEV)}
    ckd, td = ck.to(DEV), table.to(DEV)
    out = ops.infllm_scores(st["q"], ckd, td, st["sl"], page, sm)  # warm-up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.infllm_scores(st["q"], ckd, td, st["sl"], page, sm)
    prev = None
    for it in range(4):
        lens = torch.tensor([random.randint(1, max_len) for _ in range(B)])
        lens[0] = max_len - it * 700 - random.randint(0, 63)
        if it == 3:
            lens[1] = 20
        qn = torch.randn(B, Hq, D).to(torch.bfloat16)
        st["q"].copy_(qn)
        st["sl"].copy_(lens)
        out.fill_(float("nan"))
        g.replay()
        exp = ref.infllm_scores(qn, ck, table, lens, page, sm)
        check_scores(out, exp)
        if prev is not None:  # negative control: the replay did use the new inputs
            assert not torch.equal(out.cpu(), prev)
        prev = out.cpu().clone()


def test_infllm_fallback_and_errors():
    """Shapes the kernels do not cover run the reference; the raw op names bad arguments."""
    seeded("fallback")
    B, Hq, Hk, D, page = 2, 8, 2, 96, 32  # head dim 96: not instantiated
    q, ck, table, sl, NB = _score_inputs(B, Hq, Hk, D, page, torch.bfloat16, [300, 200], True)
    out = infllm._infllm_scores(q.to(DEV), ck.to(DEV), table.to(DEV), sl.to(DEV), page, 0.1)
    check_scores(out, ref.infllm_scores(q, ck, table, sl, page, 0.1))
    with pytest.raises(RuntimeError, match="head dim 96"):
        torch.ops.sglang_prr_cuda.infllm_scores(q.to(DEV), ck.to(DEV), table.to(DEV), sl.to(DEV),
                                                page, 0.1)
    with pytest.raises(RuntimeError, match="page_size=64"):
        torch.ops.sglang_prr_cuda.infllm_scores(q.to(DEV), ck.to(DEV), table.to(DEV), sl.to(DEV),
                                                64, 0.1)


@pytest.mark.parametrize("ck_dtype", [torch.float32, torch.bfloat16])  # bf16: the MMA logits
@pytest.mark.parametrize("B,Hq,Hk,D,page,qdtype", [SCORE_CASES[0], SCORE_CASES[2],
                                                    SCORE_CASES[6]])
def test_a_non_finite_logit_drops_its_query_head_from_the_group(B, Hq, Hk, D, page, qdtype,
                                                                ck_dtype):
    """A NaN or +inf in a query head, or a NaN in one compressed key, leaves those heads with no
    softmax: the kernels drop them from their group's sum as the reference does (scores with
    no NaN, the same -inf pattern), and the KV heads they do not touch keep the clean run's
    bits."""
    seeded(f"scores non-finite B={B} Hq={Hq} Hk={Hk} page={page} ck {ck_dtype}")
    seq_lens = [random.randint(3 * page, 40 * page) for _ in range(B)]
    seq_lens[0] = 37 * page + random.randint(1, page - 1)  # several chunks of the logits pass
    q, ck, table, sl, NB = _score_inputs(B, Hq, Hk, D, page, qdtype, seq_lens, False, ck_dtype)
    sm, G = 1.0 / math.sqrt(D), Hq // Hk
    td, sld = table.to(DEV), sl.to(DEV)
    clean = torch.ops.sglang_prr_cuda.infllm_scores(q.to(DEV), ck.to(DEV), td, sld, page,
                                                    sm).cpu()
    b = B - 1
    for bad in (float("nan"), float("inf")):
        h, g = random.randrange(Hk), random.randrange(G)
        q2 = q.clone()
        q2[b, h * G + g, random.randrange(D)] = bad
        out = torch.ops.sglang_prr_cuda.infllm_scores(q2.to(DEV), ck.to(DEV), td, sld, page, sm)
        exp = ref.infllm_scores(q2, ck, table, sl, page, sm)
        check_scores(out, exp)
        out = out.cpu()
        rest = torch.ones_like(out, dtype=torch.bool)
        rest[b, h] = False
        assert torch.equal(out[rest], clean[rest]), "other KV heads keep their bits"
        f = torch.isfinite(clean[b, h])
        if G > 1:  # the group's other heads keep their (finite, changed) scores
            assert not torch.allclose(out[b, h][f], clean[b, h][f], rtol=1e-3, atol=1e-5)
        else:  # the group's only head is gone: 0 where a key is
            assert torch.equal(out[b, h][f], torch.zeros_like(out[b, h][f]))
    # a NaN compressed key inside request 0 drops every head of its KV head there
    h = random.randrange(Hk)
    e = random.randint(1, (seq_lens[0] - 32) // 16 + 1)
    ck2 = ck.clone()
    ck2[int(table[0, e // (page // 16)]), e % (page // 16), h, random.randrange(D)] = math.nan
    out = torch.ops.sglang_prr_cuda.infllm_scores(q.to(DEV), ck2.to(DEV), td, sld, page, sm)
    check_scores(out, ref.infllm_scores(q, ck2, table, sl, page, sm))
    out = out.cpu()
    f = torch.isfinite(clean[0, h])
    assert torch.equal(out[0, h][f], torch.zeros_like(out[0, h][f]))
    assert not torch.equal(clean[0, h][f], torch.zeros_like(clean[0, h][f]))  # control
