"""How well does the PRR predictor guess the selected set A? (hit rates per trace family)

For each trace family (synthetic, ``tools.traces``) or a captured trace (``--trace``), and each
(K, delta) of the grid, replays with the library's ops:

* reuse-previous: P = top-|P| of the previous step's scores (= the previous A at delta = 1);
* EMA (Holt) with several fixed theta = (alpha, beta, gamma), and every one of the 80 grid
  candidates (to find the best single fixed theta in hindsight, averaged over families);
* EMA with prefill calibration: theta* = argmax of ``ops.calibrate`` over the first
  ``--calib-rows`` steps of the trace, which play the sampled prefill queries; hit rates are
  measured on the remaining steps ("decode"). Every predictor's state runs over the whole trace,
  so the decode part starts from a warm state for all of them;
* oracle: the best grid theta per request in hindsight on the decode steps (calibration's ceiling).

Metrics over the middle blocks of A (sink/local blocks are always attended, hence always hits):
the score-weighted hit rate of eq 4 (``reference.weighted_hit``), the plain overlap |P n A| / |A|,
the distribution of |M| = |A \\ P| (blocks the repair pass must attend), and how often a step's M
is empty in every KV head (its layer's repair is then a merge alone: no K/V read, no partial).

Writes ``<out>.csv`` (named predictors), ``<out>_grid.csv`` (every grid theta), ``<out>.md`` (the
table and the target checks) and ``<out>.png``. Default size runs on CPU in about a minute:

    PYTHONPATH=. python3 benchmarks/bench_predictor.py
    PYTHONPATH=. python3 benchmarks/bench_predictor.py --trace /path/to/trace_dir --k 32

With ``--trace DIR --per-layer`` the rows are per traced layer (the requests of a layer pooled)
instead of per request file, the 80 grid thetas are replayed at every (K, delta), and ``<out>.csv``
is the wide per-layer table (layer, k, delta, reuse_previous, ema_default, ema_calibrated,
best_theta_hindsight, ...; the long rows go to ``<out>_rows.csv``), with per-layer target checks
in ``<out>.md``. Real traces: ``benchmarks/record_real_traces.py``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_prr.tools import trace_families, trace_replay, traces  # noqa: E402
from sglang_prr.config import PRRConfig  # noqa: E402

# Fixed thetas shown as their own columns: the config default and three corners of the grid.
FIXED_THETAS: Dict[str, Tuple[float, float, float]] = {
    "ema_default": tuple(PRRConfig().default_theta),
    "ema_slow": (0.2, 0.1, 0.0),
    "ema_mid": (0.4, 0.2, 0.25),
    "ema_fast": (0.8, 0.5, 0.75),
}
TARGET_GAIN = 0.15  # calibrated >= reuse-previous + 15 points on every structured family
HEADLINE = (32, 1.5)  # (K blocks, delta) of the plot's bar panel and the README table
PCTS = (50, 90, 99)
# Default size: 32 calibration steps + 64 measured decode steps, 4 KV heads, 2 requests per family;
# small enough that the default grid runs in about two minutes on two CPU cores (the sort in
# select_topk dominates). Heads and requests only add samples; they do not change the model.
BENCH_STEPS = 96
BENCH_KV_HEADS = 4


n_pred_of = trace_replay.n_pred_of  # |P| middle blocks for K and delta


def evaluate(scores: torch.Tensor, nblk: torch.Tensor, k: int, delta: float, calib_rows: int,
             sink_blocks: int = 1, local_blocks: int = 1,
             fixed: Dict[str, Tuple[float, float, float]] = FIXED_THETAS,
             full_grid: bool = False, cfg: PRRConfig = None) -> Dict[str, object]:
    """The benchmark's core: every predictor on traces ``scores [R, T, Hk, NB]``, ``nblk [R, T]``.

    The first ``calib_rows`` steps calibrate (``ops.calibrate`` -> theta* per trace) and warm every
    predictor's state; the other steps are measured. ``full_grid`` also replays all 80 grid
    thetas on the measured steps (for the best fixed theta in hindsight and the oracle).
    Returns ``{"named": {predictor: {"hit", "overlap": [R], "missed": [R, T_m, Hk]}},
    "theta_star": [R, 3], "n_pred", "calib_H": [R, 80]}`` plus ``"grid": [80, 3]``,
    ``"grid_hit"``/``"grid_overlap": [R, 80]`` when ``full_grid``.
    """
    cfg = cfg or PRRConfig()
    R, T, Hk, nb = scores.shape
    if not 2 <= calib_rows < T:
        raise ValueError(f"calib_rows={calib_rows}: need 2 <= calib_rows < steps={T} (the rest "
                         f"are the measured decode steps)")
    n_pred = n_pred_of(k, delta)
    grid = trace_replay.theta_grid(cfg)  # [80, 3]
    G = grid.shape[0]
    # Calibration on the prefix rows, exactly as the prefill does it (eqs 4-5).
    H, star = trace_replay.calibrate(scores, nblk, k, n_pred, calib_rows, sink_blocks,
                                     local_blocks, grid)  # [R, 80], [R]
    names = ["reuse_prev"] + list(fixed) + ["calibrated"]
    shared = torch.tensor([trace_replay.REUSE_THETA] + list(fixed.values()), dtype=torch.float32)
    thetas = torch.cat([shared.expand(R, -1, 3), grid[star].unsqueeze(1)], 1)  # [R, C, 3]
    if full_grid:
        thetas = torch.cat([thetas, grid.expand(R, G, 3)], 1)
    res = trace_replay.replay(scores, nblk, k, n_pred, sink_blocks, local_blocks, thetas,
                        start=calib_rows)
    hit = res["hit"].mean((2, 3))  # [R, C]
    ov = res["overlap"].mean((2, 3))
    named = {n: {"hit": hit[:, c], "overlap": ov[:, c], "missed": res["missed"][:, c]}
             for c, n in enumerate(names)}
    out = {"named": named, "theta_star": grid[star], "n_pred": n_pred, "calib_H": H}
    if full_grid:
        gh, go = hit[:, len(names):], ov[:, len(names):]
        best = gh.argmax(-1)
        ar = torch.arange(R)
        named["oracle"] = {"hit": gh[ar, best], "overlap": go[ar, best],
                           "missed": res["missed"][:, len(names):][ar, best]}
        out.update(grid=grid, grid_hit=gh, grid_overlap=go)
    return out


def _stack(trs: Sequence[traces.Trace], layer: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stack traces of one shape (synthetic requests of one family) into ``[R, T, Hk, NB]``."""
    rows = [t.torch_rows(layer) for t in trs]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def _mstats(m: torch.Tensor) -> Dict[str, float]:
    x = m.reshape(-1).double().numpy()
    out = {"m_mean": float(x.mean()), "m_max": float(x.max())}
    for p in PCTS:
        out[f"m_p{p}"] = float(np.percentile(x, p))
    return out


def run(sources: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]], ks: Sequence[int],
        deltas: Sequence[float], calib_rows: int, sink: int, local: int, structured: Dict[str, bool],
        full_grid: str = "headline") -> Tuple[List[dict], List[dict], Dict[tuple, np.ndarray]]:
    """Evaluate every source (a list of stacked ``(scores, nblk)`` groups) over the grid.

    full_grid: ``all`` | ``headline`` (only at ``HEADLINE`` or the middle of the grid) | ``none``.
    """
    k0, d0 = headline(ks, deltas)
    rows, grid_rows, missed = [], [], {}
    for name, groups in sources.items():
        for k in ks:
            for d in deltas:
                fg = full_grid == "all" or (full_grid == "headline" and (k, d) == (k0, d0))
                outs = [evaluate(s, n, k, d, calib_rows, sink, local, full_grid=fg)
                        for s, n in groups]
                nreq = sum(o["theta_star"].shape[0] for o in outs)
                for pred in outs[0]["named"]:
                    hit = torch.cat([o["named"][pred]["hit"] for o in outs])
                    ov = torch.cat([o["named"][pred]["overlap"] for o in outs])
                    m = torch.cat([o["named"][pred]["missed"].reshape(-1) for o in outs])
                    missed[(name, k, d, pred)] = m.numpy()
                    # Steps whose M is empty in every KV head: the repair of such a step's
                    # layer is a merge alone (no K/V read, no partial): [R, T_m, Hk] per group.
                    none = torch.cat([(o["named"][pred]["missed"].amax(-1) == 0).reshape(-1)
                                      for o in outs])
                    rows.append(dict(source=name, structured=int(structured.get(name, True)),
                                     k=k, delta=d, n_pred=outs[0]["n_pred"], predictor=pred,
                                     hit=float(hit.mean()), overlap=float(ov.mean()),
                                     requests=nreq, m_none_all_heads=float(none.double().mean()),
                                     **_mstats(m)))
                if not fg:
                    continue
                ghit = torch.cat([o["grid_hit"] for o in outs]).mean(0)
                gov = torch.cat([o["grid_overlap"] for o in outs]).mean(0)
                star = torch.cat([o["theta_star"] for o in outs])
                for c, th in enumerate(outs[0]["grid"].tolist()):
                    th = [round(x, 4) for x in th]
                    picked = int(((star - torch.tensor(th)).abs() < 1e-4).all(-1).sum())
                    grid_rows.append(dict(source=name, k=k, delta=d, alpha=th[0], beta=th[1],
                                          gamma=th[2], hit=float(ghit[c]), overlap=float(gov[c]),
                                          picked=picked))
    return rows, grid_rows, missed


def headline(ks: Sequence[int], deltas: Sequence[float]) -> Tuple[int, float]:
    """The (K, delta) of the bar panel and the full-grid comparison."""
    k0 = HEADLINE[0] if HEADLINE[0] in ks else ks[len(ks) // 2]
    d0 = HEADLINE[1] if HEADLINE[1] in deltas else deltas[len(deltas) // 2]
    return k0, d0


def targets(rows: List[dict], grid_rows: List[dict]) -> List[dict]:
    """The issue's targets per (K, delta) on the score-weighted hit rate: calibrated >= reuse +
    ``TARGET_GAIN`` on every structured source; calibrated >= the best single fixed theta, both
    averaged over all sources (over the 80 grid thetas where they were replayed, else over the
    named fixed thetas)."""
    out = []
    for k, d in sorted({(r["k"], r["delta"]) for r in rows}):
        sel = [r for r in rows if r["k"] == k and r["delta"] == d]
        by = {(r["source"], r["predictor"]): r for r in sel}
        srcs = sorted({r["source"] for r in sel})
        gains = {s: by[(s, "calibrated")]["hit"] - by[(s, "reuse_prev")]["hit"]
                 for s in srcs if by[(s, "calibrated")]["structured"]}
        cal_avg = float(np.mean([by[(s, "calibrated")]["hit"] for s in srcs]))
        g = [r for r in grid_rows if r["k"] == k and r["delta"] == d]
        avg: Dict[object, List[float]] = {}
        if g:
            for r in g:
                avg.setdefault((r["alpha"], r["beta"], r["gamma"]), []).append(r["hit"])
            pool = "80 grid thetas"
        else:
            for name in FIXED_THETAS:
                avg[name] = [by[(s, name)]["hit"] for s in srcs]
            pool = f"{len(FIXED_THETAS)} named fixed thetas"
        best = max(avg, key=lambda t: float(np.mean(avg[t])))
        best_avg = float(np.mean(avg[best]))
        out.append(dict(k=k, delta=d, gains=gains,
                        gain_ok=bool(gains) and all(v >= TARGET_GAIN for v in gains.values()),
                        cal_avg=cal_avg, best_fixed=best, best_fixed_avg=best_avg, pool=pool,
                        fixed_ok=cal_avg >= best_avg))
    return out


def table(rows: List[dict], tg: List[dict], ks: Sequence[int], deltas: Sequence[float]) -> str:
    lines = []
    for k in ks:
        for d in deltas:
            sel = {(r["source"], r["predictor"]): r for r in rows if r["k"] == k and r["delta"] == d}
            if not sel:
                continue
            preds = ["reuse_prev"] + list(FIXED_THETAS) + ["calibrated"]
            preds += ["oracle"] if any(p == "oracle" for _, p in sel) else []
            srcs = sorted({s for s, _ in sel}, key=lambda s: (s not in trace_families.FAMILIES, s))
            lines.append(f"\nK = {k} blocks, delta = {d} (|P| = {n_pred_of(k, d)} middle blocks): "
                         "score-weighted hit (eq 4) / plain overlap; |M| of calibrated")
            lines.append("| source | " + " | ".join(preds) + " | cal - reuse | |M| mean / p90 / max "
                         "| steps with M empty in every head |")
            lines.append("|---" * (len(preds) + 4) + "|")
            for s in srcs:
                cells = [f"{sel[(s, p)]['hit']:.3f} / {sel[(s, p)]['overlap']:.3f}" for p in preds]
                c = sel[(s, "calibrated")]
                gain = c["hit"] - sel[(s, "reuse_prev")]["hit"]
                lines.append(f"| {s} | " + " | ".join(cells) + f" | {gain:+.3f} | "
                             f"{c['m_mean']:.1f} / {c['m_p90']:.0f} / {c['m_max']:.0f} | "
                             f"{c['m_none_all_heads']:.3f} |")
    lines.append("\nTargets (score-weighted hit rate):")
    for t in tg:
        g = ", ".join(f"{s} {v:+.3f}" for s, v in t["gains"].items())
        lines.append(f"- K={t['k']} delta={t['delta']}: calibrated >= reuse + {TARGET_GAIN:.2f} on "
                     f"every structured source: {'MET' if t['gain_ok'] else 'MISSED'} ({g}); "
                     f"calibrated avg {t['cal_avg']:.3f} vs best of {t['pool']} {t['best_fixed']} "
                     f"avg {t['best_fixed_avg']:.3f}: {'MET' if t['fixed_ok'] else 'MISSED'}")
    return "\n".join(lines)


def plot(path: str, rows: List[dict], grid_rows: List[dict], missed: Dict[tuple, np.ndarray],
         ks: Sequence[int], deltas: Sequence[float]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k0, d0 = headline(ks, deltas)
    sel = {(r["source"], r["predictor"]): r for r in rows if r["k"] == k0 and r["delta"] == d0}
    srcs = sorted({s for s, _ in sel}, key=lambda s: (s not in trace_families.FAMILIES, s))
    g = [r for r in grid_rows if r["k"] == k0 and r["delta"] == d0]
    bars = [("reuse_prev", "reuse-previous"), ("ema_default", "EMA default theta")]
    best: Dict[str, float] = {}
    if g:
        avg: Dict[tuple, List[float]] = {}
        for r in g:
            avg.setdefault((r["alpha"], r["beta"], r["gamma"]), []).append(r["hit"])
        best_th = max(avg, key=lambda t: np.mean(avg[t]))
        best = {r["source"]: r["hit"] for r in g if (r["alpha"], r["beta"], r["gamma"]) == best_th}
        bars.append(("best_fixed", f"best fixed theta {best_th}"))
    bars.append(("calibrated", "EMA calibrated"))
    if ("oracle" in {p for _, p in sel}):
        bars.append(("oracle", "oracle theta (hindsight)"))
    fig, ax = plt.subplots(1, 3, figsize=(18, 5))
    w = 0.8 / len(bars)
    x = np.arange(len(srcs))
    for i, (p, label) in enumerate(bars):
        ys = [best[s] if p == "best_fixed" else sel[(s, p)]["hit"] for s in srcs]
        ax[0].bar(x + (i - len(bars) / 2 + 0.5) * w, ys, w, label=label)
    ax[0].set_xticks(x, srcs, rotation=20)
    ax[0].set_ylim(0, 1.3)
    ax[0].set_ylabel("score-weighted hit rate (eq 4)")
    ax[0].set_title(f"hit rate, K={k0} blocks, delta={d0}")
    ax[0].legend(fontsize=7, loc="upper center", ncol=2)
    for s in srcs:
        for p, style in (("calibrated", "-o"), ("reuse_prev", "--x")):
            ys = [next(r["hit"] for r in rows if r["source"] == s and r["k"] == k0
                       and r["delta"] == d and r["predictor"] == p) for d in deltas]
            ax[1].plot(deltas, ys, style, label=f"{s} {p}")
    ax[1].set_xlabel("speculation budget delta (|P| <= delta K)")
    ax[1].set_ylabel("score-weighted hit rate")
    ax[1].set_title(f"hit rate vs delta, K={k0}")
    ax[1].legend(fontsize=7, ncol=2)
    for s in srcs:
        for p, style in (("calibrated", "-"), ("reuse_prev", ":")):
            m = np.sort(missed[(s, k0, d0, p)])
            ax[2].plot(m, np.arange(1, m.size + 1) / m.size, style, label=f"{s} {p}")
    ax[2].set_xlabel("|M| = |A \\ P| per step and KV head (blocks)")
    ax[2].set_ylabel("CDF")
    ax[2].set_title(f"repair size, K={k0}, delta={d0}")
    ax[2].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


LAYER_TOL = 0.005  # per-layer targets: calibrated >= reuse - tol, within tol of the best theta
LAYER_GAIN = 0.05  # ... and >= reuse + 5 points where reuse-previous < LAYER_LOW_REUSE
LAYER_LOW_REUSE = 0.90


def layer_sources(trs: Sequence[traces.Trace], per_head: bool = False
                  ) -> Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]]:
    """Captured traces regrouped by model layer: ``{"layer<id>": [(scores [1, T, Hk, NB], nblk
    [1, T]) per request]}`` (requests keep their own shapes: prompts differ in length).
    ``per_head``: every KV head of a request becomes a row of its own, ``[Hk, T, 1, NB]``, so
    calibration picks theta* per (request, layer, KV head); the hit rates of the other predictors
    are the same numbers, averaged over the same (step, head) cells."""
    out: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    ids = sorted({int(l) for t in trs for l in t.layers})
    for lid in ids:
        groups = []
        for t in trs:
            where = [i for i, l in enumerate(t.layers) if int(l) == lid]
            if where:
                sc, nb = t.torch_rows(where[0])  # [T, Hk, NB], [T]
                if per_head:
                    groups.append((sc.permute(1, 0, 2).unsqueeze(2).contiguous(),
                                   nb.unsqueeze(0).expand(sc.shape[1], -1).contiguous()))
                else:
                    groups.append((sc[None], nb[None]))
        out[f"layer{lid}"] = groups
    return out


def per_layer_rows(rows: List[dict], grid_rows: List[dict]) -> List[dict]:
    """One row per (layer, K, delta) from ``run``'s long rows and the full-grid rows: hit rates
    (score-weighted, eq 4) of reuse-previous, the default EMA, calibrated EMA, the best single grid
    theta in hindsight for that layer (averaged over its requests), and the per-request oracle."""
    by = {(r["source"], r["k"], r["delta"], r["predictor"]): r for r in rows}
    out = []
    for src, k, d in sorted({(r["source"], r["k"], r["delta"]) for r in rows},
                            key=lambda x: (int(x[0][5:]) if x[0][5:].isdigit() else x[0], x[1], x[2])):
        g = [r for r in grid_rows if r["source"] == src and r["k"] == k and r["delta"] == d]
        if not g:
            raise ValueError(f"{src} K={k} delta={d}: no full-grid rows (per-layer needs them)")
        best = max(g, key=lambda r: r["hit"])
        reuse, cal = by[(src, k, d, "reuse_prev")], by[(src, k, d, "calibrated")]
        out.append(dict(
            layer=int(src[5:]) if src.startswith("layer") else src, k=k, delta=d,
            n_pred=reuse["n_pred"], requests=reuse["requests"],
            reuse_previous=round(reuse["hit"], 5),
            ema_default=round(by[(src, k, d, "ema_default")]["hit"], 5),
            ema_calibrated=round(cal["hit"], 5),
            best_theta_hindsight=round(best["hit"], 5),
            best_theta=f"({best['alpha']:g},{best['beta']:g},{best['gamma']:g})",
            oracle_per_request=round(by[(src, k, d, "oracle")]["hit"], 5),
            cal_minus_reuse=round(cal["hit"] - reuse["hit"], 5),
            cal_minus_best=round(cal["hit"] - best["hit"], 5),
            overlap_reuse=round(reuse["overlap"], 5), overlap_calibrated=round(cal["overlap"], 5),
            m_mean_reuse=round(reuse["m_mean"], 3), m_mean_calibrated=round(cal["m_mean"], 3),
            m_none_calibrated=round(cal["m_none_all_heads"], 4)))
    for r in out:
        r["ok_not_below_reuse"] = int(r["cal_minus_reuse"] >= -LAYER_TOL)
        r["ok_near_best"] = int(r["cal_minus_best"] >= -LAYER_TOL)
        r["ok_gain_if_low"] = int(r["reuse_previous"] >= LAYER_LOW_REUSE
                                  or r["cal_minus_reuse"] >= LAYER_GAIN)
    return out


def per_layer_table(prow: List[dict]) -> str:
    lines = ["## Per layer (score-weighted hit rate, eq 4; |M| = mean blocks missed per step and "
             "KV head)", "",
             "| layer | K | delta | reuse-previous | EMA default | EMA calibrated | best theta "
             "(hindsight) | oracle/request | cal - reuse | cal - best | |M| reuse / cal | "
             "M empty in every head (cal) |",
             "|---" * 12 + "|"]
    for r in prow:
        lines.append(f"| {r['layer']} | {r['k']} | {r['delta']:g} | {r['reuse_previous']:.3f} | "
                     f"{r['ema_default']:.3f} | {r['ema_calibrated']:.3f} | "
                     f"{r['best_theta_hindsight']:.3f} {r['best_theta']} | "
                     f"{r['oracle_per_request']:.3f} | {r['cal_minus_reuse']:+.3f} | "
                     f"{r['cal_minus_best']:+.3f} | {r['m_mean_reuse']:.2f} / "
                     f"{r['m_mean_calibrated']:.2f} | {r['m_none_calibrated']:.3f} |")
    lines.append("")
    lines.append(f"Per-layer targets (tolerance {LAYER_TOL}): (a) calibrated >= reuse-previous - "
                 f"{LAYER_TOL}; (b) calibrated >= best theta in hindsight - {LAYER_TOL}; (c) where "
                 f"reuse-previous < {LAYER_LOW_REUSE:.2f}, calibrated >= reuse + {LAYER_GAIN:.2f}.")
    for k, d in sorted({(r["k"], r["delta"]) for r in prow}):
        sel = [r for r in prow if r["k"] == k and r["delta"] == d]
        parts = []
        for key, label in (("ok_not_below_reuse", "a"), ("ok_near_best", "b"),
                           ("ok_gain_if_low", "c")):
            bad = [str(r["layer"]) for r in sel if not r[key]]
            parts.append(f"({label}) " + ("MET" if not bad else "MISSED at layer " + ",".join(bad)))
        lines.append(f"- K={k} delta={d:g}: " + "; ".join(parts))
    return "\n".join(lines)


def _csv(path: str, rows: List[dict]) -> None:
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: Sequence[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(trace_families.FAMILIES),
                    help="synthetic families (comma-separated), ignored with --trace")
    ap.add_argument("--trace", default=None, help="a captured trace .npz file or directory")
    ap.add_argument("--k", default="16,32,64", help="K values in blocks")
    ap.add_argument("--delta", default="1,1.5,2", help="speculation budgets delta")
    ap.add_argument("--steps", type=int, default=BENCH_STEPS, help="steps per synthetic trace")
    ap.add_argument("--calib-rows", type=int, default=PRRConfig().calib_queries,
                    help="leading trace steps that play the sampled prefill queries")
    ap.add_argument("--requests", type=int, default=2, help="synthetic requests (seeds) per family")
    ap.add_argument("--heads", type=int, default=BENCH_KV_HEADS)
    ap.add_argument("--ctx", type=int, default=trace_families.DEFAULT_CTX_TOKENS)
    ap.add_argument("--block", type=int, default=trace_families.DEFAULT_BLOCK_SIZE)
    ap.add_argument("--sink", type=int, default=None, help="sink blocks (default: trace meta or 1)")
    ap.add_argument("--local", type=int, default=None, help="local blocks (default: meta or 1)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="override a synthetic family parameter (e.g. rho=0.5) in every family "
                         "that has it; repeatable")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "predictor"),
                    help="output path prefix (.csv, _grid.csv, .md, .png are appended)")
    ap.add_argument("--full-grid", default="none", choices=("headline", "all", "none"),
                    help="where to replay all 80 grid thetas (best fixed in hindsight, oracle)")
    ap.add_argument("--per-layer", action="store_true",
                    help="with --trace: one row per traced layer (all requests of the layer "
                         "pooled) instead of one per request; replays the full grid at every "
                         "(K, delta) and writes the wide per-layer table to <out>.csv "
                         "(the long rows go to <out>_rows.csv)")
    ap.add_argument("--per-head", action="store_true",
                    help="with --per-layer: calibrate theta* per KV head (every head a row of "
                         "its own) instead of per layer")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    if a.per_layer and not a.trace:
        raise SystemExit("--per-layer needs --trace (synthetic families have one layer)")
    if a.per_head and not a.per_layer:
        raise SystemExit("--per-head needs --per-layer")
    if a.threads:
        torch.set_num_threads(a.threads)
    ks, deltas = _ints(a.k), _floats(a.delta)
    for d in deltas:
        if d < 1:
            raise SystemExit(f"--delta {d}: each delta must be >= 1")
    t0 = time.time()
    sources: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    structured: Dict[str, bool] = {}
    if a.trace:
        trs = traces.load_traces(a.trace)
        sink = a.sink if a.sink is not None else int(trs[0].meta.get("sink_blocks", 1))
        local = a.local if a.local is not None else int(trs[0].meta.get("local_blocks", 1))
        if a.per_layer:
            sources = layer_sources(trs, per_head=a.per_head)
            structured = {name: True for name in sources}
            a.full_grid = "all"  # best theta in hindsight per layer at every (K, delta)
        else:
            for t in trs:
                name = f"trace:{t.rid or 'request'}"
                sources[name] = [tuple(x[None] for x in t.torch_rows(li))
                                 for li in range(len(t.layers))]
                structured[name] = True
        desc = (f"{len(trs)} captured trace(s) from {a.trace}"
                + (", one row per traced layer" if a.per_layer else ""))
    else:
        sink = 1 if a.sink is None else a.sink
        local = 1 if a.local is None else a.local
        over = {}
        for kv in a.param:
            name, _, val = kv.partition("=")
            if not val:
                raise SystemExit(f"--param {kv!r}: expected NAME=VALUE")
            over[name] = float(val)
        for fam in [f for f in a.families.split(",") if f]:
            p = {n: v for n, v in over.items() if n in trace_families.FAMILIES[fam].params}
            trs = [trace_families.generate(fam, steps=a.steps, num_kv_heads=a.heads,
                                           ctx_tokens=a.ctx, block_size=a.block,
                                           seed=a.seed + i, sink_blocks=sink,
                                           local_blocks=local, **p) for i in range(a.requests)]
            sources[fam] = [_stack(trs)]
            structured[fam] = trace_families.FAMILIES[fam].structured
        desc = (f"synthetic families, {a.requests} request(s) each, {a.steps} steps, "
                f"{a.heads} KV heads, {a.ctx} prompt tokens, block {a.block}, seed {a.seed}"
                + (f", overrides {over}" if over else ""))
    rows, grid_rows, missed = run(sources, ks, deltas, a.calib_rows, sink, local, structured,
                                  a.full_grid)
    tg = targets(rows, grid_rows)
    text = (f"# predictor hit rates: {desc}; first {a.calib_rows} steps calibrate, the rest are "
            f"measured; sink={sink} local={local}\n" + table(rows, tg, ks, deltas))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)) or ".", exist_ok=True)
    if a.per_layer:
        prow = per_layer_rows(rows, grid_rows)
        text += "\n\n" + per_layer_table(prow)
        _csv(a.out + ".csv", prow)
        _csv(a.out + "_rows.csv", rows)
    else:
        _csv(a.out + ".csv", rows)
    if grid_rows:
        _csv(a.out + "_grid.csv", grid_rows)
    cmd = "python3 benchmarks/bench_predictor.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with open(a.out + ".md", "w") as f:
        f.write(f"Command: `{cmd.strip()}`\n\n{text}\n")
    if not a.no_plot:
        plot(a.out + ".png", rows, grid_rows, missed, ks, deltas)
    print(text)
    print(f"\nwrote {a.out}.csv{', ' + a.out + '_rows.csv' if a.per_layer else ''}, {a.out}_grid.csv, {a.out}.md"
          f"{'' if a.no_plot else ', ' + a.out + '.png'} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
