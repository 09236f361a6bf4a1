"""bench_host_step.py on the CPU: every variant and path writes its row, the backends it times
are the ones it names, and a step's calls reach the inner backend as SGLang's would."""

from __future__ import annotations

import csv
import os
import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_host_step as hs  # noqa: E402


class Counting(hs.NullInner):
    def __init__(self):
        self.calls = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def init_forward_metadata(self, fb):
        self._count("init")

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self._count("out_graph")
        self.last_lens = fb.seq_lens_cpu.tolist()

    def forward(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        self._count("forward")
        return q


def test_every_variant_and_path_writes_its_row(tmp_path):
    out = tmp_path / "host.csv"
    rows = hs.main(["--quick", "--csv", str(out)])
    with open(out) as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == hs.COLUMNS and len(got) == len(rows) == 2 * 6
    for batch in ("1", "3"):
        mine = {(r["variant"], r["path"]) for r in got if r["batch"] == batch}
        assert mine == {("inner", "replay"), ("inner", "eager"), ("auto-dense", "replay"),
                        ("auto-dense", "eager"), ("serial", "replay"), ("prr", "replay")}
    assert all(float(r["us_per_step"]) > 0 for r in got)
    inner = {(r["path"], r["batch"]): float(r["us_per_step"]) for r in got
             if r["variant"] == "inner"}
    for r in got:  # each row's excess is over the inner backend of its own path and batch
        want = float(r["us_per_step"]) - inner[(r["path"], r["batch"])]
        assert abs(float(r["over_inner_us"]) - want) < 2e-3, r
    assert os.path.exists(tmp_path / "host.png")


def test_the_timed_steps_reach_the_inner_backend_as_sglang_would(tmp_path):
    """The auto-dense backend is the pass-through one and hands each layer to the inner backend
    once a step; the sparse variants plan their inner backend with one-token rows, the
    auto-dense one with the real lengths (control)."""
    shape = dict(hs.SHAPE, layers=5)
    batch, ctx = random.choice([1, 3, 8]), random.randrange(600, 9000)
    prof = hs.dense_profile(str(tmp_path / "p.json"), shape, [1, 8])
    for variant, lens in (("auto-dense", [ctx] * batch), ("serial", [1] * batch),
                          ("prr", [1] * batch)):
        b = hs.make_backend(variant, shape, prof)
        b.inner = inner = Counting()
        assert b.passthrough == (variant == "auto-dense"), variant
        fb = hs.decode_batch(batch, ctx)
        hs.step_calls(b, "replay", fb, shape)()
        assert inner.last_lens == lens, (variant, batch, ctx)
        if variant == "auto-dense":
            hs.step_calls(b, "eager", fb, shape)()
            assert inner.calls == {"out_graph": 1, "init": 1, "forward": 5}, inner.calls
