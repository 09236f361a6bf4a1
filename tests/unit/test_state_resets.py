"""PRRState's row resets: exactly the rows handed out again start afresh, in every layer and in
both halves of P's double buffer; a flush resets everything; the other rows keep their state."""

import random

import torch

from sglang_prr.config import PRRConfig
from sglang_prr.state import PRRState


class _Pool:  # SGLang's ReqToTokenPool as the state reads it (weakly referenced)
    def __init__(self, rows, width):
        self.req_to_token = torch.zeros(rows, width, dtype=torch.int32)


def _filled_state(rows=9):
    pool = _Pool(rows, 200)
    st = PRRState(PRRConfig(top_k=3, top_k_unit="blocks", block_size=16).validate(), 3, 2, pool,
                  torch.device("cpu"))
    assert st.apply_resets() == [-1]  # the first forward resets every row
    for t in (st.level, st.trend, st.h_sum, st.h_cnt, st.theta):
        t.uniform_(0.5, 2.0)
    for t in (st.n_init, st.p_idx, st.p_cnt):
        t.random_(1, 50)
    st.shared_theta.uniform_(0.1, 0.4)
    return st, pool


def test_new_rows_are_reset_and_the_others_kept():
    st, _pool = _filled_state()
    new = random.sample(range(st.rows), 4)
    print(f"new rows {new}")
    before = {n: getattr(st, n).clone() for n in ("level", "trend", "n_init", "theta", "p_idx",
                                                   "p_cnt", "h_sum", "h_cnt")}
    st.mark_new(new)
    assert st.apply_resets() == sorted(new)
    assert st.apply_resets() == []  # nothing pending twice
    kept = [r for r in range(st.rows) if r not in new]
    both = [2 * r + h for r in new for h in (0, 1)]
    both_kept = [2 * r + h for r in kept for h in (0, 1)]
    for name, zero in (("level", 0), ("trend", 0), ("n_init", 0), ("h_sum", 0), ("h_cnt", 0)):
        t = getattr(st, name)
        assert bool((t[:, new] == zero).all()), name
        assert torch.equal(t[:, kept], before[name][:, kept]), name
    assert bool((st.p_idx[:, both] == -1).all()) and bool((st.p_cnt[:, both] == 0).all())
    assert torch.equal(st.p_idx[:, both_kept], before["p_idx"][:, both_kept])
    assert torch.equal(st.p_cnt[:, both_kept], before["p_cnt"][:, both_kept])
    want = st.shared_theta.unsqueeze(1).expand(-1, len(new), -1)
    assert torch.equal(st.theta[:, new], want)
    assert torch.equal(st.theta[:, kept], before["theta"][:, kept])
    # control: a kept row's theta is not the shared one (the check above can fail)
    assert not torch.equal(st.theta[:, kept[:1]], st.shared_theta.unsqueeze(1))


def test_a_flush_resets_every_row():
    st, _pool = _filled_state()
    st.mark_new([1])
    st.mark_all()
    assert st.apply_resets() == [-1]
    assert float(st.level.abs().sum() + st.trend.abs().sum() + st.h_sum.abs().sum()) == 0
    assert int(st.n_init.abs().sum() + st.p_cnt.abs().sum()) == 0
    assert bool((st.p_idx == -1).all())
    assert torch.equal(st.theta, st.shared_theta.unsqueeze(1).expand_as(st.theta))
    assert st.apply_resets() == []
