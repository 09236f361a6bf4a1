"""The torch custom ops of PRR's predictor (``sglang_prr::*``, as ``custom_ops``): the Holt
update, P(t+1), the calibration's terms, and the selections whose launch also runs the
predictor's step (``quest_select_predict``, ``select_lists_predict``). ``custom_ops`` re-exports
them beside the other ops; the same rules hold (a fake each, the contracts checked on entry, the
reference by default, SM90 kernels registered by ``sglang_prr.kernels``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import contracts
from . import reference as ref
from .fake_contracts import define, fake

_NS = "sglang_prr"
Lists4 = Tuple[Tensor, Tensor, Tensor, Tensor]  # (a_idx, a_cnt, m_idx, m_cnt)


def _op(name: str, mutates_args=()):
    """The op ``sglang_prr::name``; its fake runs its contract too (``fake_contracts``)."""
    return define(_NS, name, mutates_args)


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


@_op("select_lists_predict",
     mutates_args=("p_idx", "p_cnt", "level", "trend", "n_init", "stats"))
def _select_lists_predict(scores: Tensor, nblk: Tensor, nblk_next: Tensor, p_idx: Tensor,
                          p_cnt: Tensor, p_rows: Tensor, p_next_rows: Tensor, level: Tensor,
                          trend: Tensor, n_init: Tensor, theta: Tensor, rows: Tensor, k: int,
                          n_pred: int, sink_blocks: int, local_blocks: int, n_out: int,
                          dense_row: Optional[Tensor], stats: Optional[Tensor]) -> Lists4:
    contracts.check_select_lists_predict(scores, nblk, nblk_next, p_idx, p_cnt, p_rows,
                                         p_next_rows, level, trend, n_init, theta, rows, k,
                                         n_pred, sink_blocks, local_blocks, n_out, dense_row,
                                         stats)
    return ref.select_lists_predict(scores, nblk, nblk_next, p_idx, p_cnt, p_rows, p_next_rows,
                                    level, trend, n_init, theta, rows, k, n_pred, sink_blocks,
                                    local_blocks, n_out, dense_row, stats)


@fake(_select_lists_predict)
def _(scores, nblk, nblk_next, p_idx, p_cnt, p_rows, p_next_rows, level, trend, n_init, theta,
      rows, k, n_pred, sink_blocks, local_blocks, n_out, dense_row, stats):
    lists = (scores.shape[:2] + (n_out,), scores.shape[:2]) * 2
    return tuple(scores.new_empty(s, dtype=torch.int32) for s in lists)


def select_lists_predict(scores: Tensor, nblk: Tensor, nblk_next: Tensor, p_idx: Tensor,
                         p_cnt: Tensor, p_rows: Tensor, p_next_rows: Tensor, level: Tensor,
                         trend: Tensor, n_init: Tensor, theta: Tensor, rows: Tensor, k: int,
                         n_pred: int, sink_blocks: int, local_blocks: int, n_out: int,
                         dense_row: Optional[Tensor] = None,
                         stats: Optional[Tensor] = None) -> Lists4:
    """``select_lists`` over any method's ``scores [B, Hk, NB]`` (P(t) at rows ``p_rows`` of
    p_idx ``[R', Hk, Np]``) and the predictor's step over the same scores (the Holt update on
    state rows ``rows`` of level / trend ``[R, Hk, NB]``, n_init ``[R]``, theta ``[R, 3]``;
    P(t+1) written at rows ``p_next_rows``) in one op, one launch on SM90, whose predictor CTAs
    run beside the top-K's: ``(a_idx, a_cnt, m_idx, m_cnt)``. As in
    ``reference.select_lists_predict``, which reads P(t) before it writes P(t+1); the launch
    reads and writes side by side, so no row of P may be both read and written by it (the
    decode step's double buffer: rows ``2 r + s % 2`` and ``2 r + 1 - s % 2``), as the state rows
    must be distinct: both except SGLang's padding slot 0, whose state and P no request reads."""
    return _select_lists_predict(scores, nblk, nblk_next, p_idx, p_cnt, p_rows, p_next_rows,
                                 level, trend, n_init, theta, rows, k, n_pred, sink_blocks,
                                 local_blocks, n_out, dense_row, stats)
