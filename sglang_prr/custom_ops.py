"""The torch custom ops of PRR (``sglang_prr::*``): one op per kernel, with a fake (meta)
implementation. Callers import them through ``sglang_prr.ops``, which adds the compositions that
depend on the DSA method (``methods/``); the methods themselves compose the ops defined here. The
predictor's ops are defined in ``custom_ops_predictor`` and re-exported here.

Every op's default implementation is the pure-torch reference (``reference/``), which runs on
any device; ``sglang_prr.kernels`` registers CUDA implementations of the same ops on SM90 when
they build, through ``torch.library.register_kernel``. Callers never choose: the dispatcher picks
the kernel for CUDA tensors when one is registered and the reference otherwise. Fake
implementations give output shapes without running anything (after the same contract check,
``fake_contracts``), so the ops trace under ``torch.compile`` and record into CUDA graphs like
any aten op, and refuse on the meta device what they refuse elsewhere.

Every op checks its shapes, dtypes and integer arguments on entry (``contracts.py``: no tensor
value is read, so the checks are free and graph-safe) and raises ``ValueError`` naming the bad
argument; what only values could reveal has a defined result (see ``contracts``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import contracts, contracts_infllm
from . import reference as ref
from .fake_contracts import define, fake

_NS = "sglang_prr"
Lists4 = Tuple[Tensor, Tensor, Tensor, Tensor]  # (a_idx, a_cnt, m_idx, m_cnt)


def _op(name: str, mutates_args=()):
    """The op ``sglang_prr::name``; its fake runs its contract too (``fake_contracts``)."""
    return define(_NS, name, mutates_args)


# ----------------------------------------------------------------------------- summaries
@_op("quest_update", mutates_args=("kmin", "kmax"))
def quest_update(kmin: Tensor, kmax: Tensor, k: Tensor, out_loc: Tensor, positions: Tensor,
                 page_size: int, one_per_page: bool = False) -> None:
    """Fold new keys ``k: [N, Hk, D]`` at slots ``out_loc: [N]`` / positions ``[N]`` into the
    per-page ``kmin``/``kmax: [num_pages, Hk, D]`` float32 (in place). ``one_per_page``: no two
    tokens share a page (decode), one launch instead of two."""
    contracts.check_quest_update(kmin, kmax, k, out_loc, positions, page_size)
    ref.quest_update(kmin, kmax, k, out_loc, positions, page_size, one_per_page)


@_op("infllm_update", mutates_args=("ck",))
def infllm_update(ck: Tensor, k_buf: Tensor, req_to_token: Tensor, req_idx: Tensor,
                  out_loc: Tensor, positions: Tensor, page_size: int) -> None:
    """Write compressed keys completed by the new tokens into ``ck: [num_pages, page_size//16,
    Hk, D]`` (in place). See ``reference.infllm_update``."""
    contracts_infllm.check_infllm_update(ck, k_buf, req_to_token, req_idx, out_loc, positions,
                                         page_size)
    ref.infllm_update(ck, k_buf, req_to_token, req_idx, out_loc, positions, page_size)


# ----------------------------------------------------------------------------- selection
@_op("quest_scores")
def quest_scores(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor) -> Tensor:
    """``[B, Hk, NB]`` float32 Quest scores, GQA group summed. See ``reference.quest_scores``."""
    contracts.check_quest_scores(q, kmin, kmax, table, nblk)
    return ref.quest_scores(q, kmin, kmax, table, nblk)


@fake(quest_scores)
def _(q, kmin, kmax, table, nblk):
    return q.new_empty((q.shape[0], kmin.shape[1], table.shape[1]), dtype=torch.float32)


@_op("infllm_scores")
def infllm_scores(q: Tensor, ck: Tensor, table: Tensor, seq_lens: Tensor, page_size: int,
                  sm_scale: float) -> Tensor:
    """``[B, Hk, NB]`` float32 InfLLM-v2 block scores. See ``reference.infllm_scores``."""
    contracts_infllm.check_infllm_scores(q, ck, table, seq_lens, page_size, sm_scale=sm_scale)
    return ref.infllm_scores(q, ck, table, seq_lens, page_size, sm_scale)


@fake(infllm_scores)
def _(q, ck, table, seq_lens, page_size, sm_scale):
    return q.new_empty((q.shape[0], ck.shape[2], table.shape[1]), dtype=torch.float32)


@_op("select_topk")
def select_topk(scores: Tensor, nblk: Tensor, k: int, sink_blocks: int, local_blocks: int,
                n_out: int, dense_row: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Kept blocks + top-k middle blocks: ``(idx [B, Hk, n_out] int32, cnt [B, Hk] int32)``;
    rows with ``dense_row: [B]`` set select every block."""
    contracts.check_select_topk(scores, nblk, k, sink_blocks, local_blocks, n_out, dense_row)
    return ref.select_topk(scores, nblk, k, sink_blocks, local_blocks, n_out, dense_row)


@fake(select_topk)
def _(scores, nblk, k, sink_blocks, local_blocks, n_out, dense_row=None):
    B, Hk, _ = scores.shape
    return (scores.new_empty((B, Hk, n_out), dtype=torch.int32),
            scores.new_empty((B, Hk), dtype=torch.int32))


@_op("set_difference", mutates_args=("stats",))
def _set_difference(a_idx: Tensor, a_cnt: Tensor, p_idx: Tensor, p_cnt: Tensor, nb: int,
                    p_rows: Optional[Tensor], stats: Optional[Tensor],
                    dense_row: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    contracts.check_set_difference(a_idx, a_cnt, p_idx, p_cnt, nb, p_rows, stats, dense_row)
    return ref.set_difference_counted(a_idx, a_cnt, p_idx, p_cnt, nb, p_rows, stats, dense_row)


@fake(_set_difference)
def _(a_idx, a_cnt, p_idx, p_cnt, nb, p_rows, stats, dense_row):
    return torch.empty_like(a_idx), torch.empty_like(a_cnt)


def set_difference(a_idx: Tensor, a_cnt: Tensor, p_idx: Tensor, p_cnt: Tensor, nb: int,
                   p_rows: Optional[Tensor] = None, stats: Optional[Tensor] = None,
                   dense_row: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``M = A \\ P`` as ``(idx [B, Hk, |A| width] int32, cnt [B, Hk] int32)``. ``p_rows: [B]``:
    P is read at those rows of pool-wide lists ``[R, Hk, Np]``; ``stats``: the step's counters
    of A, M and P are added in the same launch (``accumulate_stats``; ``dense_row: [B]`` bool
    rows left out). See ``reference.set_difference_counted``. (A plain function over the op:
    torch 2.11 cannot omit a mutable optional argument of a custom op.)"""
    return _set_difference(a_idx, a_cnt, p_idx, p_cnt, nb, p_rows, stats, dense_row)


@_op("select_lists", mutates_args=("stats",))
def _select_lists(scores: Tensor, nblk: Tensor, p_idx: Optional[Tensor], p_cnt: Optional[Tensor],
                  k: int, sink_blocks: int, local_blocks: int, n_out: int, p_rows: Optional[Tensor],
                  dense_row: Optional[Tensor], stats: Optional[Tensor]) -> Lists4:
    contracts.check_select_lists(scores, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks, n_out,
                                 p_rows, dense_row, stats)
    return ref.select_lists(scores, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks, n_out,
                            p_rows, dense_row, stats)


@fake(_select_lists)
def _(scores, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks, n_out, p_rows, dense_row, stats):
    lists = (scores.shape[:2] + (n_out,), scores.shape[:2]) * 2
    return tuple(scores.new_empty(s, dtype=torch.int32) for s in lists)


def select_lists(scores: Tensor, nblk: Tensor, p_idx: Optional[Tensor], p_cnt: Optional[Tensor],
                 k: int, sink_blocks: int, local_blocks: int, n_out: int,
                 p_rows: Optional[Tensor] = None, dense_row: Optional[Tensor] = None,
                 stats: Optional[Tensor] = None) -> Lists4:
    """``reference.select_lists``: ``select_topk`` + ``set_difference`` in one SM90 launch."""
    return _select_lists(scores, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks, n_out, p_rows,
                         dense_row, stats)


@_op("accumulate_stats", mutates_args=("stats",))
def accumulate_stats(stats: Tensor, a_cnt: Tensor, m_cnt: Tensor, p_cnt: Optional[Tensor],
                     dense_row: Optional[Tensor]) -> None:
    """Add a step's counters into ``stats`` (``contracts.STATS_SLOTS``, int64, in place): sum
    |A|, |M|, |P| (``p_cnt`` None: 0) and rows over the ``[B, Hk]`` rows that are not dense
    rows (``dense_row: [B]`` bool). One launch on SM90 (the fused selections count inside their
    own kernel)."""
    contracts.check_accumulate_stats(stats, a_cnt, m_cnt, p_cnt, dense_row)
    ref.accumulate_stats(stats, a_cnt, m_cnt, p_cnt, dense_row)


@_op("quest_select", mutates_args=("kmin", "kmax", "stats"))
def _quest_select(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor,
                  p_idx: Optional[Tensor], p_cnt: Optional[Tensor], k: int, sink_blocks: int,
                  local_blocks: int, n_out: int, p_rows: Optional[Tensor],
                  dense_row: Optional[Tensor], stats: Optional[Tensor],
                  new_k: Optional[Tensor] = None, new_pos: Optional[Tensor] = None,
                  page_size: int = 0, new_loc: Optional[Tensor] = None
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    contracts.check_quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink_blocks,
                                 local_blocks, n_out, p_rows, dense_row, stats, new_k, new_pos,
                                 page_size, new_loc=new_loc)
    return ref.quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink_blocks,
                            local_blocks, n_out, p_rows, dense_row, stats, new_k, new_pos,
                            page_size, new_loc)


@fake(_quest_select)
def _(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks, n_out, p_rows,
      dense_row, stats, new_k=None, new_pos=None, page_size=0, new_loc=None):
    B, Hk, NB = q.shape[0], kmin.shape[1], table.shape[1]
    lists = [q.new_empty((B, Hk, n_out), dtype=torch.int32),
             q.new_empty((B, Hk), dtype=torch.int32)]
    return (q.new_empty((B, Hk, NB), dtype=torch.float32), *lists,
            torch.empty_like(lists[0]), torch.empty_like(lists[1]))


def quest_select(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor,
                 p_idx: Optional[Tensor], p_cnt: Optional[Tensor], k: int, sink_blocks: int,
                 local_blocks: int, n_out: int, p_rows: Optional[Tensor] = None,
                 dense_row: Optional[Tensor] = None, stats: Optional[Tensor] = None,
                 new_k: Optional[Tensor] = None, new_pos: Optional[Tensor] = None,
                 page_size: int = 0, new_loc: Optional[Tensor] = None
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Quest scores + top-K + ``M = A \\ P`` in one op (one launch on SM90):
    ``(scores [B, Hk, NB] f32, a_idx, a_cnt, m_idx, m_cnt)``; P read from pool rows ``p_rows``,
    dense rows, the statistics counters, and the step's new keys ``new_k [B, Hk, D]`` at
    positions ``new_pos [B]`` folded into their blocks' scores (pages of ``page_size`` tokens).
    With the keys' slots ``new_loc [B]`` the op also writes the folded bounds into kmin/kmax
    (the decode update, ``reference.write_new_keys``); without, the summaries are not written.
    As in ``reference.quest_select``. (A plain function over the op: torch 2.11 cannot omit a
    mutable optional argument of a custom op, so every argument is passed.)"""
    return _quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks,
                         n_out, p_rows, dense_row, stats, new_k, new_pos, page_size, new_loc)


# ----------------------------------------------------------------------------- attention
@_op("sparse_attn_partials")
def sparse_attn_partials(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor,
                         seq_lens: Tensor, idx: Tensor, cnt: Tensor, page_size: int,
                         sm_scale: float, idx_rows: Optional[Tensor] = None
                         ) -> Tuple[Tensor, Tensor]:
    """Per-block partials ``(o [B, Hq, N, D] f32, lse [B, Hq, N] f32)`` over the listed blocks
    (rows ``idx_rows`` of pool-wide lists when given)."""
    contracts.check_sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size,
                                         idx_rows, sm_scale=sm_scale)
    return ref.sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size,
                                    sm_scale, idx_rows)


@fake(sparse_attn_partials)
def _(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale, idx_rows=None):
    B, Hq, D = q.shape
    N = idx.shape[2]
    return (q.new_empty((B, Hq, N, D), dtype=torch.float32),
            q.new_empty((B, Hq, N), dtype=torch.float32))


@_op("prr_merge")
def prr_merge(o_spec: Tensor, lse_spec: Tensor, p_idx: Tensor, p_cnt: Tensor, a_idx: Tensor,
              a_cnt: Tensor, o_rep: Tensor, lse_rep: Tensor, nb: int, exact: bool
              ) -> Tuple[Tensor, Tensor]:
    """Merge speculative partials (only ``P n A`` when exact) with repair partials:
    ``(o [B, Hq, D] f32, lse [B, Hq] f32)``."""
    contracts.check_prr_merge(o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, o_rep, lse_rep, nb,
                              exact)
    return ref.prr_merge(o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, o_rep, lse_rep, nb, exact)


@fake(prr_merge)
def _(o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, o_rep, lse_rep, nb, exact):
    B, Hq, _, D = o_spec.shape
    return (o_spec.new_empty((B, Hq, D), dtype=torch.float32),
            o_spec.new_empty((B, Hq), dtype=torch.float32))


@_op("sparse_attn_merge")
def sparse_attn_merge(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor, seq_lens: Tensor,
                      idx: Tensor, cnt: Tensor, page_size: int, sm_scale: float,
                      o_spec: Optional[Tensor] = None, lse_spec: Optional[Tensor] = None,
                      p_idx: Optional[Tensor] = None, p_cnt: Optional[Tensor] = None,
                      a_idx: Optional[Tensor] = None, a_cnt: Optional[Tensor] = None,
                      nb: int = 0, exact: bool = True, p_rows: Optional[Tensor] = None,
                      out_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """Attention over the listed blocks merged into one state, optionally with speculative
    partials (the PRR repair + merge; one launch on SM90): ``(o [B, Hq, D] out_dtype (default
    f32), lse [B, Hq] f32)``. Without ``o_spec`` (serial DSA) the speculative arguments stay
    unset. See ``reference.sparse_attn_merge``."""
    contracts.check_sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size,
                                      o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, nb, exact,
                                      p_rows, sm_scale=sm_scale)
    return ref.sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale,
                                 o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, nb, exact, p_rows,
                                 out_dtype)


@fake(sparse_attn_merge)
def _(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale, o_spec=None,
      lse_spec=None, p_idx=None, p_cnt=None, a_idx=None, a_cnt=None, nb=0, exact=True,
      p_rows=None, out_dtype=None):
    B, Hq, D = q.shape
    return (q.new_empty((B, Hq, D), dtype=out_dtype or torch.float32),
            q.new_empty((B, Hq), dtype=torch.float32))


@_op("merge_partials")
def merge_partials(o: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor]:
    """Merge all partial states along dim -2: ``(o [..., D] f32, lse [...] f32)``."""
    contracts.check_merge_partials(o, lse)
    return ref.merge_partials(o, lse)


@fake(merge_partials)
def _(o, lse):
    return (o.new_empty(o.shape[:-2] + o.shape[-1:], dtype=torch.float32),
            lse.new_empty(lse.shape[:-1], dtype=torch.float32))


# ----------------------------------------------------------------------------- composites
def attend_set(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor, seq_lens: Tensor,
               idx: Tensor, cnt: Tensor, page_size: int, sm_scale: float) -> Tuple[Tensor, Tensor]:
    """Attention over one block set as a single state ``(o [B, Hq, D], lse [B, Hq])``."""
    return sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale)


# The predictor's ops (custom_ops_predictor), defined there, re-exported with these.
from .custom_ops_predictor import (calib_grid_terms, calibrate, holt_update,  # noqa: E402,F401
                                   predict_set, predict_update, predict_update_rows,
                                   quest_select_predict, select_lists_predict)

# CUDA implementations of the ops above (SM90 kernels, built and loaded on first CUDA use; any
# other device, or a failed build, keeps the reference). Registering builds nothing.
from . import kernels as _kernels  # noqa: E402

_kernels.register()
