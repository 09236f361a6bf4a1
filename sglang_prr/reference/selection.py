"""Selection from block scores: A = kept blocks + top-K middle blocks, ``M = A \\ P``, and the
decode counters."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .paging import NEG_INF, in_pool, kept_mask, mask_to_list, set_difference


def select_topk(scores: Tensor, nblk: Tensor, k: int, sink_blocks: int, local_blocks: int,
                n_out: Optional[int] = None, dense_row: Optional[Tensor] = None
                ) -> Tuple[Tensor, Tensor]:
    """The selected set: kept sink/local blocks plus the top-``k`` middle blocks by score.

    scores: ``[B, Hk, NB]``; nblk: ``[B]``. Ties go to the lower block id (stable sort), and a
    middle block is selectable whatever its score (``-inf`` and NaN rank last).
    dense_row: optional ``[B]`` bool; such rows select every block (DSA with K >= all blocks is
    dense attention), which is how rows shorter than ``--prr-min-context`` decode.
    Returns ``(idx [B, Hk, n_out] int32 ascending, -1 padded; cnt [B, Hk] int32)`` with
    ``n_out = k + sink_blocks + local_blocks`` by default.
    """
    B, Hk, nb = scores.shape
    keep, middle = kept_mask(nblk, nb, sink_blocks, local_blocks)  # [B, NB]
    low = torch.finfo(torch.float32).min
    s = scores.float().nan_to_num(nan=low, posinf=torch.finfo(torch.float32).max, neginf=low)
    key = torch.where(middle.unsqueeze(1), s, torch.full_like(s, NEG_INF))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # [B, Hk, NB]
    n_mid = middle.sum(-1, keepdim=True)  # [B, 1]
    k_row = torch.full_like(n_mid, k)
    if dense_row is not None:
        k_row = torch.where(dense_row.view(-1, 1), n_mid, k_row)
    take = torch.arange(nb, device=scores.device) < torch.minimum(n_mid, k_row)  # [B, NB] by rank
    chosen = torch.zeros_like(key, dtype=torch.bool)
    chosen.scatter_(-1, order, take.unsqueeze(1).expand(B, Hk, nb))
    mask = chosen | keep.unsqueeze(1)
    return mask_to_list(mask, k + sink_blocks + local_blocks if n_out is None else n_out)


def accumulate_stats(stats: Tensor, a_cnt: Tensor, m_cnt: Tensor, p_cnt: Optional[Tensor],
                     dense_row: Optional[Tensor]) -> None:
    """PRR's counters, in place: ``stats`` (``contracts.STATS_SLOTS``: int64 sum |A|, sum |M|,
    sum |P|, rows) accumulates over the (request, KV head) rows of the step that are not dense
    rows. Counts ``[B, Hk]``."""
    w = torch.ones(a_cnt.shape[0], dtype=torch.int64, device=a_cnt.device)
    if dense_row is not None:
        w = (~dense_row).to(torch.int64)
    w = w.view(-1, 1)
    p = torch.zeros_like(a_cnt) if p_cnt is None else p_cnt.clamp(min=0)
    stats += torch.stack([(a_cnt.long() * w).sum(), (m_cnt.long() * w).sum(),
                          (p.long() * w).sum(), (w * torch.ones_like(a_cnt)).sum()]).to(stats.dtype)


def set_difference_counted(a_idx: Tensor, a_cnt: Tensor, p_idx: Tensor, p_cnt: Tensor, nb: int,
                           p_rows: Optional[Tensor] = None, stats: Optional[Tensor] = None,
                           dense_row: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``M = A \\ P`` (``set_difference``) with P read at rows ``p_rows: [B]`` of pool-wide lists
    ``[R, Hk, Np]`` / ``[R, Hk]`` (None: P is ``[B, ...]``), and, with ``stats``, the step's
    counters of A, M and P accumulated (``accumulate_stats``, ``dense_row: [B]`` rows left out)."""
    if p_rows is not None:
        r = in_pool(p_rows, p_idx.shape[0])
        p_idx, p_cnt = p_idx[r], p_cnt[r]
    m_idx, m_cnt = set_difference(a_idx, a_cnt, p_idx, p_cnt, nb)
    if stats is not None:
        accumulate_stats(stats, a_cnt, m_cnt, p_cnt, dense_row)
    return m_idx, m_cnt


def select_lists(scores: Tensor, nblk: Tensor, p_idx: Optional[Tensor], p_cnt: Optional[Tensor],
                 k: int, sink_blocks: int, local_blocks: int, n_out: int,
                 p_rows: Optional[Tensor] = None, dense_row: Optional[Tensor] = None,
                 stats: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``select_from_scores`` over the scores' own width (``nb = NB``) without the scores:
    ``(a_idx, a_cnt, m_idx, m_cnt)``, the lists ``[B, Hk, n_out]`` int32 (``M = A`` without P,
    a copy)."""
    return select_from_scores(scores, nblk, scores.shape[-1], p_idx, p_cnt, k, sink_blocks,
                              local_blocks, n_out, p_rows, dense_row, stats)[1:]


def select_from_scores(scores: Tensor, nblk: Tensor, nb: int, p_idx: Optional[Tensor],
                       p_cnt: Optional[Tensor], k: int, sink_blocks: int, local_blocks: int,
                       n_out: int, p_rows: Optional[Tensor] = None,
                       dense_row: Optional[Tensor] = None, stats: Optional[Tensor] = None
                       ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A = top-K + kept blocks from ``scores``, and ``M = A \\ P`` (``M = A`` without P):
    ``(scores, a_idx, a_cnt, m_idx, m_cnt)``. ``p_rows: [B]`` reads P at those rows of pool-wide
    lists ``[R, Hk, Np]`` / ``[R, Hk]``; ``dense_row: [B]`` bool rows select every block
    (``select_topk``); ``stats``, if given, accumulates ``accumulate_stats``."""
    a_idx, a_cnt = select_topk(scores, nblk, k, sink_blocks, local_blocks, n_out, dense_row)
    if p_idx is not None:
        m_idx, m_cnt = set_difference_counted(a_idx, a_cnt, p_idx, p_cnt, nb, p_rows, stats,
                                              dense_row)
        return scores, a_idx, a_cnt, m_idx, m_cnt
    m_idx, m_cnt = a_idx.clone(), a_cnt.clone()
    if stats is not None:
        accumulate_stats(stats, a_cnt, m_cnt, None, dense_row)
    return scores, a_idx, a_cnt, m_idx, m_cnt
