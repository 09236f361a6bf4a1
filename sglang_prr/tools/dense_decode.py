"""Dense decode attention of one layer as SGLang serves it, for the budget profile's dense rows.

On CUDA: FlashInfer's paged decode over every page of each request, as SGLang's FlashInfer
backend plans it (tensor cores for GQA groups of 4 or more, SGLang's choice; a CUDA-graph-safe
wrapper over fixed buffers). On CPU: ``reference.dense_attention`` (the plumbing of the profile,
not a timing anyone should act on). Used by ``profile_budget``; set up outside any graph.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import reference as ref

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (SGLang allocates the same order)


def paged_indices(req_to_token: Tensor, rows: Tensor, seq_lens: Tensor, page: int):
    """FlashInfer's page table of the requests: ``(indptr [B + 1], indices [sum pages],
    last_page_len [B])`` int32 on ``req_to_token``'s device; request ``b``'s pages are the slots
    ``req_to_token[rows[b], ::page] // page`` of its ``ceil(seq_lens[b] / page)`` pages."""
    dev = req_to_token.device
    lens = [int(x) for x in seq_lens.tolist()]  # host-ok: set-up, outside any graph
    npg = [math.ceil(n / page) for n in lens]
    starts = req_to_token[rows.long()][:, ::page]  # the first slot of every page of a request
    indices = torch.cat([starts[b, :npg[b]] // page for b in range(len(lens))]).int()
    indptr = torch.tensor([0] + npg, device=dev).cumsum(0).int()
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, npg)], dtype=torch.int32,
                        device=dev)
    return indptr, indices.to(dev), last


def dense_decode(q: Tensor, k_buf: Tensor, v_buf: Tensor, req_to_token: Tensor, rows: Tensor,
                 seq_lens: Tensor, page: int, scale: float
                 ) -> Optional[Callable[[Tensor], Tensor]]:
    """``attend(q) -> o [B, Hq, D]``: dense attention of queries shaped like ``q: [B, Hq, D]``
    over the pool ``k_buf``/``v_buf: [slots, Hk, D]``, request ``b`` owning the slots
    ``req_to_token[rows[b], :seq_lens[b]]`` (whole pages). None when FlashInfer is missing on
    CUDA (the profile then has no dense rows and ``--prr-budget auto`` never runs dense)."""
    if k_buf.device.type != "cuda":
        table = ref.block_table(req_to_token, rows, page)
        return lambda x: ref.dense_attention(x.float(), k_buf, v_buf, table, seq_lens, page,
                                             scale).to(x.dtype)
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - the profile goes on without dense rows
        print(f"dense_decode: FlashInfer unavailable ({type(e).__name__}: {e}); no dense rows")
        return None
    dev = k_buf.device
    Hq, (Hk, D) = q.shape[1], k_buf.shape[1:]
    indptr, indices, last = paged_indices(req_to_token, rows, seq_lens, page)
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=Hq // Hk >= 4,
        paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last)
    w.plan(indptr, indices, last, Hq, Hk, D, page, q_data_type=q.dtype,
           kv_data_type=k_buf.dtype, sm_scale=scale)
    kc, vc = k_buf.view(-1, page, Hk, D), v_buf.view(-1, page, Hk, D)
    return lambda x: w.run(x, (kc, vc))
