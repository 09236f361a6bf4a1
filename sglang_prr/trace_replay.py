"""Replay of block-score traces: how well the Holt predictor's P covers the selected set A.

``replay`` runs the library's own ops (``predict_set``, ``select_topk``, ``holt_update``) over
recorded or synthetic traces (``sglang_prr.traces``, ``sglang_prr.trace_families``) for any
number of candidate thetas at once and scores every step with eq 4's weighted hit, the overlap
``|P n A| / |A|`` and the misses ``|A \\ P|``; ``benchmarks/bench_predictor.py`` is built on it.
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np
import torch
from torch import Tensor

from . import ops
from . import reference as ref
from .traces import Trace

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
