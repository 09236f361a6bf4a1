"""``accumulate_stats``: the decode counters of a selection composed from separate ops (InfLLM-v2's)
as one op, and that composition counting through it; ``set_difference`` with P read at pool rows
and the counters added in its own launch (PRR's composed selection: no gather, no second
launch). CPU: the ops' reference paths; their SM90 kernels are compared with the reference in
``tests/gpu/test_kernels.py``."""

from __future__ import annotations

import pytest
import torch

from sglang_prr import contracts, custom_ops
from sglang_prr import reference as ref
from sglang_prr.methods.base import SelectSpec, select_from_scores


def _counts(seed, B=5, Hk=3):
    g = torch.Generator().manual_seed(seed)
    c = lambda lo: torch.randint(lo, 900, (B, Hk), generator=g, dtype=torch.int32)  # noqa: E731
    return c(0), c(0), c(-4), torch.rand(B, generator=g) < 0.5


def test_the_op_adds_the_reference_sums(seed):
    a, m, p, dense = _counts(seed)
    for pc, dr in ((p, dense), (None, None), (p, None), (None, dense)):
        want, got = contracts.new_stats(), contracts.new_stats()
        want += 7  # counters that already hold values
        got += 7
        ref.accumulate_stats(want, a, m, pc, dr)
        custom_ops.accumulate_stats(got, a, m, pc, dr)
        assert torch.equal(got, want), (pc is None, dr is None)
    # By hand, and a control: the rows of dense requests are not counted.
    got = contracts.new_stats()
    custom_ops.accumulate_stats(got, a, m, p, dense)
    keep = (~dense).view(-1, 1)
    assert got.tolist() == [int((a * keep).sum()), int((m * keep).sum()),
                            int((p.clamp(min=0) * keep).sum()), int(keep.sum()) * a.shape[1]]
    if dense.any():
        every = contracts.new_stats()
        custom_ops.accumulate_stats(every, a, m, p, None)
        assert every[3] > got[3]


@pytest.mark.parametrize("bad, name", [
    (dict(stats=torch.zeros(4, dtype=torch.int32)), "stats"),
    (dict(stats=torch.zeros(3, dtype=torch.int64)), "stats"),
    (dict(a_cnt=torch.zeros(5, 3, dtype=torch.int64)), "a_cnt"),
    (dict(m_cnt=torch.zeros(5, 4, dtype=torch.int32)), "m_cnt"),
    (dict(p_cnt=torch.zeros(5, 3, dtype=torch.float32)), "p_cnt"),
    (dict(dense_row=torch.zeros(5, dtype=torch.int32)), "dense_row"),
    (dict(dense_row=torch.zeros(4, dtype=torch.bool)), "dense_row"),
])
def test_bad_arguments_are_named(seed, bad, name):
    a, m, p, dense = _counts(seed)
    args = dict(stats=contracts.new_stats(), a_cnt=a, m_cnt=m, p_cnt=p, dense_row=dense)
    custom_ops.accumulate_stats(**args)  # control: the good arguments run
    args.update(bad)
    with pytest.raises(ValueError, match=name):
        custom_ops.accumulate_stats(**args)


def test_a_composed_selection_counts_as_the_reference(seed):
    """``methods.base.select_from_scores`` (the product's composition) accumulates the counters
    the reference composition does, with a prediction read at pool rows and dense rows."""
    g = torch.Generator().manual_seed(seed)
    B, Hk, NB, R = 4, 2, 30, 7
    scores = torch.randn(B, Hk, NB, generator=g)
    nblk = torch.randint(5, NB + 1, (B,), generator=g)
    p_idx = torch.sort(torch.randint(0, NB, (R, Hk, 9), generator=g, dtype=torch.int32)).values
    p_cnt = torch.randint(0, 10, (R, Hk), generator=g, dtype=torch.int32)
    rows = torch.randperm(R, generator=g)[:B]
    dense = torch.tensor([False, True, False, False])
    spec = SelectSpec.of(6, 1, 1, 16)
    got, want = contracts.new_stats(), contracts.new_stats()
    sel = select_from_scores(scores, nblk=nblk, nb=NB, spec=spec, p_idx=p_idx, p_cnt=p_cnt,
                             p_rows=rows, dense_row=dense, stats=got)
    r = ref.select_from_scores(scores, nblk, NB, p_idx, p_cnt, spec.k, spec.sink_blocks,
                               spec.local_blocks, spec.n_out, rows, dense, want)
    assert torch.equal(sel.m_cnt, r[4]) and torch.equal(got, want) and got[3] == 3 * Hk


def test_set_difference_reads_pool_rows_and_counts(seed):
    """``set_difference(p_rows=, stats=, dense_row=)`` == gather P's rows, the set difference,
    then ``accumulate_stats``; controls: other rows give another M, and without ``stats`` the
    counters stay untouched."""
    g = torch.Generator().manual_seed(seed)
    B, Hk, NB, R = 5, 3, 40, 9
    lists = lambda rows, n: (torch.sort(torch.randint(0, NB, (rows, Hk, n), generator=g,  # noqa
                                                      dtype=torch.int32)).values,
                             torch.randint(-1, n + 1, (rows, Hk), generator=g, dtype=torch.int32))
    a_idx, a_cnt = lists(B, 12)
    a_cnt = a_cnt.clamp(min=0)
    p_idx, p_cnt = lists(R, 15)
    rows = torch.randperm(R, generator=g)[:B]
    dense = torch.rand(B, generator=g) < 0.4
    want_stats, got_stats = contracts.new_stats() + 5, contracts.new_stats() + 5
    want = ref.set_difference(a_idx, a_cnt, p_idx[rows], p_cnt[rows], NB)
    ref.accumulate_stats(want_stats, a_cnt, want[1], p_cnt[rows], dense)
    got = custom_ops.set_difference(a_idx, a_cnt, p_idx, p_cnt, NB, p_rows=rows.int(),
                                    stats=got_stats, dense_row=dense)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got_stats, want_stats)
    other = custom_ops.set_difference(a_idx, a_cnt, p_idx, p_cnt, NB, p_rows=rows.flip(0))
    assert not torch.equal(other[0], got[0])  # control: P's rows matter
    untouched = contracts.new_stats()
    custom_ops.set_difference(a_idx, a_cnt, p_idx[rows], p_cnt[rows], NB, dense_row=dense)
    assert int(untouched.abs().sum()) == 0


def test_select_lists_is_topk_then_set_difference_then_counters(seed):
    """``select_lists`` (one op, one launch on SM90) == ``select_topk``, ``set_difference`` over
    P's pool rows and ``accumulate_stats``, stated op by op: messy P (repeats, -1, ids past the
    table, counts negative or past the width), dense rows wider than the lists (M is taken from
    A as cut); without P, M = A and |P| counts 0. Control: P's rows matter."""
    g = torch.Generator().manual_seed(seed)
    B, Hk, NB, R, Np = 5, 3, 23, 9, 8
    scores = torch.randn(B, Hk, NB, generator=g)
    nblk = torch.randint(0, NB + 1, (B,), generator=g)
    nblk[0] = NB
    p_idx = torch.randint(-2, NB + 3, (R, Hk, Np), generator=g, dtype=torch.int32)
    p_cnt = torch.randint(-2, Np + 3, (R, Hk), generator=g, dtype=torch.int32)
    rows = torch.randperm(R, generator=g)[:B]
    dense = torch.rand(B, generator=g) < 0.5
    dense[0] = True  # 23 blocks against lists of 7: A is cut
    k, sink, local, n_out = 3, 1, 1, 7
    a_idx, a_cnt = ref.select_topk(scores, nblk, k, sink, local, n_out, dense)
    m_idx, m_cnt = ref.set_difference(a_idx, a_cnt, p_idx[rows], p_cnt[rows], NB)
    want, got = contracts.new_stats() + 3, contracts.new_stats() + 3
    ref.accumulate_stats(want, a_cnt, m_cnt, p_cnt[rows], dense)
    out = custom_ops.select_lists(scores, nblk, p_idx, p_cnt, k, sink, local, n_out, rows, dense,
                                  got)
    for o, w in zip(out, (a_idx, a_cnt, m_idx, m_cnt)):
        assert torch.equal(o, w)
    assert torch.equal(got, want) and int(a_cnt[0, 0]) == n_out
    p_cnt[rows[0], 0] = Np + 5  # past the width: counted as given, as accumulate_stats does
    more = contracts.new_stats()
    custom_ops.select_lists(scores, nblk, p_idx, p_cnt, k, sink, local, n_out, rows, None, more)
    assert int(more[2]) == int(p_cnt[rows].clamp(min=0).sum())
    no_p = contracts.new_stats()
    out = custom_ops.select_lists(scores, nblk, None, None, k, sink, local, n_out, None, dense,
                                  no_p)
    assert torch.equal(out[2], a_idx) and torch.equal(out[3], a_cnt) and int(no_p[2]) == 0
    flipped = custom_ops.select_lists(scores, nblk, p_idx, p_cnt, k, sink, local, n_out,
                                      rows.flip(0), dense, None)
    assert not torch.equal(flipped[2], m_idx), "control: P's rows matter"
