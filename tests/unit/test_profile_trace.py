"""benchmarks/profile_trace.py on small synthetic chrome traces: only ``kernel`` events count,
per step, per layer and per kernel name, and the batch size of every recorded step (no sglang
or torch needed; benchmarks/bench_serving.py has its own tests in test_bench_serving.py)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "..", "..", "benchmarks", "profile_trace.py")


def _load():
    spec = importlib.util.spec_from_file_location("profile_trace", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kernel(name, dur, ts, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur}


def _events(kernel_cat="kernel"):
    """Two decode steps of a two-layer model: per step 2x attn (10 µs), 1x gemm (50 µs), 1x norm
    (5 µs, category spelled "Kernel"), SGLang's step span (CPU and GPU twin), plus host-side and
    copy events that are not kernels."""
    ev = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}}]
    ts = 0
    norm_cat = "Kernel" if kernel_cat == "kernel" else kernel_cat
    for _ in range(2):
        ev += [_kernel("attn_kernel", 10, ts, kernel_cat),
               _kernel("attn_kernel", 10, ts + 20, kernel_cat),
               _kernel("gemm<bf16>|tn", 50, ts + 40, kernel_cat),
               _kernel("rms_norm", 5, ts + 100, norm_cat),
               {"ph": "X", "cat": "user_annotation", "name": "step[DECODE bs=8]", "ts": ts,
                "dur": 800},
               {"ph": "X", "cat": "gpu_user_annotation", "name": "step[DECODE bs=8]", "ts": ts,
                "dur": 120},
               {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 900},
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": ts, "dur": 2000},
               {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": ts, "dur": 300},
               {"ph": "X", "cat": "python_function", "name": "forward", "ts": ts, "dur": 4000},
               {"ph": "f", "cat": "ac2g", "name": "flow", "ts": ts}]
        ts += 1000
    return ev


def _write(tmp_path, events, name="t.trace.json.gz"):
    path = tmp_path / name
    with gzip.open(path, "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events}, f)
    return path


def test_counts_only_kernel_events_per_step_and_layer(tmp_path):
    mod = _load()
    s = mod.summarize(_write(tmp_path, _events()), num_layers=2, steps=2)
    assert s["kernels"] == 8
    assert s["kernels_per_step"] == 4.0
    assert s["kernels_per_layer"] == 2.0
    assert s["gpu_busy_ms_per_step"] == pytest.approx(0.075, abs=1e-12)  # (20 + 50 + 5) µs
    assert s["top"] == [("gemm<bf16>|tn", 1.0, 50.0), ("attn_kernel", 2.0, 20.0),
                        ("rms_norm", 1.0, 5.0)]
    assert s["step_spans"] == {"step[DECODE bs=8]": 2}  # the GPU twin spans are not counted


def test_top_is_limited_and_sorted_by_time(tmp_path):
    mod = _load()
    s = mod.summarize(_write(tmp_path, _events()), num_layers=1, steps=1, top=2)
    assert [n for n, _, _ in s["top"]] == ["gemm<bf16>|tn", "attn_kernel"]
    assert s["kernels_per_step"] == 8.0  # the totals still cover every kernel


def test_negative_control_no_kernel_category_gives_zero(tmp_path):
    mod = _load()
    s = mod.summarize(_write(tmp_path, _events(kernel_cat="cpu_op")), num_layers=2, steps=2)
    assert s["kernels"] == 0 and s["kernels_per_step"] == 0.0 and s["kernels_per_layer"] == 0.0
    assert s["gpu_busy_ms_per_step"] == 0.0 and s["top"] == []


def test_cli_prints_markdown_table(tmp_path, capsys):
    mod = _load()
    path = _write(tmp_path, _events())
    s = mod.main([str(path), "--layers", "2", "--steps", "2"])
    text = capsys.readouterr().out
    assert s["kernels_per_step"] == 4.0
    assert "4.0 kernels/step, 2.00 kernels/layer, 0.075 ms GPU-busy/step" in text
    assert "recorded steps: 2 x step[DECODE bs=8]" in text
    assert "| `gemm<bf16>\\|tn` | 1.00 | 50.0 | 66.7% |" in text  # the pipe is escaped
    assert "aten::mm" not in text and "cudaGraphLaunch" not in text


def test_rejects_zero_steps(tmp_path):
    mod = _load()
    with pytest.raises(ValueError):
        mod.summarize(_write(tmp_path, _events()), num_layers=2, steps=0)


def test_step_batches_split_decode_from_other_steps():
    mod = _load()
    bs, other = mod.step_batches({"step[DECODE bs=8]": 5, "step[DECODE bs=1]": 1,
                                  "step[EXTEND bs=2 toks=128]": 2, "step[IDLE bs=0]": 1})
    assert bs == {1: 1, 8: 5}
    assert other == {"step[EXTEND bs=2 toks=128]": 2, "step[IDLE bs=0]": 1}
    # negative control: no decode step at all
    assert mod.step_batches({"step[EXTEND bs=8 toks=64]": 3}) == (
        {}, {"step[EXTEND bs=8 toks=64]": 3})
