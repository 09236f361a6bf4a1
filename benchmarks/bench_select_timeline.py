"""One question: where a one-pass selection launch's time goes, link by link of its chain.

At batch 1 the selection is, like the attention, a chain of dependent steps: every CTA of a row
scores its chunk of blocks and ranks its candidates, takes the row's ticket, and the row's last
CTA takes the top-K of every chunk's candidates and writes A, M (and P(t+1)). This benchmark reads
the one-pass kernel's timing probe (``SelectLink`` in ``kernels/select_predict.cu``, the records
of ``bench_attn_timeline``): each CTA's SM clock at each link, ``%globaltimer`` at entry and exit.
Each probed launch runs eagerly after an L2 flush on fresh inputs of ``bench_kernel_stages``'
selection cases (the Llama-3-8B layer's 8 KV heads, bf16 summaries, page 64, K = 2048 tokens,
block tables 128K wide; a 128K server's are 192 tokens wider, its context length: ``--table-ctx
131264``), in the server's forms: serial DSA's selection with the
step's new keys folded in and written, PRR's with M = A \\ P(t) beside it, and PRR's with the
predictor's step in its epilogue.

The probe exists only in a library built with ``SGLANG_PRR_PROBES=1``::

  SGLANG_PRR_PROBES=1 python -m sglang_prr.kernels.build .kprobe
  SGLANG_PRR_KERNEL_LIB=.kprobe/libsglang_prr_kernels.so python benchmarks/bench_select_timeline.py

Rows (CSV, ``bench_attn_timeline``'s columns; the case names the context): per case and phase,
the median / p90 / max over the CTAs that reach it, in µs at the SM's rated clock.
Phases: ``counts`` (entry to the block counts' round trip), ``pages`` (the pages' round trip: the
summaries' loads issued), ``q`` (q in shared memory), ``scores`` (the summaries' round trip, the
chunk's scores, Holt step and keys), ``rank`` (the chunk's candidates ranked and
written), ``ticket`` (the row's ticket: every CTA), ``tail_loads`` (the last CTA's loads of the
chunks' candidates), ``topk`` (the row's top-K), ``lists`` (A, M, P(t+1) written) and ``cta``
(entry to exit); ``dispatch`` and ``span`` as in ``bench_attn_timeline``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
import bench_attn_timeline as bat  # noqa: E402  (the records' arithmetic)
import bench_kernel_stages as stages  # noqa: E402  (the cases' inputs)
from sglang_prr.kernels import build  # noqa: E402

# The one-pass selection's record (select_predict.cu's SelectLink) and its phases.
SELECTION = bat.Chain(
    slots=["entry_ns", "sm", "entry", "loaded", "scored", "ranked", "arrival", "tail_loads",
           "topk", "exit", "exit_ns", "id", "lists", "counts", "issued", "spare15"],
    phases=[("counts", "entry", "counts"), ("pages", "counts", "issued"),
            ("q", "issued", "loaded"), ("scores", "loaded", "scored"),
            ("rank", "scored", "ranked"), ("ticket", "ranked", "arrival"),
            ("tail_loads", "arrival", "tail_loads"), ("topk", "tail_loads", "topk"),
            ("lists", "topk", "lists"), ("cta", "entry", "exit")],
    env="SGLANG_PRR_SELECT_TIMELINE")


def cases(page: int, top_k: int, n_pred: int):
    """(name, fn(set)) of the server's selection forms."""
    k, sink, local = top_k // page, 1, 1
    n_out = k + sink + local
    kw = dict(fold_page=page, write=True, sink=sink, local=local)
    return [("serial DSA (fold + write)", lambda s: stages.select_set(s, k, n_out, **kw)),
            ("PRR: A, M (fold + write)",
             lambda s: stages.select_set(s, k, n_out, with_p=True, **kw)),
            ("PRR: + predictor", lambda s: stages.select_predict_set(s, k, n_pred, n_out, **kw))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 32768])
    ap.add_argument("--table-ctx", type=int, default=131072,
                    help="the block tables' width in tokens (a server's: its context length, "
                         "bench_serving's context + 192)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2048, help="K in tokens")
    ap.add_argument("--n-pred", type=int, default=48, help="|P| in blocks")
    bat.add_run_args(ap, "select_timeline_h200.csv")
    a = ap.parse_args(argv)
    dev = bat.probe_device("bench_select_timeline")
    g = torch.Generator().manual_seed(0)
    rows: List[dict] = []
    for ctx in a.contexts:
        NB, NBt = ctx // a.page, max(a.table_ctx, ctx) // a.page
        sets = stages.selection_sets(1, NB, a.reps, a.n_pred, dev, g, a.page, NBt)
        for name, fn in cases(a.page, a.top_k, a.n_pred):
            rows += bat.run_case(f"{name}, {ctx // 1024}K", 1, 0,
                                 [lambda s=s, fn=fn: fn(s) for s in sets], dev, SELECTION)
    every = common.write_rows(a.csv, rows, bat.COLUMNS, append=a.append)
    bat.plot([r for r in every if r["library"] == build.library_tag()],
             os.path.splitext(a.csv)[0] + ".png", SELECTION)


if __name__ == "__main__":
    main()
