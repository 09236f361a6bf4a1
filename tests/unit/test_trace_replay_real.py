"""The real-trace hit rate that profile_budget and bench_layer hold their predictor at:
``trace_replay.real_hit_rate`` on the repository's SmolLM2 traces reproduces the recorded
constant and bench_predictor's per-layer table, and drops when the traces lose their order."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from sglang_prr import trace_replay, traces

ROOT = Path(__file__).resolve().parents[2]


def test_real_hit_rate_matches_the_recorded_value_and_the_predictor_table():
    r = trace_replay.real_hit_rate(trace_replay.REAL_TRACES, delta=1.0)
    assert r["traces"] == 4 and r["k"] == 16 and r["n_pred"] == 16
    assert r["overlap"] == pytest.approx(trace_replay.REAL_HIT_RATE_AT_K, abs=5e-4)
    # bench_predictor --per-layer wrote the calibrated overlap per layer (its own run)
    with open(ROOT / "benchmarks" / "results" / "real_traces_predictor.csv") as f:
        table = {int(row["layer"]): float(row["overlap_calibrated"])
                 for row in csv.DictReader(f) if float(row["delta"]) == 1.0}
    assert set(r["per_layer"]) == set(table) == {0, 10, 20, 29}
    for layer, want in table.items():
        assert r["per_layer"][layer] == pytest.approx(want, abs=1e-3), layer
    assert 0.0 < r["missed"] < r["k"] and 0.0 < r["hit"] <= 1.0


def test_more_budget_more_hits_and_shuffled_steps_fewer(tmp_path, seed):
    """On one request cut to two traced layers and 72 steps (8 calibrate, 64 are replayed)."""
    t = traces.load_traces(trace_replay.REAL_TRACES)[0]
    t.scores, t.nblk, t.layers = t.scores[:72, :2], t.nblk[:72], t.layers[:2]
    one = tmp_path / "one"
    one.mkdir()
    traces.save_trace(str(one / "0001.npz"), t)
    base = trace_replay.real_hit_rate(str(one), delta=1.0, calib_rows=8)
    wider = trace_replay.real_hit_rate(str(one), delta=1.5, calib_rows=8)
    assert base["traces"] == 1 and set(base["per_layer"]) == {0, 10}
    assert wider["n_pred"] == 24 and wider["overlap"] > base["overlap"] + 0.05
    assert wider["missed"] < base["missed"]
    # negative control: the same scores in a random step order (no temporal continuity); every
    # step gets the last step's blocks (nblk stays non-decreasing), blocks not yet there score low
    perm = np.random.default_rng(seed).permutation(t.steps)
    nb = int(t.nblk.max())
    t.scores, t.nblk = t.scores[perm], np.full_like(t.nblk, nb)
    t.scores[..., :nb] = np.where(np.isfinite(t.scores[..., :nb]), t.scores[..., :nb], -1e4)
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    traces.save_trace(str(shuffled / "0001.npz"), t)
    worse = trace_replay.real_hit_rate(str(shuffled), delta=1.0, calib_rows=8)
    print(f"seed {seed}: in order {base['overlap']:.3f}, shuffled {worse['overlap']:.3f}")
    assert worse["overlap"] < base["overlap"] - 0.05
    with pytest.raises(FileNotFoundError):
        trace_replay.real_hit_rate(str(tmp_path / "empty"))
