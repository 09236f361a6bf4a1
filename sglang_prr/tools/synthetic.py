"""Synthetic SGLang-style paged KV caches for the demo, the benchmarks and the GPU tests.

One layer's ``[num_slots, Hk, D]`` K/V buffers, a ``req_to_token`` table whose requests own
shuffled pages (page 0 stays SGLang's padding page, row 0 its padding request), and the Quest
summaries of the first ``ctx`` tokens of each request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import ops


@dataclass
class PagedKV:
    req_to_token: Tensor  # [batch + 1, max_ctx] int32 (row 0: padding)
    rows: Tensor          # [batch] request slots 1..batch
    table: Tensor         # [batch, NB] page ids
    pages: Tensor         # [batch, pages per request] (CPU) page ids in block order
    k_buf: Tensor         # [num_pages * page, Hk, D]
    v_buf: Tensor
    kmin: Tensor          # [num_pages, Hk, D] float32 Quest summaries
    kmax: Tensor
    n_pages: int


def paged_kv(batch: int, ctx: int, page: int, hk: int, d: int, *, dtype: torch.dtype,
             device: torch.device, generator: torch.Generator, spare_tokens: int = 0,
             topic: Tensor = None, hot_blocks: int = 0, hot_scale: float = 0.4) -> PagedKV:
    """Random K/V for ``batch`` requests with room for ``ctx + spare_tokens`` tokens each.

    With ``topic: [batch, Hk, D]``, ``hot_blocks`` random blocks of each request get
    ``hot_scale * topic`` added to their keys, so queries along the topic select them."""
    g = generator
    max_ctx = ctx + spare_tokens + page
    per_req = -(-max_ctx // page)
    n_pages = 1 + batch * per_req
    pages = (torch.randperm(n_pages - 1, generator=g) + 1).view(batch, per_req)
    r2t = (pages[:, :, None] * page + torch.arange(page)).view(batch, -1)[:, :max_ctx]
    r2t = torch.cat([torch.zeros(1, max_ctx, dtype=torch.long), r2t]).int().to(device)
    rows = torch.arange(1, batch + 1, device=device)
    k_buf = torch.randn(n_pages * page, hk, d, generator=g)
    v_buf = torch.randn(n_pages * page, hk, d, generator=g)
    if topic is not None and hot_blocks > 0:
        for b in range(batch):
            for blk in torch.randint(1, max(2, ctx // page - 1), (hot_blocks,), generator=g):
                k_buf[pages[b, blk] * page + torch.arange(page)] += hot_scale * topic[b]
    k_buf, v_buf = k_buf.to(device, dtype), v_buf.to(device, dtype)
    kmin = torch.full((n_pages, hk, d), float("inf"), device=device)
    kmax = torch.full((n_pages, hk, d), float("-inf"), device=device)
    for b in range(batch):
        loc = r2t[b + 1, :ctx]
        ops.quest_update(kmin, kmax, k_buf[loc.long()], loc, torch.arange(ctx, device=device),
                         page)
    return PagedKV(r2t, rows, ops.block_table(r2t, rows, page), pages, k_buf, v_buf, kmin, kmax,
                   n_pages)
