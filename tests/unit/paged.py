"""Builders of SGLang-style paged KV scenarios for the op tests (fresh random data per seed)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import torch

from sglang_prr import reference as R


@dataclass
class Paged:
    q: torch.Tensor            # [B, Hq, D]
    k_buf: torch.Tensor        # [num_slots, Hk, D]
    v_buf: torch.Tensor
    req_to_token: torch.Tensor  # [max_reqs, max_ctx] int32
    rows: torch.Tensor         # [B] request slots (req_pool_indices)
    seq_lens: torch.Tensor     # [B]
    page: int
    table: torch.Tensor        # [B, NB]
    sm_scale: float

    @property
    def nblk(self) -> torch.Tensor:
        return R.num_blocks(self.seq_lens, self.page)

    @property
    def nb(self) -> int:
        return self.table.shape[1]

    def quest_summary(self):
        n_pages = self.k_buf.shape[0] // self.page
        Hk, D = self.k_buf.shape[1:]
        kmin = torch.full((n_pages, Hk, D), float("inf"))
        kmax = torch.full((n_pages, Hk, D), float("-inf"))
        for b in range(len(self.seq_lens)):
            L = int(self.seq_lens[b])
            loc = self.req_to_token[int(self.rows[b]), :L]
            R.quest_update(kmin, kmax, self.k_buf[loc.long()], loc, torch.arange(L), self.page)
        return kmin, kmax

    def method_summary(self, m):
        """DSA method ``m``'s summaries (``methods.get(name)``) of every request, one update of
        its whole prefill each, in the layout's dtypes (one layer, on the CPU)."""
        n_pages = self.k_buf.shape[0] // self.page
        Hk, D = self.k_buf.shape[1:]
        summary = [t[0] for t in m.allocate(1, n_pages, Hk, D, self.page, torch.device("cpu"))]
        for b in range(len(self.seq_lens)):
            L = int(self.seq_lens[b])
            loc = self.req_to_token[int(self.rows[b]), :L]
            m.update(summary, self.k_buf[loc.long()], loc, torch.arange(L), self.page,
                     decode=False, key_buffer=self.k_buf, req_to_token=self.req_to_token,
                     token_req_idx=lambda b=b, L=L: torch.full((L,), int(self.rows[b])))
        return summary

    def infllm_summary(self):
        n_pages = self.k_buf.shape[0] // self.page
        Hk, D = self.k_buf.shape[1:]
        ck = torch.zeros(n_pages, self.page // 16, Hk, D)
        for b in range(len(self.seq_lens)):
            L = int(self.seq_lens[b])
            loc = self.req_to_token[int(self.rows[b]), :L]
            R.infllm_update(ck, self.k_buf, self.req_to_token,
                            torch.full((L,), int(self.rows[b])), loc, torch.arange(L), self.page)
        return ck


def make_paged(seed: int, lens: Sequence[int], hk: int = 2, group: int = 4, d: int = 16,
               page: int = 16, max_ctx: int = None, q_scale: float = 3.0,
               dtype=torch.float32) -> Paged:
    """Requests of the given lengths in a shuffled page pool (page 0 stays SGLang's padding page),
    living in request slots 2, 4, ... (slot rows are not the batch order)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    max_ctx = max_ctx or (max(lens) + 2 * page + 7)  # not a multiple of the page on purpose
    per_req = -(-max_ctx // page)
    n_pages = 1 + B * per_req + 3
    perm = torch.randperm(n_pages - 1, generator=g) + 1
    req_to_token = torch.zeros(2 * B + 1, max_ctx, dtype=torch.int32)
    rows = torch.arange(1, B + 1) * 2
    for b in range(B):
        pages = perm[b * per_req:(b + 1) * per_req]
        slots = (pages[:, None] * page + torch.arange(page)).reshape(-1)[:max_ctx]
        req_to_token[int(rows[b])] = slots.to(torch.int32)
    k_buf = torch.randn(n_pages * page, hk, d, generator=g).to(dtype)
    v_buf = torch.randn(n_pages * page, hk, d, generator=g).to(dtype)
    # q scaled up so attention is peaked and the choice of blocks changes the output.
    q = (torch.randn(B, hk * group, d, generator=g) * q_scale).to(dtype)
    seq_lens = torch.tensor(list(lens))
    return Paged(q, k_buf, v_buf, req_to_token, rows, seq_lens, page,
                 R.block_table(req_to_token, rows, page), 1.0 / math.sqrt(d))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp(min=1e-300))


def sets_from_list(idx: torch.Tensor, cnt: torch.Tensor) -> List[List[set]]:
    return [[set(int(v) for v in idx[b, h, :int(cnt[b, h])]) for h in range(idx.shape[1])]
            for b in range(idx.shape[0])]


def list_from_sets(sets: List[List[set]], width: int):
    B, Hk = len(sets), len(sets[0])
    idx = torch.full((B, Hk, width), -1, dtype=torch.int32)
    cnt = torch.zeros(B, Hk, dtype=torch.int32)
    for b in range(B):
        for h in range(Hk):
            s = sorted(sets[b][h])[:width]
            idx[b, h, :len(s)] = torch.tensor(s, dtype=torch.int32)
            cnt[b, h] = len(s)
    return idx, cnt


def score_series(rnd, R_: int, Phi: int, Hk: int, NB: int):
    """Calibration inputs: ``R_`` requests x ``Phi`` sampled queries of Gaussian block scores over
    a growing number of visible blocks (``-inf`` past them): ``(scores [R_, Phi, Hk, NB],
    nblk [R_, Phi])``."""
    scores = torch.full((R_, Phi, Hk, NB), float("-inf"))
    nblk = torch.zeros(R_, Phi, dtype=torch.long)
    for r in range(R_):
        for phi in range(Phi):
            n = min(NB, 5 + phi + r)
            nblk[r, phi] = n
            for h in range(Hk):
                scores[r, phi, h, :n] = torch.tensor([rnd.gauss(0, 2) for _ in range(n)])
    return scores, nblk
