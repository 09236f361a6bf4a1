"""CUDA implementations of the InfLLM-v2 ops (``infllm_update``, ``infllm_scores``).

Kernels in ``infllm_kernels.cu`` (torch ops ``sglang_prr_cuda.infllm_*`` registered by
``infllm_binding.cpp``, built into the same library as the other kernels). As for the other ops,
the choice between kernel and reference is made from shapes, dtypes, strides, alignment and
device properties only, so it is static within a CUDA graph; anything the kernels do not cover
runs ``sglang_prr.reference``.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from .. import contracts_infllm
from .. import reference as ref
from ..config import INFLLM_STRIDE
from .limits import INFLLM_MAX_GROUP
from .loader import FLOAT_TYPES, active, aligned

# Head dims the scores kernel is instantiated for (its largest GQA group is kernel_limits.h's).
INFLLM_HEAD_DIMS = (64, 128, 256)
# The compressed keys' dtypes the kernels read and write.
CK_TYPES = (torch.float32, torch.bfloat16)
# The pooling pass keeps a block range's probabilities in 48 KiB of shared memory.
INFLLM_MAX_PAGE = 16 * 12 * 1024


def _page_ok(ck, page_size: int) -> bool:
    return (INFLLM_STRIDE <= page_size <= INFLLM_MAX_PAGE and page_size % INFLLM_STRIDE == 0
            and ck.dim() == 4 and ck.shape[1] == page_size // INFLLM_STRIDE)


def _infllm_update(ck, k_buf, req_to_token, req_idx, out_loc, positions, page_size):
    contracts_infllm.check_infllm_update(ck, k_buf, req_to_token, req_idx, out_loc, positions, page_size)
    ok = (active(ck.device) and _page_ok(ck, page_size) and ck.dtype in CK_TYPES
          and ck.is_contiguous() and aligned(ck) and k_buf.dim() == 3
          and k_buf.dtype in FLOAT_TYPES and k_buf.stride(-1) == 1
          and tuple(k_buf.shape[1:]) == tuple(ck.shape[2:]) and ck.shape[3] % 8 == 0
          and k_buf.stride(0) % 8 == 0 and k_buf.stride(1) % 8 == 0 and aligned(k_buf)
          and req_to_token.dim() == 2 and req_to_token.stride(-1) == 1
          and all(t.dtype in (torch.int32, torch.int64)
                  for t in (req_to_token, req_idx, out_loc, positions)))
    if not ok:
        ref.infllm_update(ck, k_buf, req_to_token, req_idx, out_loc, positions, page_size)
        return
    torch.ops.sglang_prr_cuda.infllm_update(ck, k_buf, req_to_token, req_idx, out_loc,
                                            positions, page_size)


def _infllm_scores(q, ck, table, seq_lens, page_size, sm_scale):
    contracts_infllm.check_infllm_scores(q, ck, table, seq_lens, page_size, sm_scale=sm_scale)
    B, Hq, D = q.shape
    Hk = ck.shape[2] if ck.dim() == 4 else 0
    ok = (active(q.device) and _page_ok(ck, page_size) and ck.dtype in CK_TYPES
          and ck.is_contiguous() and aligned(ck) and D in INFLLM_HEAD_DIMS and ck.shape[3] == D
          and Hk > 0 and Hq % Hk == 0 and Hq // Hk <= INFLLM_MAX_GROUP
          and q.dtype in FLOAT_TYPES and (not q.is_contiguous() or aligned(q))
          and table.dim() == 2 and table.shape[0] == B
          and table.stride(-1) == 1 and table.dtype in (torch.int32, torch.int64)
          and seq_lens.dtype in (torch.int32, torch.int64))
    if not ok:
        return ref.infllm_scores(q, ck, table, seq_lens, page_size, sm_scale)
    return torch.ops.sglang_prr_cuda.infllm_scores(q, ck, table, seq_lens, page_size,
                                                   float(sm_scale))


IMPLS: Dict[str, Callable] = {
    "infllm_update": _infllm_update,
    "infllm_scores": _infllm_scores,
}
