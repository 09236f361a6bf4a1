"""Prefill calibration (eqs 4-5): the score-weighted hit rate of every candidate theta replayed
over sampled queries (``calibrate``; ``calib_grid_terms``, the form the product and the kernel
compute, bit for bit the same), and theta* = argmax."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .paging import NEG_INF, kept_mask, list_to_mask
from .predictor import holt_update, predict_set
from .selection import select_topk

_LOW = torch.finfo(torch.float32).min
_HIGH = torch.finfo(torch.float32).max


def weighted_hit(scores: Tensor, a_idx: Tensor, a_cnt: Tensor, p_idx: Tensor, p_cnt: Tensor,
                 middle: Tensor) -> Tensor:
    """Eq 4's per-row term over the *middle* part of A (kept blocks are hits by construction):
    ``sum_{b in P n A} w_b / sum_{b in A} w_b`` with ``w = IS - min(IS over middle blocks)`` so
    that Quest's signed scores give non-negative weights. Falls back to ``|P n A| / |A|`` when
    the weights of A sum to 0, and to 1 when A has no middle block.

    scores: ``[..., NB]``; a/p lists ``[..., n]``; middle: ``[..., NB]`` bool. Returns ``[...]``.
    """
    nb = scores.shape[-1]
    a = list_to_mask(a_idx, a_cnt, nb) & middle
    p = list_to_mask(p_idx, p_cnt, nb)
    s = scores.float().nan_to_num(neginf=0.0)
    lo = torch.where(middle, s, torch.full_like(s, float("inf"))).amin(-1, keepdim=True)
    w = torch.where(middle, s - lo, torch.zeros_like(s))
    num = (w * (a & p)).sum(-1)
    den = (w * a).sum(-1)
    n_a = a.sum(-1).float()
    plain = torch.where(n_a > 0, (a & p).sum(-1).float() / n_a.clamp(min=1), torch.ones_like(n_a))
    return torch.where(den > 0, num / den.clamp(min=1e-30), plain)


def calibrate(scores: Tensor, nblk: Tensor, k: int, n_pred: int, sink_blocks: int,
              local_blocks: int, alphas: Tensor, betas: Tensor, gammas: Tensor) -> Tensor:
    """Eqs 4-5: replay the predictor for every candidate theta over sampled prefill rows, together.

    scores: ``[R, Phi, Hk, NB]`` block scores of ``Phi`` sampled queries (in position order) of
    ``R`` requests; nblk: ``[R, Phi]`` blocks visible to each query (causal).
    alphas/betas/gammas: ``[C]`` the candidates. Returns ``H: [R, C]`` the score-weighted hit rate
    of each candidate, averaged over heads and over rows 1..Phi-1 (row 0 only seeds the state);
    ``theta* = best_theta(H)`` per request.
    """
    R, Phi, Hk, nb = scores.shape
    C = alphas.numel()
    dev = scores.device
    # Lists wider than the table hold padding only: a width of NB gives the same sets (a k of
    # 2^30 means every block), in memory bounded by the table instead of by k.
    k, n_pred, sink_blocks, local_blocks = (min(v, nb) for v in (k, n_pred, sink_blocks,
                                                                  local_blocks))
    # Candidates become a batch dimension, [R*C, Hk, NB], one sampled row at a time (the whole
    # expansion would be C times the scores). A and the weights do not depend on the candidate:
    # they are computed on the R rows and broadcast.
    nbk = nblk.long().unsqueeze(1).expand(R, C, Phi).reshape(R * C, Phi)
    a_ = alphas.float().to(dev).repeat(R)
    b_ = betas.float().to(dev).repeat(R)
    g_ = gammas.float().to(dev).repeat(R)
    level = torch.zeros(R * C, Hk, nb, device=dev)
    trend = torch.zeros_like(level)
    n_init = torch.zeros(R * C, dtype=torch.long, device=dev)
    total = torch.zeros(R * C, device=dev)
    per_cand = lambda t: t.unsqueeze(1).expand(R, C, *t.shape[1:]).reshape(R * C, *t.shape[1:])
    for phi in range(Phi):
        row_r = scores[:, phi].float()  # [R, Hk, NB]
        row, n = per_cand(row_r), nbk[:, phi].contiguous()
        if phi > 0:
            p_idx, p_cnt = predict_set(level, trend, g_, n_init, n, n_pred, sink_blocks,
                                            local_blocks)
            n_r = nblk[:, phi].long()
            a_idx, a_cnt = select_topk(row_r.contiguous(), n_r, k, sink_blocks,
                                            local_blocks, k + sink_blocks + local_blocks)
            _, middle = kept_mask(n, nb, sink_blocks, local_blocks)
            total += weighted_hit(row, per_cand(a_idx), per_cand(a_cnt), p_idx, p_cnt,
                                  middle.unsqueeze(1)).mean(-1)
        holt_update(level, trend, n_init, row, n, a_, b_)
    return (total / max(Phi - 1, 1)).view(R, C)


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


def calib_grid_terms(scores: Tensor, nblk: Tensor, wa: Tensor, am: Tensor, alphas: Tensor,
                     betas: Tensor, gammas: Tensor, n_pred: int, sink_blocks: int,
                     local_blocks: int) -> Tensor:
    """Eq 4's row term of every candidate of the grid ``alphas x betas x gammas`` (alpha-major),
    for every sampled query after the first: the predictor of each candidate is replayed over
    the ``Phi`` sampled queries and its P is scored against A.

    scores: ``[R, Phi, Hk, NB]`` float32; nblk: ``[R, Phi]`` int64; wa: ``[Phi-1, R, Hk, NB]``
    float32, the weights of A's middle blocks (0 elsewhere); am: ``[Phi-1, R, Hk, NB]`` bool, A's
    middle blocks (both of queries 1..Phi-1). Returns ``[Phi-1, R, A*B*G, Hk]`` float32: the
    score-weighted hit of P (``weighted_hit``), computed as ``calibrate`` computes it, bit for
    bit.

    The level depends on alpha only and the trend on (alpha, beta) only: one level per alpha and
    one trend per (alpha, beta) are kept (4 + 20 tracks instead of 2 x 80 for the default grid)
    and only the prediction ``l + gamma v`` is formed per candidate. Every float ``calibrate``
    rounds is rounded here by the same operation on the same operands, and every sum runs over
    contiguous ``[NB]`` rows like calibrate's. Memory: a few ``[R, A*B*G, Hk, NB]`` tensors at a
    time.
    """
    R, Phi, Hk, nb = scores.shape
    dev = scores.device
    A, B, G = alphas.numel(), betas.numel(), gammas.numel()
    a = alphas.float().to(dev).view(1, A, 1, 1, 1, 1)
    b = betas.float().to(dev).view(1, 1, B, 1, 1, 1)
    g = gammas.float().to(dev).view(1, 1, 1, G, 1, 1)
    level = torch.zeros(R, A, 1, 1, Hk, nb, device=dev)
    trend = torch.zeros(R, A, B, 1, Hk, nb, device=dev)
    n_init = torch.zeros(R, dtype=torch.long, device=dev)  # the same for every candidate
    out = torch.zeros(max(Phi - 1, 0), R, A * B * G, Hk, device=dev)
    ar = torch.arange(nb, device=dev)
    row6 = lambda t: t.view(R, 1, 1, 1, *t.shape[1:])  # [R, ...] -> broadcast over candidates
    for phi in range(Phi):
        s = scores[:, phi].float()  # [R, Hk, NB]
        n = nblk[:, phi].long()  # [R]
        if phi > 0:
            _, mid = kept_mask(n, nb, sink_blocks, local_blocks)  # [R, NB]
            # P of every candidate: eq 2 (uninitialised blocks rank last), top-n_pred middle.
            init = (ar < n_init.unsqueeze(-1)).view(R, 1, 1, 1, 1, nb)
            pred = level + g * trend  # [R, A, B, G, Hk, NB]
            p = middle_topk_mask(pred, mid.view(R, 1, 1, 1, 1, nb), n_pred, inplace=True,
                                 init=init)
            del pred
            # The row term as weighted_hit forms it. sum(w * (A & P)): (w*a)*1 and (w*a)*0 per
            # element (NaN where w overflowed), selected by P without a float copy of P. Every
            # sum runs over contiguous [NB] rows, as calibrate's: ``den`` does not depend on the
            # candidate, so it is summed once per (row, head) and broadcast (a sum over an
            # expanded view may associate in another order: one ulp off calibrate's).
            wa_r = wa[phi - 1].clone()  # [R, Hk, NB]
            num = torch.where(p, row6(wa_r), row6(wa_r * 0)).sum(-1)  # [R, A, B, G, Hk]
            den = row6(wa_r.sum(-1))  # [R, 1, 1, 1, Hk]
            n_a = row6(am[phi - 1].sum(-1).float())
            hits = torch.where(p, row6(am[phi - 1].float()), 0.0).sum(-1)  # |A & P|, exact
            plain = torch.where(n_a > 0, hits / n_a.clamp(min=1), torch.ones_like(n_a))
            out[phi - 1] = torch.where(den > 0, num / den.clamp(min=1e-30), plain).view(
                R, A * B * G, Hk)
            del p
        # Eq 3 on the tracks (holt_update's arithmetic, operand for operand). A level or trend
        # that is not finite restarts like a new block.
        sv = row6(s)
        exists = (ar < n.unsqueeze(-1)).view(R, 1, 1, 1, 1, nb)
        old = (ar < n_init.unsqueeze(-1)).view(R, 1, 1, 1, 1, nb) & exists & level.isfinite() \
            & trend.isfinite()
        # New blocks (exists, not old) start at l = IS, v = 0; blocks past nblk keep their state.
        trend = torch.where(old, b * (sv - level) + (1 - b) * trend,
                            torch.where(exists, 0.0, trend))
        level = torch.where(old, a * sv + (1 - a) * level, torch.where(exists, sv, level))
        n_init = torch.maximum(n_init, n)
    return out


def best_theta(H: Tensor) -> Tensor:
    """Eq 5: ``argmax_C H`` per request, ties to the lowest candidate index. ``H: [R, C]`` -> ``[R]``.

    A NaN hit rate (eq 4's weights overflow on scores near the float limits) ranks below every
    number, so it is never chosen over one; a row of NaN alone picks candidate 0."""
    C = H.shape[-1]
    ar = torch.arange(C, device=H.device)
    H = H.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    top = H == H.amax(-1, keepdim=True)
    return torch.where(top, ar, torch.full_like(ar, C)).amin(-1)
