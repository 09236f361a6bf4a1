"""Smoke run of benchmarks/bench_layer.py on CPU (keeps the benchmark from rotting)."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_layer_quick_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_layer", os.path.join(ROOT, "benchmarks", "bench_layer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--quick", "--device", "cpu", "--out", str(tmp_path / "layer.csv")])
    variants = {r["variant"] for r in rows}
    assert {"serial DSA", "PRR (exact)", "stage: selection"} <= variants
    assert all(r["median_us"] > 0 for r in rows)
    hit = rows[0]["hit_rate"]
    assert 0.0 < hit <= 1.0  # the predictor warmed up and hit some of A
    assert (tmp_path / "layer.csv").read_text().count("\n") == len(rows) + 1
