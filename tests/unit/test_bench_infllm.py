"""CPU dry run of benchmarks/bench_infllm.py (the reference in place of the kernels, a stub
timer): the rows carry the warm and the cold-L2 timings, each from its own measurement."""

from __future__ import annotations

import types

import pytest

from sglang_prr import reference as ref

import bench_module


@pytest.fixture
def dry(monkeypatch):
    mod = bench_module.load("bench_infllm")
    timed = []

    def fake_warm_cold(calls, reps, warmup=1, device="cuda"):
        for c in calls:
            c()
        timed.append(len(calls))
        return {"warm": (2.0, 1.5, 2.5), "cold": (3.0, 2.5, 3.5)}

    monkeypatch.setattr(mod, "DEVICE", "cpu")
    # bench_scores sets the load knobs in os.environ: restored (unset) after each test
    monkeypatch.setenv(mod.ENV_RING, "serial")
    monkeypatch.setenv(mod.ENV_POOL, "late")
    monkeypatch.setenv(mod.ENV_VARIANT, "")
    monkeypatch.setattr(mod, "ROTATE_BYTES", 1)
    monkeypatch.setattr(mod, "time_warm_cold", fake_warm_cold)
    monkeypatch.setattr(mod, "cuda_ops", lambda: types.SimpleNamespace(
        infllm_scores=ref.infllm_scores, infllm_update=ref.infllm_update))
    mod.timed = timed
    return mod


def test_dry_run_warm_and_cold_columns(dry):
    rows = []
    dry.bench_scores(1, 1024, 64, 8, 2, 32, reps=2, rows=rows)
    dry.bench_update(1, 1024, 64, 2, 32, reps=2, rows=rows)
    assert [(r["op"], r["variant"]) for r in rows] == [
        ("infllm_scores", "kernel"), ("infllm_scores", "reference"),
        ("infllm_update", "kernel"), ("infllm_update", "reference")]
    scores = rows[0]
    assert (scores["us_median"], scores["us_cold_median"]) == (2.0, 3.0)
    assert (scores["us_cold_p10"], scores["us_cold_p90"]) == (2.5, 3.5)
    key_bytes = 1 * ((1024 - 32) // 16 + 1) * 2 * 32 * 2  # bf16 compressed keys, the default
    assert scores["GBps"] == pytest.approx(key_bytes / 2.0 / 1e3, abs=0.05)
    assert scores["GBps_cold"] == pytest.approx(key_bytes / 3.0 / 1e3, abs=0.05)
    assert float(scores["max_rel_err"]) == 0.0  # the stub "kernel" is the reference itself
    assert rows[2]["us_cold_median"] == 3.0 and rows[2]["GBps_cold"] == ""
    assert dry.timed == [2, 2, 16, 16]  # R rotating sets per graph (R = 2 at ROTATE_BYTES 1)


def test_dry_run_bf16_keys_count_half_the_bytes(dry):
    """``--ck-dtype bf16``: the compressed keys are bfloat16 in both ops, the rows say so, and
    GB/s counts 2 bytes a key element (control: the fp32 row of the same shape counts 4)."""
    rows = []
    for dt in ("fp32", "bf16"):
        dry.bench_scores(1, 1024, 64, 8, 2, 32, reps=2, rows=rows, with_ref=False, ck_dtype=dt)
        dry.bench_update(1, 1024, 64, 2, 32, reps=2, rows=rows, with_ref=False, ck_dtype=dt)
    assert [(r["op"], r["ck"]) for r in rows] == [
        ("infllm_scores", "fp32"), ("infllm_update", "fp32"),
        ("infllm_scores", "bf16"), ("infllm_update", "bf16")]
    assert rows[2]["GBps"] == pytest.approx(rows[0]["GBps"] / 2, abs=0.05)
    assert float(rows[2]["max_rel_err"]) == 0.0


def test_dry_run_load_forms_set_the_knobs_and_their_column(dry, monkeypatch):
    """``--loads``: each scores row says its load form and both knobs hold it while the row is
    timed (the kernels read them at each launch); the update's rows leave the column empty."""
    seen = []
    scores = dry.cuda_ops().infllm_scores

    def spy(*args):
        seen.append((dry.os.environ.get(dry.ENV_RING), dry.os.environ.get(dry.ENV_POOL)))
        return scores(*args)

    monkeypatch.setattr(dry, "cuda_ops", lambda: types.SimpleNamespace(
        infllm_scores=spy, infllm_update=ref.infllm_update))
    rows = []
    for form in dry.LOAD_FORMS:
        dry.bench_scores(1, 1024, 64, 8, 2, 32, reps=2, rows=rows, with_ref=False, loads=form)
    dry.bench_update(1, 1024, 64, 2, 32, reps=2, rows=rows, with_ref=False)
    assert [(r["op"], r["loads"]) for r in rows] == [
        ("infllm_scores", "default"), ("infllm_scores", "ring"), ("infllm_scores", "pool"),
        ("infllm_scores", "both"), ("infllm_update", "")]
    assert list(dict.fromkeys(seen)) == [("serial", "late"), ("ids-first", "late"),
                                         ("serial", "loads-first"), ("ids-first", "loads-first")]


def test_dry_run_logits_variants_set_the_knob_and_their_column(dry, monkeypatch):
    """``--logits``: each kernel row says its logits variant and SGLANG_PRR_INFLLM_VARIANT holds
    it while the row is timed ("" lets the launcher pick); reference rows leave it empty."""
    seen = []
    scores = dry.cuda_ops().infllm_scores

    def spy(*args):
        seen.append(dry.os.environ.get(dry.ENV_VARIANT))
        return scores(*args)

    monkeypatch.setattr(dry, "cuda_ops", lambda: types.SimpleNamespace(
        infllm_scores=spy, infllm_update=ref.infllm_update))
    rows = []
    for i, variant in enumerate(dry.LOGITS):
        dry.bench_scores(1, 1024, 64, 8, 2, 32, reps=2, rows=rows, with_ref=i == 0,
                         ck_dtype="bf16", logits=variant)
    assert [(r["variant"], r["logits"]) for r in rows] == [
        ("kernel", "pick"), ("reference", ""), ("kernel", "mma"), ("kernel", "bulk"),
        ("kernel", "regs")]
    assert list(dict.fromkeys(seen)) == ["", "mma", "bulk", "regs"]
