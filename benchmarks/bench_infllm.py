"""InfLLM-v2 kernels beside the torch reference on one GPU: ``infllm_scores`` (block scores from the
compressed keys) and ``infllm_update`` (one decode step's compressed keys).

Llama-3-8B layer (32 q / 8 KV heads, head dim 128, bf16 q and keys, compressed keys in bfloat16
or, with ``--ck-dtype fp32``, float32 (``SGLANG_PRR_INFLLM_CK``); both side by side with
``--ck-dtype fp32 bf16``: the ``ck`` column), block 64, 128K context (8191 complete compressed
keys per request), batch 1 and 8 by default.
Every variant is captured in a CUDA graph that calls it over R rotating input sets (different
pages, >= 256 MB in all, so replays do not run from the 60 MB L2), replayed ``--reps`` times;
per-call time = replay / R; median and p10/p90, back to back (``us_*``) and with the L2 flushed
before every replay (``us_cold_*``, ``common.L2Flush``). GB/s counts the compressed keys that
must be read (``B x n_ck x Hk x D x`` 4 or 2 bytes) over the median (``GBps``, ``GBps_cold``).
The kernel is checked against the reference on one input set before timing.

``--loads default ring pool both`` times the scores with each form of their loads (the
``loads`` column): ``ring``, the bulk logits pass's page ids in one round trip first
(``SGLANG_PRR_INFLLM_RING=ids-first``; by default thread 0 looks each page up before its copy);
``pool``, the pool's length, statistics and logits in one round trip
(``SGLANG_PRR_INFLLM_POOL=loads-first``; three by default); ``both``; the update once.
``--logits pick mma bulk regs`` times the scores with each logits variant (the ``logits``
column, ``SGLANG_PRR_INFLLM_VARIANT``): ``pick``, the launcher's choice (the tensor cores for
bf16 keys and q); ``mma``, ``bulk`` or ``regs`` forced where it applies.

    python benchmarks/bench_infllm.py [--batch 1 8] [--ctx 131072] [--ck-dtype fp32 bf16] \
        [--loads default ring pool both] [--logits pick mma bulk regs] [--csv out.csv]

Library: ``SGLANG_PRR_INFLLM_LIB`` (a library holding the InfLLM ops) or the full kernel library.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_prr import reference as ref  # noqa: E402
from sglang_prr.methods.infllm_v2 import CK_DTYPES, DEFAULT_CK  # noqa: E402  (the knob's)

sys.path.insert(0, str(ROOT / "benchmarks"))
from common import time_warm_cold  # noqa: E402  (the benchmarks' one graph timer)

ROTATE_BYTES = 256 << 20
# The scores' load forms: (SGLANG_PRR_INFLLM_RING, SGLANG_PRR_INFLLM_POOL), read at each launch.
LOAD_FORMS = {"default": ("serial", "late"), "ring": ("ids-first", "late"),
              "pool": ("serial", "loads-first"), "both": ("ids-first", "loads-first")}
ENV_RING, ENV_POOL = "SGLANG_PRR_INFLLM_RING", "SGLANG_PRR_INFLLM_POOL"
# The logits variants (SGLANG_PRR_INFLLM_VARIANT, read at each launch; "" lets the launcher pick).
LOGITS = {"pick": "", "mma": "mma", "bulk": "bulk", "regs": "regs"}
ENV_VARIANT = "SGLANG_PRR_INFLLM_VARIANT"
DEVICE = "cuda"  # "cpu" only in the tests' dry run (kernels and timer stubbed)


def cuda_ops():
    """The kernel library's ops (the tests' dry run puts the reference in their place)."""
    return torch.ops.sglang_prr_cuda


def load_lib():
    lib = os.environ.get("SGLANG_PRR_INFLLM_LIB")
    if lib:
        torch.ops.load_library(lib)
    else:
        from sglang_prr import kernels
        assert kernels.load(), kernels.load_error()


def _times(t: dict) -> dict:
    """``us_median/_p10/_p90`` (warm L2) and ``us_cold_median/_p10/_p90`` columns."""
    out = {}
    for tag, key in (("", "warm"), ("_cold", "cold")):
        med, p10, p90 = t[key]
        out.update({f"us{tag}_median": round(med, 2), f"us{tag}_p10": round(p10, 2),
                    f"us{tag}_p90": round(p90, 2)})
    return out


def bench_scores(B, ctx, page, Hq, Hk, D, reps, rows, with_ref=True, ck_dtype=DEFAULT_CK,
                 loads="default", logits="pick"):
    dev = torch.device(DEVICE)
    # before the first launch and the graphs' capture
    os.environ[ENV_RING], os.environ[ENV_POOL] = LOAD_FORMS[loads]
    os.environ[ENV_VARIANT] = LOGITS[logits]
    NB = ctx // page
    pp = page // 16
    n_ck = (ctx - 32) // 16 + 1
    dt = CK_DTYPES[ck_dtype]
    key_bytes = B * n_ck * Hk * D * dt.itemsize
    R = max(2, math.ceil(ROTATE_BYTES / key_bytes))
    num_pages = R * B * NB + 1
    ck = torch.randn(num_pages, pp, Hk, D, device=dev).to(dt)
    perm = torch.randperm(num_pages - 1, device=dev) + 1
    tables = [perm[r * B * NB:(r + 1) * B * NB].view(B, NB).contiguous() for r in range(R)]
    qs = [torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16) for _ in range(R)]
    sl = torch.full((B,), ctx, dtype=torch.int64, device=dev)
    sm = 1.0 / math.sqrt(D)
    out = cuda_ops().infllm_scores(qs[0], ck, tables[0], sl, page, sm)
    exp = ref.infllm_scores(qs[0], ck, tables[0], sl, page, sm)
    fin = torch.isfinite(exp)
    if os.environ.get("SGLANG_PRR_INFLLM_STAGE"):  # a partial kernel (timing breakdown): no check
        err = float("nan")
    else:
        assert torch.equal(torch.isneginf(out), torch.isneginf(exp))
        err = ((out[fin] - exp[fin]).abs() / (exp[fin].abs() + 1e-6)).max().item()  # host-ok
    for name, fn in (("kernel", lambda r: cuda_ops().infllm_scores(
                         qs[r], ck, tables[r], sl, page, sm)),
                     ("reference", lambda r: ref.infllm_scores(qs[r], ck, tables[r], sl, page,
                                                               sm)))[:2 if with_ref else 1]:
        t = time_warm_cold([lambda r=r: fn(r) for r in range(R)], reps, device=DEVICE)
        rows.append(dict(op="infllm_scores", variant=name, ck=ck_dtype, loads=loads,
                         logits=logits if name == "kernel" else "", batch=B,
                         ctx=ctx, page=page, R=R, **_times(t),
                         GBps=round(key_bytes / t["warm"][0] / 1e3, 1),
                         GBps_cold=round(key_bytes / t["cold"][0] / 1e3, 1),
                         max_rel_err=f"{err:.2e}" if name == "kernel" else ""))
    del ck, tables


def bench_update(B, ctx, page, Hk, D, reps, rows, with_ref=True, ck_dtype=DEFAULT_CK):
    dev = torch.device(DEVICE)
    NB = ctx // page
    R = 16
    num_pages = B * NB + 1
    k_buf = torch.randn(num_pages * page, Hk, D, device=dev, dtype=torch.bfloat16)
    rtt = ((torch.randperm(num_pages - 1, device=dev) + 1).view(B, NB, 1) * page
           + torch.arange(page, device=dev)).view(B, NB * page).to(torch.int32)
    ck = torch.zeros(num_pages, page // 16, Hk, D, device=dev, dtype=CK_DTYPES[ck_dtype])
    req = torch.arange(B, device=dev)
    sets = []
    for _ in range(R):
        pos = torch.randint(2, ctx // 16, (B,), device=dev) * 16 - 1
        loc = rtt[req, pos].long()
        sets.append((pos, loc))
    for name, fn in (("kernel", cuda_ops().infllm_update),
                     ("reference", ref.infllm_update))[:2 if with_ref else 1]:
        t = time_warm_cold(
            [lambda p=p, l=l, fn=fn: fn(ck, k_buf, rtt, req, l, p, page) for p, l in sets], reps,
            device=DEVICE)
        rows.append(dict(op="infllm_update", variant=name, ck=ck_dtype, loads="", logits="",
                         batch=B, ctx=ctx, page=page, R=R, **_times(t), GBps="", GBps_cold="",
                         max_rel_err=""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--csv", type=str, default="")
    ap.add_argument("--no-reference", action="store_true", help="time the kernels only")
    ap.add_argument("--ck-dtype", nargs="+", choices=sorted(CK_DTYPES), default=[DEFAULT_CK],
                    help="the compressed keys' dtypes, each timed in turn")
    ap.add_argument("--loads", nargs="+", choices=list(LOAD_FORMS), default=["default"],
                    help="the scores' load forms, each timed in turn")
    ap.add_argument("--logits", nargs="+", choices=list(LOGITS), default=["pick"],
                    help="the logits variants, each timed in turn (with every load form)")
    args = ap.parse_args()
    load_lib()
    print(torch.cuda.get_device_name(), torch.__version__)
    rows = []
    for B in args.batch:
        for dt in args.ck_dtype:
            forms = [(f, v) for v in args.logits for f in args.loads]
            for i, (form, variant) in enumerate(forms):
                bench_scores(B, args.ctx, args.page, 32, 8, 128, args.reps, rows,
                             not args.no_reference and i == 0, dt, form, variant)
            bench_update(B, args.ctx, args.page, 8, 128, args.reps, rows,
                         not args.no_reference, dt)
            torch.cuda.empty_cache()
    keys = list(rows[0].keys())
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
