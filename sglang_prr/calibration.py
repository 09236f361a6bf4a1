"""Prompt-adaptive calibration during prefill: the grid search of eqs 4-5 (PRR.md section 5).

Two parts:

* ``grid_hit_rates``: eq 4 for every candidate of an (alpha x beta x gamma) grid. A, its
  weights and ``|A|`` depend on the layer and the sampled query only, so ``a_weights`` computes
  them once per chunk; ``ops.calib_grid_terms`` then replays every candidate's predictor over
  the sampled queries and scores its P against A. On CPU (the torch reference,
  ``reference.calib_grid_terms``) the result is ``reference.calibrate``'s bit for bit; on SM90
  it is one kernel launch (one CTA per candidate, KV head and layer, the Holt state in shared
  memory), whose P is the reference's and whose sums run in another order (theta* is checked
  against the reference in tests/gpu/test_calibration_kernel.py);
* ``Calibrator``: the per-forward work the attention backend delegates during extend. ``plan``
  lays out the sampled queries of each request once per forward, ``sample`` scores them against
  the block summaries in each sparse layer, ``run`` calibrates every sampled layer of a request
  at once after the forward's last sparse layer (theta* per request and layer, accumulated over
  the chunks of a chunked prefill), replays the predictor with theta* and predicts P for the
  first decode step.

Why the torch form is launch- and memory-bound, and what the kernel removes: the grid keeps
``[layers, C, Hk, NB]`` predictions and masks per sampled query (a selection by ``kthvalue``, a
scan for ties, three masked sums), about 30 launches per query; on the H200 that was 33 ms per
8K chunk of a 32-layer request at 32K and 107 ms at 128K (``bench_calibration.py --layers 32``,
``benchmarks/results/calibration_h200_layers32.csv``). The kernel reads each query's scores
once per candidate from L2 and keeps everything else on chip.

Core module: imports torch only. ``Calibrator`` reads the batch through duck-typed arguments and
writes the predictor state it is given (``state.PRRState``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops
from . import reference as ref
from .step import p_rows


# ----------------------------------------------------------------------------- eq 4 on a grid
def a_weights(scores: Tensor, nblk: Tensor, k: int, sink_blocks: int,
              local_blocks: int) -> Tuple[Tensor, Tensor]:
    """A's middle blocks and their eq-4 weights for sampled queries 1..Phi-1, as
    ``reference.weighted_hit`` forms them: ``(wa [Phi-1, R, Hk, NB] float32, am [Phi-1, R, Hk,
    NB] bool)`` from scores ``[R, Phi, Hk, NB]`` and nblk ``[R, Phi]`` (contiguous; A, its
    weights and |A| do not depend on the candidate, so they are computed once per chunk)."""
    R, Phi, Hk, nb = scores.shape
    s_a = scores[:, 1:].float().transpose(0, 1)  # [Phi-1, R, Hk, NB]
    _, mid_a = ref.kept_mask(nblk[:, 1:].long().t().reshape(-1), nb, sink_blocks, local_blocks)
    mid_a = mid_a.view(Phi - 1, R, 1, nb)
    am = ref.middle_topk_mask(s_a, mid_a, k)  # [Phi-1, R, Hk, NB]
    s0 = s_a.nan_to_num(neginf=0.0)
    lo = torch.where(mid_a, s0, torch.full_like(s0, float("inf"))).amin(-1, keepdim=True)
    wa = torch.where(mid_a, s0 - lo, torch.zeros_like(s0)) * am  # w * A
    return wa.contiguous(), am.contiguous()


def grid_hit_rates(scores: Tensor, nblk: Tensor, k: int, n_pred: int, sink_blocks: int,
                   local_blocks: int, alphas: Tensor, betas: Tensor, gammas: Tensor,
                   terms: Optional[Callable[..., Tensor]] = None) -> Tensor:
    """Eq 4 for every candidate of the grid ``alphas x betas x gammas`` (alpha-major, the order
    of ``PRRConfig.theta_grid``): ``reference.calibrate`` over that grid, bit for bit through the
    torch op (CPU and every device without the kernel).

    scores: ``[R, Phi, Hk, NB]`` block scores of ``Phi`` sampled queries (position order) of ``R``
    independent rows (layers of a request); nblk: ``[R, Phi]`` blocks visible to each query.
    alphas ``[A]``, betas ``[B]``, gammas ``[G]``: the axes of the grid (float32).
    Returns ``H: [R, A*B*G]`` float32, the score-weighted hit rate of each candidate averaged over
    the KV heads and over rows 1..Phi-1 (row 0 only seeds the predictor).

    ``a_weights`` computes A once per chunk; ``terms`` (default ``ops.calib_grid_terms``: one
    launch on SM90, ``reference.calib_grid_terms`` elsewhere) replays the candidates.
    """
    R, Phi, Hk, nb = scores.shape
    C = alphas.numel() * betas.numel() * gammas.numel()
    total = torch.zeros(R, C, device=scores.device)
    if Phi < 2:
        return total
    wa, am = a_weights(scores, nblk, k, sink_blocks, local_blocks)
    fn = ops.calib_grid_terms if terms is None else terms
    t = fn(scores.float().contiguous(), nblk.long().contiguous(), wa, am, alphas.float(),
           betas.float(), gammas.float(), n_pred, sink_blocks, local_blocks)  # [Phi-1, R, C, Hk]
    # Summed row by row like the reference (its accumulation order, so the bits are its bits).
    for j in range(Phi - 1):
        total += t[j].mean(-1)
    return total / (Phi - 1)


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
        """Per request of an extend batch that will decode sparse, ``calib_queries`` queries
        spaced evenly over its chunk (always its last one), their causal lengths and the block
        table of the blocks the chunk can see (not the request pool's whole width). Host lengths
        in; the request slots stay on the device (one-element index tensors), so nothing here
        waits for the device.

        A request whose length after this chunk (prefix + new tokens, from the host lengths) is
        below ``min_context`` is left out: its decode attends every block, so its theta* and P
        would never be used, and calibrating it is prefill work for nothing (a short chat
        prompt on the default server calibrated all 30 layers). The chunks of a long prompt
        calibrate from the first one that reaches ``min_context``; a request that only grows
        past it while decoding starts its sparse steps from the theta* last chosen per layer,
        like one that cannot calibrate."""
        rows = req_pool_indices.long()
        reqs, start = [], 0
        for i, (n_new, n_pre) in enumerate(zip(extend_seq_lens_cpu, extend_prefix_lens_cpu)):
            row = rows[i:i + 1]  # [1] slot of the request (device)
            n_new, n_pre = int(n_new), int(n_pre)
            s0, start = start, start + n_new
            phi = min(self.cfg.calib_queries, n_new)
            if phi < 1 or n_pre + n_new < self.cfg.min_context:
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
                # Eq 5 (first max: the lower index; a NaN sum, from weights that overflowed,
                # is never chosen: torch.argmax would take it).
                best = ref.best_theta(st.h_sum[layers, row])
                chosen = self.grid[best]  # [Lc, 3]
                st.theta[layers, row] = chosen
                # What a request that cannot calibrate starts from (PRRState.shared_theta).
                st.shared_theta[layers] = chosen
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
            # the half of P's double buffer the first decode step (total + 1 tokens) reads
            slot = p_rows(row, r.total + 1)
            st.p_idx[layers, slot] = p_idx
            st.p_cnt[layers, slot] = p_cnt
