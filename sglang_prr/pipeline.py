"""The PRR decode step of one layer with its two CUDA streams (PRR.md section 7).

```
main stream : [spec attention over P] ---join(A, M)-> [repair over M + merge] -join(P)-> [P := P(t+1)]
side stream :   \\-> [scores, top-K = A, M = A \\ P] -/-> [predictor update, P(t+1)] -/
```

The predictor update and P(t+1) are off the critical path: they run on the side stream while the
main stream repairs and merges, and only the final copy of P(t+1) waits for them. On SM90 each
bracket is one kernel launch (Quest's selection, the predictor step, the repair with its merge).

``PRRStep.run`` has the signature and the results of ``ops.prr_decode``; on CUDA the selection
chain runs on a side stream while the speculative attention runs on the caller's stream, joined
with events (no host synchronisation, capturable inside SGLang's decode CUDA graphs: a forked
stream joined back before the end of capture is legal). On CPU it is ``ops.prr_decode``.

P(t) is read by the speculative pass while the side stream computes P(t+1): the new prediction
is produced into fresh tensors and copied over the caller's ``p_idx``/``p_cnt`` on the main stream
after the join, so the two never race.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops


class PRRStep:
    """Owns the side stream and its events (plan once, run every step)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.side = torch.cuda.Stream(device=self.device)
            self.fork = torch.cuda.Event()
            self.join = torch.cuda.Event()      # A and M are ready
            self.join_p = torch.cuda.Event()    # P(t+1) is ready

    def run(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, summary: Sequence[Tensor],
            table: Tensor, seq_lens: Tensor, p_idx: Tensor, p_cnt: Tensor, level: Tensor,
            trend: Tensor, n_init: Tensor, theta: Tensor, method: str, k: int, n_pred: int,
            sink_blocks: int, local_blocks: int, page_size: int, sm_scale: float,
            exact: bool = True, update_p: bool = True
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """One step; see ``reference.prr_decode``. With ``update_p`` the caller's ``p_idx``/
        ``p_cnt`` are overwritten with P(t+1) (same width) after the step."""
        if not self.cuda:
            out = ops.prr_decode(q, k_buf, v_buf, summary, table, seq_lens, p_idx, p_cnt, level,
                                 trend, n_init, theta, method, k, n_pred, sink_blocks,
                                 local_blocks, page_size, sm_scale, exact)
            if update_p:
                p_idx.copy_(out[5])
                p_cnt.copy_(out[6])
            return out
        nb = table.shape[1]
        main = torch.cuda.current_stream(self.device)
        self.fork.record(main)
        with torch.cuda.stream(self.side):
            self.side.wait_event(self.fork)
            # Scores, A and M = A \ P: one launch for Quest.
            scores, a_idx, a_cnt, m_idx, m_cnt = ops.select_fused(
                method, q, list(summary), table, seq_lens, page_size, sm_scale, k, sink_blocks,
                local_blocks, p_idx, p_cnt)
            self.join.record(self.side)
            # Off the critical path: the Holt update and P(t+1) (one launch) overlap the repair.
            nblk = ops.num_blocks(seq_lens, page_size)
            pn_idx, pn_cnt = ops.predict_update(level, trend, n_init, scores, nblk, theta,
                                                ops.num_blocks(seq_lens + 1, page_size), n_pred,
                                                sink_blocks, local_blocks)
            self.join_p.record(self.side)
        # Reuse: the speculative pass over P runs concurrently with the selection chain.
        o_s, lse_s = ops.sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, p_idx, p_cnt,
                                              page_size, sm_scale)
        main.wait_event(self.join)
        for t in (a_idx, a_cnt, m_idx, m_cnt):
            t.record_stream(main)  # allocated on the side stream, consumed on main
        # Repair over M and the exact merge with the speculative partials: one launch.
        o, _ = ops.sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, m_idx, m_cnt, page_size,
                                     sm_scale, o_s, lse_s, p_idx, p_cnt, a_idx, a_cnt, nb, exact)
        # P(t) must not be overwritten before the side stream's predict has read the state and
        # before the merge above has read P(t): join the side stream back (also required to end
        # a graph capture with every forked stream joined).
        main.wait_event(self.join_p)
        for t in (pn_idx, pn_cnt):
            t.record_stream(main)
        if update_p:
            p_idx.copy_(pn_idx)
            p_cnt.copy_(pn_cnt)
        return o, a_idx, a_cnt, m_idx, m_cnt, pn_idx, pn_cnt


_steps: dict = {}


def prr_step(device: torch.device) -> PRRStep:
    """The shared ``PRRStep`` of a device (one side stream per device is enough: layers run in
    order)."""
    key = str(torch.device(device))
    if key not in _steps:
        _steps[key] = PRRStep(torch.device(device))
    return _steps[key]


def serial_dsa_step(q: Tensor, k_buf: Tensor, v_buf: Tensor, summary: Sequence[Tensor],
                    table: Tensor, seq_lens: Tensor, method: str, k: int, sink_blocks: int,
                    local_blocks: int, page_size: int, sm_scale: float,
                    out: Optional[Tensor] = None) -> Tensor:
    """Serial DSA (the baseline PRR must beat): selection, then attention, on one stream."""
    o = ops.dsa_decode(q, k_buf, v_buf, list(summary), table, seq_lens, method, k, sink_blocks,
                       local_blocks, page_size, sm_scale)[0]
    if out is not None:
        out.copy_(o)
        return out
    return o
