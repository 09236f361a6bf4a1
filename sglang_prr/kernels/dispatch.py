"""The per-op guards of the SM90 kernels and their registration as the ops' CUDA implementation.

``register()`` (called by ``sglang_prr.custom_ops`` at import) installs, for every
``sglang_prr::*`` op that has a kernel, a CUDA implementation that checks its inputs and runs
either the kernel or, for anything the kernel does not cover, the pure-torch reference. Nothing
is built then: the first guard that asks ``loader.active`` builds and loads the library. On a
GPU other than SM90, or when the build or load fails (one warning is logged), every op keeps
running the reference.

Fallbacks are decided from shapes, dtypes and device properties only (no tensor values are read),
so the choice is static within a CUDA graph. A new op: its guard here (the kernel's limits as
named constants beside it), its entry in ``IMPLS``.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from .. import contracts
from .. import reference as ref
from .infllm import IMPLS as INFLLM_IMPLS
from .limits import ATTN_MAX_GROUP, CALIB_MAX_BLOCKS, TOPK_MAX_BLOCKS
from .loader import FLOAT_TYPES, active, aligned

_registered = False

# Head dims the attention kernel is instantiated for (its largest GQA group, ATTN_MAX_GROUP,
# and the other size limits come from kernel_limits.h). Its MMAs are 16-bit, so it reads
# float16/bfloat16 KV; float32 KV runs the reference.
ATTN_HEAD_DIMS = (64, 128, 256)
ATTN_KV_TYPES = (torch.float16, torch.bfloat16)
# Shared memory the attention launch may ask for (the merge tail's lists and weights grow with
# the list widths); wider lists run the reference.
ATTN_MAX_SMEM = 160 * 1024


# ----------------------------------------------------------------------------- implementations
def _attn_ok(q, k_buf, v_buf, table, idx, cnt) -> bool:
    B, Hq, D = q.shape
    Hk = k_buf.shape[1]
    return (active(q.device) and D in ATTN_HEAD_DIMS and Hq % Hk == 0
            and Hq // Hk <= ATTN_MAX_GROUP and q.dtype in FLOAT_TYPES
            and k_buf.dtype in ATTN_KV_TYPES and v_buf.dtype == k_buf.dtype
            and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
            and all(s % 8 == 0 for s in (k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
                                         v_buf.stride(1)))
            and aligned(k_buf, v_buf) and idx.dtype == torch.int32 and cnt.dtype == torch.int32
            and table.dim() == 2 and table.stride(-1) == 1)


def _sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale,
                          idx_rows=None):
    contracts.check_sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size,
                                         idx_rows, sm_scale=sm_scale)
    if not _attn_ok(q, k_buf, v_buf, table, idx, cnt):
        return ref.sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size,
                                        sm_scale, idx_rows)
    return torch.ops.sglang_prr_cuda.sparse_attn_partials(
        q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, float(sm_scale), idx_rows)


def _quest_scores(q, kmin, kmax, table, nblk):
    contracts.check_quest_scores(q, kmin, kmax, table, nblk)
    ok = (active(q.device) and q.shape[-1] % 8 == 0 and q.shape[1] % kmin.shape[1] == 0
          and q.dtype in FLOAT_TYPES and kmin.dtype in SUMMARY_TYPES
          and kmax.dtype == kmin.dtype and kmin.is_contiguous() and kmax.is_contiguous()
          and aligned(kmin, kmax) and table.dim() == 2 and table.stride(-1) == 1
          and q.shape[1] * q.shape[2] * 4 <= 200 * 1024)
    if not ok:
        return ref.quest_scores(q, kmin, kmax, table, nblk)
    return torch.ops.sglang_prr_cuda.quest_scores(q, kmin, kmax, table, nblk)


def _select_topk(scores, nblk, k, sink_blocks, local_blocks, n_out, dense_row=None):
    contracts.check_select_topk(scores, nblk, k, sink_blocks, local_blocks, n_out, dense_row)
    if not (active(scores.device) and scores.shape[-1] <= TOPK_MAX_BLOCKS):
        return ref.select_topk(scores, nblk, k, sink_blocks, local_blocks, n_out, dense_row)
    return torch.ops.sglang_prr_cuda.select_topk(scores.float().contiguous(), nblk, k,
                                                 sink_blocks, local_blocks, n_out, dense_row)


def _predict_set(level, trend, gamma, n_init, nblk_next, n_pred, sink_blocks, local_blocks):
    contracts.check_predict_set(level, trend, gamma, n_init, nblk_next, n_pred, sink_blocks,
                                local_blocks)
    ok = (active(level.device) and level.shape[-1] <= TOPK_MAX_BLOCKS
          and level.dtype == torch.float32 and trend.dtype == torch.float32
          and level.is_contiguous() and trend.is_contiguous())
    if not ok:
        return ref.predict_set(level, trend, gamma, n_init, nblk_next, n_pred, sink_blocks,
                               local_blocks)
    return torch.ops.sglang_prr_cuda.predict_set(level, trend, gamma.float(), n_init, nblk_next,
                                                 n_pred, sink_blocks, local_blocks)


def _set_difference(a_idx, a_cnt, p_idx, p_cnt, nb, p_rows=None, stats=None, dense_row=None):
    contracts.check_set_difference(a_idx, a_cnt, p_idx, p_cnt, nb, p_rows, stats, dense_row)
    ok = (active(a_idx.device) and a_idx.dtype == torch.int32 and p_idx.dtype == torch.int32
          and a_cnt.dtype == torch.int32 and p_cnt.dtype == torch.int32 and nb <= (1 << 20)
          and (stats is None or stats.is_contiguous()))
    if not ok:
        return ref.set_difference_counted(a_idx, a_cnt, p_idx, p_cnt, nb, p_rows, stats,
                                          dense_row)
    return torch.ops.sglang_prr_cuda.set_difference(a_idx, a_cnt, p_idx, p_cnt, nb, p_rows,
                                                    stats, dense_row)


def _select_lists(scores, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks, n_out, p_rows,
                  dense_row, stats):
    contracts.check_select_lists(scores, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks, n_out,
                                 p_rows, dense_row, stats)
    if not (active(scores.device) and scores.shape[-1] <= TOPK_MAX_BLOCKS
            and (stats is None or stats.is_contiguous())):
        return ref.select_lists(scores, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks, n_out,
                                p_rows, dense_row, stats)
    return torch.ops.sglang_prr_cuda.select_lists(scores.float().contiguous(), nblk, p_idx, p_cnt,
                                                  k, sink_blocks, local_blocks, n_out, p_rows,
                                                  dense_row, stats)


def _accumulate_stats(stats, a_cnt, m_cnt, p_cnt, dense_row):
    contracts.check_accumulate_stats(stats, a_cnt, m_cnt, p_cnt, dense_row)
    if not (active(a_cnt.device) and stats.is_contiguous()):
        ref.accumulate_stats(stats, a_cnt, m_cnt, p_cnt, dense_row)
        return
    torch.ops.sglang_prr_cuda.accumulate_stats(stats, a_cnt, m_cnt, p_cnt, dense_row)


def _calib_grid_terms(scores, nblk, wa, am, alphas, betas, gammas, n_pred, sink_blocks,
                      local_blocks):
    contracts.check_calib_grid_terms(scores, nblk, wa, am, alphas, betas, gammas, n_pred,
                                     sink_blocks, local_blocks)
    ok = (active(scores.device) and scores.shape[-1] <= CALIB_MAX_BLOCKS
          and scores.is_contiguous() and nblk.dtype == torch.int64 and nblk.is_contiguous()
          and wa.is_contiguous() and am.is_contiguous() and scores.shape[0] <= 65535
          and scores.shape[2] <= 65535)
    if not ok:
        return ref.calib_grid_terms(scores, nblk, wa, am, alphas, betas, gammas, n_pred,
                                    sink_blocks, local_blocks)
    dev = scores.device
    axes = [t.to(dev, torch.float32).contiguous() for t in (alphas, betas, gammas)]
    return torch.ops.sglang_prr_cuda.calib_grid_terms(scores, nblk, wa, am, *axes, n_pred,
                                                      sink_blocks, local_blocks)


def _holt_update(level, trend, n_init, scores, nblk, alpha, beta):
    contracts.check_holt_update(level, trend, n_init, scores, nblk, alpha, beta)
    ok = (active(level.device) and level.dtype == torch.float32 and trend.dtype == torch.float32
          and level.is_contiguous() and trend.is_contiguous() and n_init.is_contiguous()
          and n_init.dtype in (torch.int32, torch.int64))
    if not ok:
        ref.holt_update(level, trend, n_init, scores, nblk, alpha, beta)
        return
    torch.ops.sglang_prr_cuda.holt_update(level, trend, n_init, scores, nblk, alpha.float(),
                                          beta.float())


# Groups (rows) one launch of a fused kernel may have: its counter array's size.
MAX_GROUPS = 1 << 18
# Quest summaries the kernels read: float32, or bfloat16 rounded outward.
SUMMARY_TYPES = (torch.float32, torch.bfloat16)


def attn_merge_smem(n: int, n1: int, na: int, group: int) -> int:
    """Bytes of shared memory the merge tail of ``sparse_attn_merge`` needs for its arrays
    (``merge_arrays_bytes`` in attention.cu, before its 16-byte rounding): the three lists, the
    keys, entries and sorted entries (int32) of both sources, and one weight per entry and query
    head of the group. The launch adds a row stage of at least one entry."""
    e = n + n1
    return 4 * (n + n1 + na + 3 * e) + 4 * group * e


def _sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale,
                       o_spec=None, lse_spec=None, p_idx=None, p_cnt=None, a_idx=None,
                       a_cnt=None, nb=0, exact=True, p_rows=None, out_dtype=None):
    """One launch: the attention over ``idx`` whose last CTA per (request, KV head) merges the
    kept partials in ascending block id (the same bits for serial DSA and PRR exact)."""
    contracts.check_sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size,
                                      o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, nb, exact,
                                      p_rows, sm_scale=sm_scale)
    B, Hq, D = q.shape
    n1 = o_spec.shape[2] if o_spec is not None else 0
    na = a_idx.shape[-1] if (o_spec is not None and exact) else 0
    smem = attn_merge_smem(idx.shape[2], n1, na, Hq // max(k_buf.shape[1], 1))
    ok = (_attn_ok(q, k_buf, v_buf, table, idx, cnt) and idx.shape[2] > 0 and D % 4 == 0
          and B * k_buf.shape[1] <= MAX_GROUPS and smem <= ATTN_MAX_SMEM
          and (o_spec is None or (o_spec.dtype == torch.float32 and lse_spec.dtype == torch.float32
                                  and (p_idx is None or p_idx.dtype == torch.int32)
                                  and (not exact or a_idx.dtype == torch.int32))))
    ok = ok and (out_dtype is None or out_dtype in FLOAT_TYPES)
    if not ok:
        return ref.sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size,
                                     sm_scale, o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, nb,
                                     exact, p_rows, out_dtype)
    return torch.ops.sglang_prr_cuda.sparse_attn_merge(
        q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, float(sm_scale), o_spec, lse_spec,
        p_idx, p_cnt, a_idx, a_cnt, nb, exact, p_rows, out_dtype)


def _quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink_blocks, local_blocks, n_out,
                  p_rows=None, dense_row=None, stats=None, new_k=None, new_pos=None,
                  page_size=0, new_loc=None):
    contracts.check_quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink_blocks,
                                 local_blocks, n_out, p_rows, dense_row, stats, new_k, new_pos,
                                 page_size, new_loc=new_loc)
    ok = _select_ok(q, kmin, kmax, table, nblk, p_idx, p_cnt, stats, new_k)
    if not ok:
        return ref.quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink_blocks,
                                local_blocks, n_out, p_rows, dense_row, stats, new_k, new_pos,
                                page_size, new_loc)
    return torch.ops.sglang_prr_cuda.quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k,
                                                  sink_blocks, local_blocks, n_out, p_rows,
                                                  dense_row, stats, new_k, new_pos, page_size,
                                                  new_loc)


def _select_ok(q, kmin, kmax, table, nblk, p_idx, p_cnt, stats, new_k=None) -> bool:
    """The selection kernels take these inputs: head dims 64/128/256 with groups up to 8 (the
    one-pass kernel), other multiples of 8 up to a group of 12K values (the row-tail kernel);
    both fold new keys of any float dtype (and write them into the summaries where asked)."""
    B, Hq, D = q.shape
    Hk = kmin.shape[1]
    G = Hq // max(Hk, 1)
    return (active(q.device) and D % 8 == 0 and Hq % Hk == 0
            and ((D in (64, 128, 256) and G <= 8) or G * D <= 12 * 1024)
            and q.dtype in FLOAT_TYPES and kmin.dtype in SUMMARY_TYPES
            and kmax.dtype == kmin.dtype and kmin.is_contiguous() and kmax.is_contiguous()
            and aligned(kmin, kmax) and table.dim() == 2 and table.stride(-1) == 1
            and 0 < table.shape[1] <= TOPK_MAX_BLOCKS and B * Hk <= MAX_GROUPS
            and (p_idx is None or (p_idx.dtype == torch.int32 and p_cnt.dtype == torch.int32))
            and (new_k is None or new_k.dtype in FLOAT_TYPES)
            and (stats is None or (stats.dtype == torch.int64 and stats.is_contiguous()
                                   and stats.numel() == len(contracts.STATS_SLOTS))))


def _quest_select_predict(q, kmin, kmax, table, nblk, nblk_next, p_idx, p_cnt, p_rows,
                          p_next_rows, level, trend, n_init, theta, rows, k, n_pred, sink_blocks,
                          local_blocks, n_out, dense_row=None, stats=None, new_k=None,
                          new_pos=None, page_size=0, new_loc=None):
    contracts.check_quest_select_predict(q, kmin, kmax, table, nblk, nblk_next, p_idx, p_cnt,
                                         p_rows, p_next_rows, level, trend, n_init, theta, rows,
                                         k, n_pred, sink_blocks, local_blocks, n_out, dense_row,
                                         stats, new_k, new_pos, page_size, new_loc)
    ok = (_select_ok(q, kmin, kmax, table, nblk, p_idx, p_cnt, stats, new_k)
          and q.shape[0] <= MAX_GROUPS
          and level.dtype == torch.float32 and trend.dtype == torch.float32
          and level.is_contiguous() and trend.is_contiguous() and n_init.is_contiguous()
          and n_init.dtype in (torch.int32, torch.int64) and theta.dtype == torch.float32
          and theta.stride(1) == 1 and p_idx.is_contiguous() and p_cnt.is_contiguous())
    if not ok:
        return ref.quest_select_predict(q, kmin, kmax, table, nblk, nblk_next, p_idx, p_cnt,
                                        p_rows, p_next_rows, level, trend, n_init, theta, rows,
                                        k, n_pred, sink_blocks, local_blocks, n_out, dense_row,
                                        stats, new_k, new_pos, page_size, new_loc)
    return torch.ops.sglang_prr_cuda.quest_select_predict(
        q, kmin, kmax, table, nblk, nblk_next, p_idx, p_cnt, p_rows, p_next_rows, level, trend,
        n_init, theta, rows, k, n_pred, sink_blocks, local_blocks, n_out, dense_row, stats,
        new_k, new_pos, page_size, new_loc)


def _predict_update(level, trend, n_init, scores, nblk, theta, nblk_next, n_pred, sink_blocks,
                    local_blocks):
    contracts.check_predict_update(level, trend, n_init, scores, nblk, theta, nblk_next, n_pred,
                                   sink_blocks, local_blocks)
    ok = (active(level.device) and level.shape[-1] <= TOPK_MAX_BLOCKS
          and level.dtype == torch.float32 and trend.dtype == torch.float32
          and level.is_contiguous() and trend.is_contiguous() and n_init.is_contiguous()
          and n_init.dtype in (torch.int32, torch.int64) and level.shape[0] <= MAX_GROUPS
          and theta.dim() == 2 and theta.shape[1] == 3)
    if not ok:
        return ref.predict_update(level, trend, n_init, scores, nblk, theta, nblk_next, n_pred,
                                  sink_blocks, local_blocks)
    th = theta.float()
    if th.stride(1) != 1:
        th = th.contiguous()
    return torch.ops.sglang_prr_cuda.predict_update(level, trend, n_init, scores, nblk, th,
                                                    nblk_next, n_pred, sink_blocks, local_blocks)


def _predictor_ok(level, trend, n_init, p_idx, p_cnt, theta, scores) -> bool:
    """Whether the predictor's kernel takes this state (else the reference runs)."""
    return (active(level.device) and level.shape[-1] <= TOPK_MAX_BLOCKS
            and level.dtype == torch.float32 and trend.dtype == torch.float32
            and level.is_contiguous() and trend.is_contiguous() and n_init.is_contiguous()
            and n_init.dtype in (torch.int32, torch.int64) and scores.shape[0] <= MAX_GROUPS
            and theta.dtype == torch.float32 and theta.dim() == 2 and theta.shape[1] == 3
            and theta.stride(1) == 1 and p_idx.dtype == torch.int32
            and p_cnt.dtype == torch.int32 and p_idx.is_contiguous() and p_cnt.is_contiguous()
            and tuple(scores.shape[1:]) == tuple(level.shape[1:]))


def _predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, scores, nblk,
                         nblk_next, n_pred, sink_blocks, local_blocks, p_rows=None):
    contracts.check_predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, scores,
                                        nblk, nblk_next, n_pred, sink_blocks, local_blocks,
                                        p_rows)
    if not _predictor_ok(level, trend, n_init, p_idx, p_cnt, theta, scores):
        ref.predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, scores, nblk,
                                nblk_next, n_pred, sink_blocks, local_blocks, p_rows)
        return
    torch.ops.sglang_prr_cuda.predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows,
                                                  scores, nblk, nblk_next, n_pred, sink_blocks,
                                                  local_blocks, p_rows)


def _select_lists_predict(scores, nblk, nblk_next, p_idx, p_cnt, p_rows, p_next_rows, level,
                          trend, n_init, theta, rows, k, n_pred, sink_blocks, local_blocks, n_out,
                          dense_row, stats):
    contracts.check_select_lists_predict(scores, nblk, nblk_next, p_idx, p_cnt, p_rows,
                                         p_next_rows, level, trend, n_init, theta, rows, k,
                                         n_pred, sink_blocks, local_blocks, n_out, dense_row,
                                         stats)
    if not (_predictor_ok(level, trend, n_init, p_idx, p_cnt, theta, scores)
            and (stats is None or stats.is_contiguous())):
        return ref.select_lists_predict(scores, nblk, nblk_next, p_idx, p_cnt, p_rows,
                                        p_next_rows, level, trend, n_init, theta, rows, k, n_pred,
                                        sink_blocks, local_blocks, n_out, dense_row, stats)
    return torch.ops.sglang_prr_cuda.select_lists_predict(
        scores.float().contiguous(), nblk, nblk_next, p_idx, p_cnt, p_rows, p_next_rows, level,
        trend, n_init, theta, rows, k, n_pred, sink_blocks, local_blocks, n_out, dense_row, stats)


def _merge_ok(o) -> bool:
    return active(o.device) and o.shape[-1] % 4 == 0 and o.shape[-1] <= 512 and o.shape[-2] > 0


def _prr_merge(o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, o_rep, lse_rep, nb, exact):
    contracts.check_prr_merge(o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, o_rep, lse_rep, nb,
                              exact)
    ok = (_merge_ok(o_spec) and o_rep.shape[-1] == o_spec.shape[-1]
          and p_idx.dtype == torch.int32 and a_idx.dtype == torch.int32
          and (not exact or nb <= (1 << 20)))
    if not ok:
        return ref.prr_merge(o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, o_rep, lse_rep, nb,
                             exact)
    return torch.ops.sglang_prr_cuda.prr_merge(o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt,
                                               o_rep, lse_rep, nb, exact)


def _merge_partials(o, lse):
    contracts.check_merge_partials(o, lse)
    if not _merge_ok(o):
        return ref.merge_partials(o, lse)
    return torch.ops.sglang_prr_cuda.merge_partials(o, lse)


def _quest_update(kmin, kmax, k, out_loc, positions, page_size, one_per_page=False):
    contracts.check_quest_update(kmin, kmax, k, out_loc, positions, page_size)
    ok = (active(kmin.device) and kmin.dtype in SUMMARY_TYPES and kmax.dtype == kmin.dtype
          and kmin.is_contiguous() and kmax.is_contiguous() and k.dtype in FLOAT_TYPES
          and (kmin.shape[1] * kmin.shape[2]) % 8 == 0)
    if not ok:
        ref.quest_update(kmin, kmax, k, out_loc, positions, page_size, one_per_page)
        return
    torch.ops.sglang_prr_cuda.quest_update(kmin, kmax, k, out_loc, positions, page_size,
                                           one_per_page)


IMPLS: Dict[str, Callable] = {
    "sparse_attn_partials": _sparse_attn_partials,
    "quest_scores": _quest_scores,
    "select_topk": _select_topk,
    "select_lists": _select_lists,
    "predict_set": _predict_set,
    "set_difference": _set_difference,
    "accumulate_stats": _accumulate_stats,
    "holt_update": _holt_update,
    "prr_merge": _prr_merge,
    "merge_partials": _merge_partials,
    "quest_update": _quest_update,
    "sparse_attn_merge": _sparse_attn_merge,
    "quest_select": _quest_select,
    "quest_select_predict": _quest_select_predict,
    "predict_update": _predict_update,
    "predict_update_rows": _predict_update_rows,
    "select_lists_predict": _select_lists_predict,
    "calib_grid_terms": _calib_grid_terms,
}
IMPLS.update(INFLLM_IMPLS)


def register() -> None:
    """Install the CUDA implementations of the ``sglang_prr::*`` ops (idempotent, no build)."""
    global _registered
    if _registered:
        return
    for name, fn in IMPLS.items():
        torch.library.register_kernel(f"sglang_prr::{name}", "cuda", fn)
    _registered = True
