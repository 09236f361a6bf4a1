"""Input contracts of InfLLM-v2's ops (``infllm_scores``, ``infllm_update``): the same rules as
``contracts`` (shapes, dtypes and integer arguments only; ``ValueError`` naming the argument)."""

from __future__ import annotations

import torch

from .config import INFLLM_STRIDE
from .contracts import query, summaries
from .contracts_base import (_FLOATS, _batch, fail, index_tensor, page_size, shape,
                             softmax_scale)


def check_infllm_scores(q, ck, table, seq_lens, page_size_, sm_scale=None) -> None:
    op = "infllm_scores"
    page_size(op, page_size_)
    softmax_scale(op, sm_scale)
    query(op, q)
    summaries(op, q, (ck,), 2)
    if ck.shape[1] != page_size_ // INFLLM_STRIDE:
        fail(op, "ck.shape[1]", ck.shape[1], f"page_size // {INFLLM_STRIDE} = "
             f"{page_size_ // INFLLM_STRIDE}")
    index_tensor(op, "table", table, 2)
    index_tensor(op, "seq_lens", seq_lens, 1)
    _batch(op, q.shape[0], table=table, seq_lens=seq_lens)


def check_infllm_update(ck, k_buf, req_to_token, req_idx, out_loc, positions,
                        page_size_) -> None:
    op = "infllm_update"
    page_size(op, page_size_)
    if k_buf.dim() != 3 or k_buf.dtype not in _FLOATS:
        fail(op, "k_buf", (k_buf.dtype, shape(k_buf)), "float [num_slots, num_kv_heads, head_dim]")
    if (ck.dim() != 4 or ck.dtype not in (torch.float32, torch.bfloat16)
            or shape(ck)[2:] != shape(k_buf)[1:]):
        fail(op, "ck", (ck.dtype, shape(ck)),
             f"float32 or bfloat16 [pages, page_size // {INFLLM_STRIDE}, {k_buf.shape[1]}, "
             f"{k_buf.shape[2]}]")
    if ck.shape[1] != page_size_ // INFLLM_STRIDE:
        fail(op, "ck.shape[1]", ck.shape[1], f"page_size // {INFLLM_STRIDE}")
    index_tensor(op, "req_to_token", req_to_token, 2)
    index_tensor(op, "out_loc", out_loc, 1)  # first: the others' lengths are compared with it
    for name, t in (("req_idx", req_idx), ("out_loc", out_loc), ("positions", positions)):
        index_tensor(op, name, t, 1)
        if t.shape[0] != out_loc.shape[0]:
            fail(op, f"{name}.shape", shape(t), f"({out_loc.shape[0]},): one per new token")
