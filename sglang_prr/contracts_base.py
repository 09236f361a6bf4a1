"""The building blocks of the ops' input contracts (``contracts``, ``contracts_predictor``,
``contracts_infllm``): one place for the message format and the rules every op shares.

A leaf module (torch only), so that each family's contracts can import it and ``contracts`` can
re-export them all without an import cycle. Like every contract, these read shapes, dtypes,
devices and Python numbers only, never a tensor value: they cost no device work or host
synchronisation and stay valid inside a CUDA-graph capture.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)

# The largest integer argument (a list width, a top-k, a block count, a page size): the kernels
# take them as C++ ``int``, and the reference allocates lists of those widths, so a larger value
# would overflow there or ask the allocator for an impossible size instead of failing by name.
INT_MAX = 2**31 - 1


def fail(op: str, what: str, got, expected: str) -> None:
    raise ValueError(f"{op}: {what} is {got}, expected {expected}")


def shape(t: Tensor):
    return tuple(t.shape)


def _is_int(v) -> bool:
    """A Python ``int`` that is not a ``bool``: ``True`` passed as a count is a caller's slip
    (an argument moved by one position), not the number 1."""
    return isinstance(v, int) and not isinstance(v, bool)


def nonneg(op: str, **ints: int) -> None:
    """Counts, widths and block numbers: integers in ``[0, INT_MAX]``."""
    for name, v in ints.items():
        if not _is_int(v) or not 0 <= v <= INT_MAX:
            fail(op, name, repr(v), "an integer in [0, 2**31 - 1] (the kernels' int32)")


def page_size(op: str, page: int) -> None:
    """Tokens per page: an integer in ``[1, INT_MAX]`` (``0`` divides by zero, a negative size
    gives negative block counts)."""
    if not _is_int(page) or not 0 < page <= INT_MAX:
        fail(op, "page_size", repr(page), "an integer in [1, 2**31 - 1]")


def softmax_scale(op: str, sm_scale) -> None:
    """The softmax scale: a finite real number (an inf or NaN scale makes every logit of the
    batch NaN). ``None``: the caller did not pass it to the check. A symbolic float (traced
    under ``torch.compile``) is left to the real op, which sees the number."""
    if sm_scale is None or isinstance(sm_scale, torch.SymFloat):
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real) \
            or not math.isfinite(sm_scale):
        fail(op, "sm_scale", repr(sm_scale), "a finite number")


def floating(op: str, name: str, t: Tensor) -> None:
    """A tensor of real numbers the op computes with (a weight, an lse, a smoothing factor):
    an integer one would be truncated or overflow where the op writes or casts it."""
    if not t.dtype.is_floating_point:
        fail(op, f"{name}.dtype", t.dtype, "a floating dtype")


def per_batch(op: str, B: int, **ts: Tensor) -> None:
    """Per-request factors (alpha, beta, gamma): exactly ``[B]`` and floating. A wider tensor
    would broadcast against the batch (one request's rows duplicated) instead of failing."""
    for name, t in ts.items():
        if shape(t) != (B,):
            fail(op, f"{name}.shape", shape(t), f"({B},): one value per request")
        floating(op, name, t)


def index_tensor(op: str, name: str, t: Tensor, dims: int) -> None:
    if t.dtype not in _INTS:
        fail(op, f"{name}.dtype", t.dtype, "int32 or int64")
    if t.dim() != dims:
        fail(op, f"{name}.shape", shape(t), f"{dims} dims")


def rows_of(op: str, name: str, rows: Optional[Tensor], batch: int, lists: Tensor) -> None:
    """``lists`` is ``[B, ...]``, or pool-wide ``[R, ...]`` read at ``rows: [B]``."""
    if rows is None:
        if lists.shape[0] != batch:
            fail(op, f"{name}.shape[0]", lists.shape[0], f"the batch size {batch}")
        return
    index_tensor(op, f"{name} rows", rows, 1)
    if rows.shape[0] != batch:
        fail(op, f"{name} rows.shape", shape(rows), f"({batch},)")


def block_list(op: str, name: str, idx: Tensor, cnt: Tensor, heads: int) -> None:
    """``idx: [*, Hk, N]`` int32 with counts ``cnt: [*, Hk]`` int32."""
    pre = f"{name}_" if name else ""  # "p_idx", or the op's own "idx"
    if idx.dtype != torch.int32 or cnt.dtype != torch.int32:
        fail(op, f"{pre}idx/{pre}cnt dtypes", (idx.dtype, cnt.dtype), "int32 lists and counts")
    if idx.dim() != 3 or idx.shape[1] != heads:
        fail(op, f"{pre}idx.shape", shape(idx), f"[rows, {heads}, N]")
    if shape(cnt) != shape(idx)[:2]:
        fail(op, f"{pre}cnt.shape", shape(cnt), f"{shape(idx)[:2]}")


def _batch(op: str, B: int, **ts: Tensor) -> None:
    """Each of ``ts`` is ``[B]`` (or ``[B, ...]``: only the first dim is checked)."""
    for name, t in ts.items():
        if t.dim() == 0 or t.shape[0] != B:
            fail(op, f"{name}.shape", shape(t), f"({B}, ...): the batch size")
