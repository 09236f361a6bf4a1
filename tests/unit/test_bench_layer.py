"""benchmarks/bench_layer.py on CPU: the smoke run of every variant with warm and cold timings,
P(t) planted at the real traces' hit rate (the step's own counters see exactly the planted
misses), the 0.7 row beside it, the real traces' |M| sequences replayed, and the old drifting
predictor; plus the planting itself, with its negative control."""


import pytest
import torch

from sglang_prr import reference as ref
from sglang_prr.tools import trace_replay, traces

import bench_module


@pytest.fixture(scope="module")
def mod():
    return bench_module.load("bench_layer")


def _by(rows):
    return {r["variant"]: r for r in rows}


@pytest.fixture(scope="module")
def one_trace(tmp_path_factory):
    """One request of the real traces, cut to its first two traced layers and 24 steps (8
    calibrate, 16 are replayed, ``--calib-rows 8``): the same plumbing at a fraction of the
    replay time (calibration's 80 candidates dominate it on a CPU)."""
    t = traces.load_traces(trace_replay.REAL_TRACES)[0]
    t.scores, t.nblk, t.layers = t.scores[:24, :2], t.nblk[:24], t.layers[:2]
    d = tmp_path_factory.mktemp("one_trace")
    traces.save_trace(str(d / "0001.npz"), t)
    return str(d)


def test_bench_layer_quick_cpu_real_hit_rate(mod, tmp_path, one_trace):
    rows = mod.main(["--quick", "--device", "cpu", "--real-traces", one_trace, "--calib-rows",
                     "8", "--out", str(tmp_path / "layer.csv")])
    by = _by(rows)
    assert {"serial DSA", "PRR (exact)", "PRR (exact), hit 0.7", "stage: selection",
            "stage: bump alone", "stage: bump + P copy"} <= set(by)
    assert all(r["median_us"] > 0 and r["cold_median_us"] > 0 for r in rows)
    prr, low = by["PRR (exact)"], by["PRR (exact), hit 0.7"]
    real = trace_replay.real_hit_rate(one_trace, delta=1.5, calib_rows=8)["overlap"]
    assert prr["hit_source"].startswith("real traces") and low["hit_source"] == "compare"
    assert prr["hit_target"] == pytest.approx(real, abs=0.07)  # 32 cells of 8 blocks
    assert low["hit_target"] == pytest.approx(0.7, abs=0.07)
    k = 128 // 16
    for r in (prr, low):  # the selection's counters saw exactly the planted misses
        assert r["mean_repair_blocks"] == pytest.approx((1 - r["hit_target"]) * k, abs=1e-3)
        assert r["hit_rate"] == pytest.approx(1 - r["mean_repair_blocks"] / (k + 2), abs=1e-3)
    assert low["mean_repair_blocks"] > prr["mean_repair_blocks"]
    assert by["serial DSA"]["hit_rate"] == prr["hit_rate"]  # the case's PRR numbers
    # --prr-predictor side: the same planted P, so the same hits and repairs as PRR's row
    side = by[mod.SIDE]
    assert side["hit_source"] == prr["hit_source"] and side["median_us"] > 0
    assert side["hit_rate"] == prr["hit_rate"] and side["mean_repair_blocks"] == prr["mean_repair_blocks"]
    assert (tmp_path / "layer.csv").read_text().count("\n") == len(rows) + 1


def test_bench_layer_replays_the_traces_misses(mod, tmp_path, one_trace):
    rows = mod.main(["--quick", "--device", "cpu", "--replay-traces", "--real-traces",
                     one_trace, "--calib-rows", "8", "--compare-hit-rate", "none",
                     "--out", str(tmp_path / "layer.csv")])
    prr = _by(rows)["PRR (exact)"]
    assert "PRR (exact), hit 0.7" not in _by(rows)
    assert prr["hit_source"] == "replay of real traces" and prr["hit_target"] < 1.0
    # cell (request b, KV head h) replays sequence b * Hk + h: (layer 0, heads 0-2), (layer 1,
    # head 0), ...; |M| scaled from the traces' K (16) to this K (8)
    m = mod.trace_misses((8, 2, 2), 8, 1.5, one_trace, 8)
    tr = traces.load_traces(one_trace)[0]
    for (b, h), (layer, head) in {(0, 0): (0, 0), (0, 1): (0, 1), (1, 1): (1, 0)}.items():
        want = trace_replay.calibrated_replay(tr, layer, 16, 1.5, 8, 1, 1)["missed"][:8, head]
        assert torch.equal(m[:, b, h], (want.float() * 8 / 16).round().long()), (b, h)
    assert prr["mean_repair_blocks"] == pytest.approx(float(m.float().mean()), abs=1e-3)


def test_bench_layer_drift_is_the_old_behaviour(mod, tmp_path):
    rows = mod.main(["--quick", "--device", "cpu", "--hit-rate", "drift", "--compare-hit-rate",
                     "none", "--out", str(tmp_path / "layer.csv")])
    prr = _by(rows)["PRR (exact)"]
    assert prr["hit_source"] == "drift" and prr["hit_target"] is None
    assert 0.0 < prr["hit_rate"] <= 1.0  # the predictor warmed up and hit some of A


def test_bench_layer_rejects_bad_hit_rates(mod, tmp_path, capsys):
    for argv, word in ((["--hit-rate", "1.2"], "allowed 0..1"),
                       (["--compare-hit-rate", "real"], "--compare-hit-rate real"),
                       (["--hit-rate", "drift", "--replay-traces"], "choose one")):
        with pytest.raises(SystemExit):
            mod.main(argv + ["--out", str(tmp_path / "x.csv")])
        assert word in capsys.readouterr().err


def test_planted_p_misses_exactly_m_blocks_of_a(mod, seed):
    g = torch.Generator().manual_seed(seed)
    T, B, Hk, nb, k, n_pred = 3, 2, 4, 40, 6, 9
    nblk = torch.tensor([40, 31])
    scores = torch.randn(T * B, Hk, nb, generator=g)
    a_idx, a_cnt = ref.select_topk(scores, nblk.repeat(T), k, 1, 1)
    a_idx, a_cnt = a_idx.view(T, B, Hk, -1), a_cnt.view(T, B, Hk)
    misses = torch.randint(0, k + 1, (T, B, Hk), generator=g)
    p_idx, p_cnt, share = mod.planted_p(a_idx, a_cnt, nblk, nb, n_pred, 1, 1, misses,
                                        n_pred + 2, g)
    keep, middle = (x[:, None, :] for x in ref.kept_mask(nblk, nb, 1, 1))  # [B, 1, NB]
    p = ref.list_to_mask(p_idx, p_cnt, nb)
    a = ref.list_to_mask(a_idx, a_cnt, nb)
    assert (p_cnt == n_pred + 2).all() and ((p & middle).sum(-1) == n_pred).all()
    assert (p & keep).sum(-1).eq(keep.sum(-1)).all()  # every kept block is in P
    assert torch.equal((a & middle & ~p).sum(-1), misses)  # |A \ P| = m, to the block
    assert share == pytest.approx(1 - float(misses.sum()) / (T * B * Hk * k))
    assert (p_idx[..., 1:] > p_idx[..., :-1]).all()  # ascending, as predict_set writes P
    # negative control: P planted for step 0's A, checked against step 1's A
    other = (a[1] & middle & ~p[0]).sum(-1)
    assert not torch.equal(other, misses[0])
