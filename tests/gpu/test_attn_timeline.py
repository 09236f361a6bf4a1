"""The attention's timing probe (``SGLANG_PRR_ATTN_TIMELINE=1``) on the GPU. In the default build
the probe is compiled out: the setting records nothing and changes no bits. In a build with
``SGLANG_PRR_PROBES=1`` (``benchmarks/bench_attn_timeline.py``) every CTA of the launch leaves one
record: its (b, hk, n) once each, its stamps in chain order, a partial for every listed entry,
the merge's stamps where the group merges; the outputs are still the same bits. Skipped with a
reason without a CUDA SM90 device."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402

require_sm90()

from test_kernels import DEV, random_lists, seeded  # noqa: E402
from test_fused_kernels import _attn_case, _dev  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_attn_timeline as bat  # noqa: E402

CUDA = torch.ops.sglang_prr_cuda


CASES = [(1, 32, 8, 128, 64, torch.bfloat16, 40, ""),        # one wave: the spread merge
         (2, 16, 4, 64, 16, torch.float16, 30, "ticket")]   # the group's last CTA merges


def _probed(B, Hq, Hk, D, page, dtype, pages, merge, monkeypatch):
    """The case's attention + merge without and with the probe's setting: both outputs, the
    records of the probed launch, the clock (kHz), the lists' counts and the list width."""
    seeded(f"timeline B={B} D={D} merge={merge}")
    q, k_buf, v_buf, table, sl, NB, nblk = _attn_case(B, Hq, Hk, D, page, dtype, pages)
    N = min(nblk) // 2 + 5
    idx, cnt = random_lists(B, Hk, N, nblk)
    cnt[0, 0] = max(int(cnt[0, 0]), 1)
    cnt[-1, -1] = 0  # an empty row: entry 0 alone takes part, as padding
    sm = 1.0 / math.sqrt(D)
    qd, kd, vd, td, sld, i, c = _dev(q, k_buf, v_buf, table, sl, idx, cnt)
    if merge:
        monkeypatch.setenv("SGLANG_PRR_ATTN_MERGE", merge)

    def run():
        return CUDA.sparse_attn_merge(qd, kd, vd, td, sld, i, c, page, sm,
                                      None, None, None, None, None, None, 0, True)[0].cpu()

    plain = run()
    monkeypatch.setenv("SGLANG_PRR_ATTN_TIMELINE", "1")
    probed = run()
    rec, khz = CUDA.probe_timeline()
    monkeypatch.delenv("SGLANG_PRR_ATTN_TIMELINE")
    return plain, probed, rec, khz, cnt, N


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype,pages,merge", CASES)
def test_the_setting_keeps_the_bits(B, Hq, Hk, D, page, dtype, pages, merge, monkeypatch):
    """SGLANG_PRR_ATTN_TIMELINE=1 changes no output bit in either build; the default build
    records nothing (its kernels hold no probe code) and a probe build records every CTA."""
    plain, probed, rec, khz, cnt, N = _probed(B, Hq, Hk, D, page, dtype, pages, merge,
                                              monkeypatch)
    assert torch.equal(probed, plain), "the probe changed the output"
    assert not torch.isnan(plain).any()
    assert rec.shape[0] in (0, B * Hk * N), rec.shape
    assert khz > 0


@pytest.mark.parametrize("B,Hq,Hk,D,page,dtype,pages,merge", CASES)
def test_timeline_records_the_chain(B, Hq, Hk, D, page, dtype, pages, merge, monkeypatch):
    """A probe build's records: every (b, hk, n) once, stamps in chain order, a partial for every
    listed entry and none for padding, a merge in every group, SMs that exist."""
    _, _, rec, khz, cnt, N = _probed(B, Hq, Hk, D, page, dtype, pages, merge, monkeypatch)
    if rec.shape[0] == 0:
        pytest.skip("the library has no probes (a SGLANG_PRR_PROBES=1 build has)")
    assert rec.shape == (B * Hk * N, len(bat.SLOTS))
    col = {s: rec[:, j] for j, s in enumerate(bat.SLOTS)}
    ident = col["id"]
    got = sorted(((int(v) >> 40), (int(v) >> 20) & 0xFFFFF, int(v) & 0xFFFFF) for v in ident)
    assert got == [(b, h, n) for b in range(B) for h in range(Hk) for n in range(N)]
    assert (col["entry"] > 0).all() and (col["exit"] > 0).all()
    assert (col["exit_ns"] >= col["entry_ns"]).all()
    n_of = ident & 0xFFFFF
    hk_of = (ident >> 20) & 0xFFFFF
    b_of = ident >> 40
    listed = n_of < cnt[b_of, hk_of].to(torch.int64)
    assert (col["partial"][listed] > 0).all() and (col["mma"][listed] > 0).all()
    assert (col["partial"][~listed] == 0).all()  # padding entries (and empty rows) exit early
    merged = col["rows"] > 0
    for b in range(B):
        for h in range(Hk):
            assert merged[(b_of == b) & (hk_of == h)].any(), f"group ({b}, {h}) never merged"
    props = torch.cuda.get_device_properties(DEV)
    assert (col["sm"] < props.multi_processor_count).all()
    phases = bat.phase_samples(rec, khz)  # raises on stamps out of chain order
    assert len(phases["kv"]) == int(listed.sum()) and phases["span"][0] > 0
    # Negative control: the checker refuses a record whose stamps run backwards.
    bad = rec.clone()
    k = int(listed.nonzero()[0])
    bad[k, bat.SLOTS.index("partial")] = bad[k, bat.SLOTS.index("entry")] - 1
    with pytest.raises(ValueError):
        bat.phase_samples(bad, khz)
