"""A toy DSA method, defined outside the package: what adding a method takes.

``block_mean``: the summary of a page is the sum of its keys, ``ksum: [Hk, D]`` float32 (the
mean needs the page's token count, which the scores read from the request's length); a block's
score is ``q . mean key``, summed over the GQA group. Reference path only (plain torch, no op
and no kernel), so it runs on every device, the meta device included. The conformance suite
(``test_methods_conformance.py``) registers it and runs it through every check a method passes;
``oracle_scores`` is its fp64 oracle, written from the keys without the summaries.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from sglang_prr.methods import DSAMethod, SummaryTensor


class BlockMean(DSAMethod):
    name = "block_mean"
    kernels = False
    fuses_predictor = False

    def layout(self, page_size: int, num_kv_heads: int, head_dim: int
               ) -> Tuple[SummaryTensor, ...]:
        return (SummaryTensor("ksum", (num_kv_heads, head_dim), torch.float32, 0.0),)

    def from_keys(self, k_pages: Tensor) -> List[Tensor]:
        return [k_pages.float().sum(1)]

    def update(self, summary: Sequence[Tensor], k: Tensor, out_loc: Tensor, positions: Tensor,
               page_size: int, *, decode: bool, key_buffer: Tensor = None,
               req_to_token: Tensor = None, token_req_idx=None) -> None:
        ksum = summary[0]
        page = out_loc.long() // page_size
        first = (positions.long() % page_size) == 0
        # A page starts again at its first token (page 0, SGLang's padding page, takes the rest).
        ksum.index_fill_(0, torch.where(first, page, torch.zeros_like(page)), 0.0)
        ksum.index_add_(0, page, k.float())

    def scores(self, q: Tensor, summary: Sequence[Tensor], *, table: Tensor, seq_lens: Tensor,
               page_size: int, sm_scale: float, nblk: Optional[Tensor] = None) -> Tensor:
        B, Hq, D = q.shape
        ksum = summary[0]
        Hk = ksum.shape[1]
        nb = table.shape[1]
        start = torch.arange(nb, device=q.device) * page_size
        n_tok = (seq_lens.long().view(B, 1) - start).clamp(0, page_size)  # [B, NB]
        mean = ksum[table.long()] / n_tok.clamp(min=1).view(B, nb, 1, 1).to(ksum.dtype)
        s = torch.einsum("bhgd,bnhd->bhn", q.float().view(B, Hk, Hq // Hk, D), mean)
        return s.masked_fill((n_tok == 0).unsqueeze(1), float("-inf"))


def oracle_scores(q, k_buf, req_to_token, rows, seq_lens, page, sm_scale
                  ) -> List[List[List[float]]]:
    """``scores[b][h_kv][blk]`` in float64 from the keys of each block, token by token."""
    B, Hq, D = q.shape
    Hk = k_buf.shape[1]
    G = Hq // Hk
    out = []
    for b in range(B):
        L = int(seq_lens[b])
        per_head = []
        for h in range(Hk):
            row = []
            for j in range(-(-L // page)):
                slots = [int(req_to_token[int(rows[b]), p]) for p in range(j * page,
                                                                          min((j + 1) * page, L))]
                mean = k_buf[slots, h].double().mean(0)
                row.append(sum(float(q[b, h * G + g].double() @ mean) for g in range(G)))
            per_head.append(row)
        out.append(per_head)
    return out
