"""One question: what does each sparse-decode kernel cost at the serving shape, with a cold L2,
and which of its stages does the time go to?

The kernels alone, on the ops the decode step calls (no FlashInfer, no SGLang; ``bench_kernels``
puts ours beside FlashInfer's paged decode): per call, CUDA-graph replays of ``R`` calls over
input sets rotated so that their bytes exceed 3x the L2, each replay after an L2 flush
(``common.time_graph(cold=True)``), and the same replays of one input set ("warm"). The copy
bandwidth of the device is measured in the same run (a 1 GiB device-to-device copy, read + write
bytes) and every row reports GB/s over the bytes it must read and the share of that bandwidth.
Only a replay's first call follows the flush; the others run back to back, the setting in which
the kernels run fastest: among a decoder layer's weight GEMMs the same kernels take 30-40% longer,
as in the server (``bench_neighbours``, CUPTI's durations).

* ``attention``: serial DSA's attention over A with its merge (``sparse_attn_merge``), the
  per-block partials alone (PRR's speculative pass, ``sparse_attn_partials``), and PRR's repair
  over |M| = 1, 2, 4, 8 blocks merged with the speculative partials of P n A (batch 1).
* ``selection``: the Quest scores alone (``quest_scores``: the two-launch selection's first
  launch, streamed, or the warp-per-block kernel with ``SGLANG_PRR_SCORES_KERNEL=warp``), Quest's
  selection for serial DSA (scores and A: ``quest_select`` without P) and for PRR (scores, A,
  M: ``quest_select``), PRR's selection with the predictor's step in its epilogue
  (``quest_select_predict``), bf16 summaries, and the predictor's step as its own launch
  (``predict_update_rows``: ``--prr-predictor side``); serial DSA's selection with the
  step's new keys folded in (``new_k``), alone and with the decode update (``quest_update``)
  running beside it on a second stream (CUDA only: in the server that placement made the selection
  7 µs a layer longer; the row asks whether it does so in isolation). The kernel the launcher picks is
  the one-pass kernel where it fits; ``SGLANG_PRR_SELECT_KERNEL=rowtail`` runs the row-tail kernels
  instead, ``=split`` the scores and the rows' tails in two launches,
  ``SGLANG_PRR_SELECT_GRID=rows|table`` forces every selection grid to about two waves (CTAs loop
  over their rows' chunks) or to the block table's width (by default the scores kernel takes two
  waves, the one-pass kernel the table), and
  ``SGLANG_PRR_SELECT_DEBUG_STOP=1|2|3`` ends the one-pass kernel after its chunks' pass / the
  tail's loads / the tail's top-K (timing probes of where the time goes; the outputs are then
  incomplete; read once per process). One run per setting, the ``select_kernel`` and ``debug_stop``
  columns say which. ``SGLANG_PRR_ATTN_DEBUG_STOP=1|2|3`` ends the attention's merge tail after the
  last CTA's ticket / the lists' sort / the lse loads and weights (the same kind of probe).
  ``SGLANG_PRR_ATTN_GRID=heads|entries``, ``SGLANG_PRR_ATTN_MERGE=split|fused|ticket`` and
  ``SGLANG_PRR_ATTN_SPREAD=row`` (which force the attention launch's grid order, its merge, and
  a spread merge shared by the whole row; by default its shape decides) are named in the
  ``attn_launch`` column. ``--table-ctx`` makes the selection's block tables wider than the
  requests' contexts, as a server's are (its context length; the ``table_ctx`` column).

Shape: Llama-3-8B layer (32 q / 8 KV heads, head dim 128, bf16), page 64, K = 2048 tokens
(32 blocks + sink + local), |P| = 48 blocks (delta 1.5).

    python benchmarks/bench_kernel_stages.py --csv benchmarks/results/kernel_stages_h200.csv
    SGLANG_PRR_SELECT_DEBUG_STOP=1 python benchmarks/bench_kernel_stages.py --parts selection \\
        --append --csv benchmarks/results/kernel_stages_h200.csv
    python benchmarks/bench_kernel_stages.py --device cpu --quick --csv /tmp/k.csv  # plumbing
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
import common  # noqa: E402  (the benchmarks' one graph timer)
from knobs import attn_launch, select_kernel  # noqa: E402
from sglang_prr import ops  # noqa: E402
from sglang_prr.kernels import build  # noqa: E402

HQ, HK, D = 32, 8, 128
COLUMNS = ["part", "case", "batch", "ctx", "table_ctx", "tokens", "m_blocks", "cold_us",
           "warm_us", "bytes", "cold_GBps", "pct_copy", "copy_GBps", "select_kernel", "attn_launch",
           "debug_stop",
           "library"]


# The timing probe each part's kernels read (``debug_stop`` column).
DEBUG_STOP_ENV = {"attention": "SGLANG_PRR_ATTN_DEBUG_STOP",
                  "selection": "SGLANG_PRR_SELECT_DEBUG_STOP"}


def copy_gbps(dev) -> float:
    """Device-to-device copy bandwidth, read + write bytes (0 on a CPU)."""
    if dev.type != "cuda":
        return 0.0
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(10):
        y.copy_(x)
    e1.record()
    e1.synchronize()
    return 2 * x.numel() * 10 / (e0.elapsed_time(e1) * 1e-3) / 1e9


def n_sets(bytes_per_set: int, dev) -> int:
    """Input sets to rotate so that a replay's inputs exceed 3x the L2."""
    return max(2, int(3 * common.l2_bytes(dev) // max(bytes_per_set, 1)) + 1)


def attention_sets(B, ntok, page, nblk_ctx, R, dev, g):
    """R input sets: B requests of ``nblk_ctx`` blocks each, lists of ntok/page + 2 blocks
    (the sink, the newest and random middle ones) on distinct pages."""
    na = ntok // page + 2
    pages_per = B * na
    kv = torch.randn(R * pages_per * page + page, 2, HK, D, generator=g).to(dev, torch.bfloat16)
    sets = []
    for r in range(R):
        table = torch.zeros(B, nblk_ctx, dtype=torch.int32)
        idx = torch.empty(B, HK, na, dtype=torch.int32)
        for b in range(B):
            mid = torch.sort(torch.randperm(nblk_ctx - 2, generator=g)[: na - 2] + 1).values
            ids = torch.cat([torch.tensor([0]), mid, torch.tensor([nblk_ctx - 1])])
            table[b, ids] = torch.arange(na, dtype=torch.int32) + 1 + r * pages_per + b * na
            idx[b] = ids.to(torch.int32)
        sets.append(dict(q=torch.randn(B, HQ, D, generator=g).to(dev, torch.bfloat16),
                         table=table.to(dev), idx=idx.to(dev),
                         cnt=torch.full((B, HK), na, dtype=torch.int32, device=dev),
                         sl=torch.full((B,), nblk_ctx * page, dtype=torch.int64, device=dev)))
    return kv[:, 0], kv[:, 1], sets, na


def attention_merge_set(s, k_buf, v_buf, page: int, sm: float):
    """Serial DSA's attention over input set ``s``'s lists (``attention_sets``) with its merge,
    bf16 out."""
    return ops.sparse_attn_merge(s["q"], k_buf, v_buf, s["table"], s["sl"], s["idx"], s["cnt"],
                                 page, sm, None, None, None, None, None, None, 0, True,
                                 out_dtype=torch.bfloat16)


def partials_set(s, k_buf, v_buf, page: int, sm: float, idx=None, cnt=None):
    """PRR's speculative pass on input set ``s``: per-block partials over ``idx`` / ``cnt`` (the
    set's lists when not given)."""
    idx, cnt = (s["idx"], s["cnt"]) if idx is None else (idx, cnt)
    return ops.sparse_attn_partials(s["q"], k_buf, v_buf, s["table"], s["sl"], idx, cnt, page,
                                    sm)


def repair_merge_set(s, k_buf, v_buf, page: int, sm: float, o_s, l_s, m_idx, m_cnt, p_idx,
                     p_cnt):
    """PRR's repair on input set ``s``: attention over M (``m_idx`` / ``m_cnt``) merged with the
    speculative partials ``(o_s, l_s)`` of P n A (exact; A = the set's lists), bf16 out."""
    return ops.sparse_attn_merge(s["q"], k_buf, v_buf, s["table"], s["sl"], m_idx, m_cnt, page,
                                 sm, o_s, l_s, p_idx, p_cnt, s["idx"], s["cnt"],
                                 s["table"].shape[1], True, out_dtype=torch.bfloat16)


def repair_lists(s, na: int, m: int):
    """PRR's lists for a repair over ``m`` of input set ``s``'s ``na`` listed blocks: M = the last
    ``m`` blocks of A (``m_idx``, ``m_cnt``), P = the first ``na - m`` (A's list with count
    ``p_cnt``)."""
    mi = s["idx"].clone()
    mi[:, :, :m] = s["idx"][:, :, na - m:]
    return mi, torch.full_like(s["cnt"], m), torch.full_like(s["cnt"], na - m)


def update_set(s, page: int) -> None:
    """Quest's decode update of selection set ``s``: its new keys folded into its summaries."""
    ops.quest_update(s["kmin"], s["kmax"], s["new_k"], s["new_loc"], s["new_pos"], page,
                     one_per_page=True)


def _fold(s, page: int, stats, write: bool = False) -> dict:
    """The selection ops' keyword arguments that fold set ``s``'s new keys (``page`` > 0; with
    ``write``, their slots too: the op writes the update) and count into ``stats``."""
    kw = dict(new_k=s["new_k"], new_pos=s["new_pos"], page_size=page) if page > 0 else {}
    if kw and write:
        kw["new_loc"] = s["new_loc"]
    return dict(kw, stats=stats) if stats is not None else kw


def select_set(s, k: int, n_out: int, *, with_p: bool = False, fold_page: int = 0, stats=None,
               sink: int = 1, local: int = 1, write: bool = False):
    """Quest's selection of input set ``s`` (``selection_sets``): serial DSA's (no P, M = A) or,
    ``with_p``, PRR's (M = A \\ P); ``fold_page`` > 0 folds the set's new keys (``write``: and
    writes them, the decode update in the same launch, as the server's step does)."""
    p = (s["p_idx"], s["p_cnt"]) if with_p else (None, None)
    return ops.quest_select(s["q"], s["kmin"], s["kmax"], s["table"], s["nblk"], *p, k, sink,
                            local, n_out, s["p_cur"] if with_p else None,
                            **_fold(s, fold_page, stats, write))


def select_predict_set(s, k: int, n_pred: int, n_out: int, *, fold_page: int = 0, stats=None,
                       sink: int = 1, local: int = 1, write: bool = False):
    """PRR's selection of input set ``s`` with the predictor's step in its epilogue (new keys
    as in ``select_set``)."""
    return ops.quest_select_predict(
        s["q"], s["kmin"], s["kmax"], s["table"], s["nblk"], s["nblk_next"], s["p_idx"],
        s["p_cnt"], s["p_cur"], s["p_nxt"], s["level"], s["trend"], s["n_init"], s["theta"],
        s["rows"], k, n_pred, sink, local, n_out, **_fold(s, fold_page, stats, write))


def bench_attention(a, dev, g, bw, rows):
    page, sm = a.page, 1.0 / math.sqrt(D)
    for B, ntok in a.attn_points:
        per = B * HK * (ntok + 2 * page) * D * 2 * 2  # the listed pages' K and V
        R = 2 if a.quick else n_sets(per, dev)
        k_buf, v_buf, sets, na = attention_sets(B, ntok, page, a.ctx_blocks, R, dev, g)

        def merge(s):
            return attention_merge_set(s, k_buf, v_buf, page, sm)

        def partials(s):
            return partials_set(s, k_buf, v_buf, page, sm)

        cases = [("serial (attention + merge)", merge, 0)]
        if B == 1:
            cases.append(("partials", partials, 0))
        for name, fn, m in cases:
            rows.append(_row("attention", name, B, a.ctx_blocks * page, ntok, m, per, R, sets, fn,
                             a, dev, bw))
        if B == 1:
            for m in a.repair_blocks:
                calls = []
                for s in sets:
                    o_s, l_s = partials(s)
                    mi, mc, pc = repair_lists(s, na, m)
                    calls.append(lambda s=s, o_s=o_s, l_s=l_s, mi=mi, mc=mc, pc=pc:
                                 repair_merge_set(s, k_buf, v_buf, page, sm, o_s, l_s, mi, mc,
                                                  s["idx"], pc))
                rows.append(_timed_row("attention", f"repair + merge, |M| = {m}", B,
                                       a.ctx_blocks * page, ntok, m, B * HK * m * page * D * 4,
                                       calls, a, dev, bw))
        del k_buf, v_buf, sets


def selection_sets(B, NB, R, n_pred, dev, g, page, NBt=None):
    """R input sets of B requests of NB blocks each, in block tables NBt >= NB wide (a server's
    table is as wide as its context length; the columns past a request's blocks hold page 0)."""
    NBt = max(NBt or NB, NB)
    sets = []
    for _ in range(R):
        P = B * NB + 1
        lo = torch.randn(P, HK, D, generator=g)
        hi = lo + torch.rand(P, HK, D, generator=g)
        table = torch.zeros(B, NBt, dtype=torch.int32)
        table[:, :NB] = torch.arange(B * NB, dtype=torch.int32).view(B, NB) + 1
        sets.append(dict(
            kmin=lo.to(dev, torch.bfloat16), kmax=hi.to(dev, torch.bfloat16),
            table=table.to(dev),
            nblk=torch.full((B,), NB, dtype=torch.int64, device=dev),
            nblk_next=torch.full((B,), NB + 1, dtype=torch.int64, device=dev),
            q=torch.randn(B, HQ, D, generator=g).to(dev, torch.bfloat16),
            rows=torch.arange(B, device=dev),
            # P's double-buffer rows (2 r + par), made here: inside the timed call they would add
            # an elementwise launch to the PRR rows only.
            p_cur=2 * torch.arange(B, device=dev), p_nxt=2 * torch.arange(B, device=dev) + 1,
            level=torch.randn(B, HK, NBt, generator=g).to(dev),
            trend=(torch.randn(B, HK, NBt, generator=g) * 0.1).to(dev),
            n_init=torch.full((B,), NB, dtype=torch.int64, device=dev),
            p_idx=torch.sort(torch.randint(0, NB, (2 * B, HK, n_pred + 2), generator=g,
                                           dtype=torch.int32), -1).values.to(dev),
            p_cnt=torch.full((2 * B, HK), n_pred + 2, dtype=torch.int32, device=dev),
            theta=torch.tensor([[0.6, 0.3, 0.5]] * B, device=dev),
            scores=torch.randn(B, HK, NBt, generator=g).to(dev),
            # The step's new key of each row, in its last block (row b's pages are b NB + 1 ..).
            new_k=torch.randn(B, HK, D, generator=g).to(dev, torch.bfloat16),
            new_pos=torch.full((B,), NB * page - 5, dtype=torch.int64, device=dev),
            new_loc=(torch.arange(B, device=dev) * NB + NB) * page + page - 5))
    return sets


def bench_selection(a, dev, g, bw, rows):
    k, sink, local, n_pred = a.top_k // a.page, 1, 1, a.n_pred
    n_out = k + sink + local
    for B, ctx in a.sel_points:
        NB = ctx // a.page
        NBt = max(a.table_ctx, ctx) // a.page
        per = B * NB * HK * D * 2 * 2  # bf16 kmin and kmax of every block
        R = 2 if a.quick else n_sets(per, dev)
        sets = selection_sets(B, NB, R, n_pred, dev, g, a.page, NBt)

        def select(s):
            return select_set(s, k, n_out, with_p=True, sink=sink, local=local)

        def select_serial(s):  # serial DSA: no P, M = A
            return select_set(s, k, n_out, sink=sink, local=local)

        def select_predict(s):
            return select_predict_set(s, k, n_pred, n_out, sink=sink, local=local)

        def predictor(s):  # --prr-predictor side: the step's own launch after the selection
            ops.predict_update_rows(
                level=s["level"], trend=s["trend"], n_init=s["n_init"], p_idx=s["p_idx"],
                p_cnt=s["p_cnt"], theta=s["theta"], rows=s["rows"], scores=s["scores"],
                nblk=s["nblk"], nblk_next=s["nblk_next"], n_pred=n_pred, sink_blocks=sink,
                local_blocks=local, p_rows=s["p_nxt"])

        def select_fold(s):  # serial DSA with the step's new keys folded into the scores
            return select_set(s, k, n_out, fold_page=a.page, sink=sink, local=local)

        def select_fold_write(s):  # ... and written: the decode update in the same launch
            return select_set(s, k, n_out, fold_page=a.page, sink=sink, local=local, write=True)

        side, forked, joined = ((torch.cuda.Stream(dev), torch.cuda.Event(), torch.cuda.Event())
                                if dev.type == "cuda" else (None, None, None))

        def select_fold_beside_update(s):  # the update on a second stream, joined after
            main = torch.cuda.current_stream(dev)
            forked.record(main)
            with torch.cuda.stream(side):
                side.wait_event(forked)
                update_set(s, a.page)
                joined.record(side)
            out = select_fold(s)
            main.wait_event(joined)
            return out

        def scores(s):  # the split selection's first launch alone (SGLANG_PRR_SCORES_KERNEL)
            return ops.quest_scores(s["q"], s["kmin"], s["kmax"], s["table"], s["nblk"])

        cases = [("scores alone", scores),
                 ("select (scores, A), serial", select_serial),
                 ("select (scores, A, M)", select),
                 ("select + predictor", select_predict),
                 ("select + fold, serial", select_fold),
                 ("select + fold + write, serial", select_fold_write)]
        if side is not None:
            cases.append(("select + fold, update beside", select_fold_beside_update))
        for name, fn in cases:
            rows.append(_row("selection", name, B, ctx, 0, 0, per, R, sets, fn, a, dev, bw,
                             NBt * a.page))
        # The predictor's bytes: scores read, level and trend read and written.
        rows.append(_row("selection", "predictor (side)", B, ctx, 0, 0, B * HK * NB * 4 * 5, R,
                         sets, predictor, a, dev, bw, NBt * a.page))
        del sets


def _row(part, case, B, ctx, tokens, m, nbytes, R, sets, fn, a, dev, bw, table_ctx=None):
    return _timed_row(part, case, B, ctx, tokens, m, nbytes,
                      [lambda s=s: fn(s) for s in sets], a, dev, bw, table_ctx)


def _timed_row(part, case, B, ctx, tokens, m, nbytes, calls, a, dev, bw, table_ctx=None):
    cold = common.time_graph(calls, a.reps, cold=True, device=dev)[0]
    warm = common.time_graph(calls[:1] * len(calls), a.reps, device=dev)[0]
    gbps = nbytes / cold / 1e3
    row = dict(part=part, case=case, batch=B, ctx=ctx, table_ctx=table_ctx or "",
               tokens=tokens, m_blocks=m,
               cold_us=round(cold, 2), warm_us=round(warm, 2), bytes=nbytes,
               cold_GBps=round(gbps, 1), pct_copy=round(100 * gbps / bw, 1) if bw else None,
               copy_GBps=round(bw, 1), select_kernel=select_kernel(),
               attn_launch=attn_launch(),
               debug_stop=int(os.environ.get(DEBUG_STOP_ENV[part], "0")),
               library=build.library_tag())
    wide = f" table={table_ctx}" if table_ctx and table_ctx != ctx else ""
    print(f"{part:10s} {case:30s} B={B:<3d} ctx={ctx:<7d}{wide} tok={tokens:<5d} "
          f"cold {cold:9.2f} us  warm {warm:9.2f} us  {gbps:7.0f} GB/s", flush=True)
    return row


def plot(rows, png: str) -> None:
    """Cold µs per case, one panel per part (the bars' labels name batch and size)."""
    plt = common.pyplot()
    if plt is None:
        return
    parts = sorted({r["part"] for r in rows})
    fig, axes = plt.subplots(len(parts), 1, figsize=(10, 3.2 * len(parts)), squeeze=False)
    for ax, part in zip(axes[:, 0], parts):
        rs = [r for r in rows if r["part"] == part]
        libs = len({r.get("library") for r in rs}) > 1  # two libraries: say which bar is which
        labels = [f"{r['case']}\nB={r['batch']} " + (f"{r['tokens']} tok" if part == "attention"
                                                    else f"{int(r['ctx']) // 1024}K")
                  + (f" [{r['library'][:8]}]" if libs else "") for r in rs]
        ax.barh(range(len(rs)), [float(r["cold_us"]) for r in rs], color="tab:blue",
                label="cold L2")
        ax.barh(range(len(rs)), [float(r["warm_us"]) for r in rs], color="tab:orange",
                alpha=0.6, label="warm L2")
        ax.set_yticks(range(len(rs)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlabel("µs per call")
        ax.set_title(part)
        ax.legend(fontsize=7)
    common.save_figure(fig, png)


def _point(text: str) -> tuple:
    a, b = text.lower().split("x")
    return int(a), int(b)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=["attention", "selection"],
                    default=["attention", "selection"])
    ap.add_argument("--attn-points", type=_point, nargs="+",
                    default=[(1, 2048), (8, 2048), (32, 2048), (8, 8192), (32, 8192)],
                    metavar="BATCHxTOKENS", help="attention: batch x selected tokens")
    ap.add_argument("--repair-blocks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ctx-blocks", type=int, default=2048,
                    help="blocks in each request's table (the attention lists' range)")
    ap.add_argument("--sel-points", type=_point, nargs="+",
                    default=[(1, 32768), (1, 131072), (8, 131072), (32, 131072)],
                    metavar="BATCHxCTX", help="selection: batch x context tokens")
    ap.add_argument("--table-ctx", type=int, default=0,
                    help="selection: the block tables' width in tokens, when wider than the "
                         "context (a server's tables are as wide as its context length)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2048, help="K in tokens")
    ap.add_argument("--n-pred", type=int, default=48, help="|P| in blocks")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (plumbing on a CPU)")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "kernel_stages.csv"))
    ap.add_argument("--append", action="store_true", help="add rows to an existing CSV")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if a.quick:
        a.attn_points, a.repair_blocks, a.ctx_blocks = [(1, 64), (2, 64)], [1, 2], 16
        a.sel_points, a.page, a.top_k, a.n_pred, a.reps = [(1, 512), (2, 512)], 16, 64, 6, 2
    common.require_kernels(dev)
    g = torch.Generator().manual_seed(0)
    bw = copy_gbps(dev)
    print(f"device {dev}, copy bandwidth {bw:.0f} GB/s, L2 {common.l2_bytes(dev) >> 20} MiB")
    rows = []
    if "attention" in a.parts:
        bench_attention(a, dev, g, bw, rows)
    if "selection" in a.parts:
        bench_selection(a, dev, g, bw, rows)
    every = common.write_rows(a.csv, rows, COLUMNS, append=a.append)
    plot(every, os.path.splitext(a.csv)[0] + ".png")
    return rows


if __name__ == "__main__":
    main()
