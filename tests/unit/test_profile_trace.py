"""benchmarks/profile_trace.py on small synthetic chrome traces: only ``kernel`` events count,
per step, per layer and per kernel name, and the batch size of every recorded step (no sglang
or torch needed; benchmarks/bench_serving.py has its own tests in test_bench_serving.py)."""

from __future__ import annotations

import gzip
import json

import pytest

import bench_module


def _load():
    return bench_module.load("profile_trace")


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


def _at(name, ts, dur, tid):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur}


def test_prr_wall_time_counts_two_streams_once(tmp_path):
    """PRR's kernels (the ``prr::`` namespace) hold the GPU from the first one's start to the
    last one's end of each cluster; a cluster ends when another kernel starts after it (the
    layer's GEMM), not when one overlaps it on another stream."""
    pt = _load()
    sel, spec = "void prr::(anonymous namespace)::select(prr::A)", "void prr::attn(prr::B)"
    ev = []
    for layer in range(2):  # update | rope | select || spec (a copy beside) | repair | gemm
        t = 1000 * layer
        ev += [_at("void prr::update(prr::C)", t, 3, 7), _at("rope", t + 4, 2, 7),
               _at(sel, t + 7, 18, 9), _at(spec, t + 7, 13, 7), _at("copy_kernel", t + 10, 2, 11),
               _at(spec, t + 26, 14, 7), _at("gemm", t + 41, 59, 7)]
    s = pt.summarize(_write(tmp_path, ev), num_layers=2, steps=1)
    # clusters [t, t + 3] and [t + 7, t + 40] per layer: 3 + 33 µs
    assert s["sparse_wall_us_per_layer"] == pytest.approx(36.0)
    # the kernels' sum counts the overlap twice (control)
    own = sum(e["dur"] for e in ev if "prr::" in e["name"]) / 2
    assert own == pytest.approx(48.0) and own > s["sparse_wall_us_per_layer"]
    assert pt.sparse_spans([]) == [] and pt.sparse_spans([(0, 5, False)]) == []
    assert pt.sparse_spans([(0, 5, True)]) == [5]  # a trace that ends inside a cluster
    assert "36.0 µs wall/layer" in pt.markdown(s)
    # a trace without PRR's kernels (dense) says nothing of it
    dense = pt.summarize(_write(tmp_path, [_at("gemm", 0, 10, 7)], "d.json.gz"), 1, 1)
    assert dense["sparse_wall_us_per_layer"] == 0 and "wall/layer" not in pt.markdown(dense)


def test_sparse_layout_places_each_launch_of_a_kernel_on_the_critical_path(tmp_path):
    """PRR's speculative attention and its repair are one kernel launched twice a layer: the
    layout keeps them apart by place (#1, #2), with their start and end from the cluster's start
    and their stream, the mean over every cluster that holds them."""
    pt = _load()
    sel = "void prr::(anonymous namespace)::select<float, 128, false>(prr::A)"
    spec = "void prr::(anonymous namespace)::attn<__half, 128, true>(prr::B, int)"
    ev = []
    for layer, (d_sel, d_rep) in enumerate([(18, 14), (20, 10)]):  # the layers' times differ
        t = 1000 * layer
        ev += [_at(sel, t + 7, d_sel, 9), _at(spec, t + 7, 13, 7),
               _at(spec, t + 8 + d_sel, d_rep, 7), _at("gemm", t + 60, 30, 7)]
    s = pt.summarize(_write(tmp_path, ev), num_layers=2, steps=1)
    rows = {(r["kernel"], r["place"]): r for r in s["sparse_layout"]}
    assert set(rows) == {("select<float, 128, false>", 1), ("attn<__half, 128, true>", 1),
                         ("attn<__half, 128, true>", 2)}
    rep = rows[("attn<__half, 128, true>", 2)]
    assert rep["clusters"] == 2 and rep["stream"] == 7
    assert rep["start_us"] == pytest.approx((19 + 21) / 2)  # after the selection, both layers
    assert rep["dur_us"] == pytest.approx(12.0) and rep["end_us"] == pytest.approx(32.0)
    assert rows[("select<float, 128, false>", 1)]["stream"] == 9
    assert rows[("select<float, 128, false>", 1)]["dur_us"] == pytest.approx(19.0)
    # negative control: by name alone the two launches would average to a start of ~10 µs
    first = rows[("attn<__half, 128, true>", 1)]
    assert first["start_us"] == pytest.approx(0.0) and first["start_us"] < rep["start_us"] - 15
    assert [r["place"] for r in s["sparse_layout"]][-1] == 2  # sorted by mean start
    md = pt.markdown(s)
    assert "| `attn<__half, 128, true>` | 2 | 7 | 2 | 20.0 | 12.0 | 32.0 |" in md
    assert pt.sparse_layout([]) == []


def _cpu(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 3, "tid": tid, "ts": ts, "dur": dur}


def _host_step(ts, prr_own, sync):
    """One step's host events on thread 1: SGLang's loop, PRR's hook (``prr_own`` µs of its own
    Python and a built-in it calls, around 100 µs of SGLang's planning it calls), a runtime call
    inside the hook (PRR's), and a synchronisation (SGLang's) when ``sync``."""
    own = prr_own - 3
    ev = [_cpu("python_function", "/x/sglang/srt/scheduler.py(10): event_loop", ts, 1000),
          _cpu("python_function", "/x/sglang_prr/serving/backend.py(278): hook", ts + 10,
               own + 3 + 100 + 5),
          _cpu("python_function", "<built-in function len>", ts + 11, 3),
          _cpu("python_function", "/x/sglang/srt/flashinfer_backend.py(691): plan", ts + 20, 100),
          _cpu("cpu_op", "aten::copy_", ts + 30, 40),  # SGLang's: inside its planning
          _cpu("cuda_runtime", "cudaLaunchKernel", ts + 20 + 100, 5)]  # PRR's own launch
    if sync:
        ev.append(_cpu("cuda_runtime", "cudaStreamSynchronize", ts + 500, 50))
    return ev


@pytest.mark.parametrize("prr_own,syncs", [(37.0, (True, True, True)), (11.0, (False,) * 3),
                                           (203.0, (True, False, False))])
def test_host_summary_counts_prrs_own_python_and_the_syncs(prr_own, syncs):
    pt = _load()
    steps = len(syncs)
    ev = [_cpu("python_function", "/x/sglang_prr/serving/plugin.py(123): run_scheduler_process",
               -5, 10 * 1000)]  # the whole loop under PRR's entry: not PRR's time
    for i, s in enumerate(syncs):
        ev += _host_step(i * 1000, prr_own, s)
    ev += [_kernel("attn_kernel", 10, 0)]  # device events are not host time
    h = pt.host_summary(ev, steps)
    # Own time prr_own - 3 + the built-in 3 + the runtime call 5 inside the hook.
    assert h["prr_host_us_per_step"] == pytest.approx(prr_own + 5)
    assert h["host_syncs_per_step"] == pytest.approx(sum(syncs) / steps)
    assert h["runtime_calls_per_step"] == pytest.approx(1 + sum(syncs) / steps)
    assert h["syncs"] == ({"cudaStreamSynchronize": sum(syncs)} if any(syncs) else {})
    # Negative control: the same hook in SGLang's tree is not PRR's time.
    other = [dict(e, name=e["name"].replace("sglang_prr/serving", "sglang/srt")) for e in ev]
    assert pt.host_summary(other, steps)["prr_host_us_per_step"] == 0.0


def test_host_line_in_markdown(tmp_path):
    pt = _load()
    ev = _events() + _host_step(0, 20.0, True) + _host_step(1000, 20.0, False)
    s = pt.summarize(_write(tmp_path, ev), num_layers=2, steps=2)
    assert s["host"]["prr_host_us_per_step"] == pytest.approx(25.0)
    md = pt.markdown(s)
    assert "0.50 synchronising (1 x cudaStreamSynchronize)" in md
    assert "PRR's Python 25.0 µs/step" in md
    with pytest.raises(ValueError, match="steps"):
        pt.host_summary(ev, 0)
