"""One question: how much host time does PRR's backend add to a decode step, beside the attention
backend it wraps?

A decode step on a GPU server is host-bound at small models (SmolLM2-135M: ~1.6 ms a step of
which ~1.1 ms GPU-busy), so the Python the wrapper runs around SGLang's calls is on the step's
critical path. This bench builds ``PRRBackend`` around an inner backend whose every call returns
at once, so that what it times is the wrapper's own Python, per decode step, in the two ways
SGLang drives a backend:

* ``replay``: a CUDA-graph step, SGLang's one host call before the replay
  (``init_forward_metadata_out_graph``; the plan is recorded in the graph);
* ``eager``: a step without a graph (``--disable-cuda-graph``, batch sizes past the captured
  ones, the CPU server): ``init_forward_metadata`` and one ``forward`` per layer. Only where the
  inner backend attends (no sparse step: its kernels are not host overhead).

Variants: ``inner`` (the null backend itself, the floor), ``auto-dense`` (``--prr-budget auto``
with a profile that runs every batch size dense: SmolLM2's server), ``serial`` (serial DSA),
``prr`` (PRR, a fixed budget). Host tensors on the CPU; the statistics flush as on a GPU (at
most once a second), not every step as a CPU server's do. µs per step: the median of ``--chunks``
chunks' means.

    python benchmarks/bench_host_step.py --csv benchmarks/results/host_step_cpu.csv
    python benchmarks/bench_host_step.py --quick --csv /tmp/host.csv   # plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
from sglang_prr.config import PRRConfig  # noqa: E402

COLUMNS = ["variant", "path", "batch", "layers", "us_per_step", "over_inner_us", "calls"]
VARIANTS = ("inner", "auto-dense", "serial", "prr")
# SmolLM2-135M's attention: 30 layers, 9 query heads, 3 KV heads of 64 dims; block 16.
SHAPE = dict(layers=30, hq=9, hk=3, d=64, page=16)


class NullInner:
    """An attention backend whose every call returns at once (``forward`` returns q)."""

    def init_forward_metadata(self, fb):
        return None

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        return None

    def init_forward_metadata_in_graph(self, fb):
        return None

    def forward(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        return q

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        return q

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        return q


class ReqPool:
    """SGLang's request pool, as the backend reads it (the state keeps a weak reference)."""

    def __init__(self):
        self.req_to_token = torch.zeros(65, 8192, dtype=torch.int32)


def _runner(shape, num_pages: int):
    L, hq, hk, d, page = (shape[k] for k in ("layers", "hq", "hk", "d", "page"))
    kbuf = torch.zeros(num_pages * page, hk, d, dtype=torch.bfloat16)
    pool = SimpleNamespace(get_key_buffer=lambda i: kbuf, get_value_buffer=lambda i: kbuf,
                           start_layer=0, set_kv_buffer=lambda *a, **k: None)
    req = ReqPool()
    mc = SimpleNamespace(get_num_kv_heads=lambda tp: hk, head_dim=d, num_hidden_layers=L,
                         get_num_attention_heads=lambda tp: hq)
    return SimpleNamespace(device="cpu", server_args=SimpleNamespace(page_size=page,
                                                                     enable_metrics=False),
                           token_to_kv_pool=pool, req_to_token_pool=req, model_config=mc,
                           use_mla_backend=False, sliding_window_size=None)


def dense_profile(path: str, shape, batches) -> str:
    """A budget profile of ``shape`` that measures dense attention faster at every batch size."""
    rows, dense = [], []
    for b in batches:
        rows += [dict(batch=b, context=4096, delta=dl, us=us) for dl, us in ((0.0, 10.0),
                                                                               (1.5, 11.0))]
        dense.append(dict(batch=b, context=4096, us=5.0))
    prof = {"version": 2, "layer_us": rows, "dense_us": dense,
            "shape": dict(method="quest", num_qo_heads=shape["hq"], num_kv_heads=shape["hk"],
                          head_dim=shape["d"], page_size=shape["page"],
                          top_k_tokens=32 * shape["page"])}
    with open(path, "w") as f:
        json.dump(prof, f)
    return path


def make_backend(variant: str, shape, profile: str):
    """The variant's backend around a fresh ``NullInner``."""
    from sglang_prr.serving import backend as bk

    inner = NullInner()
    if variant == "inner":
        return inner
    base = dict(block_size=shape["page"], top_k=32, top_k_unit="blocks", min_context=512)
    cfg = {"auto-dense": PRRConfig(budget="auto", profile=profile, **base),
           "serial": PRRConfig(serial=True, **base), "prr": PRRConfig(**base)}[variant]
    b = bk.PRRBackend(inner, _runner(shape, 600), cfg.validate(), "null")
    b.stats._on_gpu = True  # flush at most once a second, as a GPU server does
    return b


def decode_batch(batch: int, context: int):
    """A decode forward batch of ``batch`` rows at ``context`` tokens (host tensors)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lens = torch.full((batch,), context, dtype=torch.int64)
    return SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=lens.clone(),
                           seq_lens_cpu=lens, seq_lens_sum=int(lens.sum()), num_padding=0,
                           req_pool_indices=torch.arange(1, batch + 1),
                           out_cache_loc=torch.arange(batch), positions=lens - 1,
                           encoder_lens=None, rids=None)


def step_calls(b, path: str, fb, shape):
    """One decode step's host calls on backend ``b`` along ``path``."""
    if path == "replay":
        return lambda: b.init_forward_metadata_out_graph(fb)
    B, hq, hk, d = fb.seq_lens.shape[0], shape["hq"], shape["hk"], shape["d"]
    q = torch.zeros(B, hq * d)
    k = v = torch.zeros(B, hk * d)
    layers = [SimpleNamespace(layer_id=i, tp_q_head_num=hq, tp_k_head_num=hk, qk_head_dim=d,
                              v_head_dim=d, scaling=d ** -0.5, is_cross_attention=False)
              for i in range(shape["layers"])]

    def eager():
        b.init_forward_metadata(fb)
        for layer in layers:
            b.forward(q, k, v, layer, fb)
    return eager


def time_us(fn, calls: int, chunks: int) -> float:
    """µs per call: the median of ``chunks`` chunks' means (``calls`` calls each), after a warmup
    chunk."""
    means = []
    for c in range(chunks + 1):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        if c:
            means.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return statistics.median(means)


def bench(a, rows) -> None:
    shape = dict(SHAPE, layers=a.layers)
    with tempfile.TemporaryDirectory() as tmp:
        prof = dense_profile(os.path.join(tmp, "profile.json"), shape, a.batches)
        for batch in a.batches:
            floor = {}
            for variant in VARIANTS:
                b = make_backend(variant, shape, prof)
                for path in ("replay", "eager"):
                    if path == "eager" and variant in ("serial", "prr"):
                        continue  # its layers run the sparse step: not host overhead
                    fb = decode_batch(batch, a.context)
                    calls = a.calls if path == "replay" else max(a.calls // shape["layers"], 1)
                    us = time_us(step_calls(b, path, fb, shape), calls, a.chunks)
                    floor.setdefault(path, us)
                    rows.append(dict(variant=variant, path=path, batch=batch,
                                     layers=shape["layers"], us_per_step=f"{us:.3f}",
                                     over_inner_us=f"{us - floor[path]:.3f}", calls=calls))
                    print(f"{variant:>10} {path:>6} batch {batch:>3}: {us:8.2f} µs a step "
                          f"(+{us - floor[path]:.2f} over the inner backend)")


def plot(rows, png: str) -> None:
    plt = common.pyplot()
    if plt is None or not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, path in zip(axes, ("replay", "eager")):
        sel = [r for r in rows if r["path"] == path]
        batches = sorted({int(r["batch"]) for r in sel})
        names = [v for v in VARIANTS if any(r["variant"] == v for r in sel)]
        width = 0.8 / max(len(names), 1)
        for j, v in enumerate(names):
            ys = [next((float(r["us_per_step"]) for r in sel
                        if r["variant"] == v and int(r["batch"]) == bt), 0.0) for bt in batches]
            ax.bar([i + j * width for i in range(len(batches))], ys, width, label=v)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))])
        ax.set_xticklabels([f"batch {bt}" for bt in batches])
        ax.set_ylabel("host µs a decode step")
        ax.set_title(f"{path} ({rows[0]['layers']} layers)" if path == "eager" else path)
        ax.legend(fontsize=7)
    common.save_figure(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=7680)
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--calls", type=int, default=3000, help="replay steps a chunk")
    ap.add_argument("--chunks", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="few calls (plumbing)")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "host_step_cpu.csv"))
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.calls, a.chunks, a.layers = [1, 3], 40, 2, 4
    rows = []
    bench(a, rows)
    common.write_rows(a.csv, rows, COLUMNS)
    plot(rows, os.path.splitext(a.csv)[0] + ".png")
    return rows


if __name__ == "__main__":
    main()
