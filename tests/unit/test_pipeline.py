"""The two-stream PRR step: same results as ops.prr_decode, P(t+1) written back in place."""

import random

import torch

from paged import make_paged, rel_err
from sglang_prr import ops
from sglang_prr.pipeline import prr_step, serial_dsa_step


def test_prr_step_matches_prr_decode_and_updates_p():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    P = make_paged(seed, [200, 97, 150], hk=2, group=4, page=16)
    kmin, kmax = P.quest_summary()
    B, nb = 3, P.nb
    state = lambda: (torch.zeros(B, 2, nb), torch.zeros(B, 2, nb), torch.zeros(B, dtype=torch.long))
    theta = torch.tensor([[0.6, 0.3, 0.5]] * B)
    p_idx = torch.full((B, 2, 6), -1, dtype=torch.int32)
    p_cnt = torch.zeros(B, 2, dtype=torch.int32)
    l1, t1, n1 = state()
    l2, t2, n2 = state()
    step = prr_step(torch.device("cpu"))
    for s in range(3):
        seq = P.seq_lens - 3 + s
        want = ops.prr_decode(P.q, P.k_buf, P.v_buf, [kmin, kmax], P.table, seq, p_idx.clone(),
                              p_cnt.clone(), l1, t1, n1, theta, "quest", 2, 4, 1, 1, 16,
                              P.sm_scale)
        got = step.run(P.q, P.k_buf, P.v_buf, [kmin, kmax], P.table, seq, p_idx, p_cnt, l2, t2,
                       n2, theta, "quest", 2, 4, 1, 1, 16, P.sm_scale)
        assert rel_err(got[0], want[0]) < 1e-6
        assert torch.equal(p_idx, want[5]) and torch.equal(p_cnt, want[6])
        dsa = serial_dsa_step(P.q, P.k_buf, P.v_buf, [kmin, kmax], P.table, seq, "quest", 2, 1, 1,
                              16, P.sm_scale)
        assert rel_err(got[0], dsa) < 2e-5
    assert int(p_cnt.min()) > 0  # the predictor produced a non-empty P
