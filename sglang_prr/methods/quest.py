"""Quest (Tang et al., 2024): per-channel key bounds per page, scores that bound the logits.

Summary of a page: the per-channel minimum and maximum of its keys, ``kmin``/``kmax: [Hk, D]``
bfloat16 rounded outward (the minimum down, the maximum up: the score stays an upper bound of
the logits; ``+inf``/``-inf`` while the page is empty). bf16 halves the bytes the selection
reads and the KV pool gives up, against float32.

Scores: ``sum_d max(q_d kmax_d, q_d kmin_d)``, summed over the GQA group (``ops.quest_scores``).
The selection (scores, top-K, ``M = A \\ P``) is one op (``ops.quest_select``), and PRR's
selection also runs the predictor's step in its epilogue (``ops.quest_select_predict``): one
launch each on SM90. Both fold the step's new keys into the scores of their blocks
(``folds_new_keys``): min/max folds are idempotent, so the scores do not depend on whether the
decode update has written them yet, and the update leaves the critical path. Given the keys'
slots they also write the folded bounds (``writes_new_keys``): the decode update is then the
selection's own stores, a few bytes a row, and no launch of its own.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import custom_ops as ops
from .. import reference as ref
from .base import DSAMethod, NewKeys, Selected, SelectSpec, SummaryTensor

DTYPE = torch.bfloat16


class Quest(DSAMethod):
    name = "quest"
    kernels = True
    fuses_predictor = True
    predictor_place = "selection"
    folds_new_keys = True
    writes_new_keys = True

    def layout(self, page_size: int, num_kv_heads: int, head_dim: int
               ) -> Tuple[SummaryTensor, ...]:
        per_page = (num_kv_heads, head_dim)
        return (SummaryTensor("kmin", per_page, DTYPE, float("inf")),
                SummaryTensor("kmax", per_page, DTYPE, float("-inf")))

    def from_keys(self, k_pages: Tensor) -> List[Tensor]:
        kp = k_pages.float()  # exactly what the updates build from every key of the page
        return [ref.round_bf16(kp.amin(1), down=True), ref.round_bf16(kp.amax(1), down=False)]

    def update(self, summary: Sequence[Tensor], k: Tensor, out_loc: Tensor, positions: Tensor,
               page_size: int, *, decode: bool, key_buffer: Tensor = None,
               req_to_token: Tensor = None, token_req_idx=None) -> None:
        # The keys alone suffice; decode (one token per page) needs one launch instead of two.
        kmin, kmax = summary
        ops.quest_update(kmin, kmax, k, out_loc, positions, page_size, one_per_page=decode)

    def scores(self, q: Tensor, summary: Sequence[Tensor], *, table: Tensor, seq_lens: Tensor,
               page_size: int, sm_scale: float, nblk: Optional[Tensor] = None) -> Tensor:
        nblk = ref.num_blocks(seq_lens, page_size) if nblk is None else nblk
        return ops.quest_scores(q, summary[0], summary[1], table, nblk)

    def select(self, q: Tensor, summary: Sequence[Tensor], *, table: Tensor, seq_lens: Tensor,
               spec: SelectSpec, sm_scale: float, nblk: Optional[Tensor] = None,
               p_idx: Optional[Tensor] = None, p_cnt: Optional[Tensor] = None,
               p_rows: Optional[Tensor] = None, dense_row: Optional[Tensor] = None,
               stats: Optional[Tensor] = None, new_keys: Optional[NewKeys] = None,
               on_scores: Optional[Callable[[Tensor], None]] = None) -> Selected:
        nblk = ref.num_blocks(seq_lens, spec.page_size) if nblk is None else nblk
        sel = Selected(*ops.quest_select(
            q=q, kmin=summary[0], kmax=summary[1], table=table, nblk=nblk, p_idx=p_idx,
            p_cnt=p_cnt, k=spec.k, sink_blocks=spec.sink_blocks, local_blocks=spec.local_blocks,
            n_out=spec.n_out, p_rows=p_rows, dense_row=dense_row, stats=stats,
            **_fold_args(new_keys, spec)))
        if on_scores is not None:  # one launch: its scores exist when it ends
            on_scores(sel.scores)
        return sel

    def select_predict(self, q: Tensor, summary: Sequence[Tensor], *, table: Tensor,
                       seq_lens: Tensor, nblk: Tensor, nblk_next: Tensor, spec: SelectSpec,
                       sm_scale: float, state, rows: Tensor, p_rows: Tensor,
                       p_next_rows: Tensor, n_pred: int, dense_row: Optional[Tensor] = None,
                       stats: Optional[Tensor] = None,
                       new_keys: Optional[NewKeys] = None) -> Selected:
        st = state
        return Selected(*ops.quest_select_predict(
            q=q, kmin=summary[0], kmax=summary[1], table=table, nblk=nblk, nblk_next=nblk_next,
            p_idx=st.p_idx, p_cnt=st.p_cnt, p_rows=p_rows, p_next_rows=p_next_rows,
            level=st.level, trend=st.trend, n_init=st.n_init, theta=st.theta, rows=rows,
            k=spec.k, n_pred=n_pred, sink_blocks=spec.sink_blocks,
            local_blocks=spec.local_blocks, n_out=spec.n_out, dense_row=dense_row, stats=stats,
            **_fold_args(new_keys, spec)))


def _fold_args(new_keys: Optional[NewKeys], spec: SelectSpec) -> dict:
    """The selection ops' new-key arguments (none without new keys; their slots, so that the op
    writes the summaries, where given)."""
    if new_keys is None:
        return {}
    return dict(new_k=new_keys.k, new_pos=new_keys.pos, page_size=spec.page_size,
                new_loc=new_keys.loc)
