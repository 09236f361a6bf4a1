"""CPU checks of benchmarks/bench_overlap.py: the plot of a run's CSV and the clear exit without a
GPU (the timing itself needs two CUDA streams and runs on the GPU machine)."""

from __future__ import annotations

import csv

import pytest
import torch

import bench_module


def _load():
    return bench_module.load("bench_overlap")


def test_plot_only_draws_the_csv(tmp_path):
    mod = _load()
    path = tmp_path / "overlap.csv"
    rows = [dict(gpu="x", date="d", ctx=c, batch=b, page=64, top_k_tokens=2048, budget=1.5,
                 spec=12.0, selection=15.0, serial=27.0, two_stream=20.0, fork_join_only=0.5,
                 overlap=0.58) for c in (32768, 131072) for b in (1, 8)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    mod.main(["--plot-only", str(path)])
    png = tmp_path / "overlap.png"
    assert png.exists() and png.stat().st_size > 1000
    # negative control: a CSV without the timing columns is refused
    bad = tmp_path / "bad.csv"
    bad.write_text("ctx,batch\n1,1\n")
    with pytest.raises(KeyError):
        mod.main(["--plot-only", str(bad)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_cuda_exits_with_a_clear_message(tmp_path):
    mod = _load()
    with pytest.raises(SystemExit) as e:
        mod.main(["--out", str(tmp_path / "x.csv")])
    assert "needs a CUDA GPU" in str(e.value)
    assert not (tmp_path / "x.csv").exists()


def test_cold_timing_is_one_call_per_flushed_replay(monkeypatch):
    mod = _load()
    seen = []
    monkeypatch.setattr(mod.common, "time_graph",
                        lambda calls, reps, cold=False: seen.append((len(calls), cold))
                        or (1.0, 1.0, 1.0))
    mod.time_graph(lambda: None, 5, 20)
    mod.time_graph(lambda: None, 5, 20, cold=True)
    assert seen == [(20, False), (1, True)]  # a flush between inner calls would be timed
    assert mod.overlap(12.0, 15.0, 15.0) == pytest.approx(1.0)  # fully hidden
    assert mod.overlap(12.0, 15.0, 27.0) == pytest.approx(0.0)  # not at all
