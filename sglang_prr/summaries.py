"""Block summaries of the DSA methods: the one owner of what differs between Quest and InfLLM-v2.

Both keep one summary per KV page (= PRR block), per layer, so the summaries scale with the KV
pool and are shared by the pages that SGLang's radix cache shares:

* Quest: the per-channel minimum and maximum of the page's keys, ``kmin``/``kmax:
  [L, num_pages, Hk, D]`` bfloat16 rounded outward (the minimum down, the maximum up, so the
  score stays an upper bound of the logits; ``+inf``/``-inf`` while empty): half the bytes of
  float32 for the selection to read, and for the KV pool to give up;
* InfLLM-v2: the mean key of every stride of ``INFLLM_STRIDE`` tokens, ``ck: [L, num_pages,
  page // INFLLM_STRIDE, Hk, D]`` float32.

Selection reads a layer's summaries through ``ops.select_blocks(method, q, summaries.layer(l),
...)``; the decode step and calibration never branch on the method themselves.
"""

from __future__ import annotations

import math
from typing import Callable, List

import torch
from torch import Tensor

from . import ops
from . import reference as ref
from .config import INFLLM_STRIDE

METHODS = ("quest", "infllm_v2")
# Element type of each method's summaries (Quest: bf16 with outward rounding, see above).
DTYPES = {"quest": torch.bfloat16, "infllm_v2": torch.float32}


def _check(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown DSA method {method!r}: expected one of {METHODS}")


def bytes_per_token(method: str, page_size: int, num_layers: int, num_kv_heads: int,
                    head_dim: int) -> int:
    """Bytes of summaries per KV token over all layers (added to SGLang's KV cell size)."""
    _check(method)
    vectors = 2 if method == "quest" else page_size // INFLLM_STRIDE  # per page and KV head
    per_page = vectors * num_kv_heads * head_dim * DTYPES[method].itemsize
    return int(math.ceil(num_layers * per_page / page_size))


def from_keys(method: str, k_pages: Tensor) -> List[Tensor]:
    """One layer's summaries of full pages of keys ``k_pages: [num_pages, page, Hk, D]``, for
    timing and synthetic inputs: ``[kmin, kmax]`` (exactly what Quest's updates build) or
    ``[ck]`` (InfLLM-v2's shape, as the means of the page's own strides: the real compressed
    keys are overlapping windows that also reach into the request's previous page)."""
    _check(method)
    kp = k_pages.float()
    if method == "quest":
        return [ref.round_bf16(kp.amin(1), down=True), ref.round_bf16(kp.amax(1), down=False)]
    P, page, Hk, D = kp.shape
    return [kp.view(P, page // INFLLM_STRIDE, INFLLM_STRIDE, Hk, D).mean(2).contiguous()]


class BlockSummaries:
    """Every layer's summaries of every KV page, for one DSA method (see the module doc)."""

    def __init__(self, method: str, num_layers: int, num_pages: int, num_kv_heads: int,
                 head_dim: int, page_size: int, device: torch.device):
        _check(method)
        self.method, self.page = method, int(page_size)
        L, P, Hk, D = num_layers, num_pages, num_kv_heads, head_dim
        if method == "quest":
            dt = DTYPES[method]
            self.tensors = [torch.full((L, P, Hk, D), float("inf"), dtype=dt, device=device),
                            torch.full((L, P, Hk, D), float("-inf"), dtype=dt, device=device)]
        else:
            self.tensors = [torch.zeros((L, P, self.page // INFLLM_STRIDE, Hk, D), device=device)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def layer(self, layer_id: int) -> List[Tensor]:
        """Layer ``layer_id``'s summaries, as ``ops.select_blocks`` takes them."""
        return [t[layer_id] for t in self.tensors]

    def update(self, layer_id: int, k: Tensor, out_cache_loc: Tensor, positions: Tensor,
               decode: bool, key_buffer: Tensor, req_to_token: Tensor,
               token_req_idx: Callable[[], Tensor]) -> None:
        """Fold the new keys ``k: [N, Hk, D]`` (at slots ``out_cache_loc`` / ``positions``,
        ``[N]``) into their pages' summaries. Quest folds the keys alone (decode: one token per
        page, one launch); InfLLM-v2 re-reads the page's strides from ``key_buffer`` through
        ``req_to_token`` with each token's request slot (``token_req_idx()``, built only here)."""
        if self.method == "quest":
            kmin, kmax = self.layer(layer_id)
            ops.quest_update(kmin, kmax, k, out_cache_loc, positions, self.page,
                             one_per_page=decode)
        else:
            ops.infllm_update(self.tensors[0][layer_id], key_buffer, req_to_token,
                              token_req_idx(), out_cache_loc, positions, self.page)
