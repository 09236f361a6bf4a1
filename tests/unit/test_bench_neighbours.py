"""CPU checks of benchmarks/bench_neighbours.py: the per-place means it reads from a trace, the
layers' stages (each on its own layer's inputs), the plot of a CSV and the clear exits (the timing
itself needs CUPTI and runs on the GPU machine)."""

from __future__ import annotations

import csv
import os
import random
import sys
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))
import bench_neighbours as bn  # noqa: E402
from sglang_prr import ops  # noqa: E402


def _events(names, replays, layers, rng):
    """Kernel events of ``replays x layers`` layers of ``names``, random durations, plus CPU-side
    events the reader must skip."""
    ev, durs, t = [], {n: [] for n in names}, 0
    for _ in range(replays * layers):
        for n in names:
            d = rng.uniform(1.0, 50.0)
            durs[n].append(d)
            ev.append(dict(cat="kernel", name=f"void prr::(anonymous namespace)::{n}(prr::A)",
                           ts=t, dur=d))
            ev.append(dict(cat="cuda_runtime", name="cudaGraphLaunch", ts=t, dur=99.0))
            t += 1 + rng.random()
    rng.shuffle(ev)  # the reader orders them by start
    return ev, durs


def test_layer_means_reads_each_place_against_an_fp64_mean():
    rng = random.Random()
    names = ["quest_select_onepass_kernel<bf16, 128, false>", "block_attn_kernel<half, 128, true>",
             "nvjet_gemm"]
    replays, layers = rng.randint(2, 5), rng.randint(3, 7)
    ev, durs = _events(names, replays, layers, rng)
    got = bn.layer_means(ev, replays, layers)
    assert [r["kernel"] for r in got] == names
    for r, n in zip(got, names):
        want = sum(durs[n]) / len(durs[n])
        assert r["count"] == replays * layers
        assert r["mean_us"] == pytest.approx(want, abs=0.006)
    # negative control: a place whose kernels differ between layers is refused
    bad = [dict(e) for e in ev]
    k = next(e for e in sorted(bad, key=lambda e: e["ts"]) if e["cat"] == "kernel")
    k["name"] = "other_kernel(x)"
    with pytest.raises(ValueError, match="different kernels"):
        bn.layer_means(bad, replays, layers)
    # ... and so are kernels that do not split into the layers
    with pytest.raises(ValueError, match="do not split"):
        bn.layer_means(ev, replays, layers + 1)


def test_layer_means_leaves_the_excluded_kernels_out():
    rng = random.Random()
    ev, durs = _events(["sel", "flush_reduce"], 4, 1, rng)
    got = bn.layer_means(ev, 4, 1, exclude=["flush_reduce"])
    assert [r["kernel"] for r in got] == ["sel"]
    assert got[0]["mean_us"] == pytest.approx(sum(durs["sel"]) / 4, abs=0.006)
    assert len(bn.layer_means(ev, 4, 1)) == 2  # negative control: without the exclusion


def _layers(layers=4):
    a = types.SimpleNamespace(layers=layers, ctx=1024, page=16, batch=2, n_pred=6, top_k=64,
                              m_blocks=2)
    return bn.Layers(a, torch.device("cpu"), dims=(64, 96, 80))


def test_every_setting_runs_and_each_layer_reads_its_own_inputs():
    lay = _layers()
    for setting in bn.SETTINGS:
        for variant in bn.VARIANTS:
            if variant == "prr_layer" and setting not in bn.PAIRED:
                with pytest.raises(ValueError, match="prr_layer runs in the settings"):
                    lay.calls(setting, variant)
                continue
            calls = lay.calls(setting, variant)
            assert len(calls) == (1 if setting == "flushed" else lay.L)
            for c in calls:
                c()
    s = lay.sel[1]
    want = ops.quest_select(s["q"], s["kmin"], s["kmax"], s["table"], s["nblk"], None, None,
                               lay.k, 1, 1, lay.k + 2, None, new_k=s["new_k"],
                               new_pos=s["new_pos"], page_size=16)
    got = lay.select(1, prr=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    other = lay.select(1 + lay.L // 2, prr=False)  # negative control: another layer's inputs
    assert not torch.equal(got[0], other[0])
    o1, o2 = lay.attention(1), lay.attention(2)
    assert o1[0].shape == (2, 32, 128) and not torch.equal(o1[0], o2[0])
    with pytest.raises(ValueError, match="unknown stage"):
        lay.stage("nope", 0, "serial")
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        lay.calls("layers", "nope")


def test_plot_only_draws_the_csv(tmp_path):
    path = tmp_path / "n.csv"
    rows = [dict(gpu="x", date="d", library="l", variant=v, setting=s, batch=1, ctx=131200,
                 layers=32, place=p, kernel=k, mean_us=10.0 + p, median_us=10.0, count=640)
            for v in ("serial", "prr") for s in ("layers", "server")
            for p, k in enumerate(("quest_select_onepass_kernel<b>", "block_attn_kernel<h>"))]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=bn.COLUMNS)
        w.writeheader()
        w.writerows(rows)
    bn.main(["--plot-only", str(path)])
    png = tmp_path / "n.png"
    assert png.exists() and png.stat().st_size > 1000
    bad = tmp_path / "bad.csv"  # negative control: a CSV without the timing columns
    bad.write_text("variant,setting\nserial,layers\n")
    with pytest.raises(KeyError, match="mean_us"):
        bn.main(["--plot-only", str(bad)])


def test_bad_flags_name_the_value(tmp_path):
    with pytest.raises(SystemExit, match="--layers must be >= 1, got 0"):
        bn.main(["--layers", "0", "--csv", str(tmp_path / "x.csv")])
    with pytest.raises(SystemExit, match="--ctx 1000 must hold"):
        bn.main(["--ctx", "1000", "--csv", str(tmp_path / "x.csv")])
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_cuda_exits_with_a_clear_message(tmp_path):
    with pytest.raises(SystemExit) as e:
        bn.main(["--csv", str(tmp_path / "x.csv")])
    assert "needs a CUDA GPU" in str(e.value)
    assert not (tmp_path / "x.csv").exists()


def test_layer_means_by_name_orders_two_streams_kernels():
    rng = random.Random()
    replays, layers = 3, rng.randint(3, 6)
    ev, durs = _events(["quest_select_onepass_kernel<b>", "block_attn_kernel<h>", "repair"],
                       replays, layers, rng)
    ks = sorted((e for e in ev if e["cat"] == "kernel"), key=lambda e: e["ts"])
    # in one layer the speculative pass (the attention) starts before the selection
    ks[3]["ts"], ks[4]["ts"] = ks[4]["ts"], ks[3]["ts"]
    with pytest.raises(ValueError, match="different kernels"):  # negative control
        bn.layer_means(ev, replays, layers)
    got = bn.layer_means(ev, replays, layers, by_name=True)
    assert [r["kernel"] for r in got] == sorted(durs)
    for r in got:
        assert r["mean_us"] == pytest.approx(sum(durs[r["kernel"]]) / len(durs[r["kernel"]]),
                                             abs=0.006)


def test_prr_layer_lists_and_its_repair_equal_serial_attention():
    lay = _layers()
    na = lay.att[0]["idx"].shape[-1]
    for l in range(lay.L):
        s, sp = lay.att[l], lay.spec[l]
        a_ids = s["idx"]
        assert torch.equal(sp["m_idx"][..., :2], a_ids[..., na - 2:])
        assert (sp["m_cnt"] == 2).all() and (sp["p_cnt"] == 6).all()
        for b in range(a_ids.shape[0]):
            for h in range(a_ids.shape[1]):
                p = sp["p_idx"][b, h]
                assert torch.equal(p, torch.sort(p).values) and len(set(p.tolist())) == 6
                hits = set(p.tolist()) & set(a_ids[b, h].tolist())
                assert hits == set(a_ids[b, h, : na - 2].tolist())  # P n A = A less M
    lay.fork(1)
    got = lay.repair(1)
    want = lay.attention(1)
    assert torch.equal(got[0], want[0])  # exact PRR: serial DSA's bits
    assert not torch.equal(got[0], lay.attention(2)[0])  # negative control: another layer
    with pytest.raises(ValueError, match=r"\|M\| = 99 and \|P\| = 6 do not fit"):
        bn.Layers._spec_lists(lay.att[0], 99, 6, 64, torch.Generator().manual_seed(0))


def test_bad_spec_sizes_name_the_values(tmp_path):
    with pytest.raises(SystemExit, match="--m-blocks 40 and --n-pred 48"):
        bn.main(["--m-blocks", "40", "--csv", str(tmp_path / "x.csv")])
    with pytest.raises(SystemExit, match="--m-blocks 2 and --n-pred 10"):
        bn.main(["--m-blocks", "2", "--n-pred", "10", "--csv", str(tmp_path / "x.csv")])
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize("where", ["select", "side"])
def test_summary_update_placement_follows_the_flag(monkeypatch, where):
    """``--summary-update select``: the selections write the new keys into the layer's summaries
    and PRR's layer launches no update; ``side``: the selections leave the summaries as they were
    and the layer runs the update after its selection."""
    lay = _layers()
    lay.write = where == "select"
    updates = []
    orig = bn.stages.update_set
    monkeypatch.setattr(bn.stages, "update_set", lambda s, page: (updates.append(s),
                                                                  orig(s, page)))
    s = lay.sel[2]
    before, before_max = s["kmin"].clone(), s["kmax"].clone()
    lay.select(2, prr=False)
    assert torch.equal(s["kmin"], before) != lay.write
    lay.fork(2)
    lay.repair(2)
    assert len(updates) == (0 if lay.write else 1)
    ref_min, ref_max = before.clone(), before_max.clone()
    ops.quest_update(ref_min, ref_max, s["new_k"], s["new_loc"], s["new_pos"], 16,
                     one_per_page=True)
    # either way: the update's summaries (page 0, the padding sink, aside)
    assert torch.equal(s["kmin"][1:], ref_min[1:]) and torch.equal(s["kmax"][1:], ref_max[1:])
