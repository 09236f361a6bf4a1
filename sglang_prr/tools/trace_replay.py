"""Replay of block-score traces: how well the Holt predictor's P covers the selected set A.

``replay`` runs the library's own ops (``predict_set``, ``select_topk``, ``holt_update``) over
recorded or synthetic traces (``traces``, ``trace_families``) for any
number of candidate thetas at once and scores every step with eq 4's weighted hit, the overlap
``|P n A| / |A|`` and the misses ``|A \\ P|``; ``benchmarks/bench_predictor.py`` is built on it.
``calibrate`` picks theta* per trace as the prefill does, and ``calibrated_replay`` /
``real_hit_rate`` replay what the server runs (the calibrated predictor) over captured traces:
the hit rate that ``profile_budget`` and ``bench_layer`` hold their predictor at.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from .. import ops
from .. import reference as ref
from ..config import PRRConfig
from .traces import Trace, load_traces

REUSE_THETA = (1.0, 0.5, 0.0)  # alpha = 1, gamma = 0: the prediction is the previous step's scores


def replay(scores: Tensor, nblk: Tensor, k: int, n_pred: int, sink_blocks: int,
           local_blocks: int, thetas: Tensor, start: int = 1) -> Dict[str, Tensor]:
    """Run the Holt predictor for every candidate theta over traces and score its predictions.

    scores: ``[R, T, Hk, NB]`` block scores of ``R`` traces (rows in step order); nblk: ``[R, T]``;
    thetas: ``[C, 3]`` or per trace ``[R, C, 3]`` (alpha, beta, gamma). ``REUSE_THETA`` makes
    P = top-``n_pred`` of the previous step's scores (= the previous A when ``n_pred == k``).
    Uses the library's ops (``predict_set``, ``select_topk``, ``holt_update``) and eq 4's
    ``weighted_hit``; every step updates the state, steps ``>= max(start, 1)`` are measured over
    the middle blocks of ``A``.

    Returns per-step, per-head tensors ``[R, C, T_m, Hk]`` with ``T_m = T - max(start, 1)``:
    ``hit`` (eq 4, score-weighted), ``overlap`` (``|P n A| / |A|``), ``missed`` (``|A \\ P|``).
    """
    R, T, Hk, nb = scores.shape
    C = thetas.shape[-2]
    start = max(int(start), 1)
    dev = scores.device
    th = thetas.float().to(dev).expand(R, C, 3).reshape(R * C, 3)
    alpha, beta, gamma = (th[:, i].contiguous() for i in range(3))  # [R*C]
    level = torch.zeros(R * C, Hk, nb, device=dev)
    trend = torch.zeros_like(level)
    n_init = torch.zeros(R * C, dtype=torch.long, device=dev)
    hit, overlap, missed = [], [], []
    for t in range(T):
        row_r, n_r = scores[:, t].float(), nblk[:, t].long()  # [R, Hk, NB], [R]
        row = row_r.repeat_interleave(C, dim=0)
        n = n_r.repeat_interleave(C, dim=0)
        if t >= start:
            p_idx, p_cnt = ops.predict_set(level, trend, gamma, n_init, n, n_pred, sink_blocks,
                                           local_blocks)
            a_idx, a_cnt = ops.select_topk(row_r, n_r, k, sink_blocks, local_blocks,
                                           k + sink_blocks + local_blocks)
            a_idx, a_cnt = a_idx.repeat_interleave(C, 0), a_cnt.repeat_interleave(C, 0)
            _, middle = ref.kept_mask(n, nb, sink_blocks, local_blocks)
            middle = middle.unsqueeze(1)  # [R*C, 1, NB]
            hit.append(ref.weighted_hit(row, a_idx, a_cnt, p_idx, p_cnt, middle))
            a = ref.list_to_mask(a_idx, a_cnt, nb) & middle
            p = ref.list_to_mask(p_idx, p_cnt, nb)
            n_a = a.sum(-1)
            both = (a & p).sum(-1)
            overlap.append(torch.where(n_a > 0, both.float() / n_a.clamp(min=1).float(),
                                       torch.ones_like(n_a, dtype=torch.float32)))
            missed.append(n_a - both)
        ops.holt_update(level, trend, n_init, row, n, alpha, beta)
    out = {}
    for name, xs in (("hit", hit), ("overlap", overlap), ("missed", missed)):
        x = torch.stack(xs, 1) if xs else torch.zeros(R * C, 0, Hk)
        out[name] = x.view(R, C, -1, Hk)
    return out


def reuse_overlap(traces: Sequence[Trace], k: int, sink_blocks: int = 1,
                  local_blocks: int = 1) -> float:
    """Mean step-to-step overlap ``|A(t-1) n A(t)| / |A(t)|`` (middle blocks) over traces/layers."""
    vals = []
    for tr in traces:
        for li in range(len(tr.layers)):
            s, n = tr.torch_rows(li)
            r = replay(s[None], n[None], k, k, sink_blocks, local_blocks,
                       torch.tensor([REUSE_THETA]))
            vals.append(r["overlap"].mean().item())  # host-ok: offline analysis
    return float(np.mean(vals))


# ----------------------------------------------------------------------------- calibrated
# The SmolLM2-135M-Instruct traces in the repository (4 requests of 4200-5400 tokens of Python
# source, 128 decode steps, layers 0/10/20/29, block 16, K = 16 blocks), recorded with
# benchmarks/record_real_traces.py; a source checkout has them, an installed wheel does not.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REAL_TRACES = os.path.join(REPO_ROOT, "benchmarks", "results", "real_traces")
SYNTHETIC_HIT_RATE = 0.7  # what the profile held before real traces (reported beside them)
# real_hit_rate(REAL_TRACES)["overlap"] at delta 1 (|P| = K = 16 blocks), for installs without
# the traces; tests/unit/test_trace_replay_real.py recomputes it from them.
REAL_HIT_RATE_AT_K = 0.8311


def n_pred_of(k: int, delta: float) -> int:
    """|P| middle blocks for K and delta, as ``PRRConfig.predicted_blocks`` computes it."""
    return max(k, int(math.floor(delta * k + 1e-9)))


def theta_grid(cfg: Optional[PRRConfig] = None) -> Tensor:
    """The candidate thetas ``[C, 3]`` the prefill calibration chooses from."""
    return torch.tensor((cfg or PRRConfig()).theta_grid, dtype=torch.float32)


def calibrate(scores: Tensor, nblk: Tensor, k: int, n_pred: int, calib_rows: int,
              sink_blocks: int, local_blocks: int, grid: Optional[Tensor] = None
              ) -> Tuple[Tensor, Tensor]:
    """theta* per trace as the prefill calibration picks it (eqs 4-5): ``ops.calibrate`` over
    the first ``calib_rows`` steps of ``scores [R, T, Hk, NB]`` (they play the sampled prefill
    queries), then the best candidate (``reference.best_theta``: ties to the lowest index).
    Returns ``(H [R, C], index of theta* [R])`` over ``grid`` (default: the config's)."""
    grid = theta_grid() if grid is None else grid
    H = ops.calibrate(scores[:, :calib_rows].contiguous(), nblk[:, :calib_rows].contiguous(), k,
                      n_pred, sink_blocks, local_blocks, grid[:, 0].contiguous(),
                      grid[:, 1].contiguous(), grid[:, 2].contiguous())
    return H, ref.best_theta(H)


def calibrated_replay(trace: Trace, layer: int, k: int, delta: float, calib_rows: int,
                      sink_blocks: int, local_blocks: int) -> Dict[str, Tensor]:
    """The server's predictor on one traced layer of one request: theta* calibrated on the
    first ``calib_rows`` steps, then replayed over the rest (``replay``'s warm state).
    Returns ``hit``, ``overlap``, ``missed`` ``[T - calib_rows, Hk]`` and ``n_pred``."""
    sc, nb = (x[None] for x in trace.torch_rows(layer))
    n_pred = n_pred_of(k, delta)
    grid = theta_grid()
    _, star = calibrate(sc, nb, k, n_pred, calib_rows, sink_blocks, local_blocks, grid)
    res = replay(sc, nb, k, n_pred, sink_blocks, local_blocks, grid[star].unsqueeze(1),
                 start=calib_rows)
    out = {name: res[name][0, 0] for name in ("hit", "overlap", "missed")}
    out["n_pred"] = torch.tensor(n_pred)
    return out


def real_hit_rate(path: str = REAL_TRACES, k: Optional[int] = None, delta: float = 1.0,
                  calib_rows: Optional[int] = None) -> Dict[str, object]:
    """The calibrated predictor over every request and traced layer of the traces at ``path``:
    ``overlap`` = mean ``|P n A| / |A|`` (middle blocks; what ``/prr/stats`` reports as the hit
    rate), ``hit`` = eq 4's score-weighted hit, ``missed`` = mean ``|M|`` per (step, KV head),
    at ``k`` blocks (default: the traces' recording K) and ``delta`` (1: ``|P| = K``), plus
    ``per_layer`` overlaps, ``k``, ``delta``, ``n_pred``, ``traces``, ``path``.
    Raises ``FileNotFoundError`` when ``path`` holds no trace."""
    trs = load_traces(path)
    if not trs:
        raise FileNotFoundError(f"no block-score traces (*.npz) under {path}")
    meta = trs[0].meta
    k = int(k if k is not None else meta.get("top_k_blocks", 16))
    sink, local = int(meta.get("sink_blocks", 1)), int(meta.get("local_blocks", 1))
    calib_rows = calib_rows if calib_rows is not None else PRRConfig().calib_queries
    ov: Dict[int, List[Tensor]] = {}
    hit, missed = [], []
    for t in trs:
        for li, lid in enumerate(t.layers):
            r = calibrated_replay(t, li, k, delta, min(calib_rows, t.steps - 1), sink, local)
            ov.setdefault(int(lid), []).append(r["overlap"].reshape(-1))
            hit.append(r["hit"].reshape(-1))
            missed.append(r["missed"].reshape(-1).float())
    per_layer = {lid: float(torch.cat(v).mean()) for lid, v in sorted(ov.items())}
    return dict(overlap=float(torch.cat([torch.cat(v) for v in ov.values()]).mean()),
                hit=float(torch.cat(hit).mean()), missed=float(torch.cat(missed).mean()),
                per_layer=per_layer, k=k, delta=delta, n_pred=n_pred_of(k, delta),
                traces=len(trs), path=path)


def _shown(path: str) -> str:
    """``path`` relative to the repository when it lies inside it: the profile records where
    its hit rate came from, not the folder of the machine that measured it."""
    full = os.path.abspath(path)
    return os.path.relpath(full, REPO_ROOT) if full.startswith(REPO_ROOT + os.sep) else path


def profile_hit_rate(value, traces: str = REAL_TRACES) -> Tuple[float, str]:
    """``(hit rate, where it comes from)``: a number as given; ``real``: the calibrated
    predictor's |P n A| / |A| at |P| = K on the traces (``real_hit_rate``), or
    the recorded value of the repository's traces when ``traces`` holds none."""
    if value != "real":
        return float(value), "given (--hit-rate)"
    try:
        r = real_hit_rate(traces, delta=1.0)
    except (FileNotFoundError, OSError):
        return (REAL_HIT_RATE_AT_K,
                f"real traces (no traces under {traces}: the value recorded from the "
                f"repository's SmolLM2 traces)")
    per = ", ".join(f"layer {k} {v:.3f}" for k, v in r["per_layer"].items())
    return (round(r["overlap"], 4),
            f"real traces ({r['traces']} requests under {_shown(traces)}, K = {r['k']} blocks, "
            f"calibrated predictor, |P| = K; {per})")
