"""The predictor (eqs 2-3): Holt's level and trend per block, P(t+1) = kept blocks + the top
``n_pred`` middle blocks by predicted score, on a batch's own state or on the request pool's rows
in place."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .paging import NEG_INF, in_pool
from .selection import select_lists, select_topk


def holt_predict(level: Tensor, trend: Tensor, gamma: Tensor, n_init: Tensor) -> Tensor:
    """Eq 2: ``IS_hat = l + gamma * v`` for initialised blocks, ``-inf`` for the others.

    level, trend: ``[B, Hk, NB]`` float32; gamma: ``[B]``; n_init: ``[B]`` blocks with state.
    """
    nb = level.shape[-1]
    pred = level + gamma.float().view(-1, 1, 1) * trend
    init = torch.arange(nb, device=level.device) < n_init.long().unsqueeze(-1)
    return torch.where(init.unsqueeze(1), pred, torch.full_like(pred, NEG_INF))


def holt_update(level: Tensor, trend: Tensor, n_init: Tensor, scores: Tensor, nblk: Tensor,
                alpha: Tensor, beta: Tensor) -> None:
    """Eq 3, in place, once the scores ``IS[t]`` are known.

    ``v = beta (IS - l) + (1 - beta) v``; ``l = alpha IS + (1 - alpha) l`` for blocks that had
    state; a block seen for the first time (id >= n_init) starts at ``l = IS, v = 0``, and so does
    a block whose level or trend is not finite: InfLLM-v2 scores a block ``-inf`` until a complete
    compressed key covers it, and a level of ``-inf`` would otherwise stay ``-inf`` (with a
    non-finite trend) and never be predicted again; finite scores near the float limits (-3e38,
    then 3e38) leave a finite level with an infinite trend, which would predict the block always
    (or, NaN, never). Blocks past ``nblk`` are untouched;
    ``n_init`` becomes ``max(n_init, nblk)``.
    level, trend, scores: ``[B, Hk, NB]``; n_init, nblk, alpha, beta: ``[B]``.
    """
    nb = level.shape[-1]
    ar = torch.arange(nb, device=level.device)
    exists = (ar < nblk.long().unsqueeze(-1)).unsqueeze(1)
    old = (ar < n_init.long().unsqueeze(-1)).unsqueeze(1) & exists & torch.isfinite(level) \
        & torch.isfinite(trend)
    a = alpha.float().view(-1, 1, 1)
    b = beta.float().view(-1, 1, 1)
    s = scores.float()
    v_new = torch.where(old, b * (s - level) + (1 - b) * trend, torch.zeros_like(trend))
    l_new = torch.where(old, a * s + (1 - a) * level, s)
    trend.copy_(torch.where(exists, v_new, trend))
    level.copy_(torch.where(exists, l_new, level))
    n_init.copy_(torch.maximum(n_init, nblk.to(n_init.dtype)))


def predict_set(level: Tensor, trend: Tensor, gamma: Tensor, n_init: Tensor, nblk_next: Tensor,
                n_pred: int, sink_blocks: int, local_blocks: int) -> Tuple[Tensor, Tensor]:
    """P for the next step: kept blocks plus the top-``n_pred`` middle blocks by ``IS_hat``.

    nblk_next: ``[B]`` blocks the request will have at that step. Returns ``(idx, cnt)`` of width
    ``n_pred + sink_blocks + local_blocks``.
    """
    return select_topk(holt_predict(level, trend, gamma, n_init), nblk_next, n_pred,
                       sink_blocks, local_blocks)


def predict_update(level: Tensor, trend: Tensor, n_init: Tensor, scores: Tensor, nblk: Tensor,
                   theta: Tensor, nblk_next: Tensor, n_pred: int, sink_blocks: int,
                   local_blocks: int) -> Tuple[Tensor, Tensor]:
    """The predictor's whole step: eq 3 in place (``holt_update``), then P(t+1) (``predict_set``).

    theta: ``[B, 3]`` (alpha, beta, gamma). Returns ``(idx, cnt)`` of width
    ``n_pred + sink_blocks + local_blocks``.
    """
    holt_update(level, trend, n_init, scores, nblk, theta[:, 0], theta[:, 1])
    return predict_set(level, trend, theta[:, 2].contiguous(), n_init, nblk_next, n_pred,
                       sink_blocks, local_blocks)


def predict_update_rows(level: Tensor, trend: Tensor, n_init: Tensor, p_idx: Tensor,
                        p_cnt: Tensor, theta: Tensor, rows: Tensor, scores: Tensor, nblk: Tensor,
                        nblk_next: Tensor, n_pred: int, sink_blocks: int,
                        local_blocks: int, p_rows: Optional[Tensor] = None) -> None:
    """``predict_update`` on the request pool's state, in place: batch entry ``b`` updates row
    ``rows[b]`` of level/trend ``[R, Hk, NB]``, n_init ``[R]``, theta ``[R, 3]`` and writes P(t+1)
    into p_idx ``[R, Hk, W]`` / p_cnt ``[R, Hk]``, ``W >= n_pred + sink + local`` (the pool's
    width, that of the largest budget; -1 past the count). scores: ``[B, Hk, NB]``;
    nblk/nblk_next/rows: ``[B]``. ``p_rows: [B]``, if given, are the rows of p_idx/p_cnt that
    receive P(t+1) (the other half of a double buffer), else ``rows``. Rows must be distinct,
    except SGLang's padding row 0, whose state no request reads; a row outside the pool is row 0
    (``in_pool``)."""
    r = in_pool(rows, level.shape[0])
    lv, tr, ni = level[r], trend[r], n_init[r]
    idx, cnt = predict_update(lv, tr, ni, scores, nblk, theta[r], nblk_next, n_pred, sink_blocks,
                              local_blocks)
    pad = p_idx.shape[-1] - idx.shape[-1]
    if pad > 0:
        idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
    level.index_copy_(0, r, lv)
    trend.index_copy_(0, r, tr)
    n_init.index_copy_(0, r, ni)
    pr = r if p_rows is None else in_pool(p_rows, p_idx.shape[0])
    p_idx.index_copy_(0, pr, idx)
    p_cnt.index_copy_(0, pr, cnt)


def select_lists_predict(scores: Tensor, nblk: Tensor, nblk_next: Tensor, p_idx: Tensor,
                         p_cnt: Tensor, p_rows: Tensor, p_next_rows: Tensor, level: Tensor,
                         trend: Tensor, n_init: Tensor, theta: Tensor, rows: Tensor, k: int,
                         n_pred: int, sink_blocks: int, local_blocks: int, n_out: int,
                         dense_row: Optional[Tensor] = None, stats: Optional[Tensor] = None
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """A composed selection's lists and the predictor's step over the same scores (one launch
    on SM90): ``select_lists`` with P(t) read at rows ``p_rows`` of p_idx/p_cnt, then
    ``predict_update_rows`` on state rows ``rows`` with P(t+1) written at rows ``p_next_rows``
    (P(t) is read before P(t+1) is written). ``(a_idx, a_cnt, m_idx, m_cnt)``."""
    out = select_lists(scores, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks, n_out, p_rows,
                       dense_row, stats)
    predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, scores, nblk, nblk_next,
                        n_pred, sink_blocks, local_blocks, p_next_rows)
    return out
