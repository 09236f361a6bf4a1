"""CPU dry run of benchmarks/bench_select_lists.py (the ops' reference paths, a stub timer): a
row per point with both forms' cold and warm columns, each form's own call timed; the lists of
the two forms compared first (a broken M fails the point)."""

from __future__ import annotations


import pytest

import bench_module


@pytest.fixture
def mod():
    return bench_module.load("bench_select_lists")


def test_a_point_times_every_form_and_checks_the_lists(mod, monkeypatch):
    timed = []

    def timer(calls, reps, device):
        out = [c() for c in calls]
        timed.append(len(out[0]))  # two lists for the serial forms' two, four for one launch
        return {"warm": (2.0 + len(timed), 0, 0), "cold": (3.0 + len(timed), 0, 0)}

    row = mod.bench_point(2, 37, reps=1, device="cpu", timer=timer)
    assert [row[f"{n}_cold_us"] for n in mod.FORMS] == [4.0, 5.0, 6.0, 7.0]
    assert [row[f"{n}_warm_us"] for n in mod.FORMS] == [3.0, 4.0, 5.0, 6.0]
    assert timed == [2, 4, 2, 4] and (row["batch"], row["blocks"]) == (2, 37)
    # control: an M that differs from set_difference's fails the point
    real = mod.ops.select_lists

    def broken(*a, **k):
        out = list(real(*a, **k))
        out[3] = out[3] + 1
        return tuple(out)

    monkeypatch.setattr(mod.ops, "select_lists", broken)
    with pytest.raises(AssertionError, match="differs"):
        mod.bench_point(2, 37, reps=1, device="cpu", timer=timer)


def test_main_writes_the_csv(mod, monkeypatch, tmp_path):
    monkeypatch.setattr(mod, "POINTS", ((1, 20),))
    monkeypatch.setattr(mod, "time_warm_cold", lambda calls, reps, device: (
        [c() for c in calls], {"warm": (1.0, 0, 0), "cold": (2.0, 0, 0)})[1])
    csv = tmp_path / "s.csv"
    monkeypatch.setattr("sys.argv", ["x", "--device", "cpu", "--csv", str(csv)])
    mod.main()
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("batch,blocks,two_prr_cold_us,two_prr_warm_us")
    assert lines[1].startswith("1,20,2.0,1.0")
