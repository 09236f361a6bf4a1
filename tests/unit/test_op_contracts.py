"""The public ops on inputs outside their contract: a clear ValueError, or a defined result.

Shapes, dtypes and integer arguments are checked (``sglang_prr.contracts``) and a violation
raises ``ValueError`` naming the argument; values the checks cannot read without a sync have a
defined result: garbage in K/V slots past a request's length never reaches the output, counts
and ids outside a list's range are ignored, a repeated id counts once, ``nblk`` past the table is
clamped, and an empty selection attends nothing. Each property is drawn with hypothesis over fresh random inputs.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from paged import make_paged
from sglang_prr import ops
from sglang_prr import reference as ref

import pytest


def _case(seed, lens=(70, 37)):
    P = make_paged(seed, list(lens))
    kmin, kmax = P.quest_summary()
    return P, kmin, kmax


def _select(P, lo, hi, **over):
    args = dict(q=P.q, kmin=lo, kmax=hi, table=P.table, nblk=P.nblk, p_idx=None, p_cnt=None,
                k=2, sink_blocks=1, local_blocks=1, n_out=4)
    args.update(over)
    return ops.quest_select(**args)


BAD_SELECT = {
    "k": dict(k=-1),
    "sink_blocks": dict(sink_blocks=-2),
    "local_blocks": dict(local_blocks=-1),
    "n_out": dict(n_out=3),  # < k + sink + local
    "nblk": "nblk_batch",
    "summary KV heads": "heads",
    "q.shape": "q2d",
    "stats": "stats_dtype",
}


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**30), which=st.sampled_from(sorted(BAD_SELECT)))
def test_quest_select_rejects_bad_arguments_by_name(seed, which):
    P, kmin, kmax = _case(seed)
    bad = BAD_SELECT[which]
    if bad == "nblk_batch":
        bad = dict(nblk=P.nblk[:1])
    elif bad == "heads":  # summaries with 3 KV heads for 8 query heads
        bad = dict(kmin=kmin[:, :1].expand(-1, 3, -1).contiguous(),
                   kmax=kmax[:, :1].expand(-1, 3, -1).contiguous())
    elif bad == "q2d":
        bad = dict(q=P.q[:, 0])
    elif bad == "stats_dtype":
        bad = dict(stats=torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match=which.split()[0]):
        _select(P, kmin, kmax, **bad)
    _select(P, kmin, kmax)  # control: the same case without the corruption runs


BAD_ATTN = ["q.shape", "num_kv_heads", "page_size", "table.shape", "seq_lens.shape",
            "dtypes", "idx.shape"]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**30), which=st.sampled_from(BAD_ATTN))
def test_attention_rejects_bad_arguments_by_name(seed, which):
    P, _, _ = _case(seed)
    nb = P.nblk.tolist()
    idx = torch.full((2, 2, 4), -1, dtype=torch.int32)
    idx[..., 0] = 0
    cnt = torch.ones(2, 2, dtype=torch.int32)
    args = [P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, idx, cnt, P.page, P.sm_scale]
    if which == "q.shape":
        args[0] = P.q.reshape(2, -1)
    elif which == "num_kv_heads":
        args[0] = P.q[:, :7]
    elif which == "page_size":
        args[7] = 0
    elif which == "table.shape":
        args[3] = P.table[:1]
    elif which == "seq_lens.shape":
        args[4] = P.seq_lens[:1]
    elif which == "dtypes":
        args[6] = cnt.long()
    else:
        args[5] = idx[:, :1]
    with pytest.raises(ValueError, match=which.split(".")[0].split("_")[0]):
        ops.sparse_attn_partials(*args)
    assert nb  # control below: the valid call runs
    ops.sparse_attn_partials(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, idx, cnt, P.page,
                             P.sm_scale)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**30), poison=st.sampled_from([float("nan"), float("inf"),
                                                           float("-inf")]))
def test_garbage_past_the_request_never_reaches_the_output(seed, poison):
    """K/V slots at and past a request's length, inside its last (attended) page, hold garbage
    (a stale NaN or inf): the attention over that page is what it is with clean slots."""
    P, kmin, kmax = _case(seed, lens=(70, 37))  # both end inside a page of 16
    idx = torch.full((2, 2, 6), -1, dtype=torch.int32)
    cnt = torch.zeros(2, 2, dtype=torch.int32)
    for b, L in enumerate(P.seq_lens.tolist()):
        last = (L - 1) // P.page
        idx[b, :, 0], idx[b, :, 1] = 0, last
        cnt[b] = 2
    want = ops.attend_set(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, idx, cnt, P.page,
                          P.sm_scale)[0]
    k_bad, v_bad = P.k_buf.clone(), P.v_buf.clone()
    for b, L in enumerate(P.seq_lens.tolist()):
        page = int(P.table[b, (L - 1) // P.page])
        stale = torch.arange(L % P.page, P.page) + page * P.page  # same page, past the request
        assert len(stale) > 0
        k_bad[stale], v_bad[stale] = poison, poison
    got = ops.attend_set(P.q, k_bad, v_bad, P.table, P.seq_lens, idx, cnt, P.page,
                         P.sm_scale)[0]
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    # Negative control: the same garbage one slot earlier (inside the request) does change it.
    b0, L0 = 0, int(P.seq_lens[0])
    inside = int(P.table[0, (L0 - 1) // P.page]) * P.page + (L0 - 1) % P.page
    v_in = P.v_buf.clone()
    v_in[inside] = 1e3
    moved = ops.attend_set(P.q, P.k_buf, v_in, P.table, P.seq_lens, idx, cnt, P.page,
                           P.sm_scale)[0]
    assert not torch.equal(moved[b0], want[b0])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**30), extra=st.integers(1, 40))
def test_out_of_range_counts_ids_and_nblk_have_defined_results(seed, extra):
    """Counts past the width or negative, ids past NB or negative, nblk past the table: the same
    result as the sanitized input (both implementations clamp the same way)."""
    P, kmin, kmax = _case(seed)
    NB = P.nb
    idx = torch.tensor([[[0, 2, NB + extra, -5]] * 2] * 2, dtype=torch.int32)
    cnt = torch.tensor([[4 + extra, -extra]] * 2, dtype=torch.int32)
    clean_idx = torch.tensor([[[0, 2, -1, -1]] * 2] * 2, dtype=torch.int32)
    clean_cnt = torch.tensor([[2, 0]] * 2, dtype=torch.int32)
    got = ops.attend_set(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, idx, cnt, P.page,
                         P.sm_scale)
    want = ops.attend_set(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, clean_idx, clean_cnt,
                          P.page, P.sm_scale)
    assert torch.equal(got[0], want[0])
    # nblk past the table width: as if it were the width.
    big = _select(P, kmin, kmax, nblk=P.nblk + NB + extra)
    clamped = _select(P, kmin, kmax, nblk=torch.full_like(P.nblk, NB))
    for a, b in zip(big[1:], clamped[1:]):
        assert torch.equal(a, b)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**30), reps=st.lists(st.integers(0, 2), min_size=3, max_size=3),
       exact=st.booleans())
def test_repeated_ids_count_once(seed, reps, exact):
    """Duplicates are ignored: a list with ids repeated (ascending) attends, and P with repeats
    merges, as the list of its distinct ids; control: counting a repeat again differs."""
    P, _, _ = _case(seed)
    ids = [0, 2, 3]
    rep = sorted(sum(([i] * (1 + r) for i, r in zip(ids, reps)), []))
    n = len(rep)
    mk = lambda xs, w: torch.tensor([[xs + [-1] * (w - len(xs))] * 2] * 2, dtype=torch.int32)
    cnt = lambda c: torch.full((2, 2), c, dtype=torch.int32)
    got = ops.attend_set(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, mk(rep, n), cnt(n), P.page,
                         P.sm_scale)[0]
    want = ops.attend_set(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, mk(ids, n), cnt(3),
                          P.page, P.sm_scale)[0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # P with repeats: its speculative partials (repeats carry their block's) merged with A = P.
    o1, l1 = ref.sparse_attn_partials(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, mk(ids, 3),
                                      cnt(3), P.page, P.sm_scale)
    src = torch.tensor([ids.index(x) for x in rep])
    o_s, l_s = o1[:, :, src], l1[:, :, src]
    empty = mk([], 1), cnt(0)
    merged = ops.sparse_attn_merge(P.q, P.k_buf, P.v_buf, P.table, P.seq_lens, *empty, P.page,
                                   P.sm_scale, o_s, l_s, mk(rep, n), cnt(n), mk(ids, 3), cnt(3),
                                   P.nb, exact)[0]
    assert torch.allclose(merged, want, rtol=1e-5, atol=1e-6)
    if len(set(reps)) > 1:  # control: every entry merged (uneven repeats shift the weights)
        twice = ref.merge_partials(o_s, l_s)[0]
        assert not torch.allclose(twice, want, rtol=1e-3, atol=1e-4)


def test_an_empty_selection_attends_nothing():
    """K = sink = local = 0 selects no block: the empty state (0, -inf), not an IndexError."""
    P, kmin, kmax = _case(7)
    o, scores, a_idx, a_cnt = ops.dsa_decode(P.q, P.k_buf, P.v_buf, [kmin, kmax], P.table,
                                             P.seq_lens, "quest", 0, 0, 0, P.page, P.sm_scale)
    assert a_idx.shape[-1] == 0 and int(a_cnt.abs().sum()) == 0
    assert torch.equal(o, torch.zeros_like(o))
    one = ops.dsa_decode(P.q, P.k_buf, P.v_buf, [kmin, kmax], P.table, P.seq_lens, "quest", 0,
                         1, 0, P.page, P.sm_scale)[0]
    assert float(one.abs().sum()) > 0  # control: one kept block attends something
    assert ref.merge_partials(torch.zeros(2, 0, 4), torch.zeros(2, 0))[1].isneginf().all()


def _guard_mismatches(guard, schema):
    """Arguments of the op's schema the CUDA guard ``guard`` names otherwise, or takes without the
    op's default (the dispatcher passes on only what the caller gave: an argument the caller
    leaves to its default reaches the guard missing)."""
    import inspect

    params = list(inspect.signature(guard).parameters.values())
    bad = [f"names {[p.name for p in params]}"] if [p.name for p in params] != [
        a.name for a in schema.arguments] else []
    for p, a in zip(params, schema.arguments):
        if a.has_default_value() and (p.default is inspect.Parameter.empty
                                      or p.default != a.default_value):
            bad.append(f"{a.name}: default {p.default!r}, the op's {a.default_value!r}")
    return bad


def test_cuda_guards_take_the_ops_arguments_and_defaults():
    """Every CUDA implementation registered for an op (``kernels.IMPLS``, built or not) takes
    the op's arguments, with its defaults, so a call that omits an optional argument works on
    CUDA as on the CPU. Control: a guard without the defaults is caught."""
    from sglang_prr import kernels

    for name, guard in kernels.IMPLS.items():
        schema = getattr(torch.ops.sglang_prr, name).default._schema
        assert not _guard_mismatches(guard, schema), name
    schema = torch.ops.sglang_prr.sparse_attn_merge.default._schema
    assert any(a.has_default_value() for a in schema.arguments if a.name == "o_spec")

    def old_guard(q, k_buf, v_buf, table, seq_lens, idx, cnt, page_size, sm_scale, o_spec,
                  lse_spec, p_idx, p_cnt, a_idx, a_cnt, nb, exact, p_rows=None, out_dtype=None):
        pass

    assert len(_guard_mismatches(old_guard, schema)) == 8
