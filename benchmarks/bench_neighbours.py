"""One question: how long do the sparse path's kernels take among the neighbours they have in the
server, and which neighbours make them slower?

The server's profile (``bench_serving.py --profile``) gave serial DSA's selection 22.4 µs and its
attention 19.0 µs a layer at 128K / 1, where ``bench_kernel_stages`` (cold L2, CUDA-graph replays
of rotated input sets, CUDA events) gives ~16 and ~15. This benchmark runs one layer's sparse
kernels in a CUDA graph of ``--layers`` layers with per-layer inputs (each layer's summaries and
K/V its own, so every layer's data is cold), each layer's kernels among the neighbours a setting
names, and reads every kernel's duration from CUPTI (the torch profiler), as the server's profile
does. A setting is the stages of one layer, in order:

* ``flushed``: one layer a replay, the L2 flushed before it (``common.L2Flush``; the flush's own
  kernels are left out): ``bench_kernel_stages``' cold setting, read by CUPTI.
* ``layers``: select, attention (the layers back to back).
* ``server``: the qkv GEMM, select, attention, the gate/up GEMM, the down GEMM (a Llama-3-8B
  decoder layer's weights at the batch: 50, 235 and 117 MB of fp16 a layer).
* ``gemm_select``: gate/up GEMM, select, select (another layer's inputs).
* ``gemm_attention``: gate/up GEMM, attention, attention (another layer's inputs).
* ``gemm_attention_select``: gate/up GEMM, attention, select.
* ``code``: other code with almost no data (Quest's selection over fp32 summaries of one 4K
  request: another instantiation of the selection), select, attention.
* ``pages``: first touches of 8192 pages 2 MB apart (8 KB of data: a TLB sweep), select,
  attention.

Variants: ``serial`` (Quest's selection with the step's new keys folded in, as serial DSA's
server calls it; attention over A with its merge), ``prr`` (the selection with the predictor's
step in its epilogue; the same attention, whose kernel the repair runs too) and ``prr_layer``
(PRR's layer as its server step lays it out: the selection + predictor on a side stream; the
speculative pass over P beside it on the main stream; the repair over M, after the selection,
merged with the partials of P n A; |M| = ``--m-blocks``, P the rest of A and blocks outside it,
|P| = ``--n-pred``; in the settings whose ``select`` and ``attention`` are one layer's). The
selections write the step's new keys into the summaries (the decode update in their launch, as
the server's default); ``--summary-update side`` folds them only and runs the update as its own
launch after PRR's selection on the side stream (``SGLANG_PRR_SUMMARY_UPDATE=side``; its rows'
variants end in ``+side``). Shape: Llama-3-8B (32 q / 8 KV heads, head dim 128, bf16 K/V and
summaries), page 64, K = 2048 tokens, |P| = 48 blocks. The CSV has one row per (variant,
setting, place): the place of a kernel among its layer's kernels (``prr_layer``: ordered by name,
then start), its name and its mean and median µs over ``--reps`` replays of every layer.

    python benchmarks/bench_neighbours.py --csv benchmarks/results/neighbours_h200.csv
    python benchmarks/bench_neighbours.py --plot-only benchmarks/results/neighbours_h200.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_kernel_stages as stages  # noqa: E402  (the selection's and attention's input sets)
import common  # noqa: E402  (the benchmarks' graph capture and L2 flush)
from profile_trace import short_name  # noqa: E402
from sglang_prr.kernels import build  # noqa: E402

HIDDEN, INTER, QKV_O = 4096, 14336, 6144  # Llama-3-8B: hidden, MLP width, q + k + v + o columns
SETTINGS: Dict[str, Sequence[str]] = {
    "flushed": ("select", "attention"),
    "layers": ("select", "attention"),
    "server": ("gemm_qkv", "select", "attention", "gemm_up", "gemm_down"),
    "gemm_select": ("gemm_up", "select", "select_other"),
    "gemm_attention": ("gemm_up", "attention", "attention_other"),
    "gemm_attention_select": ("gemm_up", "attention", "select"),
    "code": ("other_code", "select", "attention"),
    "pages": ("touch_pages", "select", "attention"),
}
VARIANTS = ("serial", "prr", "prr_layer")
# The settings prr_layer runs in: its ``select`` stage forks the layer and ``attention`` joins it.
PAIRED = ("flushed", "layers", "server", "code", "pages")
COLUMNS = ["gpu", "date", "library", "variant", "setting", "batch", "ctx", "layers", "place",
           "kernel", "mean_us", "median_us", "count"]


def layer_means(events: Sequence[dict], replays: int, layers: int,
                exclude: Sequence[str] = (), by_name: bool = False) -> List[dict]:
    """Per place in a layer: the kernel's short name and its mean / median µs over every layer
    of every replay. ``events``: the trace's events (those with ``cat == "kernel"`` count, in
    start order, less those whose short name is in ``exclude``); each of the ``replays x layers``
    layers must hold the same kernels in the same order, else ``ValueError``. ``by_name``: a
    layer's kernels ordered by short name, then start (two streams: which of two concurrent
    kernels starts first may change from layer to layer)."""
    ks = sorted((e for e in events if e.get("cat") == "kernel"
                 and short_name(e["name"]) not in exclude), key=lambda e: e["ts"])
    n = replays * layers
    if n <= 0 or not ks or len(ks) % n:
        raise ValueError(f"{len(ks)} kernels do not split into {replays} replays x {layers} "
                         f"layers")
    per = len(ks) // n
    if by_name:
        ks = [e for i in range(0, len(ks), per)
              for e in sorted(ks[i:i + per], key=lambda e: (short_name(e["name"]), e["ts"]))]
    out = []
    for p in range(per):
        at = ks[p::per]
        names = {short_name(e["name"]) for e in at}
        if len(names) != 1:
            raise ValueError(f"place {p} of a layer holds different kernels: {sorted(names)}")
        durs = [float(e["dur"]) for e in at]
        out.append(dict(place=p, kernel=names.pop(), mean_us=round(statistics.fmean(durs), 2),
                        median_us=round(statistics.median(durs), 2), count=len(durs)))
    return out


class Layers:
    """Per-layer inputs and the stages a setting strings together (``SETTINGS``)."""

    def __init__(self, a, dev: torch.device, dims=(HIDDEN, INTER, QKV_O)):
        g = torch.Generator().manual_seed(0)
        hidden, inter, qkv_o = dims
        self.a, self.dev, self.L = a, dev, a.layers
        # The selections write the new keys (the server's default), or fold them only.
        self.write = getattr(a, "summary_update", "select") == "select"
        nb, nbt = a.ctx // a.page, a.ctx // a.page + 1  # the server's table holds one more block
        self.sel = stages.selection_sets(a.batch, nb, a.layers, a.n_pred, dev, g, a.page, nbt)
        self.k_buf, self.v_buf, self.att, _ = stages.attention_sets(
            a.batch, a.top_k, a.page, nbt, a.layers, dev, g)
        small = stages.selection_sets(1, 4096 // a.page, 1, a.n_pred, dev, g, a.page)[0]
        small["kmin"], small["kmax"] = small["kmin"].float(), small["kmax"].float()
        self.small = small
        h = torch.float16
        self.x = torch.randn(a.batch, hidden, device=dev, dtype=h)
        self.xi = torch.randn(a.batch, inter, device=dev, dtype=h)
        self.w = {"gemm_qkv": torch.randn(hidden, qkv_o, device=dev, dtype=h),
                  "gemm_up": torch.randn(hidden, 2 * inter, device=dev, dtype=h),
                  "gemm_down": torch.randn(inter, hidden, device=dev, dtype=h)}
        # The TLB sweep's 16 GB only where a setting to run sweeps it.
        sweep = any("touch_pages" in SETTINGS[st] for st in getattr(a, "settings", SETTINGS))
        span = 16 << 30 if dev.type == "cuda" and sweep else 1 << 20
        self.pages = torch.empty(span, dtype=torch.uint8, device=dev)
        self.touch = torch.arange(8192, device=dev) * (span // 8192)
        self.stats = torch.zeros(4, dtype=torch.int64, device=dev)
        self.k = a.top_k // a.page
        self.sm = 1.0 / math.sqrt(stages.D)
        self.spec = [self._spec_lists(s, a.m_blocks, a.n_pred, nbt, g) for s in self.att]
        cuda = dev.type == "cuda"
        self.side = torch.cuda.Stream(dev) if cuda else None
        self.forked, self.selected, self.side_done = (
            (torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event()) if cuda
            else (None, None, None))
        self._o_spec = None

    @staticmethod
    def _spec_lists(s, m: int, n_pred: int, nbt: int, g) -> dict:
        """PRR's lists on attention input set ``s``: M = A's last ``m`` entries (in A's width,
        count m), P = A's other entries and blocks outside A (ascending, ``n_pred`` of them: a
        hit rate of (|A| - m) / |A|)."""
        idx = s["idx"].cpu()
        B, hk, na = idx.shape
        if not 0 <= m <= na or n_pred < na - m or n_pred > nbt:
            raise ValueError(f"|M| = {m} and |P| = {n_pred} do not fit |A| = {na} in {nbt} "
                             f"blocks")
        mi = idx.clone()
        mi[:, :, :m] = idx[:, :, na - m:]
        p = torch.empty(B, hk, n_pred, dtype=torch.int32)
        for b in range(B):
            for h in range(hk):
                out = torch.ones(nbt, dtype=torch.bool)
                out[idx[b, h].long()] = False
                rest = torch.nonzero(out).flatten()
                extra = rest[torch.randperm(len(rest), generator=g)[: n_pred - (na - m)]]
                p[b, h] = torch.sort(torch.cat([idx[b, h, : na - m].long(), extra])).values
        dev = s["idx"].device
        return dict(m_idx=mi.to(dev), m_cnt=torch.full_like(s["cnt"], m), p_idx=p.to(dev),
                    p_cnt=torch.full_like(s["cnt"], n_pred))

    def select(self, l: int, prr: bool):
        s, k, a = self.sel[l], self.k, self.a
        if prr:
            return stages.select_predict_set(s, k, a.n_pred, k + 2, fold_page=a.page,
                                             stats=self.stats, write=self.write)
        return stages.select_set(s, k, k + 2, fold_page=a.page, stats=self.stats,
                                 write=self.write)

    def attention(self, l: int):
        return stages.attention_merge_set(self.att[l], self.k_buf, self.v_buf, self.a.page,
                                          self.sm)

    def fork(self, l: int) -> None:
        """PRR's layer up to the repair: the selection + predictor (and, ``--summary-update
        side``, the summary update) on the side stream, the speculative pass over P beside them
        (the server step's order)."""
        s, sp, a = self.att[l], self.spec[l], self.a
        if self.side is not None:
            main = torch.cuda.current_stream(self.dev)
            self.forked.record(main)
            with torch.cuda.stream(self.side):
                self.side.wait_event(self.forked)
                self.select(l, True)
                self.selected.record(self.side)
                if not self.write:
                    stages.update_set(self.sel[l], a.page)
                self.side_done.record(self.side)
        else:
            self.select(l, True)
            if not self.write:
                stages.update_set(self.sel[l], a.page)
        self._o_spec = stages.partials_set(s, self.k_buf, self.v_buf, a.page, self.sm,
                                           sp["p_idx"], sp["p_cnt"])

    def repair(self, l: int):
        """The repair over M after the selection, merged with the partials of P n A."""
        s, sp = self.att[l], self.spec[l]
        o_s, l_s = self._o_spec
        if self.side is not None:
            main = torch.cuda.current_stream(self.dev)
            main.wait_event(self.selected)
        out = stages.repair_merge_set(s, self.k_buf, self.v_buf, self.a.page, self.sm, o_s, l_s,
                                      sp["m_idx"], sp["m_cnt"], sp["p_idx"], sp["p_cnt"])
        if self.side is not None:
            main.wait_event(self.side_done)  # the side stream joins before the layer ends
        return out


    def stage(self, name: str, l: int, variant: str) -> None:
        other = (l + self.L // 2) % self.L
        prr = variant != "serial"
        if name.startswith("gemm_"):
            torch.matmul(self.xi if name == "gemm_down" else self.x, self.w[name])
        elif variant == "prr_layer" and name in ("select", "attention"):
            if name == "select":
                self.fork(l)
            else:
                self.repair(l)
        elif name in ("select", "select_other"):
            self.select(other if name == "select_other" else l, prr)
        elif name in ("attention", "attention_other"):
            self.attention(other if name == "attention_other" else l)
        elif name == "other_code":
            stages.select_set(self.small, self.k, self.k + 2)
        elif name == "touch_pages":
            torch.index_select(self.pages, 0, self.touch)
        else:
            raise ValueError(f"unknown stage {name!r}; stages: {sorted(_stage_names())}")

    def calls(self, setting: str, variant: str) -> List[Callable[[], None]]:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; variants: {list(VARIANTS)}")
        if variant == "prr_layer" and setting not in PAIRED:
            raise ValueError(f"prr_layer runs in the settings {list(PAIRED)}, not {setting!r}")
        names = SETTINGS[setting]
        n = 1 if setting == "flushed" else self.L

        def layer(l):
            for s in names:
                self.stage(s, l, variant)
        return [lambda l=l: layer(l) for l in range(n)]


def _stage_names():
    return {s for st in SETTINGS.values() for s in st}


def trace(fn: Callable[[], None]) -> List[dict]:
    """The torch profiler's trace events (CUPTI's kernels among them) of ``fn``'s GPU work."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        p.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def profile(calls, reps: int, flush=None) -> List[dict]:
    """Trace events of ``reps`` replays of ``calls`` captured in one graph (``flush`` before
    each replay)."""
    g, _ = common.capture(calls)

    def replays(n):
        for _ in range(n):
            if flush is not None:
                flush()
            g.replay()
    replays(2)
    torch.cuda.synchronize()
    return trace(lambda: replays(reps))


def flush_kernels(dev) -> List[str]:
    """The short names of the L2 flush's kernels (left out of the ``flushed`` setting's layers)."""
    fl = common.flusher(dev)
    fl()
    return sorted({short_name(e["name"]) for e in trace(fl) if e.get("cat") == "kernel"})


def measure(a) -> List[dict]:
    dev = torch.device("cuda")
    t0 = time.time()
    lay = Layers(a, dev)
    print(f"inputs for {a.layers} layers in {time.time() - t0:.1f} s", flush=True)
    fl_names = flush_kernels(dev)
    rows = []
    base = dict(gpu=torch.cuda.get_device_name(dev), date=time.strftime("%Y-%m-%d"),
                library=build.library_tag(), batch=a.batch, ctx=a.ctx, layers=a.layers)
    tag = "" if lay.write else "+side"
    for variant in a.variants:
        for setting in a.settings:
            if variant == "prr_layer" and setting not in PAIRED:
                continue
            flushed = setting == "flushed"
            ev = profile(lay.calls(setting, variant), a.reps,
                         common.flusher(dev) if flushed else None)
            places = layer_means(ev, a.reps, 1 if flushed else a.layers,
                                 fl_names if flushed else (), by_name=variant == "prr_layer")
            for r in places:
                rows.append(dict(base, variant=variant + tag, setting=setting, **r))
            print(f"{variant:6s} {setting:22s} " + "  ".join(
                f"{r['kernel'][:28]} {r['mean_us']:.2f}" for r in places
                if not r["kernel"].startswith(("nvjet", "gemm", "index", "cutlass"))), flush=True)
    return rows


def plot(rows, png: str) -> None:
    """Mean µs of the sparse kernels (selection, attention) per setting, a panel per variant."""
    plt = common.pyplot()
    if plt is None:
        return
    sparse = [r for r in rows if r["kernel"].startswith(("quest_select", "quest_scores",
                                                         "block_attn", "attn_merge"))]
    variants = sorted({r["variant"] for r in sparse})
    fig, axes = plt.subplots(len(variants), 1, figsize=(10, 0.5 + 0.3 * len(sparse)),
                             squeeze=False)
    for ax, v in zip(axes[:, 0], variants):
        rs = [r for r in sparse if r["variant"] == v]
        ax.barh(range(len(rs)), [float(r["mean_us"]) for r in rs],
                color=["tab:blue" if "select" in r["kernel"] or "scores" in r["kernel"]
                       else "tab:orange" for r in rs])
        ax.set_yticks(range(len(rs)))
        ax.set_yticklabels([f"{r['setting']} #{r['place']}: {r['kernel'][:34]}" for r in rs],
                           fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("µs per kernel (CUPTI)")
        ax.set_title(f"{v}: the sparse kernels among their neighbours")
    common.save_figure(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=131200,
                    help="tokens a request holds (128K of prompt and some decoded)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2048, help="K in tokens")
    ap.add_argument("--n-pred", type=int, default=48, help="|P| in blocks")
    ap.add_argument("--m-blocks", type=int, default=13,
                    help="|M| in blocks (prr_layer; the server's at 128K / 1: 12.7)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--summary-update", choices=["select", "side"], default="select",
                    help="the selections write the new keys, or the update is its own launch")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "neighbours.csv"))
    ap.add_argument("--append", action="store_true", help="add rows to an existing CSV")
    ap.add_argument("--plot-only", metavar="CSV", help="draw the plot of an existing CSV")
    a = ap.parse_args(argv)
    if a.plot_only:
        with open(a.plot_only) as f:
            rows = list(csv.DictReader(f))
        missing = {"variant", "setting", "place", "kernel", "mean_us"} - set(rows[0] if rows
                                                                             else ())
        if missing:
            raise KeyError(f"{a.plot_only} lacks the columns {sorted(missing)}")
        plot(rows, os.path.splitext(a.plot_only)[0] + ".png")
        return rows
    for name, v in (("--layers", a.layers), ("--reps", a.reps), ("--batch", a.batch)):
        if v < 1:
            raise SystemExit(f"{name} must be >= 1, got {v}")
    if a.ctx < a.top_k + 2 * a.page:
        raise SystemExit(f"--ctx {a.ctx} must hold K + 2 blocks ({a.top_k + 2 * a.page} tokens)")
    na = a.top_k // a.page + 2  # |A|: K's blocks, the sink and the newest
    if not 0 <= a.m_blocks <= na or not na - a.m_blocks <= a.n_pred <= a.ctx // a.page:
        raise SystemExit(f"--m-blocks {a.m_blocks} and --n-pred {a.n_pred} must satisfy 0 <= |M| "
                         f"<= |A| = {na} and |A| - |M| <= |P| <= {a.ctx // a.page} blocks")
    if not torch.cuda.is_available():
        raise SystemExit("bench_neighbours needs a CUDA GPU (CUPTI's kernel durations); "
                         "--plot-only draws an existing CSV")
    rows = measure(a)
    every = common.write_rows(a.csv, rows, COLUMNS, append=a.append)
    plot(every, os.path.splitext(a.csv)[0] + ".png")
    return rows


if __name__ == "__main__":
    main()
