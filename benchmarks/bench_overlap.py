"""One question: do PRR's speculative attention and the selection overlap on two CUDA streams?

PRR hides the selection behind the speculative attention over P by running them on two streams
of one CUDA graph. This times, per layer (Llama-3-8B shape, Quest, block 64, K = 2048 tokens,
|P| = 1.5 K), each alone, one after the other on one stream, and forked on two streams and joined
(PRR's shape without the repair), plus an empty fork/join. Perfect overlap gives
``two-stream = max(spec, selection)``; none gives ``spec + selection``. ``overlap`` in the CSV is
the fraction of the shorter stage that was hidden: ``(spec + selection - two_stream) / min(...)``.

Each variant is timed twice: ``--inner`` calls per captured graph replayed back to back (the
plain columns; warm L2), and one call per replay with the L2 flushed before each (``*_cold``,
``overlap_cold``; ``common.L2Flush``, outside the timed span), as the layer runs in the server.

    python benchmarks/bench_overlap.py                  # CUDA -> benchmarks/results/overlap_h200.csv
    python benchmarks/bench_overlap.py --plot-only benchmarks/results/overlap_h200.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sglang_prr import ops  # noqa: E402
from sglang_prr.tools.synthetic import paged_kv  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the benchmarks' one graph timer)

VARIANTS = ("spec", "selection", "serial", "two_stream", "fork_join_only")


def time_graph(fn, reps: int, inner: int, cold: bool = False) -> float:
    """Median per-call µs of ``inner`` calls of ``fn`` captured in one CUDA graph; ``cold``:
    one call per graph, the L2 flushed before each replay (a flush between the inner calls
    would be inside the timed span)."""
    if cold:
        return common.time_graph([fn], reps, cold=True)[0]
    return common.time_graph([fn] * inner, reps)[0]


def measure(batch: int, ctx: int, page: int, top_k: int, budget: float, reps: int, inner: int,
            heads=(32, 8, 128)) -> dict:
    hq, hk, d = heads
    dev = torch.device("cuda")
    kv = paged_kv(batch, ctx, page, hk, d, dtype=torch.bfloat16, device=dev,
                  generator=torch.Generator().manual_seed(0))
    nb = kv.table.shape[1]
    seq = torch.full((batch,), ctx, device=dev)
    k = -(-top_k // page)
    n_pred = int(budget * k)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    # P: n_pred distinct middle blocks per (request, KV head), ascending, + 2 padding entries.
    p = torch.stack([torch.randperm(nb - 2, device=dev)[:n_pred].sort().values + 1
                     for _ in range(batch * hk)]).view(batch, hk, n_pred).int()
    p_idx = torch.cat([p, torch.full((batch, hk, 2), -1, device=dev, dtype=torch.int32)], -1)
    p_cnt = torch.full((batch, hk), n_pred, device=dev, dtype=torch.int32)
    sm = 1.0 / math.sqrt(d)
    side = torch.cuda.Stream()
    fork, join = torch.cuda.Event(), torch.cuda.Event()

    def spec():
        ops.sparse_attn_partials(q, kv.k_buf, kv.v_buf, kv.table, seq, p_idx, p_cnt, page, sm)

    def sel():
        ops.select_fused("quest", q, [kv.kmin, kv.kmax], kv.table, seq, page, sm, k, 1, 1,
                         p_idx, p_cnt)

    def serial():
        sel()
        spec()

    def two_stream(side_work=sel, main_work=spec):
        main = torch.cuda.current_stream()
        fork.record(main)
        with torch.cuda.stream(side):
            side.wait_event(fork)
            side_work()
            join.record(side)
        main_work()
        main.wait_event(join)

    fns = {"spec": spec, "selection": sel, "serial": serial, "two_stream": two_stream,
           "fork_join_only": lambda: two_stream(lambda: None, lambda: None)}
    res = {}
    for tag, cold in (("", False), ("_cold", True)):
        for v, fn in fns.items():
            res[v + tag] = time_graph(fn, reps, inner, cold)
        res["overlap" + tag] = overlap(res["spec" + tag], res["selection" + tag],
                                       res["two_stream" + tag])
    return res


def overlap(spec: float, selection: float, two_stream: float) -> float:
    """The fraction of the shorter stage hidden by running the two on two streams."""
    return (spec + selection - two_stream) / max(min(spec, selection), 1e-9)


def plot(csv_path: str, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    labels = [f"{int(r['ctx']) // 1024}K/b{r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    w = 0.8 / 4
    for i, v in enumerate(("spec", "selection", "serial", "two_stream")):
        ax.bar([j + i * w for j in range(len(rows))], [float(r[v]) for r in rows], w, label=v)
    ax.set_xticks([j + 1.5 * w for j in range(len(rows))], labels)
    ax.set_ylabel("µs per layer (median)")
    ax.set_title("speculative attention and selection on two streams")
    ax.legend(fontsize=8)
    common.save_figure(fig, png, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2048, help="tokens")
    ap.add_argument("--budget", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--inner", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "overlap_h200.csv"))
    ap.add_argument("--plot-only", metavar="CSV", help="draw the PNG of an earlier run and exit")
    a = ap.parse_args(argv)
    if a.plot_only:
        plot(a.plot_only, os.path.splitext(a.plot_only)[0] + ".png")
        return []
    if not torch.cuda.is_available():
        sys.exit("bench_overlap needs a CUDA GPU (it times two CUDA streams); "
                 "use --plot-only CSV to draw an earlier run")
    from sglang_prr import kernels
    kernels.load()
    rows = []
    for ctx in a.contexts:
        for batch in a.batches:
            r = measure(batch, ctx, a.page, a.top_k, a.budget, a.reps, a.inner)
            rows.append(dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                             ctx=ctx, batch=batch, page=a.page, top_k_tokens=a.top_k,
                             budget=a.budget, **{v: round(r[v], 2) for v in VARIANTS},
                             overlap=round(r["overlap"], 3),
                             **{f"{v}_cold": round(r[f"{v}_cold"], 2) for v in VARIANTS},
                             overlap_cold=round(r["overlap_cold"], 3)))
            print(" ".join(f"{key}={val}" for key, val in rows[-1].items() if key != "gpu"))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(a.out, os.path.splitext(a.out)[0] + ".png")
    return rows


if __name__ == "__main__":
    main()
