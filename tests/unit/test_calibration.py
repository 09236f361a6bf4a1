"""calibration.grid_hit_rates (the product's grid search) against reference.calibrate, bit for
bit, and against the fp64 scalar oracle; middle_topk_mask against reference.select_topk. Negative
controls: a tie-break to the higher id and a wrong grid order are caught on the same inputs."""

from __future__ import annotations

import random

import pytest
import torch

import oracle
from paged import score_series
from sglang_prr import calibration as cal
from sglang_prr import reference as R

AXES = ([0.2, 0.6, 1.0], [0.1, 0.5], [0.0, 0.75])  # awkward: alpha = 1, gamma = 0




def _grid(axes):
    al, be, ga = axes
    flat = [(a, b, g) for a in al for b in be for g in ga]  # alpha-major, as PRRConfig
    cols = (torch.tensor([t[i] for t in flat]) for i in range(3))
    return flat, cols, [torch.tensor(x) for x in axes]


def _scores(g, shape, nblk, kind):
    """Scores ``[R, Phi, Hk, NB]`` with ``-inf`` past each row's blocks; ``kind`` makes them
    continuous, tie-heavy (rounded, 0/1) or sprinkled with NaN / +-inf / +-3e38."""
    s = torch.randn(*shape, generator=g) * 3
    if kind == "ties":
        s = s.round()
    elif kind == "binary":
        s = (s > 0).float()
    elif kind == "special":
        u = torch.rand(shape, generator=g)
        for lo, hi, v in ((0, .05, float("nan")), (.05, .1, float("inf")), (.1, .15, -3e38),
                          (.15, .2, 3e38)):
            s = torch.where((u >= lo) & (u < hi), torch.full_like(s, v), s)
    nb = shape[-1]
    return torch.where(torch.arange(nb) < nblk[..., None, None], s, torch.full_like(s, -torch.inf))


def _bits(x):
    return x.nan_to_num(0.0).view(torch.int32), x.isnan()


@pytest.mark.parametrize("kind", ["plain", "ties", "binary", "special"])
def test_grid_hit_rates_is_bitwise_the_reference(kind, seed):
    """Awkward sizes (1..4 rows, 1 to ~40 blocks, K and |P| from 0 past the block count, no or
    two sink/local blocks, rows with different block counts, counts past the table)."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(12):
        Rn, Phi, Hk, nb = rnd.randint(1, 4), rnd.randint(1, 9), rnd.choice([1, 2, 3]), rnd.randint(1, 41)
        k, n_pred = rnd.randint(0, nb + 2), rnd.randint(0, nb + 2)
        sink, local = rnd.randint(0, 2), rnd.randint(0, 2)
        nblk = torch.randint(0, nb + 3, (Rn, Phi), generator=g)
        if rnd.random() < 0.5:
            nblk = torch.sort(nblk, dim=1).values  # growing, as a prefill's sampled queries
        s = _scores(g, (Rn, Phi, Hk, nb), nblk, kind)
        axes = tuple(ax[:rnd.randint(1, len(ax))] for ax in AXES)
        _, (al, be, ga), (A, B, G) = _grid(axes)
        want = R.calibrate(s, nblk, k, n_pred, sink, local, al, be, ga)
        got = cal.grid_hit_rates(s, nblk, k, n_pred, sink, local, A, B, G)
        case = (Rn, Phi, Hk, nb, k, n_pred, sink, local, axes)
        assert got.shape == want.shape, case
        assert all(torch.equal(x, y) for x, y in zip(_bits(got), _bits(want))), (case, seed)


def test_grid_hit_rates_matches_the_fp64_oracle_and_a_wrong_grid_order_does_not(seed):
    rnd = random.Random(seed)
    Rn, Phi, Hk, NB = 2, 7, 2, 11
    scores, nblk = score_series(rnd, Rn, Phi, Hk, NB)
    flat, _, (A, B, G) = _grid(AXES)
    k, n_pred = 2, 3
    H = cal.grid_hit_rates(scores, nblk, k, n_pred, 1, 1, A, B, G)
    want = torch.tensor([[sum(oracle.calibrate_one(
        [[float(x) for x in scores[r, phi, h, :int(nblk[r, phi])]] for phi in range(Phi)],
        k, n_pred, 1, 1, theta) for h in range(Hk)) / Hk for theta in flat] for r in range(Rn)],
        dtype=torch.float64)
    assert (H.double() - want).abs().max() < 1e-5, seed
    # Negative control: the candidates differ, so reading the grid beta-major would be caught.
    beta_major = H.view(Rn, len(AXES[0]), len(AXES[1]), len(AXES[2])).transpose(1, 2)
    assert (beta_major.reshape(Rn, -1).double() - want).abs().max() > 1e-3, seed


@pytest.mark.parametrize("kind", ["plain", "ties", "binary", "special"])
def test_middle_topk_mask_is_the_middle_of_select_topk(kind, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    for _ in range(20):
        B, Hk, nb = rnd.randint(1, 5), rnd.randint(1, 3), rnd.randint(1, 50)
        k, sink, local = rnd.randint(0, nb + 2), rnd.randint(0, 2), rnd.randint(0, 2)
        nblk = torch.randint(0, nb + 3, (B,), generator=g)
        s = _scores(g, (B, Hk, nb), nblk.view(B, 1)[:, 0], kind)
        idx, cnt = R.select_topk(s, nblk, k, sink, local)
        _, middle = R.kept_mask(nblk, nb, sink, local)
        want = R.list_to_mask(idx, cnt, nb) & middle.unsqueeze(1)
        got = R.middle_topk_mask(s, middle.unsqueeze(1), k)
        assert torch.equal(got, want), (B, Hk, nb, k, sink, local, seed)


def test_ties_go_to_the_lower_block_id_and_the_opposite_rule_is_caught():
    """Five equal middle blocks, K = 2: blocks 1 and 2 (after the sink block 0). Negative
    control: ``torch.topk``'s own choice among ties is not the reference's on these inputs."""
    s = torch.tensor([[[9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0]]])
    nblk = torch.tensor([7])
    _, middle = R.kept_mask(nblk, 7, 1, 1)
    got = R.middle_topk_mask(s, middle.unsqueeze(1), 2)
    assert got[0, 0].nonzero().flatten().tolist() == [1, 2]
    idx, cnt = R.select_topk(s, nblk, 2, 1, 1)
    assert R.list_to_mask(idx, cnt, 7)[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 6]
    high_first = torch.zeros_like(got)
    high_first[0, 0, [4, 5]] = True  # ties to the higher id
    assert not torch.equal(high_first, got)


def test_calibrate_with_widths_past_the_table_is_calibrate_at_the_table():
    """A k, n_pred, sink or local of 2^30 ("every block") gives the H of that width at NB, in the
    table's memory: before, it allocated 2^30-wide lists. Control: a k below the table gives
    another H on the same scores."""
    seed = random.randrange(2 ** 31)
    g = torch.Generator().manual_seed(seed)
    Rq, Phi, Hk, nb = 2, 6, 2, 12
    nblk = torch.randint(8, nb + 1, (Rq, Phi), generator=g).sort(-1).values
    s = _scores(g, (Rq, Phi, Hk, nb), nblk, "plain")
    _, (a, b, c), _ = _grid(AXES)
    big = 2 ** 30
    for k, n_pred, sink, local in ((big, 3, 1, 1), (2, big, 1, 0), (big, big, big, 1),
                                   (4, 3, 0, big)):
        want = R.calibrate(s, nblk, min(k, nb), min(n_pred, nb), min(sink, nb), min(local, nb),
                           a, b, c)
        assert torch.equal(R.calibrate(s, nblk, k, n_pred, sink, local, a, b, c), want), seed
    every = R.calibrate(s, nblk, big, 3, 1, 1, a, b, c)
    assert (every < 1).any(), seed  # A is every block, P three of them: not a trivial H
    assert not torch.equal(R.calibrate(s, nblk, 4, 3, 1, 1, a, b, c), every), seed  # control
