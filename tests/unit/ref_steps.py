"""Whole decode steps stated on the reference alone (``sglang_prr.reference``: no dispatching op,
no method, no kernel): serial DSA and PRR of a batch with its own predictor state, over block
scores the caller computes (a method's scores on its reference path).

The product composes the same steps of the dispatching ops (``ops.dsa_decode``,
``ops.prr_decode``, ``step.DecodeStep``); the tests hold them to these. The fp64 oracle of the
single ops, written without the reference, is ``oracle.py``.
"""

from __future__ import annotations

from typing import Tuple

from torch import Tensor

from sglang_prr import reference as ref


def dsa_decode(q: Tensor, k_buf: Tensor, v_buf: Tensor, scores: Tensor, table: Tensor,
               seq_lens: Tensor, k: int, sink: int, local: int, page: int, sm_scale: float
               ) -> Tuple[Tensor, Tensor, Tensor]:
    """Serial DSA: A = kept + top-``k`` blocks of ``scores [B, Hk, NB]``, attention over A.
    Returns ``(o [B, Hq, D] float32, a_idx, a_cnt)``."""
    a_idx, a_cnt = ref.select_topk(scores, ref.num_blocks(seq_lens, page), k, sink, local)
    o, _ = ref.attend_set(q, k_buf, v_buf, table, seq_lens, a_idx, a_cnt, page, sm_scale)
    return o, a_idx, a_cnt


def prr_decode(q: Tensor, k_buf: Tensor, v_buf: Tensor, scores: Tensor, table: Tensor,
               seq_lens: Tensor, p_idx: Tensor, p_cnt: Tensor, level: Tensor, trend: Tensor,
               n_init: Tensor, theta: Tensor, k: int, n_pred: int, sink: int, local: int,
               page: int, sm_scale: float, exact: bool = True):
    """One PRR step over ``scores``: the speculative partials over P, A and ``M = A \\ P``, the
    predictor's step (state updated in place, P(t+1) for ``seq_lens + 1`` tokens), the repair
    over M merged with the partials of ``P n A`` (exact) or of P (union). Returns ``(o, a_idx,
    a_cnt, m_idx, m_cnt, p_next_idx, p_next_cnt)`` as ``ops.prr_decode``."""
    nb = table.shape[1]
    o_s, lse_s = ref.sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, p_idx, p_cnt, page,
                                          sm_scale)
    nblk = ref.num_blocks(seq_lens, page)
    _, a_idx, a_cnt, m_idx, m_cnt = ref.select_from_scores(scores, nblk, nb, p_idx, p_cnt, k,
                                                           sink, local, k + sink + local)
    pn_idx, pn_cnt = ref.predict_update(level, trend, n_init, scores, nblk, theta,
                                        ref.num_blocks(seq_lens + 1, page), n_pred, sink, local)
    o, _ = ref.sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, m_idx, m_cnt, page, sm_scale,
                                 o_s, lse_s, p_idx, p_cnt, a_idx, a_cnt, nb, exact)
    return o, a_idx, a_cnt, m_idx, m_cnt, pn_idx, pn_cnt
