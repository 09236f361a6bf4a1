"""Kernel benchmark: PRR sparse attention and selection on one GPU, beside their baselines.

1. Sparse attention (the paper's Table III grid): block 16/32/64/128/256 x token budget
   1K/2K/4K/6K/8K at batch 1/8/32, Llama-3-8B layer (32 q / 8 KV heads, head dim 128, bf16).
   ``ours_partials``: ``sparse_attn_partials`` (per-block (o, lse), the PRR speculative/repair
   pass); ``ours_full``: ``ops.attend_set`` (a finished attention state over the set: partials +
   ``merge_partials``, or the fused op where the library has one);
   ``fi_decode``: FlashInfer ``BatchDecodeWithPagedKVCacheWrapper`` over the same number of
   selected pages per request in the same paged pool (tensor cores by default, SGLang's setting
   for this shape; ``--fi-tensor-cores both`` takes the better of on/off);
   ``fi_bsa``: FlashInfer ``sparse.BlockSparseAttentionWrapper`` with one query row per request
   (R = 1) and column blocks of the block size (C = page size) over the pool buffer itself
   (``[num_slots, Hk, D]`` is its dense K/V; column block = page id), planned outside the timing.
   Our selection is per KV head (as DSA selects); both FlashInfer baselines take one block list
   per request, shared by all heads. They get KV head 0's list of our set: the same tokens for
   that head, the same count for the others, so all variants move the same KV bytes. A check
   outside the timing runs ours with that list on every head and records FlashInfer's deviation
   from it (``fi_*_relerr``).
2. Selection at block 64, context 8K-128K, batch 1/8/32, over bf16 summaries rounded outward as
   the server stores them (``--sel-dtype fp32``: float32), torch reference on the same GPU:
   ``ours`` = ``quest_scores`` + ``select_topk``; ``full`` adds ``set_difference``,
   ``holt_update`` and ``predict_set``; ``fused`` = ``quest_select`` (scores, top-K and M = A \\ P
   in one op) and ``fused_full`` = ``quest_select`` + ``predict_update`` (Holt update and the next
   prediction), each timed when the op exists.

Timing: every variant is captured in a CUDA graph that calls it over R rotating input sets
(different pages, so repeated replays do not run out of L2), replayed ``--reps`` times; the
per-call time is replay time / R; median and p10-p90 spread are reported, twice: replays back
to back (``<variant>_us``, ``_p10``, ``_p90``: warm L2, as in earlier CSVs) and replays each
after an L2 flush (``<variant>_cold_us``, ``_cold_p10``, ``_cold_p90``; ``common.L2Flush``
reads twice the L2 between replays, outside the timed span), the server's situation, where
the layer's weights pass through the L2 between two attention calls. A variant that cannot be
captured is timed eagerly with CUDA events over the same R calls (said in the ``note`` column).
GB/s counts the bytes that must move (KV of the selected tokens; the summaries of the request's
blocks, plus the predictor state read and written for the full steps) over the median
(``_GBps``, ``_cold_GBps``), and ``_pct_copy`` / ``_cold_pct_copy`` put it in percent of the
device-to-device copy bandwidth measured once at the start of the same run (``copy_GBps``: a
1 GiB copy, read + write bytes). ``attn_launch`` names the attention launch's knobs the
environment forces (``knobs.attn_launch``: ``pages-packed`` / ``pages-one`` for
``SGLANG_PRR_ATTN_PACK=1`` / ``0``, ...; empty: the launch's shape rules).

    python benchmarks/bench_kernels.py              # full grid -> benchmarks/results/kernels*.csv
    python benchmarks/bench_kernels.py --quick      # a few points
    python benchmarks/bench_kernels.py --plot-only  # PNG + summary from the CSVs (no GPU needed)
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402  (the benchmarks' one graph timer)
from common import time_warm_cold  # noqa: E402
from knobs import attn_launch  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
# Bytes each timed graph should touch over its R calls: several times the 60 MB L2 of an H200.
ROTATE_BYTES = 256 << 20
MAX_ROTATE = 64
FI_WORKSPACE = 128 << 20
# FlashInfer output allowed to deviate from ours over the same tokens (bf16 output rounding).
FI_CHECK_TOL = 2e-2


# Llama-3-8B layer: query heads, KV heads, head dim.
LAYER = (32, 8, 128)
# The selection's summary dtypes (--sel-dtype): bf16 is what the server stores.
SUMMARY_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Where the timed tensors live ("cpu" only in the CPU dry run of the tests, with the timing,
# the kernels and FlashInfer stubbed).
DEVICE = "cuda"


def cuda_ops():
    """The kernel library's ops (``ours_partials`` and the unfused selection call them directly)."""
    return torch.ops.sglang_prr_cuda


def _sync(empty_cache: bool = False):
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        if empty_cache:
            torch.cuda.empty_cache()


def time_events(calls, reps, cold=False):
    """Eager timing (for what a graph cannot capture): CUDA events around the R calls, per call;
    ``cold``: the L2 flushed before each round, outside the events."""
    return common.time_eager(calls, reps, 1, common.flusher(DEVICE) if cold else None, DEVICE)


def time_calls(calls, reps):
    """CUDA-graph timing with a warm and a cold L2, or eager CUDA-event timing when capture
    fails: ``(warm (median, p10, p90), cold (median, p10, p90), note)``."""
    try:
        t = time_warm_cold(calls, reps, device=DEVICE)
        return t["warm"], t["cold"], ""
    except Exception as e:  # noqa: BLE001 - recorded in the CSV
        _sync()
        return (time_events(calls, reps), time_events(calls, reps, cold=True),
                f"eager CUDA events (graph capture failed: {_short(e)})")


def put_times(res: dict, key: str, warm, cold, nbytes: Optional[int], copy_gbps=None) -> None:
    """A variant's columns: ``key_us/_p10/_p90`` (warm L2), ``key_cold_us/_cold_p10/_cold_p90``
    and, with the bytes it must move, ``key_GBps``, ``key_cold_GBps`` and their percent of the
    run's copy bandwidth (``key_pct_copy``, ``key_cold_pct_copy``)."""
    for tag, t in (("", warm), ("_cold", cold)):
        res[f"{key}{tag}_us"], res[f"{key}{tag}_p10"], res[f"{key}{tag}_p90"] = t
    put_bandwidth(res, key, nbytes, copy_gbps)


def put_bandwidth(res: dict, key: str, nbytes: Optional[int], copy_gbps=None) -> None:
    """``key_GBps``, ``key_cold_GBps`` from the medians, and percent of ``copy_gbps``."""
    if not nbytes:
        return
    for tag in ("", "_cold"):
        if res.get(f"{key}{tag}_us"):
            gbps = nbytes / res[f"{key}{tag}_us"] / 1e3
            res[f"{key}{tag}_GBps"] = gbps
            if copy_gbps:
                res[f"{key}{tag}_pct_copy"] = 100.0 * gbps / copy_gbps


def _short(e: BaseException, n: int = 160) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:n]


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth, GB/s: the median of ``reps`` copies of ``nbytes``,
    counting the bytes read and written (2 x ``nbytes``): the ceiling the kernels' GB/s are
    put against (``_pct_copy``)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    t_us = common.time_eager([lambda: y.copy_(x)], reps, warmup=3, device=DEVICE)[0]
    del x, y
    return 2 * nbytes / (t_us * 1e-6) / 1e9


def op_impl(name: str) -> str:
    """How ``torch.ops.sglang_prr.<name>`` runs on CUDA: 'kernel', 'reference' or 'absent'."""
    if not hasattr(torch.ops.sglang_prr, name):
        return "absent"
    has = torch._C._dispatch_has_kernel_for_dispatch_key(f"sglang_prr::{name}", "CUDA")
    return "kernel" if has else "reference"


def attend_set_impl() -> str:
    """What ``ops.attend_set`` (the ``ours_full`` variant) runs on CUDA."""
    for name in ("attend_set", "sparse_attn_merge"):
        if hasattr(torch.ops.sglang_prr, name):
            return f"{name} ({op_impl(name)})"
    return "sparse_attn_partials + merge_partials"


# ----------------------------------------------------------------------------- block lists
def request_block_lists(table: torch.Tensor, idx: torch.Tensor, cnt: torch.Tensor,
                        head: int = 0):
    """One block list per request for the one-list-per-request baselines (FlashInfer decode and
    block-sparse): the pages of KV head ``head``'s blocks, in block order, as CSR.

    table: ``[B, NB]`` page ids; idx/cnt: our per-KV-head lists ``[B, Hk, N]`` / ``[B, Hk]``.
    Returns ``(indptr [B+1] int32, indices [nnz] int32)``: request ``b``'s pages are
    ``indices[indptr[b]:indptr[b+1]]``. As a BSR matrix over the pool (R = 1 query row per
    request, C = page size, K/V = the ``[num_slots, Hk, D]`` pool buffer) column block ``p``
    is page ``p``, i.e. slots ``p * C .. p * C + C - 1``: the tokens of those blocks when every
    listed block is full (the benchmark's contexts are whole blocks). Host-side (plan time).
    """
    B, _, N = idx.shape
    ids = idx[:, head, :].long()
    valid = (torch.arange(N, device=idx.device) < cnt[:, head].long().unsqueeze(-1)) & (ids >= 0)
    pages = torch.gather(table.long(), 1, ids.clamp(min=0))
    counts = valid.sum(-1)
    indptr = torch.zeros(B + 1, dtype=torch.int32, device=idx.device)
    indptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
    indices = pages[valid].to(torch.int32).contiguous()  # row-major: request order, block order
    return indptr, indices


def bsr_slots(indptr: torch.Tensor, indices: torch.Tensor, C: int, row: int) -> torch.Tensor:
    """KV slots that BSR row ``row`` attends to (sorted): what FlashInfer reads for request row."""
    lo, hi = int(indptr[row]), int(indptr[row + 1])  # host-ok: check/test helper
    cols = indices[lo:hi].long()
    return (cols.unsqueeze(-1) * C + torch.arange(C, device=cols.device)).flatten().sort().values


def list_slots(table: torch.Tensor, idx: torch.Tensor, cnt: torch.Tensor, page: int, b: int,
               h: int) -> torch.Tensor:
    """KV slots of our block list of request ``b`` / KV head ``h`` (sorted), as the reference
    gathers them (block ``j`` -> page ``table[b, j]`` -> slots ``page * page_size + t``)."""
    n = int(cnt[b, h])  # host-ok: check/test helper
    ids = idx[b, h, :n].long()
    pages = table[b].long()[ids]
    slots = pages.unsqueeze(-1) * page + torch.arange(page, device=ids.device)
    return slots.flatten().sort().values


# ----------------------------------------------------------------------------- attention
class FiState:
    """FlashInfer handle, and the variants whose build failed (not retried)."""

    def __init__(self, mod, tensor_cores: Sequence[bool], bsa_backend: str):
        self.mod = mod
        self.tensor_cores = list(tensor_cores)
        self.bsa_backend = bsa_backend
        self.dead: Dict[str, str] = {}  # variant key -> why its build failed

    def failed(self, key: str, e: BaseException) -> str:
        """Record a failed point; a failed JIT build is not retried (it would cost minutes per
        point), other failures are retried at the next point."""
        msg = _short(e)
        if any(w in str(e).lower() for w in ("ninja", "compil", "build", "nvcc")):
            self.dead[key] = msg
        return msg

    def is_dead(self, key: str) -> Optional[str]:
        return self.dead.get(key)


def attention_point(B: int, page: int, budget: int, context: int, Hq=32, Hk=8, D=128,
                    device=None, dtype=torch.bfloat16):
    """Pool, table and R rotating input sets of one grid point (see the module docstring)."""
    device = device or DEVICE
    n = budget // page
    kv_bytes = B * Hk * budget * D * 2 * 2
    R = max(4, min(MAX_ROTATE, math.ceil(ROTATE_BYTES / kv_bytes)))
    ctx = max(context, min(R * budget, 256 * 1024))
    ctx = -(-ctx // page) * page  # whole blocks (FlashInfer's BSR has no partial last block)
    nbr = ctx // page  # blocks per request
    num_pages = B * nbr + 1  # page 0: SGLang's padding page
    k = torch.randn(num_pages * page, Hk, D, device=device, dtype=dtype)
    v = torch.randn(num_pages * page, Hk, D, device=device, dtype=dtype)
    table = (torch.randperm(B * nbr, device=device) + 1).view(B, nbr).to(torch.int32)
    seq = torch.full((B,), ctx, device=device, dtype=torch.int32)
    sets = []
    for _ in range(R):
        q = torch.randn(B, Hq, D, device=device, dtype=dtype)
        # per-(request, KV head) random blocks, ascending
        r = torch.rand(B, Hk, nbr, device=device)
        idx = r.topk(n, dim=-1).indices.sort(-1).values.to(torch.int32)
        cnt = torch.full((B, Hk), n, device=device, dtype=torch.int32)
        indptr, indices = request_block_lists(table, idx, cnt, head=0)
        sets.append({"q": q, "idx": idx, "cnt": cnt, "indptr": indptr, "indices": indices})
    return {"k": k, "v": v, "table": table, "seq": seq, "sets": sets, "R": R, "n": n,
            "kv_bytes": kv_bytes, "ctx": ctx}


def bench_attention(args, writer, fi: Optional[FiState]):
    from sglang_prr import ops
    Hq, Hk, D = LAYER
    sm = 1.0 / math.sqrt(D)
    op = cuda_ops()
    rows = []
    for B in args.batches:
        for page in args.blocks:
            for budget in args.budgets:
                t_point = time.time()
                pt = attention_point(B, page, budget, args.context, Hq, Hk, D)
                k, v, table, seq, sets = pt["k"], pt["v"], pt["table"], pt["seq"], pt["sets"]
                kv_bytes, notes = pt["kv_bytes"], []

                part = [lambda s=s: op.sparse_attn_partials(s["q"], k, v, table, seq, s["idx"],
                                                            s["cnt"], page, sm) for s in sets]
                full = [lambda s=s: ops.attend_set(s["q"], k, v, table, seq, s["idx"], s["cnt"],
                                                   page, sm) for s in sets]
                res = {"batch": B, "block": page, "budget": budget, "rotate": pt["R"],
                       "kv_bytes": kv_bytes}
                copy = getattr(args, "copy_gbps", None)
                for key, calls in (("ours_partials", part), ("ours_full", full)):
                    warm, cold, note = time_calls(calls, args.reps)
                    put_times(res, key, warm, cold, kv_bytes, copy)
                    if note:
                        notes.append(f"{key}: {note}")
                if fi is not None:
                    # ours over head 0's list on every head = what both FlashInfer baselines compute
                    s0 = sets[0]
                    shared = s0["idx"][:, :1].expand_as(s0["idx"]).contiguous()
                    o_chk = ops.attend_set(s0["q"], k, v, table, seq, shared, s0["cnt"], page,
                                           sm)[0]
                    bench_fi_decode_point(fi, res, notes, B, Hq, Hk, D, page, k, v, sets, sm,
                                          args.reps, o_chk)
                    bench_fi_bsa_point(fi, res, notes, B, Hq, Hk, D, page, k, v, sets, sm,
                                       args.reps, o_chk)
                if res["ours_full_us"] > 5 * res["ours_partials_us"]:
                    notes.append("ours_full > 5x ours_partials: reference fallback?")
                for key in ("fi_decode", "fi_bsa"):
                    if f"{key}_us" in res:
                        put_bandwidth(res, key, kv_bytes, copy)
                        res[f"speedup_{key}"] = res[f"{key}_us"] / res["ours_partials_us"]
                        res[f"speedup_{key}_cold"] = (res[f"{key}_cold_us"]
                                                      / res["ours_partials_cold_us"])
                if "fi_decode_us" in res:  # names of the earlier runs' columns
                    res["speedup_partials"] = res["speedup_fi_decode"]
                    res["speedup_full"] = res["fi_decode_us"] / res["ours_full_us"]
                res["note"] = "; ".join(notes)
                res["point_s"] = round(time.time() - t_point, 2)
                writer(res)
                rows.append(res)
                nan = float("nan")
                print(f"B={B:2d} block={page:3d} budget={budget:5d}: ours "
                      f"{res['ours_partials_us']:7.2f} us (cold {res['ours_partials_cold_us']:7.2f}"
                      f", full {res['ours_full_us']:7.2f})  "
                      f"fi_decode {res.get('fi_decode_us', nan):7.2f} (cold "
                      f"{res.get('fi_decode_cold_us', nan):7.2f})  fi_bsa "
                      f"{res.get('fi_bsa_us', nan):7.2f} us  "
                      f"x{res.get('speedup_fi_decode', nan):.2f}"
                      f"  {res['ours_partials_GBps']:.0f} GB/s "
                      f"({res.get('ours_partials_cold_pct_copy', nan):.0f}% of copy cold)  "
                      f"[{res['point_s']:.1f} s]"
                      + (f"  note: {res['note']}" if res["note"] else ""), flush=True)
                del k, v, sets, pt
                _sync(empty_cache=True)
    return rows


def _relerr(o: torch.Tensor, ref: torch.Tensor) -> float:
    return float((o.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def bench_fi_decode_point(fi: FiState, res, notes, B, Hq, Hk, D, page, k, v, sets, sm, reps,
                          o_chk):
    best = None
    for tc in fi.tensor_cores:
        key = f"fi_tc{int(tc)}"
        dead = fi.is_dead(key)
        if dead:
            notes.append(f"{key}: skipped ({dead})")
            continue
        try:
            t, note, out0 = bench_fi_decode(fi, tc, B, Hq, Hk, D, page, k, v, sets, sm, reps)
        except Exception as e:  # noqa: BLE001 - a failed baseline point is recorded, not fatal
            notes.append(f"{key} failed: {fi.failed(key, e)}")
            _sync()
            continue
        res[f"{key}_us"], res[f"{key}_cold_us"] = t[0][0], t[1][0]
        err = _relerr(out0, o_chk)
        res[f"{key}_relerr"] = err
        if err > FI_CHECK_TOL:
            notes.append(f"{key}: output differs from ours over the same tokens (rel {err:.2g})")
        if note:
            notes.append(f"{key}: {note}")
        if best is None or t[0][0] < best[0][0][0]:  # the faster warm median
            best = (t, tc, err)
    if best is not None:
        (warm, cold), tc, err = best
        put_times(res, "fi_decode", warm, cold, None)
        res["fi_decode_tc"] = int(tc)
        res["fi_decode_relerr"] = err


def bench_fi_decode(fi: FiState, tc, B, Hq, Hk, D, page, k, v, sets, sm, reps):
    flashinfer = fi.mod
    num_pages = k.shape[0] // page
    kc = k.view(num_pages, page, Hk, D)
    vc = v.view(num_pages, page, Hk, D)
    wrappers = []
    for s in sets:
        ws = torch.empty(FI_WORKSPACE, dtype=torch.uint8, device=DEVICE)
        indptr, indices = s["indptr"], s["indices"]
        last = torch.full((B,), page, device=DEVICE, dtype=torch.int32)  # whole blocks
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
        w.plan(indptr, indices, last, Hq, Hk, D, page, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16, sm_scale=sm)
        wrappers.append((w, s["q"], ws))
    out0 = wrappers[0][0].run(wrappers[0][1], (kc, vc))
    warm, cold, note = time_calls([lambda w=w, q=q: w.run(q, (kc, vc)) for w, q, _ in wrappers],
                                  reps)
    return (warm, cold), note, out0


def bench_fi_bsa_point(fi: FiState, res, notes, B, Hq, Hk, D, page, k, v, sets, sm, reps,
                       o_chk):
    """``fi_bsa``: the chosen backend (fa2 when it fails), or the faster of fa3 and fa2."""
    if fi.bsa_backend == "both":
        groups = [["fa3"], ["fa2"]]
    else:
        groups = [[fi.bsa_backend] + (["fa2"] if fi.bsa_backend != "fa2" else [])]
    best = None
    for group in groups:
        for backend in group:
            key = f"fi_bsa_{backend}"
            dead = fi.is_dead(key)
            if dead:
                notes.append(f"{key}: skipped ({dead})")
                continue
            try:
                t, note, out0, used = bench_fi_bsa(fi, backend, B, Hq, Hk, D, page, k, v, sets,
                                                   sm, reps)
            except Exception as e:  # noqa: BLE001 - a failed baseline point is recorded
                notes.append(f"{key} failed: {fi.failed(key, e)}")
                _sync()
                continue
            err = _relerr(out0, o_chk)
            if err > FI_CHECK_TOL:
                notes.append(f"{key}: output differs from ours over the same tokens "
                             f"(rel {err:.2g})")
            if note:
                notes.append(f"{key}: {note}")
            if len(groups) > 1:
                res[f"{key}_us"], res[f"{key}_cold_us"] = t[0][0], t[1][0]
            if best is None or t[0][0] < best[0][0][0]:  # the faster warm median
                best = (t, used, err)
            break  # this group has its time
    if best is not None:
        (warm, cold), used, err = best
        put_times(res, "fi_bsa", warm, cold, None)
        res["fi_bsa_backend"] = used
        res["fi_bsa_relerr"] = err


def bench_fi_bsa(fi: FiState, backend, B, Hq, Hk, D, page, k, v, sets, sm, reps):
    """FlashInfer's block-sparse attention: rows = requests (R = 1), C = page, K/V = the pool."""
    wrappers = []
    for s in sets:
        ws = torch.empty(FI_WORKSPACE, dtype=torch.uint8, device=DEVICE)
        w = fi.mod.sparse.BlockSparseAttentionWrapper(ws, backend=backend)
        w.plan(s["indptr"], s["indices"], B, k.shape[0], 1, page, Hq, Hk, D, sm_scale=sm,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
               o_data_type=torch.bfloat16)
        wrappers.append((w, s["q"], ws))
    w0 = wrappers[0][0]
    used = (w0._backend if getattr(w0, "_use_tensor_cores", True) else "decode") + \
        f"/{backend}"
    out0 = w0.run(wrappers[0][1], k, v)
    warm, cold, note = time_calls([lambda w=w, q=q: w.run(q, k, v) for w, q, _ in wrappers],
                                  reps)
    return (warm, cold), note, out0, used


# ----------------------------------------------------------------------------- selection
def bench_selection(args, writer):
    from sglang_prr import reference as ref
    op = cuda_ops()
    sp = torch.ops.sglang_prr
    fused_ok = op_impl("quest_select") != "absent"
    fused_full_ok = fused_ok and op_impl("predict_update") != "absent"
    (Hq, Hk, D), page = LAYER, 64
    k_blocks, n_pred, sink, local = 2048 // page, 48, 1, 1
    n_out = k_blocks + sink + local
    n_p = n_pred + sink + local
    rows = []
    for B in args.batches:
        for ctx in args.sel_contexts:
            t_point = time.time()
            nb = ctx // page
            sdt = SUMMARY_DTYPES[args.sel_dtype]
            sum_bytes = B * nb * Hk * D * sdt.itemsize * 2
            state_bytes = B * Hk * nb * 4 * 2 * 2  # level + trend, read and written
            R = max(2, min(32, math.ceil(ROTATE_BYTES / sum_bytes)))
            pages = R * B * nb + 1
            kmin = torch.randn(pages, Hk, D, device=DEVICE)
            kmax = kmin + torch.rand(pages, Hk, D, device=DEVICE)
            if sdt == torch.bfloat16:  # rounded outward, as the server stores them
                kmin, kmax = ref.round_bf16(kmin, down=True), ref.round_bf16(kmax, down=False)
            kmin, kmax = kmin.to(sdt), kmax.to(sdt)
            nblk = torch.full((B,), nb, device=DEVICE, dtype=torch.int64)
            nblk_next = nblk + 1
            sets = []
            perm = torch.randperm(R * B * nb, device=DEVICE) + 1
            for r in range(R):
                q = torch.randn(B, Hq, D, device=DEVICE, dtype=torch.bfloat16)
                table = perm[r * B * nb:(r + 1) * B * nb].view(B, nb).to(torch.int32)
                p_idx = torch.rand(B, Hk, nb, device=DEVICE).topk(min(n_p, nb), dim=-1).indices
                st = {"level": torch.randn(B, Hk, nb, device=DEVICE),
                      "trend": torch.randn(B, Hk, nb, device=DEVICE) * 0.1,
                      "n_init": torch.full((B,), nb - 1, device=DEVICE, dtype=torch.int64),
                      "p_idx": p_idx.sort(-1).values.to(torch.int32).contiguous(),
                      "p_cnt": torch.full((B, Hk), min(n_p, nb), device=DEVICE,
                                          dtype=torch.int32),
                      "theta": torch.tensor([[0.6, 0.3, 0.5]] * B, device=DEVICE)}
                sets.append((q, table, st))

            def ours(s, full):
                q, table, st = s
                scores = op.quest_scores(q, kmin, kmax, table, nblk)
                a_idx, a_cnt = op.select_topk(scores, nblk, k_blocks, sink, local, n_out)
                if full:
                    op.set_difference(a_idx, a_cnt, st["p_idx"], st["p_cnt"], nb)
                    op.holt_update(st["level"], st["trend"], st["n_init"], scores, nblk,
                                   st["theta"][:, 0], st["theta"][:, 1])
                    op.predict_set(st["level"], st["trend"], st["theta"][:, 2].contiguous(),
                                   st["n_init"], nblk_next, n_pred, sink, local)

            def fused(s, full):
                q, table, st = s
                scores = sp.quest_select(q, kmin, kmax, table, nblk, st["p_idx"], st["p_cnt"],
                                         k_blocks, sink, local, n_out, None, None, None)[0]
                if full:
                    sp.predict_update(st["level"], st["trend"], st["n_init"], scores, nblk,
                                      st["theta"], nblk_next, n_pred, sink, local)

            def refr(s, full):
                q, table, st = s
                scores = ref.quest_scores(q, kmin, kmax, table, nblk)
                a_idx, a_cnt = ref.select_topk(scores, nblk, k_blocks, sink, local)
                if full:
                    ref.set_difference(a_idx, a_cnt, st["p_idx"], st["p_cnt"], nb)
                    ref.holt_update(st["level"], st["trend"], st["n_init"], scores, nblk,
                                    st["theta"][:, 0], st["theta"][:, 1])
                    ref.predict_set(st["level"], st["trend"], st["theta"][:, 2].contiguous(),
                                    st["n_init"], nblk_next, n_pred, sink, local)

            res = {"batch": B, "context": ctx, "block": page, "rotate": R,
                   "sel_dtype": args.sel_dtype,
                   "summary_bytes": sum_bytes, "state_bytes": state_bytes}
            notes = []
            variants = [("ours", ours, False), ("ours", ours, True)]
            if fused_ok:
                variants.append(("fused", fused, False))
            if fused_full_ok:
                variants.append(("fused", fused, True))
            variants += [("ref", refr, False), ("ref", refr, True)]
            for name, fn, full in variants:
                key = f"{name}_{'full' if full else 'select'}"
                calls = [lambda s=s, fn=fn, full=full: fn(s, full) for s in sets]
                try:
                    warm, cold, note = time_calls(calls, args.reps)
                except Exception as e:  # noqa: BLE001 - new ops: record, keep the grid going
                    if name != "fused":
                        raise
                    notes.append(f"{key} failed: {_short(e)}")
                    _sync()
                    continue
                if note:
                    notes.append(f"{key}: {note}")
                moved = sum_bytes + (state_bytes if full else 0)
                put_times(res, key, warm, cold, moved, getattr(args, "copy_gbps", None))
            res["scores_GBps"] = res["ours_select_GBps"]  # name of the earlier runs' column
            res["speedup_select"] = res["ref_select_us"] / res["ours_select_us"]
            res["speedup_full"] = res["ref_full_us"] / res["ours_full_us"]
            for name in ("quest_select", "predict_update"):
                if op_impl(name) != "kernel":
                    notes.append(f"{name}: {op_impl(name)}")
            res["note"] = "; ".join(notes)
            res["point_s"] = round(time.time() - t_point, 2)
            writer(res)
            rows.append(res)
            nan = float("nan")
            print(f"B={B:2d} ctx={ctx:6d}: select ours {res['ours_select_us']:7.2f} (cold "
                  f"{res['ours_select_cold_us']:7.2f}) fused "
                  f"{res.get('fused_select_us', nan):7.2f} ref {res['ref_select_us']:8.2f} us; "
                  f"full ours {res['ours_full_us']:7.2f} fused {res.get('fused_full_us', nan):7.2f}"
                  f" ref {res['ref_full_us']:8.2f}; {res['scores_GBps']:.0f} GB/s "
                  f"[{res['point_s']:.1f} s]" + (f"  note: {res['note']}" if res["note"] else ""),
                  flush=True)
            del kmin, kmax, sets
            _sync(empty_cache=True)
    return rows


# ----------------------------------------------------------------------------- output
class CsvWriter:
    def __init__(self, path: Path, meta: dict):
        self.path = path
        self.meta = meta
        self.rows = []

    def __call__(self, row):
        self.rows.append({**self.meta, **row})
        keys = []
        for r in self.rows:
            keys += [k for k in r if k not in keys]
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for r in self.rows:
                w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})


def _num(r: dict, key: str) -> Optional[float]:
    """A row's value as float (rows come from this run or from a CSV); None when absent/blank."""
    v = r.get(key)
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except ValueError:
        return None
    return None if math.isnan(x) else x


ATT_SUMMARY = ("ours_partials", "ours_full", "fi_decode", "fi_bsa")
SEL_SUMMARY = (("ours", "ours_select"), ("fused", "fused_select"), ("full", "ours_full"),
               ("fused_full", "fused_full"), ("ref", "ref_select"), ("ref_full", "ref_full"))


def summary(att_rows: List[dict], sel_rows: List[dict], sel_context=131072) -> str:
    """Short table of every point (µs, medians) of this run's or a CSV's rows: warm
    L2, then, where the rows have them (runs since the cold columns), cold L2 with the percent
    of the copy bandwidth of the partials and of the finished attention (``ours_full``: the
    column the attention's bandwidth target is stated on), and of the selection alone and of
    the selection + predictor in one pass (``fused_full``: the selection's)."""
    def cell(x):
        return f"{x:9.1f}" if x is not None else f"{'-':>9}"

    out = []
    att = {(int(float(r["batch"])), int(float(r["block"])), int(float(r["budget"]))): r
           for r in att_rows}
    pts = sorted(att)  # (batch, block, budget): every point the rows hold
    sel = sorted((r for r in sel_rows if int(float(r["context"])) == sel_context),
                 key=lambda r: int(float(r["batch"])))
    for tag, what in (("", "warm L2"), ("_cold", "cold L2: flushed before every replay")):
        if tag and not any(_num(r, "ours_partials_cold_us") for r in att_rows) and \
                not any(_num(r, "ours_select_cold_us") for r in sel_rows):
            break  # an older CSV: warm only
        def pcts(r, keys):  # percent of the copy bandwidth of each key, "-" where absent
            if not tag:
                return ""
            vals = [_num(r, f"{k}{tag}_pct_copy") for k in keys]
            return "".join(f" {v:4.0f}%" if v is not None else f" {'-':>5}" for v in vals)

        if pts:
            out.append(f"sparse attention, µs (median, {what}; fi_* over the same page count "
                       f"per request)")
            out.append(f"{'batch':>5} {'block':>5} {'budget':>6} "
                       + " ".join(f"{v:>13}" for v in ATT_SUMMARY)
                       + (" (% of copy: partials, full)" if tag else ""))
            for p in pts:
                r = att[p]
                out.append(f"{p[0]:5d} {p[1]:5d} {p[2]:6d} "
                           + " ".join(f"{cell(_num(r, v + tag + '_us')):>13}"
                                      for v in ATT_SUMMARY)
                           + pcts(r, ("ours_partials", "ours_full")))
        if sel:
            out.append(f"selection at {sel_context // 1024}K context, block "
                       f"{int(float(sel[0]['block']))}, µs (median, {what})")
            out.append(f"{'batch':>5} " + " ".join(f"{name:>10}" for name, _ in SEL_SUMMARY)
                       + (" (% of copy: ours, fused_full)" if tag else ""))
            for r in sel:
                out.append(f"{int(float(r['batch'])):5d} "
                           + " ".join(f"{cell(_num(r, key + tag + '_us')):>10}"
                                      for _, key in SEL_SUMMARY)
                           + pcts(r, ("ours_select", "fused_full")))
    return "\n".join(out)


def read_csv(path: Path) -> List[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot(out_dir: Path, tag: str = "") -> List[Path]:
    """PNG of each CSV found in ``out_dir`` (columns absent from older CSVs are skipped)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    rows = read_csv(out_dir / f"kernels_attention{tag}.csv")
    if rows:
        batches = sorted({int(r["batch"]) for r in rows})
        fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.5),
                                 squeeze=False)
        styles = (("ours_partials", "-o", "ours"), ("fi_decode", "--x", "FI decode"),
                  ("fi_bsa", ":s", "FI BSA"))
        for ax, B in zip(axes[0], batches):
            for i, blk in enumerate(sorted({int(r["block"]) for r in rows})):
                rs = sorted([r for r in rows if int(r["batch"]) == B and int(r["block"]) == blk],
                            key=lambda r: int(r["budget"]))
                for key, style, label in styles:
                    pts = [(int(r["budget"]), _num(r, f"{key}_us")) for r in rs]
                    pts = [(x, y) for x, y in pts if y is not None]
                    if pts:
                        ax.plot([x for x, _ in pts], [y for _, y in pts], style, color=f"C{i}",
                                markersize=3, label=f"{label} b{blk}")
            ax.set_title(f"sparse attention, batch {B}")
            ax.set_xlabel("token budget")
            ax.set_ylabel("µs (median, CUDA graph)")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=6, ncol=3)
        fig.tight_layout()
        path = out_dir / f"kernels_attention{tag}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    rows = read_csv(out_dir / f"kernels_selection{tag}.csv")
    if rows:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        styles = (("ours_select", "-o", "kernels"), ("fused_select", "-.^", "fused"),
                  ("ref_select", "--x", "torch ref"))
        for i, B in enumerate(sorted({int(r["batch"]) for r in rows})):
            rs = sorted([r for r in rows if int(r["batch"]) == B], key=lambda r: int(r["context"]))
            for key, style, label in styles:
                pts = [(int(r["context"]) // 1024, _num(r, f"{key}_us")) for r in rs]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], style, color=f"C{i}",
                            markersize=4, label=f"{label} B={B}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"context (K tokens), block {rows[0]['block']}")
        ax.set_ylabel("scores + top-K, µs")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"kernels_selection{tag}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096, 6144, 8192])
    p.add_argument("--context", type=int, default=32768, help="tokens per request in the pool")
    p.add_argument("--sel-contexts", type=int, nargs="+",
                   default=[8192, 16384, 32768, 65536, 131072])
    p.add_argument("--sel-dtype", choices=sorted(SUMMARY_DTYPES), default="bf16",
                   help="the selection's summaries (the server stores bf16)")
    p.add_argument("--reps", type=int, default=30, help="graph replays per variant and point")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--fi-tensor-cores", choices=["on", "off", "both"], default="on",
                   help="FlashInfer decode paths to time (fi_decode = the faster one)")
    p.add_argument("--fi-bsa-backend", choices=["auto", "fa2", "fa3", "both"], default="auto",
                   help="BlockSparseAttentionWrapper backend (fa2 is tried when it fails; "
                   "both: fi_bsa = the faster of fa3 and fa2)")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--skip-selection", action="store_true")
    p.add_argument("--quick", action="store_true", help="a few points of each grid")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="suffix of the CSV/PNG names")
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.blocks, args.budgets = [1, 8], [16, 64], [2048, 8192]
        args.sel_contexts, args.reps = [8192, 131072], 15
    for name in ("batches", "blocks", "budgets", "sel_contexts"):
        bad = [x for x in getattr(args, name) if x <= 0]
        if bad:
            p.error(f"--{name.replace('_', '-')} must be positive, got {bad}")
    bad = [(c, t) for c in args.blocks for t in args.budgets if t % c]
    if bad:
        p.error(f"every budget must be a multiple of every block (budget/block blocks are "
                f"selected), got {bad[:4]}")
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    return args


def main(argv=None):
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    att_csv = args.out / f"kernels_attention{args.tag}.csv"
    sel_csv = args.out / f"kernels_selection{args.tag}.csv"
    if args.plot_only:
        for path in plot(args.out, args.tag):
            print(f"wrote {path}")
        print(summary(read_csv(att_csv), read_csv(sel_csv)))
        return
    t0 = time.time()
    from sglang_prr import kernels, ops  # noqa: F401 - ops registers the dispatching ops
    if not kernels.load():
        sys.exit(f"kernel library unavailable: {kernels.load_error()}")
    fi = None
    if not args.no_flashinfer:
        try:
            import flashinfer
            import flashinfer.sparse  # noqa: F401
            fi = FiState(flashinfer, {"on": [True], "off": [False], "both": [True, False]}[
                args.fi_tensor_cores], args.fi_bsa_backend)
        except ImportError as e:
            print(f"flashinfer not importable ({e}): no baseline", file=sys.stderr)
    meta = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "flashinfer": getattr(fi.mod, "__version__", "?") if fi else "none",
            "attend_set": attend_set_impl(), "quest_select": op_impl("quest_select"),
            "predict_update": op_impl("predict_update"),
            "attn_launch": attn_launch()}  # the attention's forced knobs (knobs.attn_launch)
    bw = copy_bandwidth()
    print(f"{meta['gpu']}  copy bandwidth {bw:.0f} GB/s (read+write)  torch {torch.__version__} "
          f"flashinfer {meta['flashinfer']}  attend_set: {meta['attend_set']}  quest_select: "
          f"{meta['quest_select']}  predict_update: {meta['predict_update']}", flush=True)
    meta["copy_GBps"] = round(bw)
    args.copy_gbps = bw  # the _pct_copy columns
    att_rows, sel_rows = [], []
    if not args.skip_attention:
        att_rows = bench_attention(args, CsvWriter(att_csv, meta), fi)
        print(f"attention grid: {len(att_rows)} points in {time.time() - t0:.0f} s", flush=True)
    t1 = time.time()
    if not args.skip_selection:
        sel_rows = bench_selection(args, CsvWriter(sel_csv, meta))
        print(f"selection grid: {len(sel_rows)} points in {time.time() - t1:.0f} s", flush=True)
    print(f"total {time.time() - t0:.0f} s")
    print(summary(att_rows, sel_rows), flush=True)
    try:
        for path in plot(args.out, args.tag):
            print(f"wrote {path}")
    except Exception as e:  # noqa: BLE001 - e.g. no matplotlib there: --plot-only later
        print(f"no plot ({_short(e)}); the CSVs are written, run --plot-only", file=sys.stderr)


if __name__ == "__main__":
    main()
