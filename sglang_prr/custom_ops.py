"""The torch custom ops of PRR (``sglang_prr::*``): one op per kernel, with a fake (meta)
implementation. Callers import them through ``sglang_prr.ops``, which adds the compositions that
depend on the DSA method (``methods/``); the methods themselves compose the ops defined here.

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


# ----------------------------------------------------------------------------- predictor
@_op("holt_update", mutates_args=("level", "trend", "n_init"))
def holt_update(level: Tensor, trend: Tensor, n_init: Tensor, scores: Tensor, nblk: Tensor,
                alpha: Tensor, beta: Tensor) -> None:
    """Eq 3 in place on ``level``/``trend: [B, Hk, NB]`` and ``n_init: [B]``."""
    contracts.check_holt_update(level, trend, n_init, scores, nblk, alpha, beta)
    ref.holt_update(level, trend, n_init, scores, nblk, alpha, beta)


@_op("predict_set")
def predict_set(level: Tensor, trend: Tensor, gamma: Tensor, n_init: Tensor, nblk_next: Tensor,
                n_pred: int, sink_blocks: int, local_blocks: int) -> Tuple[Tensor, Tensor]:
    """P(t+1) from eq 2: ``(idx [B, Hk, n_pred + sink + local] int32, cnt [B, Hk] int32)``."""
    contracts.check_predict_set(level, trend, gamma, n_init, nblk_next, n_pred, sink_blocks,
                                local_blocks)
    return ref.predict_set(level, trend, gamma, n_init, nblk_next, n_pred, sink_blocks,
                           local_blocks)


@fake(predict_set)
def _(level, trend, gamma, n_init, nblk_next, n_pred, sink_blocks, local_blocks):
    B, Hk, _ = level.shape
    n = n_pred + sink_blocks + local_blocks
    return (level.new_empty((B, Hk, n), dtype=torch.int32),
            level.new_empty((B, Hk), dtype=torch.int32))


# ----------------------------------------------------------------------------- calibration
@_op("calib_grid_terms")
def calib_grid_terms(scores: Tensor, nblk: Tensor, wa: Tensor, am: Tensor, alphas: Tensor,
                     betas: Tensor, gammas: Tensor, n_pred: int, sink_blocks: int,
                     local_blocks: int) -> Tensor:
    """Eq 4's row term of every candidate of the grid ``alphas x betas x gammas`` for sampled
    queries 1..Phi-1: ``[Phi-1, R, A*B*G, Hk]`` float32 from scores ``[R, Phi, Hk, NB]``, nblk
    ``[R, Phi]``, the weights ``wa`` and mask ``am`` of A's middle blocks ``[Phi-1, R, Hk, NB]``.
    See ``reference.calib_grid_terms``; ``calibration.grid_hit_rates`` is the caller."""
    contracts.check_calib_grid_terms(scores, nblk, wa, am, alphas, betas, gammas, n_pred,
                                     sink_blocks, local_blocks)
    return ref.calib_grid_terms(scores, nblk, wa, am, alphas, betas, gammas, n_pred,
                                sink_blocks, local_blocks)


@fake(calib_grid_terms)
def _(scores, nblk, wa, am, alphas, betas, gammas, n_pred, sink_blocks, local_blocks):
    R, Phi, Hk, _ = scores.shape
    C = alphas.shape[0] * betas.shape[0] * gammas.shape[0]
    return scores.new_empty((max(Phi - 1, 0), R, C, Hk), dtype=torch.float32)


@_op("predict_update", mutates_args=("level", "trend", "n_init"))
def predict_update(level: Tensor, trend: Tensor, n_init: Tensor, scores: Tensor, nblk: Tensor,
                   theta: Tensor, nblk_next: Tensor, n_pred: int, sink_blocks: int,
                   local_blocks: int) -> Tuple[Tensor, Tensor]:
    """Holt update (eq 3, in place) + P(t+1) in one op (one launch on SM90); theta ``[B, 3]``.
    See ``reference.predict_update``."""
    contracts.check_predict_update(level, trend, n_init, scores, nblk, theta, nblk_next, n_pred,
                                   sink_blocks, local_blocks)
    return ref.predict_update(level, trend, n_init, scores, nblk, theta, nblk_next, n_pred,
                              sink_blocks, local_blocks)


@fake(predict_update)
def _(level, trend, n_init, scores, nblk, theta, nblk_next, n_pred, sink_blocks, local_blocks):
    B, Hk, _ = level.shape
    n = n_pred + sink_blocks + local_blocks
    return (level.new_empty((B, Hk, n), dtype=torch.int32),
            level.new_empty((B, Hk), dtype=torch.int32))


@_op("predict_update_rows", mutates_args=("level", "trend", "n_init", "p_idx", "p_cnt"))
def predict_update_rows(level: Tensor, trend: Tensor, n_init: Tensor, p_idx: Tensor,
                        p_cnt: Tensor, theta: Tensor, rows: Tensor, scores: Tensor, nblk: Tensor,
                        nblk_next: Tensor, n_pred: int, sink_blocks: int,
                        local_blocks: int, p_rows: Optional[Tensor] = None) -> None:
    """``predict_update`` on the request pool's state in place (one launch on SM90, no gather or
    scatter): batch entry ``b`` updates pool row ``rows[b]`` and writes P(t+1) into row
    ``p_rows[b]`` of p_idx/p_cnt (default ``rows[b]``). See ``reference.predict_update_rows``."""
    contracts.check_predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, scores,
                                        nblk, nblk_next, n_pred, sink_blocks, local_blocks,
                                        p_rows)
    ref.predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, scores, nblk,
                            nblk_next, n_pred, sink_blocks, local_blocks, p_rows)


@_op("quest_select_predict",
     mutates_args=("kmin", "kmax", "p_idx", "p_cnt", "level", "trend", "n_init", "stats"))
def _quest_select_predict(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor,
                          nblk_next: Tensor, p_idx: Tensor, p_cnt: Tensor, p_rows: Tensor,
                          p_next_rows: Tensor, level: Tensor, trend: Tensor, n_init: Tensor,
                          theta: Tensor, rows: Tensor, k: int, n_pred: int, sink_blocks: int,
                          local_blocks: int, n_out: int, dense_row: Optional[Tensor],
                          stats: Optional[Tensor], new_k: Optional[Tensor] = None,
                          new_pos: Optional[Tensor] = None, page_size: int = 0,
                          new_loc: Optional[Tensor] = None
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    contracts.check_quest_select_predict(q, kmin, kmax, table, nblk, nblk_next, p_idx, p_cnt,
                                         p_rows, p_next_rows, level, trend, n_init, theta, rows,
                                         k, n_pred, sink_blocks, local_blocks, n_out, dense_row,
                                         stats, new_k, new_pos, page_size, new_loc)
    return ref.quest_select_predict(q, kmin, kmax, table, nblk, nblk_next, p_idx, p_cnt, p_rows,
                                    p_next_rows, level, trend, n_init, theta, rows, k, n_pred,
                                    sink_blocks, local_blocks, n_out, dense_row, stats, new_k,
                                    new_pos, page_size, new_loc)


@fake(_quest_select_predict)
def _(q, kmin, kmax, table, nblk, nblk_next, p_idx, p_cnt, p_rows, p_next_rows, level, trend,
      n_init, theta, rows, k, n_pred, sink_blocks, local_blocks, n_out, dense_row, stats,
      new_k=None, new_pos=None, page_size=0, new_loc=None):
    B, Hk, NB = q.shape[0], kmin.shape[1], table.shape[1]
    lists = [q.new_empty((B, Hk, n_out), dtype=torch.int32),
             q.new_empty((B, Hk), dtype=torch.int32)]
    return (q.new_empty((B, Hk, NB), dtype=torch.float32), *lists,
            torch.empty_like(lists[0]), torch.empty_like(lists[1]))


def quest_select_predict(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor,
                         nblk_next: Tensor, p_idx: Tensor, p_cnt: Tensor, p_rows: Tensor,
                         p_next_rows: Tensor, level: Tensor, trend: Tensor, n_init: Tensor,
                         theta: Tensor, rows: Tensor, k: int, n_pred: int, sink_blocks: int,
                         local_blocks: int, n_out: int, dense_row: Optional[Tensor] = None,
                         stats: Optional[Tensor] = None, new_k: Optional[Tensor] = None,
                         new_pos: Optional[Tensor] = None, page_size: int = 0,
                         new_loc: Optional[Tensor] = None
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Quest selection and the predictor's step of one decode step in one op (one launch on
    SM90): ``(scores [B, Hk, NB] f32, a_idx, a_cnt, m_idx, m_cnt)`` with M = A \\ P(t), P(t) at
    rows ``p_rows`` of p_idx ``[R', Hk, Np]``; the Holt update on state rows ``rows`` of level /
    trend ``[R, Hk, NB]``, n_init ``[R]``, theta ``[R, 3]``; P(t+1) written at rows
    ``p_next_rows``; new keys (and their write, with ``new_loc``) as in ``quest_select``. See
    ``reference.quest_select_predict``."""
    return _quest_select_predict(q, kmin, kmax, table, nblk, nblk_next, p_idx, p_cnt, p_rows,
                                 p_next_rows, level, trend, n_init, theta, rows, k, n_pred,
                                 sink_blocks, local_blocks, n_out, dense_row, stats, new_k,
                                 new_pos, page_size, new_loc)


@_op("calibrate")
def calibrate(scores: Tensor, nblk: Tensor, k: int, n_pred: int, sink_blocks: int,
              local_blocks: int, alphas: Tensor, betas: Tensor, gammas: Tensor) -> Tensor:
    """Eq 4 for every candidate: ``H: [R, C]`` float32. See ``reference.calibrate``."""
    contracts.check_calibrate(scores, nblk, k, n_pred, sink_blocks, local_blocks, alphas, betas,
                              gammas)
    return ref.calibrate(scores, nblk, k, n_pred, sink_blocks, local_blocks, alphas, betas, gammas)


@fake(calibrate)
def _(scores, nblk, k, n_pred, sink_blocks, local_blocks, alphas, betas, gammas):
    return scores.new_empty((scores.shape[0], alphas.shape[0]), dtype=torch.float32)


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


# CUDA implementations of the ops above (SM90 kernels, built and loaded on first CUDA use; any
# other device, or a failed build, keeps the reference). Registering builds nothing.
from . import kernels as _kernels  # noqa: E402

_kernels.register()
