"""benchmarks/common.py on CPU: the cold-L2 timer flushes before every timed round and keeps
the flush out of the timing; the warm/cold pair; the flush buffer's size; the wall-clock
fallback of the graph timer; the CSV writer that appends a run's rows."""

from __future__ import annotations

import csv
import random
import sys
import time
from pathlib import Path

import pytest
import torch

import bench_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def common():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return bench_module.load("common")


def test_flush_is_outside_the_timing(common):
    seen = []
    slow_flush = lambda: (seen.append("flush"), time.sleep(0.02))
    work = lambda: seen.append("call")
    med, p10, p90 = common.time_eager([work, work], reps=5, warmup=1, flush=slow_flush,
                                      device="cpu")
    assert seen[:2] == ["call", "call"]  # the warm-up round is not flushed
    assert seen[2:] == ["flush", "call", "call"] * 5  # a flush before every timed round
    assert med < 5000 and p10 <= med <= p90  # µs per call: the 20 ms flush is not in it
    # negative control: the same sleep inside the timed calls is measured
    med, _, _ = common.time_eager([lambda: time.sleep(0.02)], reps=3, device="cpu")
    assert med >= 19000


def test_warm_cold_pair_flushes_only_the_cold_rounds(common):
    fl = common.flusher("cpu")
    assert fl is common.flusher("cpu")  # one buffer per device
    before = fl.calls
    t = common.time_warm_cold([lambda: torch.ones(8).sum()], reps=4, device="cpu")
    assert set(t) == {"warm", "cold"} and all(len(v) == 3 and v[0] > 0 for v in t.values())
    assert fl.calls - before == 4
    before = fl.calls
    common.time_graph([lambda: None], reps=3, device="cpu")  # warm: no flush
    assert fl.calls == before
    common.time_graph([lambda: None], reps=3, cold=True, device="cpu")
    assert fl.calls - before == 3


def test_flush_reads_twice_the_last_level_cache(common, monkeypatch):
    monkeypatch.setattr(common, "_cpu_cache_bytes", lambda: 1 << 20)
    fl = common.L2Flush("cpu")
    assert fl.nbytes == 2 << 20 and fl.buf.numel() * 4 == fl.nbytes
    fl()
    assert fl.out.item() == fl.buf.numel() and fl.calls == 1  # it read every element
    assert common.l2_bytes("cpu") == 1 << 20
    assert common.L2Flush("cpu", factor=3).nbytes == 3 << 20


def test_summary(common):
    assert common.summary([5.0, 1.0, 3.0, 2.0, 4.0]) == (3.0, 1.0, 5.0)
    assert common.pct([1.0, 2.0, 3.0], 50) == 2.0


def test_write_rows_appends_after_the_rows_already_there(common, tmp_path):
    rng = random.Random()
    cols = ["a", "b"]
    first = [dict(a=rng.randint(0, 99), b=rng.random()) for _ in range(rng.randint(1, 5))]
    second = [dict(a=rng.randint(0, 99), b=rng.random()) for _ in range(rng.randint(1, 5))]
    path = tmp_path / "sub" / "rows.csv"  # its folder is made
    common.write_rows(str(path), first, cols)
    every = common.write_rows(str(path), second, cols, append=True)
    with open(path, newline="") as f:
        got = list(csv.DictReader(f))
    want = [{k: str(v) for k, v in r.items()} for r in first + second]
    assert got == want and len(every) == len(want)
    # negative control: without append, the earlier rows are gone
    common.write_rows(str(path), second, cols)
    with open(path, newline="") as f:
        assert len(list(csv.DictReader(f))) == len(second)


def test_require_kernels_stops_where_the_reference_would_be_timed(common, monkeypatch):
    """On a CUDA device the library does not serve, a kernel benchmark stops and says why
    (its rows would time the torch reference); a served device and a CPU pass."""
    from sglang_prr import kernels
    monkeypatch.setattr(kernels, "active", lambda dev: False)
    monkeypatch.setattr(kernels, "load_error", lambda: "ops differ (test)")
    with pytest.raises(SystemExit, match="ops differ"):
        common.require_kernels("cuda")
    common.require_kernels("cpu")  # the reference is what a CPU run times
    monkeypatch.setattr(kernels, "active", lambda dev: True)
    common.require_kernels("cuda")
