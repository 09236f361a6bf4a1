"""One question: does a composed method's selection tail (InfLLM-v2's, or a new method's, after
its scores) cost less as one launch (``select_lists``: top-K, M = A \\ P and the counters) than as
the two it replaced (``select_topk`` then ``set_difference`` for PRR, ``select_topk`` then
``accumulate_stats`` for serial DSA)?

The same scores for both forms (random float32 ``[B, Hk, NB]``, every block of the row present),
Llama-3-8B's 8 KV heads, K = 32 blocks + 1 sink + 2 local, |P| = 51 blocks read at pool rows, the
step's counters on. Per point, CUDA-graph replays of one call of each form, back to back
(``*_warm_us``) and after an L2 flush (``*_cold_us``; ``common.time_warm_cold``); the lists of
the two PRR forms are checked equal first. A CSV row per point and a plot of the cold times.

    python benchmarks/bench_select_lists.py --csv benchmarks/results/select_lists_h200.csv
    python benchmarks/bench_select_lists.py --device cpu --reps 2 --csv /tmp/s.csv  # plumbing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import pyplot, require_kernels, save_figure, time_warm_cold, write_rows  # noqa: E402

from sglang_prr import contracts, ops  # noqa: E402

HK, K, SINK, LOCAL, NP = 8, 32, 1, 2, 51
POINTS = ((1, 2048), (1, 512), (8, 2048), (32, 2048))  # (batch, table blocks)
FORMS = ("two_prr", "one_prr", "two_serial", "one_serial")
LABELS = {"two_prr": "PRR: select_topk + set_difference", "one_prr": "PRR: select_lists",
          "two_serial": "serial DSA: select_topk + accumulate_stats",
          "one_serial": "serial DSA: select_lists"}


def forms(B: int, NB: int, device) -> dict:
    """The four forms' calls on one point's inputs: name -> a function of no arguments."""
    g = torch.Generator(device=device).manual_seed(B * 7 + NB)
    s = torch.randn(B, HK, NB, device=device, generator=g)
    nblk = torch.full((B,), NB, device=device)
    p_idx = torch.sort(torch.randint(0, NB, (B, HK, NP), device=device, generator=g,
                                     dtype=torch.int32)).values
    p_cnt = torch.full((B, HK), NP, device=device, dtype=torch.int32)
    rows = torch.arange(B, device=device)
    st = contracts.new_stats(device)
    n_out = K + SINK + LOCAL

    def two_prr():
        a, c = ops.select_topk(s, nblk, K, SINK, LOCAL, n_out)
        return ops.set_difference(a, c, p_idx, p_cnt, NB, p_rows=rows, stats=st)

    def one_prr():
        return ops.select_lists(s, nblk, p_idx, p_cnt, K, SINK, LOCAL, n_out, rows, None, st)

    def two_serial():
        a, c = ops.select_topk(s, nblk, K, SINK, LOCAL, n_out)
        torch.ops.sglang_prr.accumulate_stats(st, c, c, None, None)
        return a, c

    def one_serial():
        return ops.select_lists(s, nblk, None, None, K, SINK, LOCAL, n_out, None, None, st)

    return dict(two_prr=two_prr, one_prr=one_prr, two_serial=two_serial, one_serial=one_serial)


def bench_point(B: int, NB: int, reps: int, device, timer=None) -> dict:
    """One CSV row: every form's cold and warm µs at batch B over NB table blocks."""
    timer = timer or time_warm_cold
    f = forms(B, NB, device)
    two, one = f["two_prr"](), f["one_prr"]()
    if not (torch.equal(two[0], one[2]) and torch.equal(two[1], one[3])):
        raise AssertionError(f"select_lists' M differs from set_difference's at B={B} NB={NB}")
    row = {"batch": B, "blocks": NB}
    for name in FORMS:
        t = timer([f[name]], reps=reps, device=device)
        row[f"{name}_cold_us"] = round(t["cold"][0], 2)
        row[f"{name}_warm_us"] = round(t["warm"][0], 2)
    print(row, flush=True)
    return row


def plot(rows, png: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(rows))
    for j, name in enumerate(FORMS):
        ax.bar([i + (j - 1.5) * 0.2 for i in x], [r[f"{name}_cold_us"] for r in rows], 0.2,
               label=LABELS[name])
    ax.set_xticks(list(x), [f"{r['batch']} x {r['blocks']}" for r in rows])
    ax.set_xlabel("batch x table blocks")
    ax.set_ylabel("µs, cold L2")
    ax.legend(fontsize=8)
    save_figure(fig, png)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--csv", default="benchmarks/results/select_lists.csv")
    args = ap.parse_args()
    require_kernels(args.device)
    rows = [bench_point(B, NB, args.reps, args.device) for B, NB in POINTS]
    cols = ["batch", "blocks"] + [f"{n}_{t}_us" for n in FORMS for t in ("cold", "warm")]
    write_rows(args.csv, rows, cols)
    plot(rows, args.csv.rsplit(".", 1)[0] + ".png")


if __name__ == "__main__":
    main()
