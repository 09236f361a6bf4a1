"""Input contracts of the predictor's and the calibration's ops (``holt_update``, ``predict_set``,
``predict_update``, ``predict_update_rows``, ``calib_grid_terms``, ``calibrate``,
``best_theta``): the same rules as ``contracts`` (shapes, dtypes and integer arguments only, never
a value; ``ValueError`` naming the argument), which re-exports them.

The Holt state (level, trend) is float32 wherever an op updates it in place: a state of another
dtype would be written back truncated (an int32 level stays 0), so every op that updates it takes
the same state check (``_holt_state``); the smoothing factors alpha, beta, gamma are floating
and one per request (or per state row, in ``theta``), never broadcast.
"""

from __future__ import annotations

import torch

from .contracts_base import (INT_MAX, block_list, fail, floating, index_tensor, nonneg,
                             per_batch, rows_of, shape)


def _widths(op: str, n_pred: int, sink: int, local: int) -> None:
    """P's width ``n_pred + sink + local``: each an integer >= 0, their sum an int32 too (the
    list the op allocates has that width)."""
    nonneg(op, n_pred=n_pred, sink_blocks=sink, local_blocks=local)
    if n_pred + sink + local > INT_MAX:
        fail(op, "n_pred + sink_blocks + local_blocks", n_pred + sink + local,
             "at most 2**31 - 1 (P's list width, an int32)")


def _holt_state(op, level, trend, rows: str = "batch") -> None:
    if level.dim() != 3 or level.dtype != torch.float32:
        fail(op, "level", (level.dtype, shape(level)), f"float32 [{rows}, num_kv_heads, NB]")
    if shape(trend) != shape(level) or trend.dtype != torch.float32:
        fail(op, "trend", (trend.dtype, shape(trend)), f"float32 {shape(level)}")


def _counts(op, B, **tensors) -> None:
    """Integer tensors of one count per batch entry, ``[B]``."""
    for name, t in tensors.items():
        index_tensor(op, name, t, 1)
        if shape(t) != (B,):
            fail(op, f"{name}.shape", shape(t), f"({B},)")


def check_holt_update(level, trend, n_init, scores, nblk, alpha, beta) -> None:
    op = "holt_update"
    _holt_state(op, level, trend)
    if shape(scores) != shape(level):
        fail(op, "scores.shape", shape(scores), f"{shape(level)}")
    B = level.shape[0]
    _counts(op, B, n_init=n_init, nblk=nblk)
    per_batch(op, B, alpha=alpha, beta=beta)


def check_predict_set(level, trend, gamma, n_init, nblk_next, n_pred, sink, local) -> None:
    op = "predict_set"
    _widths(op, n_pred, sink, local)
    _holt_state(op, level, trend)
    B = level.shape[0]
    _counts(op, B, n_init=n_init, nblk_next=nblk_next)
    per_batch(op, B, gamma=gamma)


def check_predict_update(level, trend, n_init, scores, nblk, theta, nblk_next, n_pred, sink,
                         local) -> None:
    op = "predict_update"
    _widths(op, n_pred, sink, local)
    _holt_state(op, level, trend)
    if shape(scores) != shape(level):
        fail(op, "scores.shape", shape(scores), f"{shape(level)}")
    B = level.shape[0]
    _counts(op, B, n_init=n_init, nblk=nblk, nblk_next=nblk_next)
    if shape(theta) != (B, 3):
        fail(op, "theta.shape", shape(theta), f"({B}, 3): (alpha, beta, gamma) per request")
    floating(op, "theta", theta)


def check_predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, scores, nblk,
                              nblk_next, n_pred, sink, local, p_rows=None,
                              op: str = "predict_update_rows") -> None:
    """The pool's state is updated in place at ``rows``: the same state check as
    ``predict_update`` (float32 level/trend, an integer ``n_init``), and ``theta`` float32 as
    the pool keeps it (the kernel reads it as float32)."""
    _widths(op, n_pred, sink, local)
    _holt_state(op, level, trend, "rows")
    R, Hk, NB = level.shape
    if scores.dim() != 3 or shape(scores)[1:] != (Hk, NB):
        fail(op, "scores.shape", shape(scores), f"[batch, {Hk}, {NB}]")
    B = scores.shape[0]
    _counts(op, B, rows=rows, nblk=nblk, nblk_next=nblk_next)
    index_tensor(op, "n_init", n_init, 1)
    if shape(n_init) != (R,):
        fail(op, "n_init.shape", shape(n_init), f"({R},): one per state row")
    if theta.dtype != torch.float32 or shape(theta) != (R, 3):
        fail(op, "theta", (theta.dtype, shape(theta)),
             f"float32 ({R}, 3): (alpha, beta, gamma) per state row")
    block_list(op, "p", p_idx, p_cnt, Hk)
    # P's rows are the state's rows, or its own (p_rows: e.g. the other half of a double buffer).
    if p_rows is None and p_idx.shape[0] != R:
        fail(op, "p_idx.shape[0]", p_idx.shape[0], f"the state's rows {R} (or give p_rows)")
    if p_idx.shape[2] < n_pred + sink + local:
        fail(op, "p_idx.shape", shape(p_idx), f"[rows, {Hk}, >= {n_pred + sink + local}]")
    if p_rows is not None:
        rows_of(op, "p", p_rows, B, p_idx)


def check_calib_grid_terms(scores, nblk, wa, am, alphas, betas, gammas, n_pred, sink,
                           local) -> None:
    op = "calib_grid_terms"
    _widths(op, n_pred, sink, local)
    if scores.dim() != 4 or scores.dtype != torch.float32:
        fail(op, "scores", f"{scores.dtype} {shape(scores)}", "float32 [R, Phi, Hk, NB]")
    R, Phi, Hk, nb = scores.shape
    index_tensor(op, "nblk", nblk, 2)
    if shape(nblk) != (R, Phi):
        fail(op, "nblk.shape", shape(nblk), f"({R}, {Phi})")
    want = (max(Phi - 1, 0), R, Hk, nb)
    if wa.dtype != torch.float32 or shape(wa) != want:
        fail(op, "wa", f"{wa.dtype} {shape(wa)}", f"float32 {want}")
    if am.dtype != torch.bool or shape(am) != want:
        fail(op, "am", f"{am.dtype} {shape(am)}", f"bool {want}")
    for name, t in (("alphas", alphas), ("betas", betas), ("gammas", gammas)):
        if t.dim() != 1 or t.shape[0] < 1 or t.dtype != torch.float32:
            fail(op, name, f"{t.dtype} {shape(t)}", "float32 [n >= 1]")


def check_calibrate(scores, nblk, k, n_pred, sink, local, alphas, betas, gammas) -> None:
    """``H: [R, C]`` needs C >= 1 candidates: with none, eq 5's argmax has nothing to pick."""
    op = "calibrate"
    nonneg(op, k=k)
    _widths(op, n_pred, sink, local)
    if k + sink + local > INT_MAX:
        fail(op, "k + sink_blocks + local_blocks", k + sink + local,
             "at most 2**31 - 1 (A's list width, an int32)")
    if scores.dim() != 4:
        fail(op, "scores.shape", shape(scores), "[requests, queries, num_kv_heads, NB]")
    index_tensor(op, "nblk", nblk, 2)
    if shape(nblk) != shape(scores)[:2]:
        fail(op, "nblk.shape", shape(nblk), f"{shape(scores)[:2]}")
    for name, t in (("alphas", alphas), ("betas", betas), ("gammas", gammas)):
        if t.dim() != 1:
            fail(op, f"{name}.shape", shape(t), "[C]: one value per candidate")
        floating(op, name, t)
    if not (alphas.shape[0] == betas.shape[0] == gammas.shape[0]):
        fail(op, "candidate counts", (alphas.shape[0], betas.shape[0], gammas.shape[0]),
             "equal: alphas, betas and gammas list the candidates together")
    if alphas.shape[0] < 1:
        fail(op, "alphas.shape", shape(alphas), "[C] with C >= 1 candidates")


def check_best_theta(H) -> None:
    """Eq 5 picks one of ``H: [R, C]``'s C >= 1 candidates per request."""
    op = "best_theta"
    if H.dim() != 2 or H.shape[1] < 1:
        fail(op, "H.shape", shape(H), "[requests, C] with C >= 1 candidates")
    floating(op, "H", H)
