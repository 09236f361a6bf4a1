"""bench_select_timeline.py's chain on CPU: the one-pass selection's records (its slots, in
``bench_attn_timeline``'s arithmetic) to phase durations. Synthetic records with known answers;
negative controls: stamps running backwards are refused, a CTA that never reached a link leaves
that phase out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_attn_timeline as bat  # noqa: E402
import bench_select_timeline as bst  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_bench_attn_timeline  # noqa: E402  (its synthetic records)

KHZ = 1_000_000  # 1 GHz: 1000 clocks a µs
CHAIN = bst.SELECTION


def _record(sm, entry_ns, clocks, exit_ns):
    return test_bench_attn_timeline._record(sm, entry_ns, clocks, exit_ns, slots=CHAIN.slots)


def _launch():
    head = dict(entry=1000, counts=1200, issued=1500, loaded=2000, scored=4000, ranked=4500)
    tail = dict(head, arrival=5500, tail_loads=6500, topk=9500, lists=10000, exit=10000)
    chunk = dict(head, arrival=5000, exit=5000)
    idle = dict(entry=1000, exit=1100)  # a chunk past the row's blocks
    return torch.tensor([_record(0, 100, tail, 9_100), _record(1, 500, chunk, 4_000),
                         _record(1, 200, idle, 300)], dtype=torch.int64)


def test_slots_fit_the_record_and_the_shared_slots_match():
    assert len(CHAIN.slots) == len(bat.ATTENTION.slots) == 16
    for shared in ("entry_ns", "sm", "entry", "exit", "exit_ns", "id"):
        assert CHAIN.slots.index(shared) == bat.ATTENTION.slots.index(shared)
    assert CHAIN.order() == ["entry", "counts", "issued", "loaded", "scored", "ranked",
                             "arrival", "tail_loads", "topk", "lists", "exit"]
    assert bat.ATTENTION.order()[-1] == "exit"


def test_phases():
    got = bat.phase_samples(_launch(), KHZ, CHAIN)
    assert got["counts"] == pytest.approx([0.2, 0.2])
    assert got["pages"] == pytest.approx([0.3, 0.3])
    assert got["q"] == pytest.approx([0.5, 0.5])
    assert got["scores"] == pytest.approx([2.0, 2.0])
    assert got["rank"] == pytest.approx([0.5, 0.5])
    assert got["ticket"] == pytest.approx([1.0, 0.5])
    assert got["tail_loads"] == pytest.approx([1.0])   # the row's last CTA only
    assert got["topk"] == pytest.approx([3.0])
    assert got["lists"] == pytest.approx([0.5])
    assert got["cta"] == pytest.approx([9.0, 4.0, 0.1])
    assert got["span"] == pytest.approx([9.0])
    rows = bat.summarize("c", 1, 0, [got], 2, CHAIN)
    assert {r["phase"] for r in rows} >= {"counts", "q", "topk", "lists", "dispatch", "span"}


def test_backwards_stamps_are_refused():
    rec = _launch()
    rec[0, CHAIN.slots.index("topk")] = 6000  # before "tail_loads" (6500)
    with pytest.raises(ValueError, match="topk"):
        bat.phase_samples(rec, KHZ, CHAIN)
