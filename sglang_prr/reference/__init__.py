"""Pure-torch reference of every PRR operation: the CPU path and the oracle for the kernels.

A leaf: it imports torch and ``config`` only, never the ops, the methods or the kernels, so the
oracle and the product share no code path above it. One module per op family (``paging``,
``quest``, ``infllm_v2``, ``selection``, ``predictor``, ``calibration``, ``attention``); the
names are re-exported here (``from sglang_prr import reference as ref; ref.quest_scores(...)``).
The compositions of a whole decode step live above the ops (``ops.dsa_decode``,
``ops.prr_decode``, ``step.DecodeStep``) and, stated on the reference alone, in the tests
(``tests/unit/ref_steps.py``).

Conventions (shared with the kernels and the SGLang backend):

* Paged KV, addressed SGLang's way. ``k_buf``/``v_buf`` are one layer's ``[num_slots, Hk, D]``
  buffers; one PRR block is one KV page of ``page_size`` slots, so block ``j`` of request ``b``
  lives in page ``block_table[b, j] = req_to_token[req_pool_indices[b], j * page_size] //
  page_size`` and token ``j * page_size + t`` in slot ``page * page_size + t``.
* Page 0 is SGLang's padding page (slot 0 absorbs the KV writes of padded rows). Summary writes
  that must go nowhere are sent there, so a request never owns page 0.
* Block sets are static-shape lists ``idx: [B, Hk, N] int32`` of request-local block ids (an id
  listed twice counts once: a repeat is padding), sorted ascending, padded with -1, with
  device-side counts ``cnt: [B, Hk] int32``. Nothing here reads a tensor value on the host:
  every function is graph-safe.
* Scores are ``[B, Hk, NB] float32`` with ``-inf`` for blocks a request does not have.
* GQA: query head ``h`` belongs to KV head ``h // G`` (``G = Hq // Hk``); the scores of a group
  are summed, so one block set serves every query head of the group and each K/V load is shared.
* Partial attention states are ``(o, lse)`` with ``lse`` the natural-log sum of exp of the scaled
  logits; an empty state is ``(0, -inf)``, the identity of the merge (eq 6 in log-sum-exp form).
"""

from __future__ import annotations

from .attention import (attend_set, dense_attention, merge_partials, merge_state, prr_merge,
                        sparse_attn_merge, sparse_attn_partials)
from .calibration import best_theta, calib_grid_terms, calibrate, middle_topk_mask, weighted_hit
from .infllm_v2 import infllm_scores, infllm_update
from .paging import (NEG_INF, block_table, expand_heads, kept_mask, list_isin, list_to_mask,
                     in_pool, mask_to_list, num_blocks, repeated_entries, set_difference)
from .predictor import (holt_predict, holt_update, predict_set, predict_update, predict_update_rows,
                        select_lists_predict)
from .quest import quest_scores, quest_select, quest_select_predict, quest_update, round_bf16
from .selection import (accumulate_stats, select_from_scores, select_lists, select_topk,
                        set_difference_counted)

__all__ = [
    "attend_set", "dense_attention", "merge_partials", "merge_state", "prr_merge",
    "sparse_attn_merge", "sparse_attn_partials",
    "best_theta", "calib_grid_terms", "calibrate", "middle_topk_mask", "weighted_hit",
    "infllm_scores", "infllm_update",
    "NEG_INF", "block_table", "expand_heads", "kept_mask", "list_isin", "list_to_mask",
    "in_pool", "mask_to_list", "num_blocks", "repeated_entries", "set_difference",
    "holt_predict", "holt_update", "predict_set", "predict_update", "predict_update_rows",
    "select_lists_predict",
    "quest_scores", "quest_select", "quest_select_predict", "quest_update", "round_bf16",
    "accumulate_stats", "select_from_scores", "select_lists", "select_topk",
    "set_difference_counted",
]
