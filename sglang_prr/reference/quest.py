"""Quest's ops: the per-page key bounds (bf16 rounded outward), their fold, the block scores, and
the selection of a decode step (scores, top-K, ``M = A \\ P``), also fused with the predictor's
step. ``methods/quest.py`` is the method; these are its ops' reference."""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

from .paging import NEG_INF, in_pool
from .predictor import predict_update_rows
from .selection import select_from_scores

# index_reduce_ (deterministic amin/amax scatter) is flagged beta by torch; its semantics are what
# the summaries need, so the warning is silenced here rather than printed on every update.
warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")


def round_bf16(x: Tensor, down: bool) -> Tensor:
    """``x`` (float32) rounded to bfloat16 toward -inf (``down``) or +inf: the outward rounding
    that keeps ``kmin`` a lower and ``kmax`` an upper bound of the keys, as the kernels'
    ``__float2bfloat16_rd`` / ``_ru`` round. Round to nearest, then one step outward where that
    went the wrong way."""
    y = x.to(torch.bfloat16)
    yf = y.float()
    wrong = (yf > x) if down else (yf < x)
    bits = y.view(torch.int16).to(torch.int32)
    neg = bits < 0  # sign bit set
    # One step toward -inf: |y| up for y < 0, down for y > 0; from +/-0 to the smallest
    # negative subnormal (0x8001). Toward +inf: the mirror image.
    zero = (bits & 0x7FFF) == 0
    if down:
        step = torch.where(zero, torch.full_like(bits, -32767), torch.where(neg, bits + 1, bits - 1))
    else:
        step = torch.where(zero, torch.ones_like(bits), torch.where(neg, bits - 1, bits + 1))
    out = torch.where(wrong, step, bits).to(torch.int16).view(torch.bfloat16)
    return out


def key_bounds(k: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Keys ``k`` as the summaries of ``dtype`` store them, ``(lo, hi)``: bfloat16 rounded outward
    (min/max commute with it), any other dtype as is."""
    if dtype == torch.bfloat16:
        return round_bf16(k.float(), down=True), round_bf16(k.float(), down=False)
    x = k.to(dtype)
    return x, x


def quest_update(kmin: Tensor, kmax: Tensor, k: Tensor, out_loc: Tensor, positions: Tensor,
                 page_size: int, one_per_page: bool = False) -> None:
    """Fold newly written keys into the per-page key min/max, in place.

    kmin, kmax: ``[num_pages, Hk, D]`` float32 summaries, indexed by page.
    k: ``[N, Hk, D]`` the new keys; out_loc: ``[N]`` their slots; positions: ``[N]`` their
    positions in their requests. A page is reset when the token at its first position is
    written (so a reused page forgets its previous owner); tokens of one call may share pages.
    ``one_per_page`` promises that they do not (decode): the result is the same, and the kernel
    then needs one launch instead of two.
    """
    page = in_pool(out_loc.long() // page_size, kmin.shape[0])  # outside the pool: page 0
    first = (positions.long() % page_size) == 0
    reset = torch.where(first, page, torch.zeros_like(page))  # page 0 = padding sink
    kmin.index_fill_(0, reset, float("inf"))
    kmax.index_fill_(0, reset, NEG_INF)
    lo, hi = key_bounds(k, kmin.dtype)
    kmin.index_reduce_(0, page, lo, "amin")
    kmax.index_reduce_(0, page, hi, "amax")


def fold_new_keys(lo: Tensor, hi: Tensor, dtype: torch.dtype, nblk: Tensor, new_k: Tensor,
                  new_pos: Tensor, page_size: int) -> None:
    """Fold each row's new key into the gathered summaries of its block, in place, as
    ``quest_update`` folds it into the page (the first position of a page: the key alone).

    lo, hi: ``[B, NB, Hk, D]`` float32 (``kmin[table]``, ``kmax[table]``); dtype: the summaries'
    (bfloat16 rounds the key outward first); new_k: ``[B, Hk, D]``; new_pos: ``[B]`` positions (a
    negative one, or one in a block at or past ``nblk``, folds nothing). Folding a key into a
    summary that already holds it changes nothing, so the scores are the same whether or not the
    update has run."""
    B, NB = lo.shape[:2]
    ok, col = _key_blocks(new_pos, nblk, NB, page_size)
    row = torch.arange(B, device=lo.device)
    cur_lo, cur_hi = lo[row, col], hi[row, col]  # [B, Hk, D]
    f_lo, f_hi = _folded(cur_lo, cur_hi, dtype, new_k, new_pos, page_size)
    keep = ~ok.view(-1, 1, 1)
    lo[row, col] = torch.where(keep, cur_lo, f_lo)
    hi[row, col] = torch.where(keep, cur_hi, f_hi)


def _key_blocks(new_pos: Tensor, nblk: Tensor, nb: int, page_size: int) -> Tuple[Tensor, Tensor]:
    """Whether each row's new key folds into one of its blocks (``ok [B]``: a position >= 0 in a
    block below ``min(nblk, nb)``) and that block (``col [B]`` int64, 0 where not ``ok``)."""
    pos = new_pos.long()
    blk = pos.div(page_size, rounding_mode="floor")
    ok = (pos >= 0) & (blk < torch.clamp(nblk.long(), max=nb))
    return ok, torch.where(ok, blk, torch.zeros_like(blk))


def _folded(cur_lo: Tensor, cur_hi: Tensor, dtype: torch.dtype, new_k: Tensor, new_pos: Tensor,
            page_size: int) -> Tuple[Tensor, Tensor]:
    """Bounds ``[B, Hk, D]`` (float32) with each row's key folded in as ``quest_update`` folds it:
    the first position of a page replaces them, any other only a smaller min / larger max."""
    xl, xh = (b.float() for b in key_bounds(new_k, dtype))
    first = (new_pos.long() % page_size == 0).view(-1, 1, 1)
    return (torch.where(first | (xl < cur_lo), xl, cur_lo),
            torch.where(first | (xh > cur_hi), xh, cur_hi))


def write_new_keys(kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor, new_k: Tensor,
                   new_pos: Tensor, new_loc: Tensor, page_size: int) -> None:
    """The decode update done by the selection: each row's new key folded into the bounds of its
    block (page ``table[b, new_pos[b] // page_size]``, as ``fold_new_keys`` folds it) and written,
    in place, to page ``new_loc[b] // page_size`` (the page its slot lies in: the same page for
    the server's rows, so this is ``quest_update(..., one_per_page=True)``). Rows whose key folds
    nothing (a negative position, a block at or past ``nblk``) write page 0, the padding sink no
    request reads, as ``quest_update`` resets it; so do rows whose slot lies outside the pool
    (``in_pool``: a negative one's page would be counted from the pool's end, another
    request's). Rows writing the same page
    leave one of their values there (a request's newest page is its own; padding rows share page
    0). No host sync.
    """
    B, NB = table.shape
    ok, col = _key_blocks(new_pos, nblk, NB, page_size)
    src = in_pool(table[torch.arange(B, device=table.device), col], kmin.shape[0])
    lo, hi = _folded(kmin[src].float(), kmax[src].float(), kmin.dtype, new_k, new_pos, page_size)
    loc = new_loc.long()
    dst = torch.where(ok, in_pool(loc.div(page_size, rounding_mode="floor"), kmin.shape[0]),
                      torch.zeros_like(col))
    kmin[dst] = lo.to(kmin.dtype)
    kmax[dst] = hi.to(kmax.dtype)


def quest_scores(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor,
                 new_k: Optional[Tensor] = None, new_pos: Optional[Tensor] = None,
                 page_size: int = 0) -> Tensor:
    """Quest block scores ``IS = sum_d max(q_d*kmax_d, q_d*kmin_d)``, summed over each GQA group.

    q: ``[B, Hq, D]``; kmin/kmax: ``[num_pages, Hk, D]``; table: ``[B, NB]`` page ids;
    nblk: ``[B]`` blocks per request. Returns ``[B, Hk, NB]`` float32, ``-inf`` past nblk.
    Summing the per-head upper bounds keeps an upper bound of the group's summed logits.
    With ``new_k [B, Hk, D]`` / ``new_pos [B]``, each row's new key counts in its block's score
    as if it had been folded into the summary (``fold_new_keys``; the summaries are not written).
    """
    B, Hq, D = q.shape
    Hk = kmin.shape[1]
    G = Hq // Hk
    nb = table.shape[1]
    pages = in_pool(table, kmin.shape[0])  # a page outside the pool: page 0
    lo = kmin[pages].float()  # [B, NB, Hk, D] (bfloat16 summaries: exact in float32)
    hi = kmax[pages].float()
    if new_k is not None:
        fold_new_keys(lo, hi, kmin.dtype, nblk, new_k, new_pos, page_size)
    qg = q.float().view(B, Hk, G, D)
    # fmax, as the kernels' fmaxf: where one product is NaN (a zero q_d against an infinite
    # bound) the other is the bound; a NaN q_d makes both NaN, and the block's score NaN.
    s = torch.fmax(torch.einsum("bhgd,bnhd->bhgnd", qg, hi),
                   torch.einsum("bhgd,bnhd->bhgnd", qg, lo)).sum(-1).sum(2)  # [B, Hk, NB]
    exists = torch.arange(nb, device=q.device) < nblk.long().unsqueeze(-1)
    return torch.where(exists.unsqueeze(1), s, torch.full_like(s, NEG_INF))


def quest_select(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor,
                 p_idx: Optional[Tensor], p_cnt: Optional[Tensor], k: int, sink_blocks: int,
                 local_blocks: int, n_out: int, p_rows: Optional[Tensor] = None,
                 dense_row: Optional[Tensor] = None, stats: Optional[Tensor] = None,
                 new_k: Optional[Tensor] = None, new_pos: Optional[Tensor] = None,
                 page_size: int = 0, new_loc: Optional[Tensor] = None
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Quest selection of one step: scores, A = top-K + kept blocks, and M = A \\ P.

    ``p_idx``/``p_cnt`` None gives ``M = A``; with ``p_rows: [B]`` they are rows of the pool-wide
    prediction ``[R, Hk, Np]`` / ``[R, Hk]``. ``dense_row: [B]`` bool selects every block of those
    rows (``select_topk``); ``stats: [4]`` int64, if given, accumulates ``accumulate_stats``.
    ``new_k``/``new_pos``: the step's new keys in the scores (``quest_scores``); with their slots
    ``new_loc [B]`` too, the folded bounds are also written to the summaries (``write_new_keys``:
    the decode update in the same op), after the scores are read.
    Returns ``(scores [B, Hk, NB], a_idx, a_cnt, m_idx, m_cnt)`` with lists of width ``n_out``.
    """
    s = quest_scores(q, kmin, kmax, table, nblk, new_k, new_pos, page_size)
    if new_loc is not None:
        write_new_keys(kmin, kmax, table, nblk, new_k, new_pos, new_loc, page_size)
    return select_from_scores(s, nblk, table.shape[1], p_idx, p_cnt, k, sink_blocks,
                              local_blocks, n_out, p_rows, dense_row, stats)


def quest_select_predict(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor,
                         nblk_next: Tensor, p_idx: Tensor, p_cnt: Tensor, p_rows: Tensor,
                         p_next_rows: Tensor, level: Tensor, trend: Tensor, n_init: Tensor,
                         theta: Tensor, rows: Tensor, k: int, n_pred: int, sink_blocks: int,
                         local_blocks: int, n_out: int, dense_row: Optional[Tensor] = None,
                         stats: Optional[Tensor] = None, new_k: Optional[Tensor] = None,
                         new_pos: Optional[Tensor] = None, page_size: int = 0,
                         new_loc: Optional[Tensor] = None
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A Quest decode step's selection and the predictor's step (one launch on SM90):
    ``quest_select`` with P(t) read at rows ``p_rows`` of p_idx/p_cnt, then
    ``predict_update_rows`` on state rows ``rows`` with P(t+1) written at rows ``p_next_rows``
    (P(t) is read before P(t+1) is written, so the two may be the same rows)."""
    out = quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks,
                       n_out, p_rows, dense_row, stats, new_k, new_pos, page_size, new_loc)
    predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, out[0], nblk, nblk_next,
                        n_pred, sink_blocks, local_blocks, p_next_rows)
    return out
