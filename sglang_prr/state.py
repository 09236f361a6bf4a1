"""Per-request PRR state, indexed by SGLang's ``req_pool_idx``, and per-page block summaries.

Rows follow ``ReqToTokenPool``: row 0 is SGLang's padding row (padded CUDA-graph rows read and
write there harmlessly), rows ``1..size`` belong to requests. A row is reset when its slot is
handed to a new request (``ReqToTokenPool.alloc``) and every row after a cache flush
(``ReqToTokenPool.clear``); the reset itself happens at the start of the next prefill forward,
outside any decode step.

Memory: the predictor state is ``O(rows x layers x Hk x NB)`` with ``NB`` the blocks of the
longest context; the block summaries are per KV page (``[num_pages, Hk, D]`` float32 per layer
for Quest's kmin/kmax, ``[num_pages, page//16, Hk, D]`` for InfLLM-v2's compressed keys), so they
scale with the KV pool like the KV itself and are shared by pages shared through the radix cache.
"""

from __future__ import annotations

import weakref
from typing import List, Sequence

import torch

from . import summaries
from .config import PRRConfig
from .step import LayerState

_LISTENERS: "weakref.WeakSet[PRRState]" = weakref.WeakSet()


def summary_bytes_per_token(cfg: PRRConfig, num_layers: int, num_kv_heads: int,
                            head_dim: int) -> int:
    """Bytes of block summaries per KV token over all layers (added to SGLang's KV cell size)."""
    if not cfg.enabled:
        return 0
    return summaries.bytes_per_token(cfg.method, cfg.block_size, num_layers, num_kv_heads,
                                     head_dim)


def state_bytes(cfg: PRRConfig, num_layers: int, num_kv_heads: int, rows: int,
                max_context_len: int) -> int:
    """Bytes of the predictor state for ``rows`` request slots."""
    nb = -(-max_context_len // cfg.block_size)
    n_p = cfg.predicted_blocks + cfg.sink_blocks + cfg.local_blocks
    # level/trend, P double-buffered (two lists and counts), n_init, theta, calibration sums
    per_row = num_layers * (num_kv_heads * (2 * nb * 4 + 2 * (n_p * 4 + 4)) + 8 + 3 * 4
                            + len(cfg.theta_grid) * 4 + 4)
    return rows * per_row


def notify_new_slots(pool, rows: Sequence[int]) -> None:
    for st in list(_LISTENERS):
        if st.pool_ref() is pool:
            st.mark_new(rows)


def notify_clear(pool) -> None:
    for st in list(_LISTENERS):
        if st.pool_ref() is pool:
            st.mark_all()


class PRRState:
    """Predictor state of every request slot for every layer.

    level, trend: ``[L, rows, Hk, NB]`` float32; n_init: ``[L, rows]`` int64 (blocks with
    state); theta: ``[L, rows, 3]`` float32 (alpha, beta, gamma); p_idx/p_cnt: the prediction
    for the next decode step, double-buffered, ``[L, 2 rows, Hk, n_pred + sink + local]`` int32
    and ``[L, 2 rows, Hk]``: the decode step of length s (the decoded token included) reads
    P(t) from row ``2 r + s % 2`` and writes P(t+1) into ``2 r + 1 - s % 2``, which the next
    step reads (``step.p_rows``);
    h_sum/h_cnt: calibration scores accumulated over the chunks of a prefill, ``[L, rows, C]``
    and ``[L, rows]``; shared_theta: ``[L, 3]``, the theta* a new request starts from: the
    default until a request is calibrated, then the theta* last chosen per layer (a request that
    cannot calibrate, e.g. one whose prompt is a radix-cache hit but for its last token, keeps it).
    """

    def __init__(self, cfg: PRRConfig, num_layers: int, num_kv_heads: int, req_pool,
                 device: torch.device):
        self.cfg = cfg
        self.rows = req_pool.req_to_token.shape[0]
        self.nb = -(-req_pool.req_to_token.shape[1] // cfg.block_size)
        L, R, Hk, NB = num_layers, self.rows, num_kv_heads, self.nb
        n_p = cfg.predicted_blocks + cfg.sink_blocks + cfg.local_blocks
        self.level = torch.zeros(L, R, Hk, NB, dtype=torch.float32, device=device)
        self.trend = torch.zeros_like(self.level)
        self.n_init = torch.zeros(L, R, dtype=torch.int64, device=device)
        self.theta = torch.empty(L, R, 3, dtype=torch.float32, device=device)
        self.p_idx = torch.empty(L, 2 * R, Hk, n_p, dtype=torch.int32, device=device)
        self.p_cnt = torch.zeros(L, 2 * R, Hk, dtype=torch.int32, device=device)
        self.h_sum = torch.zeros(L, R, len(cfg.theta_grid), dtype=torch.float32, device=device)
        self.h_cnt = torch.zeros(L, R, dtype=torch.float32, device=device)
        self.default_theta = torch.tensor(cfg.default_theta, dtype=torch.float32, device=device)
        self.shared_theta = self.default_theta.expand(L, 3).clone()
        self.pool_ref = weakref.ref(req_pool)
        self._pending: set = set()
        self._pending_all = True
        _LISTENERS.add(self)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.level, self.trend, self.n_init, self.theta, self.p_idx, self.p_cnt,
            self.h_sum, self.h_cnt, self.shared_theta))

    def layer(self, l: int):
        """Layer ``l``'s state as the decode step reads and writes it, in place (``LayerState``
        views, rows indexed by request slot)."""
        return LayerState(self.p_idx[l], self.p_cnt[l], self.level[l], self.trend[l],
                          self.n_init[l], self.theta[l])

    def mark_new(self, rows: Sequence[int]) -> None:
        self._pending.update(int(r) for r in rows)

    def mark_all(self) -> None:
        self._pending_all = True

    def apply_resets(self) -> List[int]:
        """Reset the rows handed out since the last call (host bookkeeping; call outside
        decode). Returns the rows reset (all rows as ``[-1]`` after a flush)."""
        if self._pending_all:
            self._pending_all = False
            self._pending.clear()
            self._reset(torch.arange(self.rows, device=self.level.device))
            return [-1]
        if not self._pending:
            return []
        rows = sorted(self._pending)
        self._pending.clear()
        self._reset(self._index(rows))
        return rows

    def _index(self, rows: List[int]) -> torch.Tensor:
        """``rows`` as an index tensor on the state's device, copied without waiting for it: a
        copy from pageable host memory (``torch.tensor(rows, device=...)``) synchronises the host
        with the stream, i.e. waits for every launch queued before it, at each prefill that brings
        a new request (the overlap scheduler's next batch waits with it). From pinned memory the
        copy is queued like a kernel, and the caching host allocator keeps the buffer until the
        copy is done."""
        cuda = self.level.device.type == "cuda"
        host = torch.tensor(rows, dtype=torch.long, pin_memory=cuda)
        return host.to(self.level.device, non_blocking=cuda)

    def _reset(self, rows: torch.Tensor) -> None:
        """Reset ``rows`` (a device index tensor) of every tensor. Scalars go in by
        ``index_fill_``: an indexed assignment of a Python number (``t[:, rows] = 0.0``) makes the
        number a host tensor and copies it over, which synchronises like any pageable copy."""
        both = torch.cat([2 * rows, 2 * rows + 1])
        for t, v, r in ((self.level, 0.0, rows), (self.trend, 0.0, rows), (self.n_init, 0, rows),
                        (self.p_idx, -1, both), (self.p_cnt, 0, both), (self.h_sum, 0.0, rows),
                        (self.h_cnt, 0.0, rows)):
            t.index_fill_(1, r, v)
        L = self.theta.shape[0]
        self.theta.index_copy_(1, rows, self.shared_theta.unsqueeze(1).expand(L, rows.numel(), 3))
