"""Paging and block lists: block counts and tables, id lists <-> masks, set difference, the
kept (sink/local) and middle blocks, per-KV-head -> per-query-head. See the package docstring
for the conventions."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

NEG_INF = float("-inf")


def num_blocks(seq_lens: Tensor, page_size: int) -> Tensor:
    """Blocks per request: ``ceil(seq_lens / page_size)``; ``seq_lens: [B]`` -> ``[B]`` int64."""
    return (seq_lens.long() + page_size - 1) // page_size


def in_pool(ids: Tensor, n: int) -> Tensor:
    """Indices into a pool of ``n`` rows, as int64: request slots (``rows``, ``p_rows``,
    ``idx_rows``), page ids (a table's, or a KV slot's page) and KV slots. One outside ``[0, n)``
    (a caller's error: SGLang's never are) is 0, SGLang's padding row, page or slot, which no
    request reads: a bad index reads and writes there, never past the pool (the kernels'
    ``in_pool``). Python's negative indexing would have read another request's row or page, and
    one past the pool was an IndexError here and a read past the buffer in a kernel."""
    r = ids.long()
    return torch.where((r >= 0) & (r < n), r, torch.zeros_like(r))


def block_table(req_to_token: Tensor, req_pool_indices: Tensor, page_size: int) -> Tensor:
    """Page id of every block of every request.

    req_to_token: ``[max_reqs, max_ctx]`` int32 slot of each (request slot, position).
    req_pool_indices: ``[B]`` request slots of the batch.
    Returns ``[B, NB]`` int64 with ``NB = ceil(max_ctx / page_size)``; entries past a request's
    length are whatever ``req_to_token`` holds there and must be masked by the caller.
    """
    rows = req_to_token[req_pool_indices.long()]  # [B, max_ctx]
    return rows[:, ::page_size].long() // page_size


def mask_to_list(mask: Tensor, n: int) -> Tuple[Tensor, Tensor]:
    """Block mask ``[..., NB] bool`` -> ascending id list ``[..., n]`` int32 (-1 padded), count.

    Static shapes: at most ``n`` ids are kept (the lowest ones); ``n`` may exceed NB.
    """
    nb = mask.shape[-1]
    ar = torch.arange(nb, device=mask.device)
    key = torch.where(mask, ar, ar + nb)  # selected ids first, in order
    order = torch.sort(key, dim=-1).values
    if n > nb:
        pad = torch.full(mask.shape[:-1] + (n - nb,), 2 * nb, device=mask.device, dtype=order.dtype)
        order = torch.cat([order, pad], dim=-1)
    order = order[..., :n]
    idx = torch.where(order < nb, order, torch.full_like(order, -1)).to(torch.int32)
    cnt = mask.sum(-1).clamp(max=n).to(torch.int32)
    return idx, cnt


def list_to_mask(idx: Tensor, cnt: Tensor, nb: int) -> Tensor:
    """Id list ``[..., n]`` with counts ``[...]`` -> mask ``[..., nb]`` bool (padding ignored)."""
    n = idx.shape[-1]
    valid = (torch.arange(n, device=idx.device) < cnt.unsqueeze(-1).long()) & (idx >= 0) & (idx < nb)
    target = torch.where(valid, idx.long(), torch.full_like(idx, nb, dtype=torch.long))
    mask = torch.zeros(idx.shape[:-1] + (nb + 1,), dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, target, True)
    return mask[..., :nb]


def list_isin(idx: Tensor, cnt: Tensor, ref_idx: Tensor, ref_cnt: Tensor, nb: int) -> Tensor:
    """For each valid entry of ``idx``, is it in the set ``ref``? ``[..., n]`` bool (False on
    padding). Ids outside ``[0, nb)`` are padding in both lists, never members."""
    ref_mask = list_to_mask(ref_idx, ref_cnt, nb)  # [..., nb]
    safe = idx.long().clamp(min=0, max=max(nb - 1, 0))
    hit = torch.gather(ref_mask, -1, safe) if nb > 0 else torch.zeros_like(idx, dtype=torch.bool)
    valid = ((torch.arange(idx.shape[-1], device=idx.device) < cnt.unsqueeze(-1).long())
             & (idx >= 0) & (idx < nb))
    return hit & valid


def repeated_entries(idx: Tensor, cnt: Tensor) -> Tensor:
    """Valid entries whose id an earlier valid entry of the same list already holds: ``[..., n]``
    bool. Block lists are sets: a repeated id is padding (attended and merged once)."""
    n = idx.shape[-1]
    ar = torch.arange(n, device=idx.device)
    valid = (ar < cnt.long().unsqueeze(-1)) & (idx >= 0)
    same = (idx.unsqueeze(-1) == idx.unsqueeze(-2)) & valid.unsqueeze(-2)  # [..., j, i]
    earlier = ar.view(n, 1) > ar.view(1, n)  # i < j
    return valid & (same & earlier).any(-1)


def set_difference(a_idx: Tensor, a_cnt: Tensor, p_idx: Tensor, p_cnt: Tensor, nb: int,
                   n: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``M = A \\ P`` as a padded list of at most ``n`` (default ``A``'s width) ids and counts."""
    a_mask = list_to_mask(a_idx, a_cnt, nb)
    p_mask = list_to_mask(p_idx, p_cnt, nb)
    return mask_to_list(a_mask & ~p_mask, a_idx.shape[-1] if n is None else n)


def kept_mask(nblk: Tensor, nb: int, sink_blocks: int, local_blocks: int) -> Tuple[Tensor, Tensor]:
    """Always-kept and middle (selectable) block masks, ``[B, NB]`` each, for ``nblk: [B]`` blocks."""
    ar = torch.arange(nb, device=nblk.device)
    n = nblk.long().clamp(0, nb).unsqueeze(-1)  # blocks past the table do not exist
    exists = ar < n
    keep = exists & ((ar < sink_blocks) | (ar >= n - local_blocks))
    return keep, exists & ~keep


def expand_heads(x: Tensor, group: int) -> Tensor:
    """Per-KV-head ``[B, Hk, ...]`` -> per-query-head ``[B, Hk*group, ...]``."""
    return x.repeat_interleave(group, dim=1)
