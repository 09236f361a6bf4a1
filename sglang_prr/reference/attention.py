"""Sparse decode attention over block lists: per-block partial states ``(o, lse)``, their merge
(eq 6), PRR's merge of the speculative and repair partials, and the attention over one set."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .paging import (NEG_INF, expand_heads, in_pool, list_isin, mask_to_list, num_blocks,
                     repeated_entries)


def _gather_blocks(buf: Tensor, table: Tensor, idx: Tensor, page_size: int) -> Tensor:
    """K or V of the listed blocks: ``[B, Hk, N, page_size, D]`` float32 (padding and pages
    outside the pool read page 0)."""
    B, Hk, N = idx.shape
    nb = table.shape[1]
    blk = idx.long().clamp(min=0, max=nb - 1)
    pages = torch.gather(table.unsqueeze(1).expand(B, Hk, nb), -1, blk)  # [B, Hk, N]
    pages = torch.where((idx >= 0) & (idx < nb), pages, torch.zeros_like(pages))
    pages = in_pool(pages, buf.shape[0] // page_size)  # a page past the pool: page 0
    slots = pages.unsqueeze(-1) * page_size + torch.arange(page_size, device=idx.device)
    heads = torch.arange(Hk, device=idx.device).view(1, Hk, 1, 1)
    return buf[slots, heads].float()


def sparse_attn_partials(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor, seq_lens: Tensor,
                         idx: Tensor, cnt: Tensor, page_size: int, sm_scale: float,
                         idx_rows: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Attention of one decode query per request over each listed block separately.

    q: ``[B, Hq, D]``; k_buf, v_buf: ``[num_slots, Hk, D]``; table: ``[B, NB]`` page ids;
    seq_lens: ``[B]`` (tokens at or past it are masked); idx/cnt: block list ``[B, Hk, N]`` and
    counts ``[B, Hk]``; with ``idx_rows: [B]`` they are the rows ``idx_rows[b]`` of pool-wide lists
    ``[R, Hk, N]`` / ``[R, Hk]`` (the predictor state read in place). Returns per-block partials
    ``o: [B, Hq, N, D]`` float32 (normalised within the block) and ``lse: [B, Hq, N]`` float32;
    padding entries are ``(0, -inf)``.
    """
    if idx_rows is not None:
        r = in_pool(idx_rows, idx.shape[0])
        idx, cnt = idx[r], cnt[r]
    B, Hq, D = q.shape
    Hk, N = idx.shape[1], idx.shape[2]
    G = Hq // Hk
    k = _gather_blocks(k_buf, table, idx, page_size)  # [B, Hk, N, P, D]
    v = _gather_blocks(v_buf, table, idx, page_size)
    pos = idx.long().unsqueeze(-1) * page_size + torch.arange(page_size, device=q.device)
    entry_ok = ((torch.arange(N, device=q.device) < cnt.long().unsqueeze(-1)) & (idx >= 0)
                & (idx < table.shape[1])  # ids outside the table are padding
                & ~repeated_entries(idx, cnt))  # so are repeats: a block is attended once
    ok = entry_ok.unsqueeze(-1) & (pos < seq_lens.long().view(B, 1, 1, 1))  # [B, Hk, N, P]
    logits = torch.einsum("bhgd,bhnpd->bhgnp", q.float().view(B, Hk, G, D), k) * sm_scale
    logits = logits.masked_fill(~ok.unsqueeze(2), NEG_INF)
    lse = torch.logsumexp(logits, dim=-1)  # [B, Hk, G, N]
    p = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    # Masked slots (past the request, padding entries) never enter the sums: a stale NaN there
    # would survive a multiplication by zero.
    v = torch.where(ok.unsqueeze(-1), v, torch.zeros_like(v))
    o = torch.einsum("bhgnp,bhnpd->bhgnd", p, v)
    return o.reshape(B, Hq, N, D), lse.reshape(B, Hq, N)


def merge_partials(o: Tensor, lse: Tensor, keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Merge the kept partial states along dim -2 of ``o`` (eq 6 over many states at once).

    o: ``[..., N, D]``; lse: ``[..., N]``; keep: ``[..., N]`` bool (default all). Returns
    ``(o [..., D], lse [...])``; nothing kept gives ``(0, -inf)``. An entry of weight 0 (not
    kept, lse -inf, or far below the max) adds nothing whatever its ``o`` holds; a NaN or inf in
    a kept entry's ``o`` reaches the output.
    """
    lse = lse.float()
    if lse.shape[-1] == 0:  # nothing to merge: the empty state
        return (o.new_zeros(o.shape[:-2] + o.shape[-1:], dtype=torch.float32),
                lse.new_full(lse.shape[:-1], NEG_INF))
    if keep is not None:
        lse = lse.masked_fill(~keep, NEG_INF)
    m = lse.amax(-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # 0 for -inf entries
    l = w.sum(-1, keepdim=True)
    # Entries of weight 0 add nothing whatever they hold (an unwritten or empty partial); a kept
    # entry's NaN or inf reaches the output, as in dense attention (the kernels' merge_accum).
    o = torch.where(w.unsqueeze(-1) > 0, o.float(), torch.zeros((), device=o.device))
    out = (w.unsqueeze(-1) * o).sum(-2) / l.clamp(min=1e-30)
    return out, (m_safe + torch.log(l)).squeeze(-1)


def merge_state(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tuple[Tensor, Tensor]:
    """Eq 6 for two states: ``o: [..., D]``, ``lse: [...]``."""
    return merge_partials(torch.stack([o1, o2], -2), torch.stack([lse1, lse2], -1))


def dense_attention(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor, seq_lens: Tensor,
                    page_size: int, sm_scale: float) -> Tensor:
    """Decode attention over every block (the baseline DSA must equal when K covers all)."""
    B = q.shape[0]
    Hk, nb = k_buf.shape[1], table.shape[1]
    nblk = num_blocks(seq_lens, page_size)
    mask = (torch.arange(nb, device=q.device) < nblk.unsqueeze(-1)).unsqueeze(1).expand(B, Hk, nb)
    idx, cnt = mask_to_list(mask, nb)
    o, lse = sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale)
    return merge_partials(o, lse)[0]


def attend_set(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor, seq_lens: Tensor,
               idx: Tensor, cnt: Tensor, page_size: int, sm_scale: float) -> Tuple[Tensor, Tensor]:
    """Attention over a block set, as one state ``(o [B, Hq, D], lse [B, Hq])``."""
    o, lse = sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale)
    return merge_partials(o, lse)


def sparse_attn_merge(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor, seq_lens: Tensor,
                      idx: Tensor, cnt: Tensor, page_size: int, sm_scale: float,
                      o_spec: Optional[Tensor] = None, lse_spec: Optional[Tensor] = None,
                      p_idx: Optional[Tensor] = None, p_cnt: Optional[Tensor] = None,
                      a_idx: Optional[Tensor] = None, a_cnt: Optional[Tensor] = None,
                      nb: int = 0, exact: bool = True, p_rows: Optional[Tensor] = None,
                      out_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """Attention over the listed blocks, merged into one state, with the speculative partials.

    Without ``o_spec``: ``attend_set``. With it: the repair over ``idx`` (= M) merged with the
    speculative partials as ``prr_merge`` does (exact: only ``P n A`` of them; union: all);
    ``p_rows: [B]`` reads P from rows of pool-wide lists, as ``idx_rows`` of
    ``sparse_attn_partials``. Returns ``(o [B, Hq, D], lse [B, Hq] float32)`` with ``o`` in
    ``out_dtype`` (float32 by default; the model's dtype saves the decode step a cast).
    """
    o_r, lse_r = sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size,
                                      sm_scale)
    if o_spec is None:
        o, lse = merge_partials(o_r, lse_r)
    else:
        if p_rows is not None and p_idx is not None:
            r = in_pool(p_rows, p_idx.shape[0])
            p_idx, p_cnt = p_idx[r], p_cnt[r]
        o, lse = prr_merge(o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, o_r, lse_r, nb, exact)
    return (o if out_dtype is None else o.to(out_dtype)), lse


def prr_merge(o_spec: Tensor, lse_spec: Tensor, p_idx: Tensor, p_cnt: Tensor, a_idx: Tensor,
              a_cnt: Tensor, o_rep: Tensor, lse_rep: Tensor, nb: int, exact: bool = True
              ) -> Tuple[Tensor, Tensor]:
    """Combine the speculative per-block partials over P with the repair partials over M = A \\ P.

    exact: keep only the speculative partials of blocks in ``P n A`` -> attention over exactly A.
    union: keep every speculative partial -> attention over ``P u A``. In both, an id repeated in
    P counts once (its first entry).
    o_spec: ``[B, Hq, Np, D]``, lse_spec ``[B, Hq, Np]``; o_rep/lse_rep likewise over M.
    Returns ``(o [B, Hq, D] float32, lse [B, Hq])``.
    """
    G = o_spec.shape[1] // p_idx.shape[1]
    first = ~repeated_entries(p_idx, p_cnt)
    if exact:
        keep = expand_heads(list_isin(p_idx, p_cnt, a_idx, a_cnt, nb) & first, G)
    else:
        keep = expand_heads(first, G)
    o = torch.cat([o_spec, o_rep], dim=-2)
    lse = torch.cat([lse_spec.masked_fill(~keep, NEG_INF), lse_rep], dim=-1)
    return merge_partials(o, lse)
