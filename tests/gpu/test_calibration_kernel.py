"""The SM90 calibration kernel (``calib_grid_terms``) against the pure-torch reference.

* the per-row terms of every candidate equal ``reference.calib_grid_terms`` (run on the CPU from
  the same inputs) up to the summation order of four sums: the predictions, hence P, are the
  reference's bit for bit, so a wrong P shows as a difference of at least one block's weight;
* theta* from ``calibration.grid_hit_rates`` on CUDA (through the kernel) equals theta* of
  ``reference.calibrate`` on continuous scores, and is optimal to rounding on tie-heavy ones.

Negative controls: a grid read in another order, and one more predicted block, are caught.
Fresh random inputs each run (the seed is printed); awkward sizes, InfLLM-style ``-inf`` scores.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from sglang_prr import reference as ref

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402  (the SM90 gate, tests/gpu/sm90.py)

require_sm90()

from sglang_prr import calibration as cal  # noqa: E402
from sglang_prr.config import PRRConfig  # noqa: E402

DEV = torch.device("cuda")
CUDA = torch.ops.sglang_prr_cuda


def _seed(tag: str) -> random.Random:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[{tag}] seed={seed}")
    torch.manual_seed(seed)
    return random.Random(seed)


def _scores(shape, nblk, kind):
    """``[R, Phi, Hk, NB]`` scores, ``-inf`` past each query's blocks; ``kind``: continuous,
    tie-heavy, or with InfLLM-style ``-inf`` inside the visible blocks and NaN / +inf."""
    s = torch.randn(*shape) * 3
    if kind == "ties":
        s = s.round()
    elif kind == "special":
        u = torch.rand(shape)
        s = torch.where(u < 0.08, torch.full_like(s, float("-inf")), s)
        s = torch.where((u >= 0.08) & (u < 0.1), torch.full_like(s, float("nan")), s)
        s = torch.where((u >= 0.1) & (u < 0.11), torch.full_like(s, float("inf")), s)
    nb = shape[-1]
    return torch.where(torch.arange(nb) < nblk[..., None, None], s, torch.full_like(s, -torch.inf))


def _axes(cfg=None):
    cfg = cfg or PRRConfig()
    return [torch.tensor(x, dtype=torch.float32)
            for x in (cfg.calib_alphas, cfg.calib_betas, cfg.calib_gammas)]


def _series(rnd, Rn, Phi, Hk, nb, kind):
    start = torch.randint(1, max(2, nb // 2), (Rn, 1))
    grow = torch.randint(0, 3, (Rn, Phi)).cumsum(1)
    nblk = torch.minimum(start + grow, torch.tensor(nb + rnd.randint(0, 2)))
    return _scores((Rn, Phi, Hk, nb), nblk, kind), nblk


@pytest.mark.parametrize("kind", ["plain", "ties", "special"])
@pytest.mark.parametrize("Rn,Phi,Hk,nb,k,n_pred,sink,local", [
    (1, 2, 1, 1, 1, 1, 0, 0), (3, 9, 2, 41, 5, 8, 1, 1), (2, 17, 8, 512, 32, 48, 1, 2),
    (1, 5, 3, 2048, 32, 48, 0, 0), (1, 6, 2, 9000, 100, 600, 4, 4)])
def test_terms_match_the_reference(kind, Rn, Phi, Hk, nb, k, n_pred, sink, local):
    rnd = _seed(f"calib {kind} {Rn}x{Phi}x{Hk}x{nb}")
    scores, nblk = _series(rnd, Rn, Phi, Hk, nb, kind)
    wa, am = cal.a_weights(scores, nblk, k, sink, local)
    A, B, G = _axes()
    want = ref.calib_grid_terms(scores, nblk, wa, am, A, B, G, n_pred, sink, local)
    dev = lambda t: t.to(DEV).contiguous()
    got = CUDA.calib_grid_terms(dev(scores), dev(nblk), dev(wa), dev(am), dev(A), dev(B),
                                dev(G), n_pred, sink, local).cpu()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, equal_nan=True)
    # Negative controls: the reference with the gammas in the opposite order, or with half the
    # blocks in P. Where the reference itself tells them apart from ``want`` (tie-heavy or
    # non-finite inputs often cannot), the kernel's terms must be far from them too: the
    # tolerance above separates a wrong replay from the right one.
    controlled = False
    for bad_g, bad_n in ((G.flip(0), n_pred), (G, n_pred // 2)):
        want_bad = ref.calib_grid_terms(scores, nblk, wa, am, A, B, bad_g, bad_n, sink, local)
        fin = want.isfinite() & want_bad.isfinite()
        if fin.any() and (want_bad[fin] - want[fin]).abs().max() > 1e-3:
            assert (got[fin] - want_bad[fin]).abs().max() > 1e-3
            controlled = True
    # (The rows' block counts, not the table's width, decide whether P can leave blocks out:
    # a row of 90 blocks under |P| = 600 predicts every block whatever the grid.)
    if kind == "plain" and Phi >= 5 and int(nblk.min()) > 2 * (n_pred + sink + local):
        assert controlled, "no negative control could tell the configurations apart"


@pytest.mark.parametrize("kind", ["plain", "ties"])
def test_theta_star_equals_the_reference(kind):
    """The server's grid search on CUDA (grid_hit_rates through the kernel, 32 layers at once as
    Calibrator.run does) against reference.calibrate on the CPU."""
    rnd = _seed(f"theta* {kind}")
    Rn, Phi, Hk, nb, k, n_pred = 32, 16, 4, 300, 16, 24
    scores, nblk = _series(rnd, Rn, Phi, Hk, nb, kind)
    A, B, G = _axes()
    grid = torch.tensor(PRRConfig().theta_grid)
    H_ref = ref.calibrate(scores, nblk, k, n_pred, 1, 1, grid[:, 0], grid[:, 1], grid[:, 2])
    H = cal.grid_hit_rates(scores.to(DEV), nblk.to(DEV), k, n_pred, 1, 1, A, B, G).cpu()
    assert (H - H_ref).abs().max() < 1e-5
    best, best_ref = ref.best_theta(H), ref.best_theta(H_ref)
    if kind == "plain":
        assert torch.equal(best, best_ref)
    else:  # ties within rounding may fall either way: the choice is optimal in H_ref
        chosen = H_ref.gather(1, best.unsqueeze(1)).squeeze(1)
        assert (chosen >= H_ref.amax(1) - 1e-5).all()
    # Negative control: theta* of other rows' scores differs somewhere (the choice is informed).
    H_shift = cal.grid_hit_rates(scores.roll(1, 0).to(DEV), nblk.roll(1, 0).to(DEV), k, n_pred,
                                 1, 1, A, B, G).cpu()
    assert not torch.equal(H_shift, H)
