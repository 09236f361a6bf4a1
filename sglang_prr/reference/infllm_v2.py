"""InfLLM-v2's ops: the compressed keys (means of overlapping windows) and the block scores
(softmax over the compressed keys, max-pooled to blocks). ``methods/infllm_v2.py`` is the
method; these are its ops' reference."""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import INFLLM_STRIDE, INFLLM_WINDOW
from .paging import NEG_INF, in_pool


def infllm_update(ck: Tensor, k_buf: Tensor, req_to_token: Tensor, req_idx: Tensor,
                  out_loc: Tensor, positions: Tensor, page_size: int) -> None:
    """Write the compressed keys completed by the new tokens, in place.

    Compressed key ``i`` is the mean of the keys at positions ``[16 i, 16 i + 32)``. It is stored
    with the page holding its *last* token, at ``ck[page, j]`` with ``j = i + 1 -
    (pos // page_size) * (page_size // 16)``; it depends only on that page and the previous one,
    so pages shared through the radix cache share their compressed keys.

    ck: ``[num_pages, page_size // 16, Hk, D]`` float32 or bfloat16 (the float32 mean rounded
    to nearest); k_buf: ``[num_slots, Hk, D]`` with the new keys already written; req_to_token:
    ``[max_reqs, max_ctx]``; req_idx: ``[N]`` request slot of each new token; out_loc,
    positions: ``[N]``. The mean sums the window's keys in float32 in position order, then
    scales by 1/32 (exact), so that a kernel summing in the same order writes the same bits.
    """
    W, S = INFLLM_WINDOW, INFLLM_STRIDE
    per_page = page_size // S
    pos = positions.long()
    done = ((pos + 1) % S == 0) & (pos >= W - 1)
    win = pos.unsqueeze(-1) - (W - 1) + torch.arange(W, device=pos.device)  # [N, W]
    win = in_pool(win, req_to_token.shape[1])  # before the request or past its row: column 0
    rows = in_pool(req_idx, req_to_token.shape[0])  # outside the pools: row / slot / page 0
    slots = in_pool(req_to_token[rows.unsqueeze(-1), win], k_buf.shape[0])  # [N, W]
    win_keys = k_buf[slots].float()  # [N, W, Hk, D]
    acc = torch.zeros_like(win_keys[:, 0])  # +0 first, as the kernel: -0 keys sum to +0
    for w in range(W):  # in position order (torch's mean may pair them differently)
        acc += win_keys[:, w]
    mean = acc * (1.0 / W)  # [N, Hk, D]
    i = (pos - (W - 1)) // S
    j = i + 1 - (pos // page_size) * per_page
    flat = in_pool(out_loc.long() // page_size, ck.shape[0]) * per_page + j
    flat = torch.where(done, flat, torch.zeros_like(flat))  # not completed -> padding page
    ck.view(-1, *ck.shape[2:]).index_copy_(0, flat, mean.to(ck.dtype))


def infllm_scores(q: Tensor, ck: Tensor, table: Tensor, seq_lens: Tensor, page_size: int,
                  sm_scale: float) -> Tensor:
    """InfLLM-v2 block scores: softmax of ``q . ck`` over the request's complete compressed keys,
    summed over the GQA group, max-pooled to each block a compressed key overlaps.

    q: ``[B, Hq, D]``; ck: ``[num_pages, page_size//16, Hk, D]`` (float32 or bfloat16, read
    as float32); table: ``[B, NB]``;
    seq_lens: ``[B]``. Returns ``[B, Hk, NB]`` float32 (``-inf`` where no complete compressed
    key touches the block, e.g. past the request).
    """
    W, S = INFLLM_WINDOW, INFLLM_STRIDE
    B, Hq, D = q.shape
    per_page = page_size // S
    Hk = ck.shape[2]
    G = Hq // Hk
    nb = table.shape[1]
    E = nb * per_page
    c = ck[in_pool(table, ck.shape[0])].reshape(B, E, Hk, D).float()  # entry e: key e - 1
    n_ck = ((seq_lens.long() - W) // S + 1).clamp(min=0)  # complete compressed keys
    e = torch.arange(E, device=q.device)
    valid = (e >= 1) & (e <= n_ck.unsqueeze(-1))  # [B, E]
    logits = torch.einsum("bhgd,behd->bhge", q.float().view(B, Hk, G, D), c) * sm_scale
    logits = logits.masked_fill(~valid[:, None, None, :], NEG_INF)
    p = torch.softmax(logits, dim=-1)
    # A head whose softmax is undefined (a NaN or +inf logit, or no finite one: the whole row is
    # then NaN) adds nothing to its group's sum; the group's other heads keep their scores.
    p = torch.where(p.isnan().any(-1, keepdim=True), torch.zeros_like(p), p).sum(2)  # [B, Hk, E]
    p = p.masked_fill(~valid[:, None, :], NEG_INF)
    ends_here = p.view(B, Hk, nb, per_page).amax(-1)  # keys whose last token is in the block
    # The first key stored with block b+1 starts in block b (it straddles the boundary).
    starts_here = torch.cat([p.view(B, Hk, nb, per_page)[:, :, 1:, 0],
                             torch.full((B, Hk, 1), NEG_INF, device=q.device)], dim=-1)
    return torch.maximum(ends_here, starts_here)
