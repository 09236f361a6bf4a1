"""One question: how much of a sparse attention launch at the serving shape is its K/V's trip
from HBM, i.e. what would an L2 prefetch of the listed blocks' K/V, issued by the selection's
tail as soon as it knows A (or M), take off the attention (or the repair) that follows it?

The kernels alone, as ``bench_kernel_stages`` times them (CUDA-graph replays over input sets
rotated past 3x the L2, an L2 flush before each replay, µs per call), in three forms per case:

* ``cold``: the launch alone;
* ``own``: a gather of exactly the launch's K/V rows (``index_select`` of the listed pages' slots,
  every KV head) right before it, so that its K/V are in L2 while its lists, table and q are not;
  the gather alone is timed too and taken off;
* ``other``: the same gather of another input set's rows before it (the control: a kernel before
  the launch whose bytes do not help it), the gather taken off likewise.

``own`` - ``other`` is what the K/V's trip from HBM costs the launch; ``cold`` - ``other`` is what
a kernel before it changes by itself (its launch overlapping the gather's tail). The cases:
serial DSA's attention over A with its merge (batch 1 and 8, K = 2048 tokens) and PRR's repair
over |M| blocks merged with the speculative partials (batch 1).

    python benchmarks/bench_kv_in_l2.py --csv benchmarks/results/kv_in_l2_h200.csv
    python benchmarks/bench_kv_in_l2.py --device cpu --quick --csv /tmp/kv.csv   # plumbing
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_kernel_stages as stages  # noqa: E402  (the same input sets and op calls)
import common  # noqa: E402
from sglang_prr.kernels import build  # noqa: E402

COLUMNS = ["case", "batch", "tokens", "m_blocks", "cold_us", "gather_us", "own_us", "other_us",
           "kv_trip_us", "library"]


def gather_rows(k_buf: torch.Tensor, s: dict, ids: torch.Tensor, page: int):
    """A call that reads the K and V rows (every KV head) of blocks ``ids`` ``[B, n]`` of input
    set ``s`` into a static buffer: one ``index_select`` over the slots of their pages. The sets'
    K and V share one buffer ``[slots, 2, Hk, D]`` (``attention_sets``), whose view ``k_buf``
    is."""
    S, hk, d = k_buf.shape
    kv = torch.as_strided(k_buf, (S, 2, hk, d), (2 * hk * d, hk * d, d, 1))
    pages = torch.gather(s["table"].long(), 1, ids.long())  # [B, n]
    slots = (pages.reshape(-1, 1) * page + torch.arange(page, device=k_buf.device)).reshape(-1)
    out = torch.empty(slots.numel(), 2, hk, d, dtype=kv.dtype, device=kv.device)
    return lambda: torch.index_select(kv, 0, slots, out=out)


def time_calls(calls, a, dev) -> float:
    return common.time_graph(calls, a.reps, cold=True, device=dev)[0]


def measure(case, B, ntok, m, launches, gathers, a, dev, rows) -> None:
    """``launches[i]`` and ``gathers[i]`` (its own rows) per input set; the control gathers the
    next set's rows."""
    n = len(launches)
    cold = time_calls(launches, a, dev)
    gather = time_calls(gathers, a, dev)
    own = time_calls([lambda i=i: (gathers[i](), launches[i]()) for i in range(n)], a, dev)
    other = time_calls([lambda i=i: (gathers[(i + 1) % n](), launches[i]()) for i in range(n)],
                       a, dev)
    row = dict(case=case, batch=B, tokens=ntok, m_blocks=m, cold_us=round(cold, 2),
               gather_us=round(gather, 2), own_us=round(own - gather, 2),
               other_us=round(other - gather, 2), kv_trip_us=round(other - own, 2),
               library=build.library_tag())
    rows.append(row)
    print(f"{case:28s} B={B:<3d} tok={ntok:<5d} |M|={m:<3d} cold {cold:7.2f}  gather "
          f"{gather:7.2f}  K/V in L2 {own - gather:7.2f}  control {other - gather:7.2f}  "
          f"-> K/V trip {other - own:6.2f} us", flush=True)


def bench(a, dev, rows) -> None:
    g = torch.Generator().manual_seed(0)
    page, sm, hk, d = a.page, 1.0 / math.sqrt(stages.D), stages.HK, stages.D
    for B, ntok in a.points:
        per = B * hk * (ntok + 2 * page) * d * 2 * 2
        R = 2 if a.quick else stages.n_sets(per, dev)
        k_buf, v_buf, sets, na = stages.attention_sets(B, ntok, page, a.ctx_blocks, R, dev, g)
        # Every KV head lists the same blocks (attention_sets), so head 0's are the pages read.
        launches = [lambda s=s: stages.attention_merge_set(s, k_buf, v_buf, page, sm)
                    for s in sets]
        gathers = [gather_rows(k_buf, s, s["idx"][:, 0], page) for s in sets]
        measure("serial (attention + merge)", B, ntok, 0, launches, gathers, a, dev, rows)
        if B != 1:
            continue
        for m in a.repair_blocks:
            launches, gathers = [], []
            for s in sets:
                o_s, l_s = stages.partials_set(s, k_buf, v_buf, page, sm)
                mi, mc, pc = stages.repair_lists(s, na, m)
                launches.append(lambda s=s, o_s=o_s, l_s=l_s, mi=mi, mc=mc, pc=pc:
                                stages.repair_merge_set(s, k_buf, v_buf, page, sm, o_s, l_s, mi,
                                                        mc, s["idx"], pc))
                gathers.append(gather_rows(k_buf, s, mi[:, 0, :m], page))
            measure("repair + merge", B, ntok, m, launches, gathers, a, dev, rows)
        del k_buf, v_buf, sets


def plot(rows, png: str) -> None:
    plt = common.pyplot()
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.5))
    labels = [f"{r['case']} B={r['batch']}" + (f" |M|={r['m_blocks']}" if r["m_blocks"] else "")
              for r in rows]
    y = range(len(rows))
    ax.barh([i + 0.25 for i in y], [float(r["other_us"]) for r in rows], height=0.25,
            label="control (another set's K/V gathered before)")
    ax.barh([i for i in y], [float(r["own_us"]) for r in rows], height=0.25,
            label="its K/V in L2")
    ax.barh([i - 0.25 for i in y], [float(r["cold_us"]) for r in rows], height=0.25,
            label="cold")
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("µs per launch (cold L2 otherwise)")
    ax.legend(fontsize=7)
    common.save_figure(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=stages._point, nargs="+", default=[(1, 2048), (8, 2048)],
                    metavar="BATCHxTOKENS")
    ap.add_argument("--repair-blocks", type=int, nargs="+", default=[1, 13])
    ap.add_argument("--ctx-blocks", type=int, default=2048)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (plumbing on a CPU)")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "kv_in_l2.csv"))
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if a.quick:
        a.points, a.repair_blocks, a.ctx_blocks, a.page, a.reps = [(1, 64)], [1], 16, 16, 2
    common.require_kernels(dev)
    rows = []
    bench(a, dev, rows)
    common.write_rows(a.csv, rows, COLUMNS)
    plot(rows, os.path.splitext(a.csv)[0] + ".png")
    return rows


if __name__ == "__main__":
    main()
