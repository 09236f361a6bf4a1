"""Prompt-adaptive calibration during prefill: the grid search of eqs 4-5 (PRR.md section 5).

Two parts:

* ``grid_hit_rates``: eq 4 for every candidate of an (alpha x beta x gamma) grid, the same numbers
  as ``reference.calibrate`` bit for bit, at a fraction of its cost (see below);
* ``Calibrator``: the per-forward work the attention backend delegates during extend. ``plan``
  lays out the sampled queries of each request once per forward, ``sample`` scores them against
  the block summaries in each sparse layer, ``run`` calibrates every sampled layer of a request
  at once after the forward's last sparse layer (theta* per request and layer, accumulated over
  the chunks of a chunked prefill), replays the predictor with theta* and predicts P for the
  first decode step.

Why ``reference.calibrate`` is slow, and what ``grid_hit_rates`` does instead:

* it replays Holt's recurrence for all ``C`` candidates, but the level depends on alpha only and
  the trend on (alpha, beta) only: here one level per alpha and one trend per (alpha, beta) are
  kept (4 + 20 tracks instead of 2 x 80 for the default grid) and only the prediction
  ``l + gamma v`` is formed per candidate;
* every sampled row's P was a full stable sort of ``[R*C, Hk, NB]``, a scatter, a second sort to
  turn the mask into an id list (``mask_to_list``) and a scatter back to a mask
  (``list_to_mask``); eq 4 needs the mask only, and top-n with ties to the lower id is a
  threshold: the n-th largest key (``torch.kthvalue``, a selection), everything above it, and the
  keys equal to it in ascending id until n are taken;
* A, its weights and ``|A|`` depend on the layer and the sampled query, not on the candidate:
  they are computed once per chunk for every sampled query, where the reference expanded them to
  ``R*C`` rows at every row.

Measured (same inputs, ``H`` bitwise equal): in-process CPU prefill, 30 layers, 3 KV heads, page
16, a 3K-token prompt in 1K chunks: calibration 5.7 s -> 0.8 s of a 6.8 s serial-DSA prefill;
H200, 32 layers x 8 KV heads, page 64, 8K chunks: 88-106 ms -> 30-36 ms per chunk up to 32K,
291 -> 110 ms at 128K (``bench_calibration.py --layers 32``).

Every float the reference rounds is rounded here by the same operation on the same operands, and
every sum runs over the same ``[..., NB]`` rows with the same number of outputs (``den`` sums an
expanded view rather than a copy), so ``H`` is bitwise the reference's, on CPU and on CUDA
(tests/unit/test_calibration.py; the fp64 oracle checks both).

Core module: imports torch only. ``Calibrator`` reads the batch through duck-typed arguments and
writes the predictor state it is given (``state.PRRState``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops
from . import reference as ref

NEG_INF = float("-inf")
_LOW = torch.finfo(torch.float32).min
_HIGH = torch.finfo(torch.float32).max


# ----------------------------------------------------------------------------- selection masks
def middle_topk_mask(scores: Tensor, middle: Tensor, k: int, inplace: bool = False,
                     init: Optional[Tensor] = None) -> Tensor:
    """The middle blocks ``reference.select_topk`` chooses, as a mask: the top ``min(k, n_mid)``
    middle blocks by score, ties to the lower block id, ``-inf``/NaN ranked last (as the lowest
    float), ``+inf`` as the highest.

    scores: ``[..., NB]`` float; middle: ``[..., NB]`` bool, broadcastable to ``scores``.
    Returns ``[..., NB]`` bool. ``inplace``: ``scores`` is a float32 scratch tensor of the full
    shape that may be overwritten (saves a copy of the largest tensor of the grid search).
    ``init``: optional bool mask broadcastable to ``scores``; blocks outside it score ``-inf``
    (``reference.holt_predict``'s uninitialised blocks). No host synchronisation: the counts
    stay on the device.
    """
    nb = scores.shape[-1]
    kk = min(int(k), nb)
    if kk >= nb or kk <= 0:  # every middle block (n_mid <= nb <= k), whatever its score, or none
        take = middle if kk > 0 else torch.zeros_like(middle)
        return torch.broadcast_to(take, torch.broadcast_shapes(scores.shape, middle.shape))
    # The key of reference.select_topk: finite for middle blocks, -inf for the others (a middle
    # block scored -inf or NaN gets the lowest float).
    key = scores.nan_to_num_(nan=_LOW, posinf=_HIGH, neginf=_LOW) if inplace else \
        scores.float().nan_to_num(nan=_LOW, posinf=_HIGH, neginf=_LOW)
    fill = torch.where(middle, _LOW, NEG_INF)  # the small mask's shape
    key = torch.where(middle if init is None else middle & init, key, fill)
    # Take everything above the kk-th largest key, then the keys equal to it in ascending id
    # until kk are taken. A row with fewer than kk middle blocks has -inf there: raised to the
    # lowest float, the threshold then takes every middle block and nothing else (the others are
    # -inf). kthvalue is a selection, O(NB) per row, where the reference sorts the row twice.
    thr = torch.kthvalue(key, nb - kk + 1, dim=-1, keepdim=True).values.clamp_(min=_LOW)
    gt = key > thr
    eq = key == thr
    need = kk - gt.sum(-1, keepdim=True, dtype=torch.int32)  # ties to take
    return gt | (eq & (eq.cumsum(-1, dtype=torch.int32) <= need))


# ----------------------------------------------------------------------------- eq 4 on a grid
def grid_hit_rates(scores: Tensor, nblk: Tensor, k: int, n_pred: int, sink_blocks: int,
                   local_blocks: int, alphas: Tensor, betas: Tensor, gammas: Tensor) -> Tensor:
    """Eq 4 for every candidate of the grid ``alphas x betas x gammas`` (alpha-major, the order
    of ``PRRConfig.theta_grid``): bitwise ``reference.calibrate`` over that grid.

    scores: ``[R, Phi, Hk, NB]`` block scores of ``Phi`` sampled queries (position order) of ``R``
    independent rows (layers of a request); nblk: ``[R, Phi]`` blocks visible to each query.
    alphas ``[A]``, betas ``[B]``, gammas ``[G]``: the axes of the grid (float32).
    Returns ``H: [R, A*B*G]`` float32, the score-weighted hit rate of each candidate averaged over
    the KV heads and over rows 1..Phi-1 (row 0 only seeds the predictor).
    Memory: a few ``[R, A*B*G, Hk, NB]`` tensors at a time (float32 and bool).
    """
    R, Phi, Hk, nb = scores.shape
    dev = scores.device
    A, B, G = alphas.numel(), betas.numel(), gammas.numel()
    a = alphas.float().to(dev).view(1, A, 1, 1, 1, 1)
    b = betas.float().to(dev).view(1, 1, B, 1, 1, 1)
    g = gammas.float().to(dev).view(1, 1, 1, G, 1, 1)
    # Holt state per track: the level depends on alpha only, the trend on (alpha, beta) only.
    level = torch.zeros(R, A, 1, 1, Hk, nb, device=dev)
    trend = torch.zeros(R, A, B, 1, Hk, nb, device=dev)
    n_init = torch.zeros(R, dtype=torch.long, device=dev)  # the same for every candidate
    total = torch.zeros(R, A, B, G, device=dev)
    ar = torch.arange(nb, device=dev)
    row6 = lambda t: t.view(R, 1, 1, 1, *t.shape[1:])  # [R, ...] -> broadcast over candidates
    # A, its weights and |A| depend on the row and the sampled query only, not on the candidate
    # or the predictor: every sampled query's at once, [Phi-1, R, ...] (one launch per op for
    # the whole chunk instead of one per query; selections, minima and counts are exact).
    if Phi > 1:
        s_a = scores[:, 1:].float().transpose(0, 1)  # [Phi-1, R, Hk, NB]
        _, mid_a = ref.kept_mask(nblk[:, 1:].long().t().reshape(-1), nb, sink_blocks,
                                 local_blocks)
        mid_a = mid_a.view(Phi - 1, R, 1, nb)
        am_a = middle_topk_mask(s_a, mid_a, k)  # [Phi-1, R, Hk, NB]
        s0 = s_a.nan_to_num(neginf=0.0)
        lo = torch.where(mid_a, s0, torch.full_like(s0, float("inf"))).amin(-1, keepdim=True)
        wa_a = torch.where(mid_a, s0 - lo, torch.zeros_like(s0)) * am_a  # w * A
        n_a_a = am_a.sum(-1).float()  # [Phi-1, R, Hk]
        del s_a, s0, lo
    for phi in range(Phi):
        s = scores[:, phi].float()  # [R, Hk, NB]
        n = nblk[:, phi].long()  # [R]
        if phi > 0:
            # P of every candidate: eq 2 (uninitialised blocks rank last), top-n_pred middle.
            init = (ar < n_init.unsqueeze(-1)).view(R, 1, 1, 1, 1, nb)
            pred = level + g * trend  # [R, A, B, G, Hk, NB]
            p = middle_topk_mask(pred, row6(mid_a[phi - 1]), n_pred, inplace=True, init=init)
            del pred
            # Eq 4's row term, as reference.weighted_hit forms it. sum(w * (A & P)): (w*a)*1
            # and (w*a)*0 per element (NaN where w overflowed), selected by P without a float
            # copy of P. The sums run over rows of the candidates' shape, as the reference's
            # (``den`` over an expanded view, from a fresh allocation like the reference's).
            wa = wa_a[phi - 1].clone()  # [R, Hk, NB]
            num = torch.where(p, row6(wa), row6(wa * 0)).sum(-1)  # [R, A, B, G, Hk]
            den = row6(wa).expand(p.shape).sum(-1)
            n_a = row6(n_a_a[phi - 1])
            hits = torch.where(p, row6(am_a[phi - 1].float()), 0.0).sum(-1)  # |A & P|, exact
            plain = torch.where(n_a > 0, hits / n_a.clamp(min=1), torch.ones_like(n_a))
            total += torch.where(den > 0, num / den.clamp(min=1e-30), plain).mean(-1)
            del p
        # Eq 3 on the tracks (``reference.holt_update``'s arithmetic, operand for operand).
        sv = row6(s)
        exists = (ar < n.unsqueeze(-1)).view(R, 1, 1, 1, 1, nb)
        old = (ar < n_init.unsqueeze(-1)).view(R, 1, 1, 1, 1, nb) & exists
        # New blocks (exists, not old) start at l = IS, v = 0; blocks past nblk keep their state.
        # A block at or past n_init was never touched here (the state starts at zero), so its
        # trend is already the +0 the reference writes.
        trend = torch.where(old, b * (sv - level) + (1 - b) * trend, trend)
        level = torch.where(old, a * sv + (1 - a) * level, torch.where(exists, sv, level))
        n_init = torch.maximum(n_init, n)
    return (total / max(Phi - 1, 1)).view(R, A * B * G)


# ----------------------------------------------------------------------------- the backend's part
@dataclass
class _Request:
    """One request of an extend batch: its sampled queries, the same for every layer."""
    row: Tensor  # [1] request pool slot (device)
    s0: int  # first token of its chunk in the batch
    offs: Tensor  # [Phi] sampled query offsets in the chunk (device)
    seq: Tensor  # [Phi] causal lengths of the sampled queries (device)
    nb_used: int  # blocks the chunk can see
    table: Tensor  # [Phi, nb_used] page of each block (device)
    total: int  # tokens of the request after the chunk
    scores: List[Tuple[int, Tensor]] = field(default_factory=list)  # (layer, [Phi, Hk, nb_used])


@dataclass
class CalibrationPlan:
    """The per-forward layout kept by the backend from its first sparse layer to ``run``."""
    reqs: List[_Request]


class Calibrator:
    """Prefill calibration of one attention backend (see the module docstring).

    cfg: ``PRRConfig``; state: ``PRRState`` (written in place: ``h_sum``, ``h_cnt``, ``theta``,
    ``level``, ``trend``, ``n_init``, ``p_idx``, ``p_cnt``); stats: an object with a
    ``calibrations`` host counter and ``theta_hist``, a ``[C]`` int64 device histogram of layer
    0's theta* (drained with the other device counters, so nothing here waits for the device).
    """

    def __init__(self, cfg, state, stats, page_size: int, device: torch.device):
        self.cfg = cfg
        self.state = state
        self.stats = stats
        self.page = int(page_size)
        self.device = torch.device(device)
        self.k_blocks = cfg.top_k_blocks
        self.n_pred = cfg.predicted_blocks
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=self.device)
        # The grid's axes (grid_hit_rates) and its candidates, alpha-major like cfg.theta_grid.
        self.alphas, self.betas, self.gammas = (
            f32(cfg.calib_alphas), f32(cfg.calib_betas), f32(cfg.calib_gammas))
        self.grid = f32(cfg.theta_grid)  # [C, 3]
        self._one = torch.ones(1, dtype=torch.int64, device=self.device)
        # Layer ids as device tensors, made once per set of layers: building them from a host
        # list each chunk would wait for the device (the layers of a forward never change).
        self._layer_ids: Dict[Tuple[int, ...], Tensor] = {}

    def plan(self, req_to_token: Tensor, req_pool_indices: Tensor,
             extend_seq_lens_cpu: Sequence[int], extend_prefix_lens_cpu: Sequence[int]
             ) -> CalibrationPlan:
        """Per request of an extend batch, ``calib_queries`` queries spaced evenly over its chunk
        (always its last one), their causal lengths and the block table of the blocks the chunk
        can see (not the request pool's whole width). Host lengths in; the request slots stay on
        the device (one-element index tensors), so nothing here waits for the device."""
        rows = req_pool_indices.long()
        reqs, start = [], 0
        for i, (n_new, n_pre) in enumerate(zip(extend_seq_lens_cpu, extend_prefix_lens_cpu)):
            row = rows[i:i + 1]  # [1] slot of the request (device)
            n_new, n_pre = int(n_new), int(n_pre)
            s0, start = start, start + n_new
            phi = min(self.cfg.calib_queries, n_new)
            if phi < 1:
                continue
            # phi <= n_new spaces the offsets >= 1 apart, so they are distinct after rounding
            # (no ``unique``, which would wait for the device).
            offs = torch.linspace(0, n_new - 1, phi, device=self.device).round().long()
            seq = n_pre + offs + 1  # [Phi]
            nb_used = -(-(n_pre + n_new) // self.page)
            # One row of the request's pages, shared by its sampled queries.
            pages = req_to_token.index_select(0, row)[0, :nb_used * self.page:self.page]
            pages = pages.long() // self.page
            table = pages.unsqueeze(0).expand(phi, nb_used).contiguous()  # [Phi, nb_used]
            reqs.append(_Request(row, s0, offs, seq, nb_used, table, n_pre + n_new))
        return CalibrationPlan(reqs)

    def sample(self, plan: CalibrationPlan, layer_id: int, q: Tensor, summary: List[Tensor],
               sm_scale: float) -> None:
        """Block scores of the sampled queries of layer ``layer_id`` (``q: [N, Hq, D]``, the
        batch's tokens), kept in ``plan`` until ``run``."""
        for r in plan.reqs:
            scores = ops.select_blocks(self.cfg.method, q[r.s0 + r.offs], summary, r.table, r.seq,
                                       self.page, sm_scale)  # [Phi, Hk, nb_used]
            r.scores.append((layer_id, scores))

    def run(self, plan: CalibrationPlan) -> None:
        """Eqs 4-5 for every sampled layer of each request at once (``grid_hit_rates``: rows are
        independent, so this is the per-layer calibration batched over layers). The objective
        accumulates over the chunks of a chunked prefill; theta* = argmax per request and layer
        (first max, on the device); then the predictor is replayed over the sampled queries
        with theta* (continuing the state of earlier chunks) and predicts P for the first
        decode step. Consumes the scores kept in ``plan``."""
        cfg, st = self.cfg, self.state
        for r in plan.reqs:
            taken, r.scores = r.scores, []
            if not taken:
                continue
            row, nb_used = r.row, r.nb_used
            key = tuple(l for l, _ in taken)
            layers = self._layer_ids.get(key)
            if layers is None:
                layers = self._layer_ids[key] = torch.tensor(key, device=self.device)  # [Lc]
            scores = torch.stack([sc for _, sc in taken])  # [Lc, Phi, Hk, nb_used]
            Lc, Phi = scores.shape[:2]
            nblk = ref.num_blocks(r.seq, self.page)  # [Phi]
            if Phi >= 2:
                H = grid_hit_rates(scores, nblk.unsqueeze(0).expand(Lc, Phi), self.k_blocks,
                                   self.n_pred, cfg.sink_blocks, cfg.local_blocks, self.alphas,
                                   self.betas, self.gammas)  # [Lc, C]
                st.h_sum[layers, row] += H * (Phi - 1)
                st.h_cnt[layers, row] += Phi - 1
                best = torch.argmax(st.h_sum[layers, row], dim=-1)  # first max: lower index
                st.theta[layers, row] = self.grid[best]
                self.stats.calibrations += Lc
                if taken[0][0] == 0:  # the chosen theta of layer 0, counted on the device
                    self.stats.theta_hist.index_add_(0, best[:1], self._one)
            theta = st.theta[layers, row]  # [Lc, 3]
            lv = st.level[layers, row, :, :nb_used]  # copies [Lc, Hk, nb_used]
            tr = st.trend[layers, row, :, :nb_used]
            ni = st.n_init[layers, row]
            alpha, beta = theta[:, 0].contiguous(), theta[:, 1].contiguous()
            for p in range(Phi):
                ops.holt_update(lv, tr, ni, scores[:, p].contiguous(),
                                nblk[p:p + 1].expand(Lc).contiguous(), alpha, beta)
            st.level[layers, row, :, :nb_used] = lv
            st.trend[layers, row, :, :nb_used] = tr
            st.n_init[layers, row] = ni
            # P for the first decode step (total + 1 tokens): only the blocks that step has.
            nb_next = -(-(r.total + 1) // self.page)
            p_idx, p_cnt = ops.predict_set(
                st.level[layers, row, :, :nb_next], st.trend[layers, row, :, :nb_next],
                theta[:, 2].contiguous(), ni, torch.full((Lc,), nb_next, device=self.device),
                self.n_pred, cfg.sink_blocks, cfg.local_blocks)
            pad = st.p_idx.shape[-1] - p_idx.shape[-1]  # the pool's lists may be wider
            if pad > 0:
                p_idx = torch.nn.functional.pad(p_idx, (0, pad), value=-1)
            st.p_idx[layers, row] = p_idx
            st.p_cnt[layers, row] = p_cnt
