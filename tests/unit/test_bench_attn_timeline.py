"""bench_attn_timeline.py's arithmetic on CPU: per-CTA records (the kernel's timing probe) to
phase durations, the launch's dispatch and span, CTAs per SM, rows and plot. Synthetic records
with known answers; negative controls: stamps running backwards are refused, a CTA that never
reached a link leaves that phase out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_attn_timeline as bat  # noqa: E402

KHZ = 2_000_000  # 2 GHz: 2000 clocks a µs


def _record(sm, entry_ns, clocks, exit_ns, ident=0, slots=bat.SLOTS):
    """One CTA's record of a chain with these ``slots``: ``clocks`` maps slot names (entry ..
    exit) to clock values."""
    r = [0] * len(slots)
    r[slots.index("entry_ns")] = entry_ns
    r[slots.index("sm")] = sm
    r[slots.index("exit_ns")] = exit_ns
    r[slots.index("id")] = ident
    for k, v in clocks.items():
        r[slots.index(k)] = v
    return r


def _launch():
    full = dict(entry=1000, lists=3000, issued=5000, kv=9000, mma=12000, partial=13000,
                arrival=14000, rows=16000, exit=20000)
    padding = dict(entry=500, lists=2500, exit=2600)  # no partial, no merge
    arrives = {k: v + 7 for k, v in full.items() if k not in ("rows",)}  # ticket, no rows
    return torch.tensor([_record(3, 10_000, full, 20_000, 1),
                         _record(3, 10_500, padding, 11_000, 2),
                         _record(5, 12_000, arrives, 17_000, 3)], dtype=torch.int64)


def test_phases_dispatch_and_span():
    got = bat.phase_samples(_launch(), KHZ)
    assert got["lists"] == pytest.approx([1.0, 1.0, 1.0])
    assert got["page"] == pytest.approx([1.0, 1.0])       # the padding CTA issued nothing
    assert got["kv"] == pytest.approx([2.0, 2.0])
    assert got["mma"] == pytest.approx([1.5, 1.5])
    assert got["combine"] == pytest.approx([0.5, 0.5])
    assert got["sort_barrier"] == pytest.approx([1.0])    # only the CTA that merged rows
    assert got["rows"] == pytest.approx([2.0])
    assert got["cta"] == pytest.approx([9.5, 1.05, 9.5])
    assert got["dispatch"] == pytest.approx([0.0, 0.5, 2.0])
    assert got["span"] == pytest.approx([10.0])
    assert bat.ctas_per_sm(_launch()) == 2


def test_backwards_stamps_are_refused():
    rec = _launch()
    rec[0, bat.SLOTS.index("kv")] = 4000  # before "issued" (5000)
    with pytest.raises(ValueError, match="kv"):
        bat.phase_samples(rec, KHZ)


def test_rows_and_plot(tmp_path):
    launches = [bat.phase_samples(_launch(), KHZ)] * 2
    rows = bat.summarize("case", 1, 0, launches, 2)
    by = {r["phase"]: r for r in rows}
    assert set(by) >= {"lists", "page", "kv", "mma", "combine", "rows", "cta", "dispatch",
                       "span"}
    assert by["lists"]["ctas"] == 6 and by["rows"]["ctas"] == 2
    assert by["cta"]["median_us"] == pytest.approx(9.5) and by["cta"]["max_us"] == 9.5
    assert by["span"]["median_us"] == pytest.approx(10.0)
    assert all(list(r) == bat.COLUMNS for r in rows)
    png = tmp_path / "t.png"
    bat.plot(rows, str(png))
    pytest.importorskip("matplotlib")
    assert png.exists()
