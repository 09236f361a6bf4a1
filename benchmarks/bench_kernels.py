"""Kernel benchmark: PRR sparse attention and selection on one GPU, beside their baselines.

1. Sparse attention (the paper's Table III grid): block 16/32/64/128/256 x token budget
   1K/2K/4K/6K/8K at batch 1/8/32, Llama-3-8B layer (32 q / 8 KV heads, head dim 128, bf16).
   ``ours_partials``: ``sparse_attn_partials`` (per-block (o, lse), the PRR speculative/repair
   pass); ``ours_full``: partials + ``merge_partials`` (a finished attention output);
   ``fi_decode``: FlashInfer ``BatchDecodeWithPagedKVCacheWrapper`` over the same number of
   selected pages per request in the same paged pool (its best of tensor cores on/off).
   Our selection is per KV head (as DSA selects); FlashInfer's decode takes one page list per
   request, so it gets the same page count per request: both move the same KV bytes.
2. Selection at block 64, context 8K-128K, batch 1/8/32: Quest scores + top-K with the kernels
   vs the torch reference (``sglang_prr.reference``) on the same GPU; ``full`` adds the set
   difference, the Holt update and the next-step prediction.

Timing: every variant is captured in a CUDA graph that calls it over R rotating input sets
(different pages, so repeated replays do not run out of L2), replayed ``--reps`` times; the
per-call time is replay time / R; median and p10-p90 spread are reported. GB/s counts the bytes
that must move (KV of the selected tokens; the summaries of the request's blocks) over the median.

    python benchmarks/bench_kernels.py                 # full grid -> benchmarks/results/kernels*.csv
    python benchmarks/bench_kernels.py --quick         # a few points
    python benchmarks/bench_kernels.py --plot-only     # PNG from the CSVs (no GPU needed)
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
# Bytes each timed graph should touch over its R calls: several times the 60 MB L2 of an H200.
ROTATE_BYTES = 256 << 20
MAX_ROTATE = 64


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))]


def time_graph(calls, reps):
    """Capture ``calls`` (R closures) in one graph; per-call µs (median, p10, p90) over reps."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:  # warm-up outside capture (JIT, allocator)
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        ts.append(st.elapsed_time(en) * 1000.0 / len(calls))
    del g
    return statistics.median(ts), pct(ts, 10), pct(ts, 90)


def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(10):
        y.copy_(x)
    en.record()
    en.synchronize()
    bw = 2 * x.numel() * 10 / (st.elapsed_time(en) / 1000) / 1e9
    del x, y
    return bw


# ----------------------------------------------------------------------------- attention
def bench_attention(args, writer, fi):
    Hq, Hk, D = 32, 8, 128
    dt = torch.bfloat16
    sm = 1.0 / math.sqrt(D)
    rows = []
    for B in args.batches:
        for page in args.blocks:
            for budget in args.budgets:
                n = budget // page
                kv_bytes = B * Hk * budget * D * 2 * 2
                R = max(4, min(MAX_ROTATE, math.ceil(ROTATE_BYTES / kv_bytes)))
                ctx = max(args.context, min(R * budget, 256 * 1024))
                nbr = ctx // page  # blocks per request
                num_pages = B * nbr + 1
                k = torch.randn(num_pages * page, Hk, D, device="cuda", dtype=dt)
                v = torch.randn(num_pages * page, Hk, D, device="cuda", dtype=dt)
                table = (torch.randperm(B * nbr, device="cuda") + 1).view(B, nbr).to(torch.int32)
                seq = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
                sets = []
                for _ in range(R):
                    q = torch.randn(B, Hq, D, device="cuda", dtype=dt)
                    # per-(request, KV head) random blocks, ascending
                    r = torch.rand(B, Hk, nbr, device="cuda")
                    idx = r.topk(n, dim=-1).indices.sort(-1).values.to(torch.int32)
                    cnt = torch.full((B, Hk), n, device="cuda", dtype=torch.int32)
                    # per-request page list for FlashInfer (same count)
                    blk = torch.rand(B, nbr, device="cuda").topk(n, dim=-1).indices.sort(-1).values
                    pages = torch.gather(table.long(), 1, blk).to(torch.int32)
                    sets.append((q, idx, cnt, pages))
                op = torch.ops.sglang_prr_cuda

                def part(s=None):
                    return [lambda s=s: op.sparse_attn_partials(s[0], k, v, table, seq, s[1], s[2],
                                                                page, sm) for s in sets]

                def full():
                    def f(s):
                        o, lse = op.sparse_attn_partials(s[0], k, v, table, seq, s[1], s[2], page,
                                                         sm)
                        return op.merge_partials(o, lse)
                    return [lambda s=s: f(s) for s in sets]

                res = {"batch": B, "block": page, "budget": budget, "rotate": R,
                       "kv_bytes": kv_bytes}
                res["ours_partials_us"], res["ours_partials_p10"], res["ours_partials_p90"] = \
                    time_graph(part(), args.reps)
                res["ours_full_us"], res["ours_full_p10"], res["ours_full_p90"] = \
                    time_graph(full(), args.reps)
                best = None
                for tc in fi["tensor_cores"]:
                    try:
                        t = bench_fi_decode(fi, tc, B, Hq, Hk, D, page, k, v, sets, sm, args.reps)
                    except Exception as e:  # noqa: BLE001
                        print(f"flashinfer (tensor cores={tc}) failed: {e}", file=sys.stderr)
                        continue
                    res[f"fi_tc{int(tc)}_us"] = t[0]
                    if best is None or t[0] < best[0]:
                        best = t
                if best is not None:
                    res["fi_decode_us"], res["fi_decode_p10"], res["fi_decode_p90"] = best
                    res["speedup_partials"] = best[0] / res["ours_partials_us"]
                    res["speedup_full"] = best[0] / res["ours_full_us"]
                res["ours_partials_GBps"] = kv_bytes / res["ours_partials_us"] / 1e3
                res["ours_full_GBps"] = kv_bytes / res["ours_full_us"] / 1e3
                if "fi_decode_us" in res:
                    res["fi_decode_GBps"] = kv_bytes / res["fi_decode_us"] / 1e3
                writer(res)
                rows.append(res)
                print(f"B={B:2d} block={page:3d} budget={budget:5d}: ours {res['ours_partials_us']:7.2f}"
                      f" us (+merge {res['ours_full_us']:7.2f})  fi {res.get('fi_decode_us', float('nan')):7.2f}"
                      f" us  x{res.get('speedup_partials', float('nan')):.2f}  "
                      f"{res['ours_partials_GBps']:.0f} GB/s", flush=True)
                del k, v, sets
                torch.cuda.empty_cache()
    return rows


def bench_fi_decode(fi, tc, B, Hq, Hk, D, page, k, v, sets, sm, reps):
    flashinfer = fi["mod"]
    num_pages = k.shape[0] // page
    kc = k.view(num_pages, page, Hk, D)
    vc = v.view(num_pages, page, Hk, D)
    n = sets[0][3].shape[1]
    wrappers = []
    for s in sets:
        ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        indptr = torch.arange(0, (B + 1) * n, n, device="cuda", dtype=torch.int32)
        last = torch.full((B,), page, device="cuda", dtype=torch.int32)
        indices = s[3].reshape(-1).contiguous()
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
        w.plan(indptr, indices, last, Hq, Hk, D, page, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16, sm_scale=sm)
        wrappers.append((w, s[0], ws))
    return time_graph([lambda w=w, q=q: w.run(q, (kc, vc)) for w, q, _ in wrappers], reps)


# ----------------------------------------------------------------------------- selection
def bench_selection(args, writer):
    from sglang_prr import reference as ref
    op = torch.ops.sglang_prr_cuda
    Hq, Hk, D, page = 32, 8, 128, 64
    k_blocks, n_pred, sink, local = 2048 // page, 48, 1, 1
    rows = []
    for B in args.batches:
        for ctx in args.sel_contexts:
            nb = ctx // page
            sum_bytes = B * nb * Hk * D * 4 * 2
            R = max(2, min(32, math.ceil(ROTATE_BYTES / sum_bytes)))
            pages = R * B * nb + 1
            kmin = torch.randn(pages, Hk, D, device="cuda")
            kmax = kmin + torch.rand(pages, Hk, D, device="cuda")
            nblk = torch.full((B,), nb, device="cuda", dtype=torch.int64)
            nblk_next = nblk + 1
            sets = []
            perm = torch.randperm(R * B * nb, device="cuda") + 1
            for r in range(R):
                q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
                table = perm[r * B * nb:(r + 1) * B * nb].view(B, nb).to(torch.int32)
                st = {"level": torch.randn(B, Hk, nb, device="cuda"),
                      "trend": torch.randn(B, Hk, nb, device="cuda") * 0.1,
                      "n_init": torch.full((B,), nb - 1, device="cuda", dtype=torch.int64),
                      "p_idx": torch.randint(0, nb, (B, Hk, n_pred + sink + local),
                                             device="cuda").sort(-1).values.to(torch.int32),
                      "p_cnt": torch.full((B, Hk), n_pred + sink + local, device="cuda",
                                          dtype=torch.int32),
                      "theta": torch.tensor([[0.6, 0.3, 0.5]] * B, device="cuda")}
                sets.append((q, table, st))

            def ours(s, full):
                q, table, st = s
                scores = op.quest_scores(q, kmin, kmax, table, nblk)
                a_idx, a_cnt = op.select_topk(scores, nblk, k_blocks, sink, local,
                                              k_blocks + sink + local)
                if full:
                    op.set_difference(a_idx, a_cnt, st["p_idx"], st["p_cnt"], nb)
                    op.holt_update(st["level"], st["trend"], st["n_init"], scores, nblk,
                                   st["theta"][:, 0], st["theta"][:, 1])
                    op.predict_set(st["level"], st["trend"], st["theta"][:, 2].contiguous(),
                                   st["n_init"], nblk_next, n_pred, sink, local)

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
                   "summary_bytes": sum_bytes}
            for name, fn in (("ours", ours), ("ref", refr)):
                for full in (False, True):
                    key = f"{name}_{'full' if full else 'select'}"
                    t = time_graph([lambda s=s, fn=fn, full=full: fn(s, full) for s in sets],
                                   args.reps)
                    res[f"{key}_us"], res[f"{key}_p10"], res[f"{key}_p90"] = t
            res["scores_GBps"] = sum_bytes / res["ours_select_us"] / 1e3
            res["speedup_select"] = res["ref_select_us"] / res["ours_select_us"]
            res["speedup_full"] = res["ref_full_us"] / res["ours_full_us"]
            writer(res)
            rows.append(res)
            print(f"B={B:2d} ctx={ctx:6d}: select ours {res['ours_select_us']:7.2f} us ref "
                  f"{res['ref_select_us']:8.2f} us (x{res['speedup_select']:.1f}); full ours "
                  f"{res['ours_full_us']:7.2f} ref {res['ref_full_us']:8.2f}; "
                  f"{res['scores_GBps']:.0f} GB/s", flush=True)
            del kmin, kmax, sets
            torch.cuda.empty_cache()
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


def plot(out_dir: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    att = out_dir / "kernels_attention.csv"
    if att.exists():
        rows = list(csv.DictReader(open(att)))
        batches = sorted({int(r["batch"]) for r in rows})
        fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
        for ax, B in zip(axes[0], batches):
            for blk in sorted({int(r["block"]) for r in rows}):
                rs = sorted([r for r in rows if int(r["batch"]) == B and int(r["block"]) == blk],
                            key=lambda r: int(r["budget"]))
                x = [int(r["budget"]) for r in rs]
                ax.plot(x, [float(r["ours_partials_us"]) for r in rs], "-o", label=f"ours b{blk}")
                if rs and "fi_decode_us" in rs[0] and rs[0]["fi_decode_us"]:
                    ax.plot(x, [float(r["fi_decode_us"]) for r in rs], "--x", label=f"FI b{blk}")
            ax.set_title(f"sparse attention, batch {B}")
            ax.set_xlabel("token budget")
            ax.set_ylabel("µs (median, CUDA graph)")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(out_dir / "kernels_attention.png", dpi=110)
    sel = out_dir / "kernels_selection.csv"
    if sel.exists():
        rows = list(csv.DictReader(open(sel)))
        fig, ax = plt.subplots(figsize=(6, 4))
        for B in sorted({int(r["batch"]) for r in rows}):
            rs = sorted([r for r in rows if int(r["batch"]) == B], key=lambda r: int(r["context"]))
            x = [int(r["context"]) // 1024 for r in rs]
            ax.plot(x, [float(r["ours_select_us"]) for r in rs], "-o", label=f"kernels B={B}")
            ax.plot(x, [float(r["ref_select_us"]) for r in rs], "--x", label=f"torch ref B={B}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (K tokens), block 64")
        ax.set_ylabel("scores + top-K, µs")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "kernels_selection.png", dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096, 6144, 8192])
    p.add_argument("--context", type=int, default=32768, help="tokens per request in the pool")
    p.add_argument("--sel-contexts", type=int, nargs="+",
                   default=[8192, 16384, 32768, 65536, 131072])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--fi-tensor-cores", choices=["on", "off", "both"], default="both")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--skip-selection", action="store_true")
    p.add_argument("--quick", action="store_true", help="a few points of each grid")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="suffix of the CSV names")
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        plot(args.out)
        return
    if args.quick:
        args.batches, args.blocks, args.budgets = [1, 8], [16, 64], [2048, 8192]
        args.sel_contexts, args.reps = [8192, 131072], 15
    from sglang_prr import kernels
    if not kernels.load():
        sys.exit(f"kernel library unavailable: {kernels.load_error()}")
    fi = {"mod": None, "tensor_cores": []}
    if not args.no_flashinfer:
        try:
            import flashinfer
            fi["mod"] = flashinfer
            fi["tensor_cores"] = {"on": [True], "off": [False], "both": [True, False]}[
                args.fi_tensor_cores]
        except ImportError as e:
            print(f"flashinfer not importable ({e}): no baseline", file=sys.stderr)
    meta = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "flashinfer": getattr(fi["mod"], "__version__", "none") if fi["mod"] else "none"}
    bw = copy_bandwidth()
    print(f"{meta['gpu']}  copy bandwidth {bw:.0f} GB/s (read+write)  torch {torch.__version__} "
          f"flashinfer {meta['flashinfer']}", flush=True)
    meta["copy_GBps"] = round(bw)
    if not args.skip_attention:
        bench_attention(args, CsvWriter(args.out / f"kernels_attention{args.tag}.csv", meta), fi)
    if not args.skip_selection:
        bench_selection(args, CsvWriter(args.out / f"kernels_selection{args.tag}.csv", meta))


if __name__ == "__main__":
    main()
