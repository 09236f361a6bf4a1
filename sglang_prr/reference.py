"""Pure-torch reference of every PRR operation: the CPU path and the oracle for the kernels.

Conventions (shared with the kernels and the SGLang backend):

* Paged KV, addressed SGLang's way. ``k_buf``/``v_buf`` are one layer's ``[num_slots, Hk, D]``
  buffers; one PRR block is one KV page of ``page_size`` slots, so block ``j`` of request ``b``
  lives in page ``block_table[b, j] = req_to_token[req_pool_indices[b], j * page_size] //
  page_size`` and token ``j * page_size + t`` in slot ``page * page_size + t``.
* Page 0 is SGLang's padding page (slot 0 absorbs the KV writes of padded rows). Summary writes
  that must go nowhere are sent there, so a request never owns page 0.
* Block sets are static-shape lists ``idx: [B, Hk, N] int32`` of request-local block ids (an id
  listed twice counts once: a repeat is padding), sorted
  ascending, padded with -1, with device-side counts ``cnt: [B, Hk] int32``. Nothing here reads a
  tensor value on the host: every function is graph-safe.
* Scores are ``[B, Hk, NB] float32`` with ``-inf`` for blocks a request does not have.
* GQA: query head ``h`` belongs to KV head ``h // G`` (``G = Hq // Hk``); the scores of a group
  are summed, so one block set serves every query head of the group and each K/V load is shared.
* Partial attention states are ``(o, lse)`` with ``lse`` the natural-log sum of exp of the scaled
  logits; an empty state is ``(0, -inf)``, the identity of the merge (eq 6 in log-sum-exp form).
"""

from __future__ import annotations

import sys
import warnings
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .config import INFLLM_STRIDE, INFLLM_WINDOW

NEG_INF = float("-inf")
_LOW = torch.finfo(torch.float32).min
_HIGH = torch.finfo(torch.float32).max

# index_reduce_ (deterministic amin/amax scatter) is flagged beta by torch; its semantics are what
# the summaries need, so the warning is silenced here rather than printed on every update.
warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")


# ----------------------------------------------------------------------------- paging helpers
def num_blocks(seq_lens: Tensor, page_size: int) -> Tensor:
    """Blocks per request: ``ceil(seq_lens / page_size)``; ``seq_lens: [B]`` -> ``[B]`` int64."""
    return (seq_lens.long() + page_size - 1) // page_size


def block_table(req_to_token: Tensor, req_pool_indices: Tensor, page_size: int) -> Tensor:
    """Page id of every block of every request.

    req_to_token: ``[max_reqs, max_ctx]`` int32 slot of each (request slot, position).
    req_pool_indices: ``[B]`` request slots of the batch.
    Returns ``[B, NB]`` int64 with ``NB = ceil(max_ctx / page_size)``; entries past a request's
    length are whatever ``req_to_token`` holds there and must be masked by the caller.
    """
    rows = req_to_token[req_pool_indices.long()]  # [B, max_ctx]
    return rows[:, ::page_size].long() // page_size


def mask_to_list(mask: Tensor, n: int) -> Tuple[Tensor, Tensor]:
    """Block mask ``[..., NB] bool`` -> ascending id list ``[..., n]`` int32 (-1 padded), count.

    Static shapes: at most ``n`` ids are kept (the lowest ones); ``n`` may exceed NB.
    """
    nb = mask.shape[-1]
    ar = torch.arange(nb, device=mask.device)
    key = torch.where(mask, ar, ar + nb)  # selected ids first, in order
    order = torch.sort(key, dim=-1).values
    if n > nb:
        pad = torch.full(mask.shape[:-1] + (n - nb,), 2 * nb, device=mask.device, dtype=order.dtype)
        order = torch.cat([order, pad], dim=-1)
    order = order[..., :n]
    idx = torch.where(order < nb, order, torch.full_like(order, -1)).to(torch.int32)
    cnt = mask.sum(-1).clamp(max=n).to(torch.int32)
    return idx, cnt


def list_to_mask(idx: Tensor, cnt: Tensor, nb: int) -> Tensor:
    """Id list ``[..., n]`` with counts ``[...]`` -> mask ``[..., nb]`` bool (padding ignored)."""
    n = idx.shape[-1]
    valid = (torch.arange(n, device=idx.device) < cnt.unsqueeze(-1).long()) & (idx >= 0) & (idx < nb)
    target = torch.where(valid, idx.long(), torch.full_like(idx, nb, dtype=torch.long))
    mask = torch.zeros(idx.shape[:-1] + (nb + 1,), dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, target, True)
    return mask[..., :nb]


def list_isin(idx: Tensor, cnt: Tensor, ref_idx: Tensor, ref_cnt: Tensor, nb: int) -> Tensor:
    """For each valid entry of ``idx``, is it in the set ``ref``? ``[..., n]`` bool (False on padding)."""
    ref_mask = list_to_mask(ref_idx, ref_cnt, nb + 1)  # [..., nb+1]
    safe = idx.long().clamp(min=0, max=nb)
    hit = torch.gather(ref_mask, -1, safe)
    valid = (torch.arange(idx.shape[-1], device=idx.device) < cnt.unsqueeze(-1).long()) & (idx >= 0)
    return hit & valid


def repeated_entries(idx: Tensor, cnt: Tensor) -> Tensor:
    """Valid entries whose id an earlier valid entry of the same list already holds: ``[..., n]``
    bool. Block lists are sets: a repeated id is padding (attended and merged once)."""
    n = idx.shape[-1]
    ar = torch.arange(n, device=idx.device)
    valid = (ar < cnt.long().unsqueeze(-1)) & (idx >= 0)
    same = (idx.unsqueeze(-1) == idx.unsqueeze(-2)) & valid.unsqueeze(-2)  # [..., j, i]
    earlier = ar.view(n, 1) > ar.view(1, n)  # i < j
    return valid & (same & earlier).any(-1)


def set_difference(a_idx: Tensor, a_cnt: Tensor, p_idx: Tensor, p_cnt: Tensor, nb: int,
                   n: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``M = A \\ P`` as a padded list of at most ``n`` (default ``A``'s width) ids and counts."""
    a_mask = list_to_mask(a_idx, a_cnt, nb)
    p_mask = list_to_mask(p_idx, p_cnt, nb)
    return mask_to_list(a_mask & ~p_mask, a_idx.shape[-1] if n is None else n)


def kept_mask(nblk: Tensor, nb: int, sink_blocks: int, local_blocks: int) -> Tuple[Tensor, Tensor]:
    """Always-kept and middle (selectable) block masks, ``[B, NB]`` each, for ``nblk: [B]`` blocks."""
    ar = torch.arange(nb, device=nblk.device)
    n = nblk.long().clamp(0, nb).unsqueeze(-1)  # blocks past the table do not exist
    exists = ar < n
    keep = exists & ((ar < sink_blocks) | (ar >= n - local_blocks))
    return keep, exists & ~keep


# ----------------------------------------------------------------------------- Quest summaries
def round_bf16(x: Tensor, down: bool) -> Tensor:
    """``x`` (float32) rounded to bfloat16 toward -inf (``down``) or +inf: the outward rounding
    that keeps ``kmin`` a lower and ``kmax`` an upper bound of the keys, as the kernels'
    ``__float2bfloat16_rd`` / ``_ru`` round. Round to nearest, then one step outward where that
    went the wrong way."""
    y = x.to(torch.bfloat16)
    yf = y.float()
    wrong = (yf > x) if down else (yf < x)
    bits = y.view(torch.int16).to(torch.int32)
    neg = bits < 0  # sign bit set
    # One step toward -inf: |y| up for y < 0, down for y > 0; from +/-0 to the smallest
    # negative subnormal (0x8001). Toward +inf: the mirror image.
    zero = (bits & 0x7FFF) == 0
    if down:
        step = torch.where(zero, torch.full_like(bits, -32767), torch.where(neg, bits + 1, bits - 1))
    else:
        step = torch.where(zero, torch.ones_like(bits), torch.where(neg, bits - 1, bits + 1))
    out = torch.where(wrong, step, bits).to(torch.int16).view(torch.bfloat16)
    return out


def quest_update(kmin: Tensor, kmax: Tensor, k: Tensor, out_loc: Tensor, positions: Tensor,
                 page_size: int, one_per_page: bool = False) -> None:
    """Fold newly written keys into the per-page key min/max, in place.

    kmin, kmax: ``[num_pages, Hk, D]`` float32 summaries, indexed by page.
    k: ``[N, Hk, D]`` the new keys; out_loc: ``[N]`` their slots; positions: ``[N]`` their
    positions in their requests. A page is reset when the token at its first position is
    written (so a reused page forgets its previous owner); tokens of one call may share pages.
    ``one_per_page`` promises that they do not (decode): the result is the same, and the kernel
    then needs one launch instead of two.
    """
    page = out_loc.long() // page_size
    first = (positions.long() % page_size) == 0
    reset = torch.where(first, page, torch.zeros_like(page))  # page 0 = padding sink
    kmin.index_fill_(0, reset, float("inf"))
    kmax.index_fill_(0, reset, NEG_INF)
    if kmin.dtype == torch.bfloat16:  # outward rounding: min/max commute with it
        lo, hi = round_bf16(k.float(), down=True), round_bf16(k.float(), down=False)
    else:
        lo = hi = k.to(kmin.dtype)
    kmin.index_reduce_(0, page, lo, "amin")
    kmax.index_reduce_(0, page, hi, "amax")


def quest_scores(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor) -> Tensor:
    """Quest block scores ``IS = sum_d max(q_d*kmax_d, q_d*kmin_d)``, summed over each GQA group.

    q: ``[B, Hq, D]``; kmin/kmax: ``[num_pages, Hk, D]``; table: ``[B, NB]`` page ids;
    nblk: ``[B]`` blocks per request. Returns ``[B, Hk, NB]`` float32, ``-inf`` past nblk.
    Summing the per-head upper bounds keeps an upper bound of the group's summed logits.
    """
    B, Hq, D = q.shape
    Hk = kmin.shape[1]
    G = Hq // Hk
    nb = table.shape[1]
    lo = kmin[table].float()  # [B, NB, Hk, D] (bfloat16 summaries: exact in float32)
    hi = kmax[table].float()
    qg = q.float().view(B, Hk, G, D)
    s = torch.maximum(torch.einsum("bhgd,bnhd->bhgnd", qg, hi),
                      torch.einsum("bhgd,bnhd->bhgnd", qg, lo)).sum(-1).sum(2)  # [B, Hk, NB]
    exists = torch.arange(nb, device=q.device) < nblk.long().unsqueeze(-1)
    return torch.where(exists.unsqueeze(1), s, torch.full_like(s, NEG_INF))


# ----------------------------------------------------------------------------- InfLLM-v2
def infllm_update(ck: Tensor, k_buf: Tensor, req_to_token: Tensor, req_idx: Tensor,
                  out_loc: Tensor, positions: Tensor, page_size: int) -> None:
    """Write the compressed keys completed by the new tokens, in place.

    Compressed key ``i`` is the mean of the keys at positions ``[16 i, 16 i + 32)``. It is stored
    with the page holding its *last* token, at ``ck[page, j]`` with ``j = i + 1 -
    (pos // page_size) * (page_size // 16)``; it depends only on that page and the previous one,
    so pages shared through the radix cache share their compressed keys.

    ck: ``[num_pages, page_size // 16, Hk, D]`` float32; k_buf: ``[num_slots, Hk, D]`` with the
    new keys already written; req_to_token: ``[max_reqs, max_ctx]``; req_idx: ``[N]`` request
    slot of each new token; out_loc, positions: ``[N]``.
    """
    W, S = INFLLM_WINDOW, INFLLM_STRIDE
    per_page = page_size // S
    pos = positions.long()
    done = ((pos + 1) % S == 0) & (pos >= W - 1)
    win = (pos.unsqueeze(-1) - (W - 1) + torch.arange(W, device=pos.device)).clamp(min=0)  # [N, W]
    slots = req_to_token[req_idx.long().unsqueeze(-1), win].long()  # [N, W]
    mean = k_buf[slots].float().mean(1)  # [N, Hk, D]
    i = (pos - (W - 1)) // S
    j = i + 1 - (pos // page_size) * per_page
    flat = (out_loc.long() // page_size) * per_page + j
    flat = torch.where(done, flat, torch.zeros_like(flat))  # not completed -> padding page
    ck.view(-1, *ck.shape[2:]).index_copy_(0, flat, mean.to(ck.dtype))


def infllm_scores(q: Tensor, ck: Tensor, table: Tensor, seq_lens: Tensor, page_size: int,
                  sm_scale: float) -> Tensor:
    """InfLLM-v2 block scores: softmax of ``q . ck`` over the request's complete compressed keys,
    summed over the GQA group, max-pooled to each block a compressed key overlaps.

    q: ``[B, Hq, D]``; ck: ``[num_pages, page_size//16, Hk, D]``; table: ``[B, NB]``;
    seq_lens: ``[B]``. Returns ``[B, Hk, NB]`` float32 (``-inf`` where no complete compressed
    key touches the block, e.g. past the request).
    """
    W, S = INFLLM_WINDOW, INFLLM_STRIDE
    B, Hq, D = q.shape
    per_page = page_size // S
    Hk = ck.shape[2]
    G = Hq // Hk
    nb = table.shape[1]
    E = nb * per_page
    c = ck[table].reshape(B, E, Hk, D)  # entry e holds compressed key i = e - 1
    n_ck = ((seq_lens.long() - W) // S + 1).clamp(min=0)  # complete compressed keys
    e = torch.arange(E, device=q.device)
    valid = (e >= 1) & (e <= n_ck.unsqueeze(-1))  # [B, E]
    logits = torch.einsum("bhgd,behd->bhge", q.float().view(B, Hk, G, D), c) * sm_scale
    logits = logits.masked_fill(~valid[:, None, None, :], NEG_INF)
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2)  # [B, Hk, E]
    p = p.masked_fill(~valid[:, None, :], NEG_INF)
    ends_here = p.view(B, Hk, nb, per_page).amax(-1)  # keys whose last token is in the block
    # The first key stored with block b+1 starts in block b (it straddles the boundary).
    starts_here = torch.cat([p.view(B, Hk, nb, per_page)[:, :, 1:, 0],
                             torch.full((B, Hk, 1), NEG_INF, device=q.device)], dim=-1)
    return torch.maximum(ends_here, starts_here)


# ----------------------------------------------------------------------------- selection
def select_topk(scores: Tensor, nblk: Tensor, k: int, sink_blocks: int, local_blocks: int,
                n_out: Optional[int] = None, dense_row: Optional[Tensor] = None
                ) -> Tuple[Tensor, Tensor]:
    """The selected set: kept sink/local blocks plus the top-``k`` middle blocks by score.

    scores: ``[B, Hk, NB]``; nblk: ``[B]``. Ties go to the lower block id (stable sort), and a
    middle block is selectable whatever its score (``-inf`` and NaN rank last).
    dense_row: optional ``[B]`` bool; such rows select every block (DSA with K >= all blocks is
    dense attention), which is how rows shorter than ``--prr-min-context`` decode.
    Returns ``(idx [B, Hk, n_out] int32 ascending, -1 padded; cnt [B, Hk] int32)`` with
    ``n_out = k + sink_blocks + local_blocks`` by default.
    """
    B, Hk, nb = scores.shape
    keep, middle = kept_mask(nblk, nb, sink_blocks, local_blocks)  # [B, NB]
    low = torch.finfo(torch.float32).min
    s = scores.float().nan_to_num(nan=low, posinf=torch.finfo(torch.float32).max, neginf=low)
    key = torch.where(middle.unsqueeze(1), s, torch.full_like(s, NEG_INF))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # [B, Hk, NB]
    n_mid = middle.sum(-1, keepdim=True)  # [B, 1]
    k_row = torch.full_like(n_mid, k)
    if dense_row is not None:
        k_row = torch.where(dense_row.view(-1, 1), n_mid, k_row)
    take = torch.arange(nb, device=scores.device) < torch.minimum(n_mid, k_row)  # [B, NB] by rank
    chosen = torch.zeros_like(key, dtype=torch.bool)
    chosen.scatter_(-1, order, take.unsqueeze(1).expand(B, Hk, nb))
    mask = chosen | keep.unsqueeze(1)
    return mask_to_list(mask, k + sink_blocks + local_blocks if n_out is None else n_out)


# ----------------------------------------------------------------------------- predictor
def holt_predict(level: Tensor, trend: Tensor, gamma: Tensor, n_init: Tensor) -> Tensor:
    """Eq 2: ``IS_hat = l + gamma * v`` for initialised blocks, ``-inf`` for the others.

    level, trend: ``[B, Hk, NB]`` float32; gamma: ``[B]``; n_init: ``[B]`` blocks with state.
    """
    nb = level.shape[-1]
    pred = level + gamma.float().view(-1, 1, 1) * trend
    init = torch.arange(nb, device=level.device) < n_init.long().unsqueeze(-1)
    return torch.where(init.unsqueeze(1), pred, torch.full_like(pred, NEG_INF))


def holt_update(level: Tensor, trend: Tensor, n_init: Tensor, scores: Tensor, nblk: Tensor,
                alpha: Tensor, beta: Tensor) -> None:
    """Eq 3, in place, once the scores ``IS[t]`` are known.

    ``v = beta (IS - l) + (1 - beta) v``; ``l = alpha IS + (1 - alpha) l`` for blocks that had
    state; a block seen for the first time (id >= n_init) starts at ``l = IS, v = 0``, and so does
    a block whose level is not finite: InfLLM-v2 scores a block ``-inf`` until a complete
    compressed key covers it, and a level of ``-inf`` would otherwise stay ``-inf`` (with a
    non-finite trend) and never be predicted again. Blocks past ``nblk`` are untouched;
    ``n_init`` becomes ``max(n_init, nblk)``.
    level, trend, scores: ``[B, Hk, NB]``; n_init, nblk, alpha, beta: ``[B]``.
    """
    nb = level.shape[-1]
    ar = torch.arange(nb, device=level.device)
    exists = (ar < nblk.long().unsqueeze(-1)).unsqueeze(1)
    old = (ar < n_init.long().unsqueeze(-1)).unsqueeze(1) & exists & torch.isfinite(level)
    a = alpha.float().view(-1, 1, 1)
    b = beta.float().view(-1, 1, 1)
    s = scores.float()
    v_new = torch.where(old, b * (s - level) + (1 - b) * trend, torch.zeros_like(trend))
    l_new = torch.where(old, a * s + (1 - a) * level, s)
    trend.copy_(torch.where(exists, v_new, trend))
    level.copy_(torch.where(exists, l_new, level))
    n_init.copy_(torch.maximum(n_init, nblk.to(n_init.dtype)))


def predict_set(level: Tensor, trend: Tensor, gamma: Tensor, n_init: Tensor, nblk_next: Tensor,
                n_pred: int, sink_blocks: int, local_blocks: int) -> Tuple[Tensor, Tensor]:
    """P for the next step: kept blocks plus the top-``n_pred`` middle blocks by ``IS_hat``.

    nblk_next: ``[B]`` blocks the request will have at that step. Returns ``(idx, cnt)`` of width
    ``n_pred + sink_blocks + local_blocks``.
    """
    return select_topk(holt_predict(level, trend, gamma, n_init), nblk_next, n_pred,
                       sink_blocks, local_blocks)


def predict_update(level: Tensor, trend: Tensor, n_init: Tensor, scores: Tensor, nblk: Tensor,
                   theta: Tensor, nblk_next: Tensor, n_pred: int, sink_blocks: int,
                   local_blocks: int) -> Tuple[Tensor, Tensor]:
    """The predictor's whole step: eq 3 in place (``holt_update``), then P(t+1) (``predict_set``).

    theta: ``[B, 3]`` (alpha, beta, gamma). Returns ``(idx, cnt)`` of width
    ``n_pred + sink_blocks + local_blocks``.
    """
    holt_update(level, trend, n_init, scores, nblk, theta[:, 0], theta[:, 1])
    return predict_set(level, trend, theta[:, 2].contiguous(), n_init, nblk_next, n_pred,
                       sink_blocks, local_blocks)


def predict_update_rows(level: Tensor, trend: Tensor, n_init: Tensor, p_idx: Tensor,
                        p_cnt: Tensor, theta: Tensor, rows: Tensor, scores: Tensor, nblk: Tensor,
                        nblk_next: Tensor, n_pred: int, sink_blocks: int,
                        local_blocks: int, p_rows: Optional[Tensor] = None) -> None:
    """``predict_update`` on the request pool's state, in place: batch entry ``b`` updates row
    ``rows[b]`` of level/trend ``[R, Hk, NB]``, n_init ``[R]``, theta ``[R, 3]`` and writes P(t+1)
    into p_idx ``[R, Hk, W]`` / p_cnt ``[R, Hk]``, ``W >= n_pred + sink + local`` (the pool's
    width, that of the largest budget; -1 past the count). scores: ``[B, Hk, NB]``;
    nblk/nblk_next/rows: ``[B]``. ``p_rows: [B]``, if given, are the rows of p_idx/p_cnt that
    receive P(t+1) (the other half of a double buffer), else ``rows``. Rows must be distinct,
    except SGLang's padding row 0, whose state no request reads."""
    r = rows.long()
    lv, tr, ni = level[r], trend[r], n_init[r]
    idx, cnt = predict_update(lv, tr, ni, scores, nblk, theta[r], nblk_next, n_pred, sink_blocks,
                              local_blocks)
    pad = p_idx.shape[-1] - idx.shape[-1]
    if pad > 0:
        idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
    level.index_copy_(0, r, lv)
    trend.index_copy_(0, r, tr)
    n_init.index_copy_(0, r, ni)
    pr = r if p_rows is None else p_rows.long()
    p_idx.index_copy_(0, pr, idx)
    p_cnt.index_copy_(0, pr, cnt)


# ----------------------------------------------------------------------------- calibration
def weighted_hit(scores: Tensor, a_idx: Tensor, a_cnt: Tensor, p_idx: Tensor, p_cnt: Tensor,
                 middle: Tensor) -> Tensor:
    """Eq 4's per-row term over the *middle* part of A (kept blocks are hits by construction):
    ``sum_{b in P n A} w_b / sum_{b in A} w_b`` with ``w = IS - min(IS over middle blocks)`` so
    that Quest's signed scores give non-negative weights. Falls back to ``|P n A| / |A|`` when
    the weights of A sum to 0, and to 1 when A has no middle block.

    scores: ``[..., NB]``; a/p lists ``[..., n]``; middle: ``[..., NB]`` bool. Returns ``[...]``.
    """
    nb = scores.shape[-1]
    a = list_to_mask(a_idx, a_cnt, nb) & middle
    p = list_to_mask(p_idx, p_cnt, nb)
    s = scores.float().nan_to_num(neginf=0.0)
    lo = torch.where(middle, s, torch.full_like(s, float("inf"))).amin(-1, keepdim=True)
    w = torch.where(middle, s - lo, torch.zeros_like(s))
    num = (w * (a & p)).sum(-1)
    den = (w * a).sum(-1)
    n_a = a.sum(-1).float()
    plain = torch.where(n_a > 0, (a & p).sum(-1).float() / n_a.clamp(min=1), torch.ones_like(n_a))
    return torch.where(den > 0, num / den.clamp(min=1e-30), plain)


def calibrate(scores: Tensor, nblk: Tensor, k: int, n_pred: int, sink_blocks: int,
              local_blocks: int, alphas: Tensor, betas: Tensor, gammas: Tensor,
              impl=None) -> Tensor:
    """Eqs 4-5: replay the predictor for every candidate theta over sampled prefill rows, together.

    scores: ``[R, Phi, Hk, NB]`` block scores of ``Phi`` sampled queries (in position order) of
    ``R`` requests; nblk: ``[R, Phi]`` blocks visible to each query (causal).
    alphas/betas/gammas: ``[C]`` the candidates. Returns ``H: [R, C]`` the score-weighted hit rate
    of each candidate, averaged over heads and over rows 1..Phi-1 (row 0 only seeds the state);
    ``theta* = best_theta(H)`` per request. ``impl`` is the module whose ``predict_set``,
    ``select_topk`` and ``holt_update`` are composed (this one by default; ``sglang_prr.ops`` runs
    them through the dispatching ops, i.e. the CUDA kernels where registered).
    """
    impl = _this if impl is None else impl
    R, Phi, Hk, nb = scores.shape
    C = alphas.numel()
    dev = scores.device
    # Candidates become a batch dimension, [R*C, Hk, NB], one sampled row at a time (the whole
    # expansion would be C times the scores). A and the weights do not depend on the candidate:
    # they are computed on the R rows and broadcast.
    nbk = nblk.long().unsqueeze(1).expand(R, C, Phi).reshape(R * C, Phi)
    a_ = alphas.float().to(dev).repeat(R)
    b_ = betas.float().to(dev).repeat(R)
    g_ = gammas.float().to(dev).repeat(R)
    level = torch.zeros(R * C, Hk, nb, device=dev)
    trend = torch.zeros_like(level)
    n_init = torch.zeros(R * C, dtype=torch.long, device=dev)
    total = torch.zeros(R * C, device=dev)
    per_cand = lambda t: t.unsqueeze(1).expand(R, C, *t.shape[1:]).reshape(R * C, *t.shape[1:])
    for phi in range(Phi):
        row_r = scores[:, phi].float()  # [R, Hk, NB]
        row, n = per_cand(row_r), nbk[:, phi].contiguous()
        if phi > 0:
            p_idx, p_cnt = impl.predict_set(level, trend, g_, n_init, n, n_pred, sink_blocks,
                                            local_blocks)
            n_r = nblk[:, phi].long()
            a_idx, a_cnt = impl.select_topk(row_r.contiguous(), n_r, k, sink_blocks,
                                            local_blocks, k + sink_blocks + local_blocks)
            _, middle = kept_mask(n, nb, sink_blocks, local_blocks)
            total += weighted_hit(row, per_cand(a_idx), per_cand(a_cnt), p_idx, p_cnt,
                                  middle.unsqueeze(1)).mean(-1)
        impl.holt_update(level, trend, n_init, row, n, a_, b_)
    return (total / max(Phi - 1, 1)).view(R, C)


def middle_topk_mask(scores: Tensor, middle: Tensor, k: int, inplace: bool = False,
                     init: Optional[Tensor] = None) -> Tensor:
    """The middle blocks ``reference.select_topk`` chooses, as a mask: the top ``min(k, n_mid)``
    middle blocks by score, ties to the lower block id, ``-inf``/NaN ranked last (as the lowest
    float), ``+inf`` as the highest.

    scores: ``[..., NB]`` float; middle: ``[..., NB]`` bool, broadcastable to ``scores``.
    Returns ``[..., NB]`` bool. ``inplace``: ``scores`` is a float32 scratch tensor of the full
    shape that may be overwritten (saves a copy of the largest tensor of the grid search).
    ``init``: optional bool mask broadcastable to ``scores``; blocks outside it score ``-inf``
    (``reference.holt_predict``'s uninitialised blocks). No host synchronisation: the counts
    stay on the device.
    """
    nb = scores.shape[-1]
    kk = min(int(k), nb)
    if kk >= nb or kk <= 0:  # every middle block (n_mid <= nb <= k), whatever its score, or none
        take = middle if kk > 0 else torch.zeros_like(middle)
        return torch.broadcast_to(take, torch.broadcast_shapes(scores.shape, middle.shape))
    # The key of reference.select_topk: finite for middle blocks, -inf for the others (a middle
    # block scored -inf or NaN gets the lowest float).
    key = scores.nan_to_num_(nan=_LOW, posinf=_HIGH, neginf=_LOW) if inplace else \
        scores.float().nan_to_num(nan=_LOW, posinf=_HIGH, neginf=_LOW)
    fill = torch.where(middle, _LOW, NEG_INF)  # the small mask's shape
    key = torch.where(middle if init is None else middle & init, key, fill)
    # Take everything above the kk-th largest key, then the keys equal to it in ascending id
    # until kk are taken. A row with fewer than kk middle blocks has -inf there: raised to the
    # lowest float, the threshold then takes every middle block and nothing else (the others are
    # -inf). kthvalue is a selection, O(NB) per row, where the reference sorts the row twice.
    thr = torch.kthvalue(key, nb - kk + 1, dim=-1, keepdim=True).values.clamp_(min=_LOW)
    gt = key > thr
    eq = key == thr
    need = kk - gt.sum(-1, keepdim=True, dtype=torch.int32)  # ties to take
    return gt | (eq & (eq.cumsum(-1, dtype=torch.int32) <= need))


def calib_grid_terms(scores: Tensor, nblk: Tensor, wa: Tensor, am: Tensor, alphas: Tensor,
                     betas: Tensor, gammas: Tensor, n_pred: int, sink_blocks: int,
                     local_blocks: int) -> Tensor:
    """Eq 4's row term of every candidate of the grid ``alphas x betas x gammas`` (alpha-major),
    for every sampled query after the first: the predictor of each candidate is replayed over
    the ``Phi`` sampled queries and its P is scored against A.

    scores: ``[R, Phi, Hk, NB]`` float32; nblk: ``[R, Phi]`` int64; wa: ``[Phi-1, R, Hk, NB]``
    float32, the weights of A's middle blocks (0 elsewhere); am: ``[Phi-1, R, Hk, NB]`` bool, A's
    middle blocks (both of queries 1..Phi-1). Returns ``[Phi-1, R, A*B*G, Hk]`` float32: the
    score-weighted hit of P (``weighted_hit``), computed as ``calibrate`` computes it, bit for
    bit.

    The level depends on alpha only and the trend on (alpha, beta) only: one level per alpha and
    one trend per (alpha, beta) are kept (4 + 20 tracks instead of 2 x 80 for the default grid)
    and only the prediction ``l + gamma v`` is formed per candidate. Every float ``calibrate``
    rounds is rounded here by the same operation on the same operands, and every sum runs over
    the same ``[..., NB]`` rows with the same number of outputs (``den`` sums an expanded view
    rather than a copy). Memory: a few ``[R, A*B*G, Hk, NB]`` tensors at a time.
    """
    R, Phi, Hk, nb = scores.shape
    dev = scores.device
    A, B, G = alphas.numel(), betas.numel(), gammas.numel()
    a = alphas.float().to(dev).view(1, A, 1, 1, 1, 1)
    b = betas.float().to(dev).view(1, 1, B, 1, 1, 1)
    g = gammas.float().to(dev).view(1, 1, 1, G, 1, 1)
    level = torch.zeros(R, A, 1, 1, Hk, nb, device=dev)
    trend = torch.zeros(R, A, B, 1, Hk, nb, device=dev)
    n_init = torch.zeros(R, dtype=torch.long, device=dev)  # the same for every candidate
    out = torch.zeros(max(Phi - 1, 0), R, A * B * G, Hk, device=dev)
    ar = torch.arange(nb, device=dev)
    row6 = lambda t: t.view(R, 1, 1, 1, *t.shape[1:])  # [R, ...] -> broadcast over candidates
    for phi in range(Phi):
        s = scores[:, phi].float()  # [R, Hk, NB]
        n = nblk[:, phi].long()  # [R]
        if phi > 0:
            _, mid = kept_mask(n, nb, sink_blocks, local_blocks)  # [R, NB]
            # P of every candidate: eq 2 (uninitialised blocks rank last), top-n_pred middle.
            init = (ar < n_init.unsqueeze(-1)).view(R, 1, 1, 1, 1, nb)
            pred = level + g * trend  # [R, A, B, G, Hk, NB]
            p = middle_topk_mask(pred, mid.view(R, 1, 1, 1, 1, nb), n_pred, inplace=True,
                                 init=init)
            del pred
            # The row term as weighted_hit forms it. sum(w * (A & P)): (w*a)*1 and (w*a)*0 per
            # element (NaN where w overflowed), selected by P without a float copy of P. The
            # sums run over rows of the candidates' shape, as calibrate's (``den`` over an
            # expanded view, from a fresh allocation like calibrate's).
            wa_r = wa[phi - 1].clone()  # [R, Hk, NB]
            num = torch.where(p, row6(wa_r), row6(wa_r * 0)).sum(-1)  # [R, A, B, G, Hk]
            den = row6(wa_r).expand(p.shape).sum(-1)
            n_a = row6(am[phi - 1].sum(-1).float())
            hits = torch.where(p, row6(am[phi - 1].float()), 0.0).sum(-1)  # |A & P|, exact
            plain = torch.where(n_a > 0, hits / n_a.clamp(min=1), torch.ones_like(n_a))
            out[phi - 1] = torch.where(den > 0, num / den.clamp(min=1e-30), plain).view(
                R, A * B * G, Hk)
            del p
        # Eq 3 on the tracks (holt_update's arithmetic, operand for operand). A level that is
        # not finite restarts like a new block.
        sv = row6(s)
        exists = (ar < n.unsqueeze(-1)).view(R, 1, 1, 1, 1, nb)
        old = (ar < n_init.unsqueeze(-1)).view(R, 1, 1, 1, 1, nb) & exists & level.isfinite()
        # New blocks (exists, not old) start at l = IS, v = 0; blocks past nblk keep their state.
        trend = torch.where(old, b * (sv - level) + (1 - b) * trend,
                            torch.where(exists, 0.0, trend))
        level = torch.where(old, a * sv + (1 - a) * level, torch.where(exists, sv, level))
        n_init = torch.maximum(n_init, n)
    return out


def best_theta(H: Tensor) -> Tensor:
    """Eq 5: ``argmax_C H`` per request, ties to the lowest candidate index. ``H: [R, C]`` -> ``[R]``."""
    C = H.shape[-1]
    ar = torch.arange(C, device=H.device)
    top = H == H.amax(-1, keepdim=True)
    return torch.where(top, ar, torch.full_like(ar, C)).amin(-1)


# ----------------------------------------------------------------------------- attention
def _gather_blocks(buf: Tensor, table: Tensor, idx: Tensor, page_size: int) -> Tensor:
    """K or V of the listed blocks: ``[B, Hk, N, page_size, D]`` float32 (padding reads page 0)."""
    B, Hk, N = idx.shape
    nb = table.shape[1]
    blk = idx.long().clamp(min=0, max=nb - 1)
    pages = torch.gather(table.unsqueeze(1).expand(B, Hk, nb), -1, blk)  # [B, Hk, N]
    pages = torch.where((idx >= 0) & (idx < nb), pages, torch.zeros_like(pages))
    slots = pages.unsqueeze(-1) * page_size + torch.arange(page_size, device=idx.device)
    heads = torch.arange(Hk, device=idx.device).view(1, Hk, 1, 1)
    return buf[slots, heads].float()


def sparse_attn_partials(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor, seq_lens: Tensor,
                         idx: Tensor, cnt: Tensor, page_size: int, sm_scale: float,
                         idx_rows: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Attention of one decode query per request over each listed block separately.

    q: ``[B, Hq, D]``; k_buf, v_buf: ``[num_slots, Hk, D]``; table: ``[B, NB]`` page ids;
    seq_lens: ``[B]`` (tokens at or past it are masked); idx/cnt: block list ``[B, Hk, N]`` and
    counts ``[B, Hk]``; with ``idx_rows: [B]`` they are the rows ``idx_rows[b]`` of pool-wide lists
    ``[R, Hk, N]`` / ``[R, Hk]`` (the predictor state read in place). Returns per-block partials
    ``o: [B, Hq, N, D]`` float32 (normalised within the block) and ``lse: [B, Hq, N]`` float32;
    padding entries are ``(0, -inf)``.
    """
    if idx_rows is not None:
        idx, cnt = idx[idx_rows.long()], cnt[idx_rows.long()]
    B, Hq, D = q.shape
    Hk, N = idx.shape[1], idx.shape[2]
    G = Hq // Hk
    k = _gather_blocks(k_buf, table, idx, page_size)  # [B, Hk, N, P, D]
    v = _gather_blocks(v_buf, table, idx, page_size)
    pos = idx.long().unsqueeze(-1) * page_size + torch.arange(page_size, device=q.device)
    entry_ok = ((torch.arange(N, device=q.device) < cnt.long().unsqueeze(-1)) & (idx >= 0)
                & (idx < table.shape[1])  # ids outside the table are padding
                & ~repeated_entries(idx, cnt))  # so are repeats: a block is attended once
    ok = entry_ok.unsqueeze(-1) & (pos < seq_lens.long().view(B, 1, 1, 1))  # [B, Hk, N, P]
    logits = torch.einsum("bhgd,bhnpd->bhgnp", q.float().view(B, Hk, G, D), k) * sm_scale
    logits = logits.masked_fill(~ok.unsqueeze(2), NEG_INF)
    lse = torch.logsumexp(logits, dim=-1)  # [B, Hk, G, N]
    p = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    # Masked slots (past the request, padding entries) never enter the sums: a stale NaN there
    # would survive a multiplication by zero.
    v = torch.where(ok.unsqueeze(-1), v, torch.zeros_like(v))
    o = torch.einsum("bhgnp,bhnpd->bhgnd", p, v)
    return o.reshape(B, Hq, N, D), lse.reshape(B, Hq, N)


def merge_partials(o: Tensor, lse: Tensor, keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Merge the kept partial states along dim -2 of ``o`` (eq 6 over many states at once).

    o: ``[..., N, D]``; lse: ``[..., N]``; keep: ``[..., N]`` bool (default all). Returns
    ``(o [..., D], lse [...])``; nothing kept gives ``(0, -inf)``.
    """
    lse = lse.float()
    if lse.shape[-1] == 0:  # nothing to merge: the empty state
        return (o.new_zeros(o.shape[:-2] + o.shape[-1:], dtype=torch.float32),
                lse.new_full(lse.shape[:-1], NEG_INF))
    if keep is not None:
        lse = lse.masked_fill(~keep, NEG_INF)
    m = lse.amax(-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # 0 for -inf entries
    l = w.sum(-1, keepdim=True)
    out = (w.unsqueeze(-1) * o.float().nan_to_num(0.0)).sum(-2) / l.clamp(min=1e-30)
    return out, (m_safe + torch.log(l)).squeeze(-1)


def merge_state(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tuple[Tensor, Tensor]:
    """Eq 6 for two states: ``o: [..., D]``, ``lse: [...]``."""
    return merge_partials(torch.stack([o1, o2], -2), torch.stack([lse1, lse2], -1))


def dense_attention(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor, seq_lens: Tensor,
                    page_size: int, sm_scale: float) -> Tensor:
    """Decode attention over every block (the baseline DSA must equal when K covers all)."""
    B = q.shape[0]
    Hk, nb = k_buf.shape[1], table.shape[1]
    nblk = num_blocks(seq_lens, page_size)
    mask = (torch.arange(nb, device=q.device) < nblk.unsqueeze(-1)).unsqueeze(1).expand(B, Hk, nb)
    idx, cnt = mask_to_list(mask, nb)
    o, lse = sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale)
    return merge_partials(o, lse)[0]


def attend_set(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor, seq_lens: Tensor,
               idx: Tensor, cnt: Tensor, page_size: int, sm_scale: float) -> Tuple[Tensor, Tensor]:
    """Attention over a block set, as one state ``(o [B, Hq, D], lse [B, Hq])``."""
    o, lse = sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale)
    return merge_partials(o, lse)


def sparse_attn_merge(q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor, seq_lens: Tensor,
                      idx: Tensor, cnt: Tensor, page_size: int, sm_scale: float,
                      o_spec: Optional[Tensor] = None, lse_spec: Optional[Tensor] = None,
                      p_idx: Optional[Tensor] = None, p_cnt: Optional[Tensor] = None,
                      a_idx: Optional[Tensor] = None, a_cnt: Optional[Tensor] = None,
                      nb: int = 0, exact: bool = True, p_rows: Optional[Tensor] = None,
                      out_dtype: Optional[torch.dtype] = None, impl=None
                      ) -> Tuple[Tensor, Tensor]:
    """Attention over the listed blocks, merged into one state, with the speculative partials.

    Without ``o_spec``: ``attend_set``. With it: the repair over ``idx`` (= M) merged with the
    speculative partials as ``prr_merge`` does (exact: only ``P n A`` of them; union: all);
    ``p_rows: [B]`` reads P from rows of pool-wide lists, as ``idx_rows`` of
    ``sparse_attn_partials``. Returns ``(o [B, Hq, D], lse [B, Hq] float32)`` with ``o`` in
    ``out_dtype`` (float32 by default; the model's dtype saves the decode step a cast).
    ``impl`` as in ``dsa_decode``.
    """
    impl = _this if impl is None else impl
    o_r, lse_r = impl.sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size,
                                           sm_scale)
    if o_spec is None:
        o, lse = impl.merge_partials(o_r, lse_r)
    else:
        if p_rows is not None and p_idx is not None:
            p_idx, p_cnt = p_idx[p_rows.long()], p_cnt[p_rows.long()]
        o, lse = impl.prr_merge(o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, o_r, lse_r, nb,
                                exact)
    return (o if out_dtype is None else o.to(out_dtype)), lse


def expand_heads(x: Tensor, group: int) -> Tensor:
    """Per-KV-head ``[B, Hk, ...]`` -> per-query-head ``[B, Hk*group, ...]``."""
    return x.repeat_interleave(group, dim=1)


def prr_merge(o_spec: Tensor, lse_spec: Tensor, p_idx: Tensor, p_cnt: Tensor, a_idx: Tensor,
              a_cnt: Tensor, o_rep: Tensor, lse_rep: Tensor, nb: int, exact: bool = True
              ) -> Tuple[Tensor, Tensor]:
    """Combine the speculative per-block partials over P with the repair partials over M = A \\ P.

    exact: keep only the speculative partials of blocks in ``P n A`` -> attention over exactly A.
    union: keep every speculative partial -> attention over ``P u A``. In both, an id repeated in
    P counts once (its first entry).
    o_spec: ``[B, Hq, Np, D]``, lse_spec ``[B, Hq, Np]``; o_rep/lse_rep likewise over M.
    Returns ``(o [B, Hq, D] float32, lse [B, Hq])``.
    """
    G = o_spec.shape[1] // p_idx.shape[1]
    first = ~repeated_entries(p_idx, p_cnt)
    if exact:
        keep = expand_heads(list_isin(p_idx, p_cnt, a_idx, a_cnt, nb) & first, G)
    else:
        keep = expand_heads(first, G)
    o = torch.cat([o_spec, o_rep], dim=-2)
    lse = torch.cat([lse_spec.masked_fill(~keep, NEG_INF), lse_rep], dim=-1)
    return merge_partials(o, lse)


def select_blocks(method: str, q: Tensor, summary: Sequence[Tensor], table: Tensor,
                  seq_lens: Tensor, page_size: int, sm_scale: float) -> Tensor:
    """Block scores of the chosen DSA method. summary: ``(kmin, kmax)`` for Quest, ``(ck,)`` for
    InfLLM-v2. Returns ``[B, Hk, NB]``."""
    if method == "quest":
        return quest_scores(q, summary[0], summary[1], table, num_blocks(seq_lens, page_size))
    if method == "infllm_v2":
        return infllm_scores(q, summary[0], table, seq_lens, page_size, sm_scale)
    raise ValueError(f"unknown DSA method {method!r}: expected quest | infllm_v2")


def accumulate_stats(stats: Tensor, a_cnt: Tensor, m_cnt: Tensor, p_cnt: Optional[Tensor],
                     dense_row: Optional[Tensor]) -> None:
    """PRR's counters, in place: ``stats`` (``contracts.STATS_SLOTS``: int64 sum |A|, sum |M|,
    sum |P|, rows) accumulates over the (request, KV head) rows of the step that are not dense
    rows. Counts ``[B, Hk]``."""
    w = torch.ones(a_cnt.shape[0], dtype=torch.int64, device=a_cnt.device)
    if dense_row is not None:
        w = (~dense_row).to(torch.int64)
    w = w.view(-1, 1)
    p = torch.zeros_like(a_cnt) if p_cnt is None else p_cnt.clamp(min=0)
    stats += torch.stack([(a_cnt.long() * w).sum(), (m_cnt.long() * w).sum(),
                          (p.long() * w).sum(), (w * torch.ones_like(a_cnt)).sum()]).to(stats.dtype)


def select_from_scores(scores: Tensor, nblk: Tensor, nb: int, p_idx: Optional[Tensor],
                       p_cnt: Optional[Tensor], k: int, sink_blocks: int, local_blocks: int,
                       n_out: int, p_rows: Optional[Tensor] = None,
                       dense_row: Optional[Tensor] = None, stats: Optional[Tensor] = None,
                       impl=None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A = top-K + kept blocks from ``scores``, and ``M = A \\ P`` (``M = A`` without P):
    ``(scores, a_idx, a_cnt, m_idx, m_cnt)``. ``p_rows``, ``dense_row`` and ``stats`` as in
    ``quest_select``. ``impl`` as in ``dsa_decode``."""
    impl = _this if impl is None else impl
    a_idx, a_cnt = impl.select_topk(scores, nblk, k, sink_blocks, local_blocks, n_out, dense_row)
    if p_idx is None:
        m_idx, m_cnt = a_idx.clone(), a_cnt.clone()
    else:
        if p_rows is not None:
            p_idx, p_cnt = p_idx[p_rows.long()], p_cnt[p_rows.long()]
        m_idx, m_cnt = impl.set_difference(a_idx, a_cnt, p_idx, p_cnt, nb)
    if stats is not None:
        accumulate_stats(stats, a_cnt, m_cnt, p_cnt, dense_row)
    return scores, a_idx, a_cnt, m_idx, m_cnt


def quest_select(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor,
                 p_idx: Optional[Tensor], p_cnt: Optional[Tensor], k: int, sink_blocks: int,
                 local_blocks: int, n_out: int, p_rows: Optional[Tensor] = None,
                 dense_row: Optional[Tensor] = None, stats: Optional[Tensor] = None, impl=None
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Quest selection of one step: scores, A = top-K + kept blocks, and M = A \\ P.

    ``p_idx``/``p_cnt`` None gives ``M = A``; with ``p_rows: [B]`` they are rows of the pool-wide
    prediction ``[R, Hk, Np]`` / ``[R, Hk]``. ``dense_row: [B]`` bool selects every block of those
    rows (``select_topk``); ``stats: [4]`` int64, if given, accumulates ``accumulate_stats``.
    Returns ``(scores [B, Hk, NB], a_idx, a_cnt, m_idx, m_cnt)`` with lists of width ``n_out``.
    ``impl`` as in ``dsa_decode``.
    """
    impl = _this if impl is None else impl
    return select_from_scores(impl.quest_scores(q, kmin, kmax, table, nblk), nblk,
                              table.shape[1], p_idx, p_cnt, k, sink_blocks, local_blocks, n_out,
                              p_rows, dense_row, stats, impl)


def quest_select_predict(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, nblk: Tensor,
                         nblk_next: Tensor, p_idx: Tensor, p_cnt: Tensor, p_rows: Tensor,
                         p_next_rows: Tensor, level: Tensor, trend: Tensor, n_init: Tensor,
                         theta: Tensor, rows: Tensor, k: int, n_pred: int, sink_blocks: int,
                         local_blocks: int, n_out: int, dense_row: Optional[Tensor] = None,
                         stats: Optional[Tensor] = None
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A Quest decode step's selection and the predictor's step (one launch on SM90):
    ``quest_select`` with P(t) read at rows ``p_rows`` of p_idx/p_cnt, then
    ``predict_update_rows`` on state rows ``rows`` with P(t+1) written at rows ``p_next_rows``
    (P(t) is read before P(t+1) is written, so the two may be the same rows)."""
    out = quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks,
                       n_out, p_rows, dense_row, stats)
    predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, out[0], nblk, nblk_next,
                        n_pred, sink_blocks, local_blocks, p_next_rows)
    return out


def select_fused(method: str, q: Tensor, summary: Sequence[Tensor], table: Tensor,
                 seq_lens: Tensor, page_size: int, sm_scale: float, k: int, sink_blocks: int,
                 local_blocks: int, p_idx: Optional[Tensor] = None,
                 p_cnt: Optional[Tensor] = None, impl=None, nblk: Optional[Tensor] = None,
                 n_out: Optional[int] = None, p_rows: Optional[Tensor] = None,
                 dense_row: Optional[Tensor] = None, stats: Optional[Tensor] = None
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Selection of one decode step for either method: ``(scores, a_idx, a_cnt, m_idx, m_cnt)``
    with ``M = A \\ P`` (``M = A`` without P); lists of width ``n_out`` (default
    ``k + sink + local``). ``nblk`` (default from ``seq_lens``), ``p_rows``, ``dense_row`` and
    ``stats`` as in ``quest_select``."""
    impl = _this if impl is None else impl
    n_out = k + sink_blocks + local_blocks if n_out is None else n_out
    nblk = num_blocks(seq_lens, page_size) if nblk is None else nblk
    if method == "quest":
        return impl.quest_select(q, summary[0], summary[1], table, nblk, p_idx, p_cnt, k,
                                 sink_blocks, local_blocks, n_out, p_rows, dense_row, stats)
    scores = impl.select_blocks(method, q, summary, table, seq_lens, page_size, sm_scale)
    return select_from_scores(scores, nblk, table.shape[1], p_idx, p_cnt, k, sink_blocks,
                              local_blocks, n_out, p_rows, dense_row, stats, impl)


def dsa_decode(q: Tensor, k_buf: Tensor, v_buf: Tensor, summary: Sequence[Tensor], table: Tensor,
               seq_lens: Tensor, method: str, k: int, sink_blocks: int, local_blocks: int,
               page_size: int, sm_scale: float, impl=None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Serial DSA decode step: score, select A, attend over A.

    ``impl`` is the module whose ops are composed (this one by default; ``sglang_prr.ops`` for
    the dispatching path). Returns ``(o [B, Hq, D] float32, scores [B, Hk, NB], a_idx, a_cnt)``.
    """
    impl = _this if impl is None else impl
    scores, a_idx, a_cnt, _, _ = impl.select_fused(method, q, summary, table, seq_lens,
                                                   page_size, sm_scale, k, sink_blocks,
                                                   local_blocks)
    o, _ = impl.attend_set(q, k_buf, v_buf, table, seq_lens, a_idx, a_cnt, page_size, sm_scale)
    return o, scores, a_idx, a_cnt


def prr_decode(q: Tensor, k_buf: Tensor, v_buf: Tensor, summary: Sequence[Tensor], table: Tensor,
               seq_lens: Tensor, p_idx: Tensor, p_cnt: Tensor, level: Tensor, trend: Tensor,
               n_init: Tensor, theta: Tensor, method: str, k: int, n_pred: int, sink_blocks: int,
               local_blocks: int, page_size: int, sm_scale: float, exact: bool = True, impl=None
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One PRR decode step (predict -> speculative attention -> selection -> repair -> merge).

    p_idx/p_cnt: this step's prediction P (any set: the output does not depend on it in exact
    mode); level/trend/n_init: predictor state, updated in place; theta: ``[B, 3]`` (alpha, beta,
    gamma). ``impl`` as in ``dsa_decode``. Returns ``(o, a_idx, a_cnt, m_idx, m_cnt, p_next_idx,
    p_next_cnt)`` where P(t+1) is predicted for ``seq_lens + 1`` tokens.
    """
    impl = _this if impl is None else impl
    nb = table.shape[1]
    # Reuse: speculative pass over P (beside selection, on a second stream, in the CUDA path).
    o_s, lse_s = impl.sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, p_idx, p_cnt,
                                           page_size, sm_scale)
    # Selection with M = A \ P, then the predictor update and P(t+1), off the critical path.
    scores, a_idx, a_cnt, m_idx, m_cnt = impl.select_fused(
        method, q, summary, table, seq_lens, page_size, sm_scale, k, sink_blocks, local_blocks,
        p_idx, p_cnt)
    pn_idx, pn_cnt = impl.predict_update(level, trend, n_init, scores,
                                         num_blocks(seq_lens, page_size), theta,
                                         num_blocks(seq_lens + 1, page_size), n_pred,
                                         sink_blocks, local_blocks)
    # Repair over M = A \ P merged with the speculative partials (exact: only P n A of them).
    o, _ = impl.sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, m_idx, m_cnt, page_size,
                                  sm_scale, o_s, lse_s, p_idx, p_cnt, a_idx, a_cnt, nb, exact)
    return o, a_idx, a_cnt, m_idx, m_cnt, pn_idx, pn_cnt


_this = sys.modules[__name__]
