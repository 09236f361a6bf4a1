"""The server's block summaries: every layer's summary of every KV page, for one DSA method.

What a summary is (its tensors, dtype, fold and scores) is the method's (``methods/``: Quest's
bf16 ``kmin``/``kmax`` rounded outward, InfLLM-v2's float32 or bfloat16 compressed keys
``ck``); this module owns the per-layer tensors the server allocates once, sized with the KV
pool (one summary per page, shared by the pages SGLang's radix cache shares), and the names the
shell and the tools call (``bytes_per_token``, ``from_keys``).

Selection reads a layer's summaries through ``ops.select_blocks(method, q, summaries.layer(l),
...)``; the decode step and calibration never branch on the method themselves.
"""

from __future__ import annotations

from typing import Callable, List

import torch
from torch import Tensor

from . import methods

METHODS = methods.BUILTIN


def bytes_per_token(method: str, page_size: int, num_layers: int, num_kv_heads: int,
                    head_dim: int) -> int:
    """Bytes of summaries per KV token over all layers (added to SGLang's KV cell size)."""
    return methods.get(method).bytes_per_token(page_size, num_layers, num_kv_heads, head_dim)


def from_keys(method: str, k_pages: Tensor) -> List[Tensor]:
    """One layer's summaries of full pages of keys ``k_pages: [num_pages, page, Hk, D]``, for
    timing and synthetic inputs (``DSAMethod.from_keys``)."""
    return methods.get(method).from_keys(k_pages)


class BlockSummaries:
    """Every layer's summaries of every KV page, for one DSA method: ``tensors``, one ``[L,
    num_pages, ...]`` tensor per entry of the method's ``layout``."""

    def __init__(self, method: str, num_layers: int, num_pages: int, num_kv_heads: int,
                 head_dim: int, page_size: int, device: torch.device):
        self.impl = methods.get(method)
        self.method, self.page = method, int(page_size)
        self.tensors = self.impl.allocate(num_layers, num_pages, num_kv_heads, head_dim,
                                          self.page, device)

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
        ``[N]``) into their pages' summaries of layer ``layer_id`` (``DSAMethod.update``: Quest
        folds the keys alone, one launch in decode; InfLLM-v2 re-reads the page's strides from
        ``key_buffer`` through ``req_to_token`` with each token's request slot,
        ``token_req_idx()``, built only then)."""
        self.impl.update(self.layer(layer_id), k, out_cache_loc, positions, self.page,
                         decode=decode, key_buffer=key_buffer, req_to_token=req_to_token,
                         token_req_idx=token_req_idx)
