"""Input contracts of the public ops (``sglang_prr.ops``), checked at the Python boundary.

Every check reads shapes, dtypes and integer arguments only, never a tensor value, so it costs no
device work, no host synchronisation, and is as valid inside a CUDA-graph capture as outside. A
violated contract raises ``ValueError`` naming the argument, the value received and the value
expected. Both implementations of an op (the torch reference and the SM90 kernel) call the same
check, so they accept and refuse the same inputs.

What the checks cannot see (values) has a defined result instead, in both implementations:
block ids outside ``[0, NB)`` and entries past a list's count are ignored, counts are clamped to
``[0, width]``, ``nblk`` past the table's width is clamped to it, K/V slots at or past a
request's length are never read into the arithmetic (a NaN there does not reach the output), and
an index outside its pool is 0, SGLang's padding row, page or slot (``reference.in_pool``):
request slots (``rows``, ``p_rows``, ``idx_rows``, ``req_idx``), a table's page ids, and KV slots
(``out_loc``, ``new_loc``, ``req_to_token``'s), and a position past a ``req_to_token`` row (read
at its column 0). Never memory past a pool.

The shared rules live in ``contracts_base``, the predictor's and the calibration's checks in
``contracts_predictor`` and InfLLM-v2's in ``contracts_infllm``; this module holds the attention
and selection checks and re-exports the others, so that every op's check is
``contracts.check_<op>``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .contracts_base import (_FLOATS, _batch, block_list, fail, floating, index_tensor, nonneg,
                             page_size, rows_of, shape, softmax_scale)
from .contracts_predictor import (check_best_theta, check_calib_grid_terms, check_calibrate,
                                  check_holt_update, check_predict_set, check_predict_update,
                                  check_predict_update_rows)

# The ops (custom_ops, the kernels' guards) call each check as ``contracts.check_<op>`` and the
# methods use the shared rules as ``contracts.<rule>``: the family modules' names are here too.
__all__ = [
    "STATS_SLOTS", "new_stats", "fail", "shape", "nonneg", "page_size", "softmax_scale",
    "floating", "index_tensor", "rows_of", "block_list", "query", "paged_attention", "selection",
    "summaries", "summary_count", "new_keys", "check_sparse_attn_partials",
    "check_sparse_attn_merge", "check_select_topk", "check_select_lists", "check_quest_select",
    "check_quest_update", "check_quest_select_predict", "check_quest_scores",
    "check_set_difference", "check_accumulate_stats", "check_holt_update", "check_predict_set",
    "check_predict_update", "check_predict_update_rows", "check_select_lists_predict",
    "check_calib_grid_terms",
    "check_calibrate", "check_best_theta", "check_prr_merge", "check_merge_partials",
]

# The decode counters the selection accumulates (int64, one slot each, in this order): sum |A|,
# sum |M| and sum |P| over the sparse (request, KV head) rows of every layer-step, and the
# number of such rows. The kernels' ``StatSlot`` enum (kernels/prr_kernels.h) lists the same
# slots in the same order (tests/unit/test_structure.py reads both).
STATS_SLOTS = ("selected", "repair", "predicted", "rows")


def new_stats(device=None) -> Tensor:
    """Zeroed decode counters, ``[len(STATS_SLOTS)]`` int64 (see ``STATS_SLOTS``)."""
    return torch.zeros(len(STATS_SLOTS), dtype=torch.int64, device=device)


def query(op: str, q: Tensor) -> None:
    """A decode query ``[B, Hq, D]`` of a float dtype the kernels read (float32, float16 or
    bfloat16): the scoring ops accept what the attention ops accept."""
    if q.dim() != 3:
        fail(op, "q.shape", shape(q), "[batch, num_qo_heads, head_dim]")
    if q.dtype not in _FLOATS:
        fail(op, "q.dtype", q.dtype, "float32, float16 or bfloat16")


def paged_attention(op: str, q: Tensor, k_buf: Tensor, v_buf: Tensor, table: Tensor,
                    seq_lens: Tensor, page: int) -> None:
    """q ``[B, Hq, D]``; k_buf/v_buf ``[slots, Hk, D]``; table ``[B, NB]``; seq_lens ``[B]``.
    The pool holds at least one page and the table at least one block: a padding entry reads
    block 0 of the table and its page (masked afterwards), which must exist."""
    query(op, q)
    if k_buf.dim() != 3 or shape(k_buf) != shape(v_buf):
        fail(op, "k_buf/v_buf shapes", (shape(k_buf), shape(v_buf)),
             "both [num_slots, num_kv_heads, head_dim]")
    for name, t in (("k_buf", k_buf), ("v_buf", v_buf)):
        if t.dtype not in _FLOATS:
            fail(op, f"{name}.dtype", t.dtype, "float32, float16 or bfloat16")
    B, Hq, D = q.shape
    if k_buf.shape[2] != D:
        fail(op, "KV head_dim", k_buf.shape[2], f"q's head_dim {D}")
    if k_buf.shape[1] == 0 or Hq % k_buf.shape[1] != 0:
        fail(op, "num_kv_heads", k_buf.shape[1], f"a divisor of num_qo_heads={Hq}")
    page_size(op, page)
    if k_buf.shape[0] == 0 or k_buf.shape[0] % page != 0:
        fail(op, "KV slots", k_buf.shape[0], f"a multiple of page_size={page}, at least one page")
    index_tensor(op, "table", table, 2)
    if table.shape[0] != B:
        fail(op, "table.shape[0]", table.shape[0], f"the batch size {B}")
    if table.shape[1] == 0:
        fail(op, "table.shape[1]", 0, "NB >= 1 blocks per request")
    index_tensor(op, "seq_lens", seq_lens, 1)
    if seq_lens.shape[0] != B:
        fail(op, "seq_lens.shape", shape(seq_lens), f"({B},)")


def selection(op: str, k: int, sink: int, local: int, n_out: int) -> None:
    nonneg(op, k=k, sink_blocks=sink, local_blocks=local, n_out=n_out)
    if n_out < k + sink + local:
        fail(op, "n_out", n_out, f">= k + sink_blocks + local_blocks = {k + sink + local}")


def summaries(op: str, q: Tensor, parts: Sequence[Tensor], heads_dim: int) -> None:
    """Quest ``(kmin, kmax)`` ``[pages, Hk, D]`` (``heads_dim`` = 1) or InfLLM-v2 ``ck``
    ``[pages, page // 16, Hk, D]`` (``heads_dim`` = 2), float32 or bfloat16, matching q's heads
    and head dim."""
    allowed = (torch.float32, torch.bfloat16)
    for t in parts:
        if t.dtype not in allowed:
            fail(op, "summary dtype", t.dtype, " or ".join(str(d) for d in allowed))
        if t.dim() != heads_dim + 2 or t.shape[-1] != q.shape[-1]:
            fail(op, "summary shape", shape(t), f"[pages, ..., Hk, {q.shape[-1]}]")
        hk = t.shape[heads_dim]
        if hk == 0 or q.shape[1] % hk != 0:
            fail(op, "summary KV heads", hk, f"a divisor of num_qo_heads={q.shape[1]}")
    if len(parts) == 2 and shape(parts[0]) != shape(parts[1]):
        fail(op, "kmin/kmax shapes", (shape(parts[0]), shape(parts[1])), "equal")
    if len(parts) == 2 and parts[0].dtype != parts[1].dtype:
        fail(op, "kmin/kmax dtypes", (parts[0].dtype, parts[1].dtype), "equal")


def summary_count(op: str, method: str, summary: Sequence[Tensor], layout: Sequence) -> None:
    """A DSA method's summary: one tensor per entry of its ``layout`` (``DSAMethod.layout``), in
    that order. One missing fails as an IndexError inside the method; an extra one is ignored."""
    names = [t.name for t in layout]
    if len(summary) != len(names):
        fail(op, "len(summary)", len(summary),
             f"{len(names)}: the tensors {names} of method {method!r}")


# ----------------------------------------------------------------------------- per op
def check_sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size_,
                               idx_rows=None, op="sparse_attn_partials", sm_scale=None) -> None:
    paged_attention(op, q, k_buf, v_buf, table, seq_lens, page_size_)
    softmax_scale(op, sm_scale)
    block_list(op, "", idx, cnt, k_buf.shape[1])
    rows_of(op, "idx", idx_rows, q.shape[0], idx)


def check_sparse_attn_merge(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size_, o_spec,
                            lse_spec, p_idx, p_cnt, a_idx, a_cnt, nb, exact,
                            p_rows=None, sm_scale=None) -> None:
    """With ``o_spec`` both merges read P's list (an id repeated in P merges once, and P's
    entries are o_spec's N1 partials); the exact one also reads A and ``nb``, which must be the
    table's width: the merge keeps a P entry by looking it up in A among ``nb`` ids, so another
    ``nb`` silently keeps or drops blocks of the table."""
    op = "sparse_attn_merge"
    check_sparse_attn_partials(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size_, op=op,
                               sm_scale=sm_scale)
    if o_spec is None:
        return
    B, Hq, D = q.shape
    if lse_spec is None or o_spec.dim() != 4 or shape(o_spec)[:2] != (B, Hq) \
            or o_spec.shape[3] != D or shape(lse_spec) != shape(o_spec)[:3]:
        fail(op, "o_spec/lse_spec shapes",
             (shape(o_spec), None if lse_spec is None else shape(lse_spec)),
             f"[{B}, {Hq}, N1, {D}] and [{B}, {Hq}, N1]")
    floating(op, "o_spec", o_spec)
    floating(op, "lse_spec", lse_spec)
    if p_idx is None or p_cnt is None:
        fail(op, "p_idx/p_cnt", "missing", "P's list and counts with o_spec (both merges)")
    block_list(op, "p", p_idx, p_cnt, k_buf.shape[1])
    if p_idx.shape[2] != o_spec.shape[2]:
        fail(op, "p_idx width", p_idx.shape[2], f"o_spec's N1 = {o_spec.shape[2]}")
    rows_of(op, "p", p_rows, B, p_idx)
    if not exact:
        return
    if a_idx is None or a_cnt is None:
        fail(op, "a_idx/a_cnt", "missing", "A's list and counts for the exact merge")
    block_list(op, "a", a_idx, a_cnt, k_buf.shape[1])
    rows_of(op, "a", None, B, a_idx)
    nonneg(op, nb=nb)
    if nb != table.shape[1]:
        fail(op, "nb", nb, f"the table's width table.shape[1] = {table.shape[1]}")


def check_select_topk(scores, nblk, k, sink, local, n_out, dense_row=None,
                      op: str = "select_topk") -> None:
    if scores.dim() != 3:
        fail(op, "scores.shape", shape(scores), "[batch, num_kv_heads, num_blocks]")
    index_tensor(op, "nblk", nblk, 1)
    if nblk.shape[0] != scores.shape[0]:
        fail(op, "nblk.shape", shape(nblk), f"({scores.shape[0]},)")
    selection(op, k, sink, local, n_out)
    if dense_row is not None and (dense_row.dtype != torch.bool
                                  or shape(dense_row) != (scores.shape[0],)):
        fail(op, "dense_row", (dense_row.dtype, shape(dense_row)), f"bool ({scores.shape[0]},)")


def check_select_lists(scores, nblk, p_idx, p_cnt, k, sink, local, n_out, p_rows=None,
                       dense_row=None, stats=None, op: str = "select_lists") -> None:
    check_select_topk(scores, nblk, k, sink, local, n_out, dense_row, op=op)
    if p_idx is not None:
        if p_cnt is None:
            fail(op, "p_cnt", None, "a tensor with p_idx")
        block_list(op, "p", p_idx, p_cnt, scores.shape[1])
        rows_of(op, "p", p_rows, scores.shape[0], p_idx)
    if stats is not None and (stats.dtype != torch.int64 or shape(stats) != (len(STATS_SLOTS),)):
        fail(op, "stats", (stats.dtype, shape(stats)), f"int64 ({len(STATS_SLOTS)},)")


def check_quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink, local, n_out,
                       p_rows=None, dense_row=None, stats=None, new_k=None, new_pos=None,
                       page_size_=0, op: str = "quest_select", new_loc=None) -> None:
    query(op, q)
    summaries(op, q, (kmin, kmax), 1)
    index_tensor(op, "table", table, 2)
    index_tensor(op, "nblk", nblk, 1)
    if table.shape[0] != q.shape[0] or nblk.shape[0] != q.shape[0]:
        fail(op, "table/nblk batch", (table.shape[0], nblk.shape[0]), f"{q.shape[0]}")
    selection(op, k, sink, local, n_out)
    if p_idx is not None:
        if p_cnt is None:
            fail(op, "p_cnt", None, "a tensor with p_idx")
        block_list(op, "p", p_idx, p_cnt, kmin.shape[1])
        rows_of(op, "p", p_rows, q.shape[0], p_idx)
    if dense_row is not None and (dense_row.dtype != torch.bool
                                  or shape(dense_row) != (q.shape[0],)):
        fail(op, "dense_row", (dense_row.dtype, shape(dense_row)), f"bool ({q.shape[0]},)")
    if stats is not None and (stats.dtype != torch.int64 or shape(stats) != (len(STATS_SLOTS),)):
        fail(op, "stats", (stats.dtype, shape(stats)), f"int64 ({len(STATS_SLOTS)},)")
    new_keys(op, q, kmin.shape[1], new_k, new_pos, page_size_, new_loc)


def new_keys(op: str, q: Tensor, heads: int, new_k: Optional[Tensor], new_pos: Optional[Tensor],
             page: int, new_loc: Optional[Tensor] = None) -> None:
    """A selection's new keys: none, or ``new_k [B, Hk, D]`` float with ``new_pos [B]`` and a
    page size; their slots ``new_loc [B]`` (the summaries written) only with them."""
    if new_k is None:
        for name, t in (("new_pos", new_pos), ("new_loc", new_loc)):
            if t is not None:
                fail(op, name, shape(t), "None without new_k")
        return
    B, _, D = q.shape
    if new_k.dtype not in _FLOATS or shape(new_k) != (B, heads, D):
        fail(op, "new_k", (new_k.dtype, shape(new_k)), f"float ({B}, {heads}, {D})")
    if new_pos is None:
        fail(op, "new_pos", None, f"an int ({B},) tensor with new_k")
    index_tensor(op, "new_pos", new_pos, 1)
    _batch(op, B, new_pos=new_pos)
    if new_loc is not None:
        index_tensor(op, "new_loc", new_loc, 1)
        _batch(op, B, new_loc=new_loc)
    page_size(op, page)


def check_quest_update(kmin, kmax, k, out_loc, positions, page_size_) -> None:
    op = "quest_update"
    page_size(op, page_size_)
    if k.dim() != 3 or k.dtype not in _FLOATS:
        fail(op, "k", (k.dtype, shape(k)), "float [tokens, num_kv_heads, head_dim]")
    summaries(op, k, (kmin, kmax), 1)
    if kmin.shape[1] != k.shape[1]:
        fail(op, "summary KV heads", kmin.shape[1], f"k's {k.shape[1]}")
    for name, t in (("out_loc", out_loc), ("positions", positions)):
        index_tensor(op, name, t, 1)
        if t.shape[0] != k.shape[0]:
            fail(op, f"{name}.shape", shape(t), f"({k.shape[0]},)")


def check_select_lists_predict(scores, nblk, nblk_next, p_idx, p_cnt, p_rows, p_next_rows, level,
                               trend, n_init, theta, rows, k, n_pred, sink, local, n_out,
                               dense_row=None, stats=None) -> None:
    op = "select_lists_predict"
    check_select_lists(scores, nblk, p_idx, p_cnt, k, sink, local, n_out, p_rows, dense_row,
                       stats, op=op)
    if p_rows is None or p_next_rows is None:
        fail(op, "p_rows/p_next_rows", None, "tensors (P(t) and P(t+1) at pool rows)")
    check_predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, scores, nblk,
                              nblk_next, n_pred, sink, local, p_next_rows, op=op)


def check_quest_select_predict(q, kmin, kmax, table, nblk, nblk_next, p_idx, p_cnt, p_rows,
                               p_next_rows, level, trend, n_init, theta, rows, k, n_pred, sink,
                               local, n_out, dense_row=None, stats=None, new_k=None,
                               new_pos=None, page_size_=0, new_loc=None) -> None:
    op = "quest_select_predict"
    check_quest_select(q, kmin, kmax, table, nblk, p_idx, p_cnt, k, sink, local, n_out, p_rows,
                       dense_row, stats, new_k, new_pos, page_size_, op=op, new_loc=new_loc)
    if level.dim() != 3 or shape(level)[1:] != (kmin.shape[1], table.shape[1]):
        fail(op, "level.shape", shape(level), f"[rows, {kmin.shape[1]}, {table.shape[1]}]")
    scores = torch.empty((q.shape[0],) + tuple(level.shape[1:]), device="meta")  # shape only
    check_predict_update_rows(level, trend, n_init, p_idx, p_cnt, theta, rows, scores, nblk,
                              nblk_next, n_pred, sink, local, p_next_rows, op=op)


# ----------------------------------------------------------------------------- the other ops
def check_quest_scores(q, kmin, kmax, table, nblk) -> None:
    op = "quest_scores"
    query(op, q)
    summaries(op, q, (kmin, kmax), 1)
    index_tensor(op, "table", table, 2)
    index_tensor(op, "nblk", nblk, 1)
    _batch(op, q.shape[0], table=table, nblk=nblk)


def check_set_difference(a_idx, a_cnt, p_idx, p_cnt, nb, p_rows=None, stats=None,
                         dense_row=None) -> None:
    op = "set_difference"
    nonneg(op, nb=nb)
    if a_idx.dim() != 3:
        fail(op, "a_idx.shape", shape(a_idx), "[batch, num_kv_heads, N]")
    block_list(op, "a", a_idx, a_cnt, a_idx.shape[1])
    block_list(op, "p", p_idx, p_cnt, a_idx.shape[1])
    rows_of(op, "p_idx", p_rows, a_idx.shape[0], p_idx)
    if stats is not None:
        if stats.dtype != torch.int64 or shape(stats) != (len(STATS_SLOTS),):
            fail(op, "stats", (stats.dtype, shape(stats)),
                 f"int64 [{len(STATS_SLOTS)}] (new_stats)")
    if dense_row is not None and (dense_row.dtype != torch.bool
                                  or shape(dense_row) != (a_idx.shape[0],)):
        fail(op, "dense_row", (dense_row.dtype, shape(dense_row)), f"bool ({a_idx.shape[0]},)")


def check_accumulate_stats(stats, a_cnt, m_cnt, p_cnt, dense_row) -> None:
    op = "accumulate_stats"
    if stats.dtype != torch.int64 or shape(stats) != (len(STATS_SLOTS),):
        fail(op, "stats", (stats.dtype, shape(stats)), f"int64 [{len(STATS_SLOTS)}] (new_stats)")
    if a_cnt.dim() != 2 or a_cnt.dtype != torch.int32:
        fail(op, "a_cnt", (a_cnt.dtype, shape(a_cnt)), "int32 [batch, num_kv_heads]")
    for name, t in (("m_cnt", m_cnt), ("p_cnt", p_cnt)):
        if t is not None and (t.dtype != torch.int32 or shape(t) != shape(a_cnt)):
            fail(op, name, (t.dtype, shape(t)), f"int32 {shape(a_cnt)}")
    if dense_row is not None and (dense_row.dtype != torch.bool
                                  or shape(dense_row) != (a_cnt.shape[0],)):
        fail(op, "dense_row", (dense_row.dtype, shape(dense_row)), f"bool ({a_cnt.shape[0]},)")


def check_prr_merge(o_spec, lse_spec, p_idx, p_cnt, a_idx, a_cnt, o_rep, lse_rep, nb,
                    exact) -> None:
    op = "prr_merge"
    nonneg(op, nb=nb)
    if o_spec.dim() != 4:
        fail(op, "o_spec.shape", shape(o_spec), "[batch, num_qo_heads, Np, head_dim]")
    B, Hq, Np, D = o_spec.shape
    if shape(lse_spec) != (B, Hq, Np):
        fail(op, "lse_spec.shape", shape(lse_spec), f"({B}, {Hq}, {Np})")
    if p_idx.dim() != 3 or p_idx.shape[1] == 0 or Hq % p_idx.shape[1] != 0:
        fail(op, "p_idx.shape", shape(p_idx), f"[{B}, a divisor of {Hq}, {Np}]")
    block_list(op, "p", p_idx, p_cnt, p_idx.shape[1])
    block_list(op, "a", a_idx, a_cnt, p_idx.shape[1])
    _batch(op, B, p_idx=p_idx, a_idx=a_idx, o_rep=o_rep)
    if p_idx.shape[2] != Np:
        fail(op, "p_idx.shape[2]", p_idx.shape[2], f"o_spec's {Np} entries")
    if o_rep.dim() != 4 or o_rep.shape[1] != Hq or o_rep.shape[3] != D:
        fail(op, "o_rep.shape", shape(o_rep), f"[{B}, {Hq}, Nm, {D}]")
    if shape(lse_rep) != shape(o_rep)[:3]:
        fail(op, "lse_rep.shape", shape(lse_rep), f"{shape(o_rep)[:3]}")
    for name, t in (("o_spec", o_spec), ("lse_spec", lse_spec), ("o_rep", o_rep),
                    ("lse_rep", lse_rep)):
        floating(op, name, t)


def check_merge_partials(o, lse) -> None:
    op = "merge_partials"
    if o.dim() < 2 or shape(lse) != shape(o)[:-1]:
        fail(op, "o/lse shapes", (shape(o), shape(lse)), "[..., N, D] and [..., N]")
