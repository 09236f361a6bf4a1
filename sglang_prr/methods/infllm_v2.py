"""InfLLM-v2 (MiniCPM4, 2025): compressed keys over overlapping windows, scored by attention.

Summary of a page: the compressed keys stored with it, ``ck: [page // INFLLM_STRIDE, Hk, D]``
bfloat16 (the float32 mean rounded to nearest: half float32's bytes, for the scores to stream and
the KV pool to give up, and with a 16-bit q the logits run on tensor cores), or float32 with
``SGLANG_PRR_INFLLM_CK=fp32``. Compressed key ``i`` is the mean of the keys at positions
``[16 i, 16 i + 32)`` (``INFLLM_STRIDE``, ``INFLLM_WINDOW``), stored with the page of its last
token; it depends on that page and the previous one only, so pages shared through the radix cache
share it (``reference.infllm_update``).

Scores: the softmax of ``q . ck`` over the request's complete compressed keys, summed over the
GQA group, max-pooled to every block a compressed key overlaps (``ops.infllm_scores``).
The selection composes the scores, top-K and ``M = A \\ P`` (``DSAMethod.select``); PRR's
predictor step follows it (``ops.predict_update_rows``).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import custom_ops as ops
from ..config import INFLLM_STRIDE
from .base import DSAMethod, SummaryTensor


ENV_CK = "SGLANG_PRR_INFLLM_CK"
CK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_CK = "bf16"  # measured against float32 in the server (benchmarks/RUNS.md, run 61)


def ck_dtype() -> torch.dtype:
    """The compressed keys' dtype: ``SGLANG_PRR_INFLLM_CK`` (``bf16``, the default, or ``fp32``);
    any other value is refused with its name."""
    value = os.environ.get(ENV_CK, DEFAULT_CK)
    if value not in CK_DTYPES:
        raise ValueError(f"{ENV_CK}={value!r}: expected one of {sorted(CK_DTYPES)}")
    return CK_DTYPES[value]


class InfLLMv2(DSAMethod):
    name = "infllm_v2"
    kernels = True
    fuses_predictor = True

    def layout(self, page_size: int, num_kv_heads: int, head_dim: int
               ) -> Tuple[SummaryTensor, ...]:
        if page_size % INFLLM_STRIDE != 0:
            raise ValueError(f"infllm_v2: page_size is {page_size}, expected a multiple of the "
                             f"compression stride {INFLLM_STRIDE}")
        return (SummaryTensor("ck", (page_size // INFLLM_STRIDE, num_kv_heads, head_dim),
                              ck_dtype(), 0.0),)

    def from_keys(self, k_pages: Tensor) -> List[Tensor]:
        # The shape of the real compressed keys, as the means of the page's own strides (the real
        # ones are overlapping windows that also reach into the request's previous page).
        P, page, Hk, D = k_pages.shape
        kp = k_pages.float().view(P, page // INFLLM_STRIDE, INFLLM_STRIDE, Hk, D)
        return [kp.mean(2).to(ck_dtype()).contiguous()]

    def update(self, summary: Sequence[Tensor], k: Tensor, out_loc: Tensor, positions: Tensor,
               page_size: int, *, decode: bool, key_buffer: Tensor, req_to_token: Tensor,
               token_req_idx) -> None:
        # A compressed key spans two pages: it is re-read from the pool, through each token's
        # request slot, rather than folded from ``k``.
        ops.infllm_update(summary[0], key_buffer, req_to_token, token_req_idx(), out_loc,
                          positions, page_size)

    def scores(self, q: Tensor, summary: Sequence[Tensor], *, table: Tensor, seq_lens: Tensor,
               page_size: int, sm_scale: float, nblk: Optional[Tensor] = None) -> Tensor:
        return ops.infllm_scores(q, summary[0], table, seq_lens, page_size, sm_scale)
