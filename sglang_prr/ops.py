"""Public PRR ops: what callers import.

* The torch custom ops (``custom_ops``: one op per kernel, a fake implementation each, the
  contracts checked at the boundary; SM90 kernels on CUDA, the pure-torch reference elsewhere),
  re-exported under their names.
* The compositions that depend on the DSA method, through the registry (``methods``): a
  method's block scores (``select_blocks``) and selection (``select_fused``), and the serial
  DSA and PRR decode steps of a batch with its own predictor state (``dsa_decode``,
  ``prr_decode``: the demo's and the tests' path; the server's step is ``step.DecodeStep``).

Nothing here branches on a method's name. The reference (``sglang_prr.reference``) states every
op on its own; the compositions here run the dispatching ops, so on CUDA they run the kernels.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from torch import Tensor

from . import contracts, methods
from . import reference as ref
from .custom_ops import (attend_set, calib_grid_terms, calibrate, holt_update, infllm_scores,
                         infllm_update, merge_partials, predict_set, predict_update,
                         predict_update_rows, prr_merge, quest_scores, quest_select,
                         quest_select_predict, quest_update, select_lists,
                         select_lists_predict, select_topk, set_difference, sparse_attn_merge,
                         sparse_attn_partials)
from .methods import Selected, SelectSpec

__all__ = [
    # the custom ops (custom_ops.py)
    "attend_set", "calib_grid_terms", "calibrate", "holt_update", "infllm_scores",
    "infllm_update", "merge_partials", "predict_set", "predict_update", "predict_update_rows",
    "prr_merge", "quest_scores", "quest_select", "quest_select_predict", "quest_update",
    "select_lists", "select_lists_predict", "select_topk", "set_difference",
    "sparse_attn_merge", "sparse_attn_partials",
    # paging helpers of the reference (no op: index arithmetic)
    "num_blocks", "best_theta", "block_table",
    # the compositions through the methods' registry
    "select_blocks", "select_fused", "dsa_decode", "prr_decode",
]


def num_blocks(seq_lens: Tensor, page_size: int) -> Tensor:
    """``reference.num_blocks`` (``ceil(seq_lens / page_size)``, ``[B]`` int64) with the page
    size checked: 0 would divide by zero and a negative size give negative counts."""
    contracts.page_size("num_blocks", page_size)
    return ref.num_blocks(seq_lens, page_size)


def block_table(req_to_token: Tensor, req_pool_indices: Tensor, page_size: int) -> Tensor:
    """``reference.block_table`` (``[B, NB]`` page ids) with the page size checked, which is
    its slice step: 0 or a negative step fails there without naming ``page_size``."""
    contracts.page_size("block_table", page_size)
    return ref.block_table(req_to_token, req_pool_indices, page_size)


def best_theta(H: Tensor) -> Tensor:
    """``reference.best_theta`` (eq 5: the best candidate ``[R]`` of ``H: [R, C]``) with ``H``
    checked: at least one candidate to pick."""
    contracts.check_best_theta(H)
    return ref.best_theta(H)


def _method(op: str, method: str, summary: Sequence[Tensor], page_size: int, sm_scale: float):
    """The registered ``method``, after the checks of what a composition passes on to it: the
    page size and the softmax scale, and one summary tensor per entry of the method's layout
    (a missing one would fail as an IndexError inside the method, an extra one be ignored)."""
    contracts.page_size(op, page_size)
    contracts.softmax_scale(op, sm_scale)
    m = methods.get(method)
    contracts.summary_count(op, m.name, summary, m.layout(page_size, 1, 1))  # the count only
    return m


def select_blocks(method: str, q: Tensor, summary: Sequence[Tensor], table: Tensor,
                  seq_lens: Tensor, page_size: int, sm_scale: float) -> Tensor:
    """Block scores ``[B, Hk, NB]`` float32 of ``method`` (``DSAMethod.scores``) for the queries
    ``q: [B, Hq, D]``, from one layer's ``summary`` (the method's tensors, e.g. Quest's
    ``(kmin, kmax)``)."""
    summary = list(summary)
    m = _method("select_blocks", method, summary, page_size, sm_scale)
    return m.scores(q, summary, table=table, seq_lens=seq_lens, page_size=page_size,
                    sm_scale=sm_scale)


def select_fused(method: str, q: Tensor, summary: Sequence[Tensor], table: Tensor,
                 seq_lens: Tensor, page_size: int, sm_scale: float, k: int, sink_blocks: int,
                 local_blocks: int, p_idx: Optional[Tensor] = None,
                 p_cnt: Optional[Tensor] = None, *, nblk: Optional[Tensor] = None,
                 n_out: Optional[int] = None, p_rows: Optional[Tensor] = None,
                 dense_row: Optional[Tensor] = None, stats: Optional[Tensor] = None
                 ) -> Selected:
    """Selection of one decode step (``DSAMethod.select``): ``(scores, a_idx, a_cnt, m_idx,
    m_cnt)`` with ``M = A \\ P`` (``M = A`` without P); lists of width ``n_out`` (default
    ``k + sink + local``). ``nblk`` defaults to ``ceil(seq_lens / page_size)``; ``p_rows``,
    ``dense_row``, ``stats`` as in ``methods.select_from_scores``. Quest: one op; InfLLM-v2:
    its scores, then ``select_lists`` (top-K, set difference and counters)."""
    spec = SelectSpec.of(k, sink_blocks, local_blocks, page_size, n_out)
    summary = list(summary)
    m = _method("select_fused", method, summary, page_size, sm_scale)
    return m.select(q, summary, table=table, seq_lens=seq_lens, spec=spec, sm_scale=sm_scale,
                    nblk=nblk, p_idx=p_idx, p_cnt=p_cnt, p_rows=p_rows, dense_row=dense_row,
                    stats=stats)


def dsa_decode(q: Tensor, k_buf: Tensor, v_buf: Tensor, summary: Sequence[Tensor], table: Tensor,
               seq_lens: Tensor, method: str, k: int, sink_blocks: int, local_blocks: int,
               page_size: int, sm_scale: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Serial DSA decode step: score, select A, attend over A. q ``[B, Hq, D]``; k_buf/v_buf
    ``[slots, Hk, D]``; table ``[B, NB]``; seq_lens ``[B]``. Returns ``(o [B, Hq, D] float32,
    scores [B, Hk, NB], a_idx, a_cnt)``."""
    sel = select_fused(method, q, summary, table, seq_lens, page_size, sm_scale, k, sink_blocks,
                       local_blocks)
    o, _ = attend_set(q, k_buf, v_buf, table, seq_lens, sel.a_idx, sel.a_cnt, page_size,
                      sm_scale)
    return o, sel.scores, sel.a_idx, sel.a_cnt


def prr_decode(q: Tensor, k_buf: Tensor, v_buf: Tensor, summary: Sequence[Tensor], table: Tensor,
               seq_lens: Tensor, p_idx: Tensor, p_cnt: Tensor, level: Tensor, trend: Tensor,
               n_init: Tensor, theta: Tensor, method: str, k: int, n_pred: int, sink_blocks: int,
               local_blocks: int, page_size: int, sm_scale: float, exact: bool = True
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One PRR decode step (predict -> speculative attention -> selection -> repair -> merge) of
    a batch whose predictor state is its own (rows = batch entries).

    p_idx/p_cnt ``[B, Hk, Np]`` / ``[B, Hk]``: this step's prediction P (any set: the output does
    not depend on it in exact mode); level/trend ``[B, Hk, NB]``, n_init ``[B]``: the predictor
    state, updated in place; theta ``[B, 3]`` (alpha, beta, gamma). Returns ``(o, a_idx, a_cnt,
    m_idx, m_cnt, p_next_idx, p_next_cnt)``, P(t+1) predicted for ``seq_lens + 1`` tokens."""
    summary = list(summary)
    # The method's checks (select_fused runs them too) before the speculative pass's work.
    _method("prr_decode", method, summary, page_size, sm_scale)
    # Reuse: the speculative pass over P (beside the selection, on a second stream, in the
    # server's step).
    o_s, lse_s = sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, p_idx, p_cnt, page_size,
                                      sm_scale)
    # Selection with M = A \ P, then the predictor's step and P(t+1), off the critical path.
    sel = select_fused(method, q, summary, table, seq_lens, page_size, sm_scale, k, sink_blocks,
                       local_blocks, p_idx, p_cnt)
    pn_idx, pn_cnt = predict_update(level, trend, n_init, sel.scores,
                                    num_blocks(seq_lens, page_size), theta,
                                    num_blocks(seq_lens + 1, page_size), n_pred, sink_blocks,
                                    local_blocks)
    # Repair over M = A \ P merged with the speculative partials (exact: only P n A of them).
    o, _ = sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, sel.m_idx, sel.m_cnt, page_size,
                             sm_scale, o_spec=o_s, lse_spec=lse_s, p_idx=p_idx, p_cnt=p_cnt,
                             a_idx=sel.a_idx, a_cnt=sel.a_cnt, nb=table.shape[1], exact=exact)
    return o, sel.a_idx, sel.a_cnt, sel.m_idx, sel.m_cnt, pn_idx, pn_cnt
