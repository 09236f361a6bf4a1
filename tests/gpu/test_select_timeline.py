"""The one-pass selection's timing probe (``SGLANG_PRR_SELECT_TIMELINE=1``) on the GPU. In the
default build the probe is compiled out: the setting records nothing and changes no bits. In a
build with ``SGLANG_PRR_PROBES=1`` (``benchmarks/bench_select_timeline.py``) every CTA of the
launch leaves one record: its (b, hk, chunk) once each, its stamps in chain order, the chunk's
links where the row has that chunk, the tail's links in exactly one CTA of each row; the outputs
are still the same bits. Skipped with a reason without a CUDA SM90 device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402

require_sm90()

from test_kernels import DEV  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kernel_stages as stages  # noqa: E402
import bench_select_timeline as bst  # noqa: E402
import bench_attn_timeline as bat  # noqa: E402

CUDA = torch.ops.sglang_prr_cuda
PAGE = 16
# (batch, the rows' blocks, the tables' blocks, |P|, K in blocks): rows of 5 and 2 chunks of 64
# blocks in tables of 7 and 4 (the chunks past a row's blocks exit at once).
CASES = [(2, 300, 420, 10, 12), (1, 70, 250, 40, 33)]


def _forms(k, n_pred):
    n_out = k + 2
    return {"serial": lambda s: stages.select_set(s, k, n_out),
            "prr": lambda s: stages.select_set(s, k, n_out, with_p=True),
            "predictor": lambda s: stages.select_predict_set(s, k, n_pred, n_out)}


def _run(form, s, k, n_pred, monkeypatch, probed):
    """The form's outputs (and the set's state after it) on a copy of set s; the records and
    clock where probed."""
    s = {key: v.clone() for key, v in s.items()}
    if probed:
        monkeypatch.setenv("SGLANG_PRR_SELECT_TIMELINE", "1")
    try:
        out = _forms(k, n_pred)[form](s)
        rec, khz = CUDA.probe_timeline() if probed else (None, 0)
    finally:
        monkeypatch.delenv("SGLANG_PRR_SELECT_TIMELINE", raising=False)
    got = [x.cpu() for x in out] + [s[key].cpu() for key in ("level", "trend", "n_init",
                                                              "p_idx", "p_cnt")]
    return got, rec, khz


@pytest.mark.parametrize("B,NB,NBt,n_pred,k", CASES)
@pytest.mark.parametrize("form", ["serial", "prr", "predictor"])
def test_the_setting_keeps_the_bits(B, NB, NBt, n_pred, k, form, monkeypatch):
    """SGLANG_PRR_SELECT_TIMELINE=1 changes no output bit (A, M, the scores, the predictor's
    state and P(t+1)) in either build; the default build records nothing."""
    g = torch.Generator().manual_seed(1000 + NB)
    s = stages.selection_sets(B, NB, 1, n_pred, DEV, g, PAGE, NBt)[0]
    plain, _, _ = _run(form, s, k, n_pred, monkeypatch, False)
    probed, rec, khz = _run(form, s, k, n_pred, monkeypatch, True)
    for i, (x, y) in enumerate(zip(plain, probed)):
        assert torch.equal(x, y), f"output {i} changed under the probe"
    # Negative control: another query gives other lists.
    s2 = dict(s, q=torch.randn_like(s["q"]))
    other, _, _ = _run(form, s2, k, n_pred, monkeypatch, False)
    assert not torch.equal(other[1], plain[1])
    assert rec.shape[0] in (0, B * stages.HK * ((NBt + 63) // 64)), rec.shape
    assert khz > 0


@pytest.mark.parametrize("B,NB,NBt,n_pred,k", CASES)
@pytest.mark.parametrize("form", ["serial", "predictor"])
def test_timeline_records_the_chain(B, NB, NBt, n_pred, k, form, monkeypatch):
    """A probe build's records: every (b, hk, chunk) of the grid once, stamps in chain order, the
    chunk's links in the CTAs of the row's chunks only, the tail's in one CTA a row."""
    g = torch.Generator().manual_seed(2000 + NB)
    s = stages.selection_sets(B, NB, 1, n_pred, DEV, g, PAGE, NBt)[0]
    _, rec, khz = _run(form, s, k, n_pred, monkeypatch, True)
    if rec.shape[0] == 0:
        pytest.skip("the library has no probes (a SGLANG_PRR_PROBES=1 build has)")
    chain = bst.SELECTION
    gx = (NBt + 63) // 64
    assert rec.shape == (B * stages.HK * gx, len(chain.slots))
    col = {name: rec[:, j] for j, name in enumerate(chain.slots)}
    ident = col["id"]
    b_of, hk_of, ch_of = ident >> 40, (ident >> 20) & 0xFFFFF, ident & 0xFFFFF
    got = sorted(zip(b_of.tolist(), hk_of.tolist(), ch_of.tolist()))
    assert got == [(b, h, c) for b in range(B) for h in range(stages.HK) for c in range(gx)]
    assert (col["entry"] > 0).all() and (col["exit"] > 0).all()
    assert (col["exit_ns"] >= col["entry_ns"]).all()
    # The row's chunks: its blocks, and with the predictor the next step's one more.
    rows_blocks = NB + 1 if form == "predictor" else NB
    working = ch_of < (rows_blocks + 63) // 64
    for link in ("counts", "issued", "loaded", "scored", "ranked", "arrival"):
        assert (col[link][working] > 0).all(), link
        assert (col[link][~working] == 0).all(), link
    tails = col["lists"] > 0
    assert ((col["tail_loads"] > 0) == tails).all() and ((col["topk"] > 0) == tails).all()
    for b in range(B):
        for h in range(stages.HK):
            assert int(tails[(b_of == b) & (hk_of == h)].sum()) == 1, f"row ({b}, {h})"
    props = torch.cuda.get_device_properties(DEV)
    assert (col["sm"] < props.multi_processor_count).all()
    phases = bat.phase_samples(rec, khz, chain)  # raises on stamps out of chain order
    assert len(phases["scores"]) == int(working.sum())
    assert len(phases["topk"]) == B * stages.HK and phases["span"][0] > 0
    # Negative control: the checker refuses a record whose stamps run backwards.
    bad = rec.clone()
    r = int(tails.nonzero()[0])
    bad[r, chain.slots.index("topk")] = bad[r, chain.slots.index("arrival")] - 1
    with pytest.raises(ValueError):
        bat.phase_samples(bad, khz, chain)
