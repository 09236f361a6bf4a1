"""benchmarks/bench_serving.py on CPU: the plan of servers and points, the server commands, the
decode-batch check (SGLang's log lines and the profile's step spans), the timing, the real-text
prompts, the logprob comparison, the CSV merge and plot; and one CPU server (demo shape) that
decodes a steady batch (every step bs = B) and, as the check's negative control, a staggered one
(steps of fewer requests, caught)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

import bench_module


@pytest.fixture(scope="module")
def bench():
    return bench_module.load("bench_serving", register=True)


def _plan(bench, *argv):
    _, a = bench.parse_args(list(argv))
    return {s.name: [(p.kind, p.ctx, p.batch) for p in pts] for s, pts in bench.plan(a)}, a


def test_default_plan_has_every_kind(bench):
    plan, _ = _plan(bench)
    grid = [("grid", 32768, 1), ("grid", 32768, 8), ("throughput", 32768, 16),
            ("grid", 131072, 1)]
    assert list(plan) == ["dense", "serial", "prr", "auto", "serial-infllm_v2", "prr-infllm_v2",
                          "dense-smollm2", "serial-smollm2", "prr-smollm2", "auto-smollm2"]
    assert plan["dense"] == [("reference", 4096, 1)] + grid  # the reference row: dense only
    assert plan["serial"] == plan["prr"] == plan["auto"] == grid
    assert plan["serial-infllm_v2"] == plan["prr-infllm_v2"] == [("infllm", 32768, 1),
                                                                 ("infllm", 131072, 1)]
    assert plan["prr-smollm2"] == plan["auto-smollm2"] == [("smollm2", 7680, 1)]


def test_plan_selection(bench):
    plan, _ = _plan(bench, "--only", "throughput", "infllm", "--variants", "prr", "auto")
    assert plan == {"prr": [("throughput", 32768, 16)], "auto": [("throughput", 32768, 16)],
                    "prr-infllm_v2": [("infllm", 32768, 1), ("infllm", 131072, 1)]}
    plan, _ = _plan(bench, "--throughput", "--infllm-points", "--smollm2", "--skip",
                    "--dense-ref-ctx", "0", "--variants", "dense")
    assert plan == {"dense": [("grid", 32768, 1), ("grid", 32768, 8), ("grid", 131072, 1),
                              ("grid", 131072, 8)]}  # no throughput, no reference, 128K/8 back
    plan, a = _plan(bench, "--arrival", "staggered", "--only", "grid", "--variants", "serial")
    assert {p.arrival for _, pts in bench.plan(a) for p in pts} == {"staggered"}


def test_bad_options_are_named(bench, capsys):
    for argv, word in ((["--smollm2", "8100x1"], "8100x1"), (["--out", "1"], "--out 1"),
                       (["--throughput", "32768"], "CTXxBATCH"),
                       (["--decode-log-interval", "0"], "--decode-log-interval 0"),
                       (["--passes", "0"], "--passes 0"), (["--rounds", "-1"], "--rounds -1")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert word in capsys.readouterr().err
    bench.parse_args(["--smollm2", "8100x1", "--only", "grid"])  # not run: not checked


def test_server_commands(bench, tmp_path, capsys):
    bench.main(["--dry-run", "--workdir", str(tmp_path)])
    cmds = [ln.split() for ln in capsys.readouterr().out.splitlines() if "launch_server" in ln]
    assert len(cmds) == 10
    opt = lambda c, k: c[c.index(k) + 1] if k in c else None
    for c in cmds:  # the decode batch of every step comes from SGLang's own log
        assert (opt(c, "--log-level"), opt(c, "--decode-log-interval")) == ("info", "1")
        assert opt(c, "--attention-backend") == "flashinfer" and "--disable-cuda-graph" not in c
    dense, serial, prr, auto, inf_s, inf_p, sm_d, sm_s, sm_p, sm_a = cmds
    assert opt(dense, "--max-running-requests") == opt(dense, "--cuda-graph-max-bs") == "16"
    assert opt(dense, "--prr-method") == "dense" and "--prr-serial" in serial
    assert opt(auto, "--prr-budget") == "auto" and opt(prr, "--prr-budget") == "1.5"
    assert opt(inf_s, "--prr-method") == opt(inf_p, "--prr-method") == "infllm_v2"
    assert "--prr-serial" in inf_s and "--prr-serial" not in inf_p
    for c in cmds[:6]:
        assert opt(c, "--load-format") == "dummy" and "--dtype" not in c
    for c in (sm_d, sm_s, sm_p, sm_a):  # real weights, bf16, within SmolLM2's 8192 positions
        assert "--load-format" not in c and opt(c, "--dtype") == "bfloat16"
        assert int(opt(c, "--context-length")) <= 8192
    assert opt(sm_d, "--prr-method") == "dense" and "--prr-serial" in sm_s
    # auto reads the profile of its model's layer shape
    assert opt(auto, "--prr-profile").endswith("budget_profile_h200.json")
    assert opt(sm_a, "--prr-budget") == "auto"
    assert opt(sm_a, "--prr-profile").endswith("budget_profile_h200_smollm2.json")
    # the default predictor (side), named to the servers that speculate only
    pred = [opt(c, "--prr-predictor") if "--prr-predictor" in c else None for c in cmds]
    assert pred[cmds.index(auto)] == "side" and pred[cmds.index(sm_a)] == "side"
    assert pred[cmds.index(sm_d)] is None and pred[cmds.index(sm_s)] is None


def test_side_predictor_reaches_the_speculating_servers_only(bench, tmp_path, capsys,
                                                             monkeypatch):
    bench.main(["--dry-run", "--workdir", str(tmp_path), "--predictor", "side", "--only",
                "grid", "infllm"])
    cmds = [ln.split() for ln in capsys.readouterr().out.splitlines() if "launch_server" in ln]
    side = lambda c: c[c.index("--prr-predictor") + 1] if "--prr-predictor" in c else None
    got = [("--prr-serial" in c, c[c.index("--prr-budget") + 1] if "--prr-budget" in c else None,
            side(c)) for c in cmds]
    # dense, serial, prr, auto; InfLLM-v2 serial, prr
    assert [g[2] for g in got] == [None, None, "side", "side", None, "side"], got
    _, a = bench.parse_args(["--predictor", "side"])
    assert bench._label(bench.Server("prr", "quest", "m"), a) == "PRR (exact), side predictor"
    monkeypatch.setenv("SGLANG_PRR_PREDICT_ORDER", "repair")  # its own launch after the repair
    assert bench._predictor(bench.Server("prr", "quest", "m"), a) == "side-late"
    assert bench._label(bench.Server("prr", "quest", "m"), a) == \
        "PRR (exact), side predictor after the repair"
    assert bench._predictor(bench.Server("serial", "quest", "m"), a) == ""
    monkeypatch.delenv("SGLANG_PRR_PREDICT_ORDER")
    # InfLLM-v2's own launch follows the repair unless the knob says otherwise
    assert bench._predictor(bench.Server("prr", "infllm_v2", "m"), a) == "side-late"
    monkeypatch.setenv("SGLANG_PRR_PREDICT_ORDER", "selection")
    assert bench._predictor(bench.Server("prr", "infllm_v2", "m"), a) == "side"
    monkeypatch.setenv("SGLANG_PRR_PREDICT_ORDER", "scores")  # forked after the scores
    assert bench._label(bench.Server("prr", "infllm_v2", "m"), a) == \
        "PRR (exact), InfLLM-v2, side predictor forked after the scores"
    monkeypatch.setenv("SGLANG_PRR_PREDICT_ORDER", "next")  # at the next layer's fork
    assert bench._label(bench.Server("prr", "infllm_v2", "m"), a) == \
        "PRR (exact), InfLLM-v2, side predictor at the next layer's fork"
    monkeypatch.delenv("SGLANG_PRR_PREDICT_ORDER")
    assert bench._label(bench.Server("serial", "quest", "m"), a) == "serial DSA"
    # --predictor fused names it to the same servers; their rows' predictor column is empty
    bench.main(["--dry-run", "--workdir", str(tmp_path), "--predictor", "fused", "--only",
                "grid", "infllm"])
    cmds = [ln.split() for ln in capsys.readouterr().out.splitlines() if "launch_server" in ln]
    assert [side(c) for c in cmds] == [None, None, "fused", "fused", None, "fused"]
    _, a = bench.parse_args(["--predictor", "fused"])
    assert bench._predictor(bench.Server("prr", "quest", "m"), a) == ""


@pytest.mark.parametrize("env,want", [
    ({}, ""), ({"SGLANG_PRR_PDL": "1"}, "pdl"), ({"SGLANG_PRR_FOLD_NEW_KEYS": "0"}, "update-first"),
    ({"SGLANG_PRR_SELECT_KERNEL": "split"}, "select-split"),
    ({"SGLANG_PRR_SELECT_KERNEL": "bogus"}, ""),  # the launcher ignores it too
    ({"SGLANG_PRR_SCORES_KERNEL": "warp"}, "scores-warp"),
    ({"SGLANG_PRR_SCORES_KERNEL": "stream"}, ""),  # the default
    ({"SGLANG_PRR_TOPK": "scan"}, "topk-scan"), ({"SGLANG_PRR_TOPK": "walks"}, ""),
    ({"SGLANG_PRR_ATTN_GRID": "heads"}, "grid-heads"), ({"SGLANG_PRR_ATTN_GRID": "blocks"}, ""),
    ({"SGLANG_PRR_ATTN_GRID": "entries"}, "grid-entries"),
    ({"SGLANG_PRR_ATTN_MERGE": "split"}, "merge-split"),
    ({"SGLANG_PRR_ATTN_MERGE": "fused"}, "merge-fused"), ({"SGLANG_PRR_ATTN_MERGE": "x"}, ""),
    ({"SGLANG_PRR_ATTN_MERGE": "ticket"}, "merge-ticket"),
    ({"SGLANG_PRR_ATTN_SPREAD": "row"}, "spread-row"), ({"SGLANG_PRR_ATTN_SPREAD": "all"}, ""),
    ({"SGLANG_PRR_ATTN_MERGE_SPLITS": "2"}, "merge-splits-2"),
    ({"SGLANG_PRR_ATTN_MERGE_SPLITS": "1"}, "merge-splits-1"),  # one CTA a group, asked for
    ({"SGLANG_PRR_ATTN_MERGE_SPLITS": "auto"}, ""), ({"SGLANG_PRR_ATTN_MERGE_SPLITS": "0"}, ""),
    ({"SGLANG_PRR_ATTN_PACK": "1"}, "pages-packed"), ({"SGLANG_PRR_ATTN_PACK": "0"}, "pages-one"),
    ({"SGLANG_PRR_ATTN_PACK": "on"}, ""),
    ({"SGLANG_PRR_SELECT_GRID": "rows"}, "select-rows"), ({"SGLANG_PRR_SELECT_GRID": "2"}, ""),
    ({"SGLANG_PRR_SELECT_GRID": "table"}, "select-table"),
    ({"SGLANG_PRR_SMEM_CARVEOUT": "max"}, "carveout-max"),
    ({"SGLANG_PRR_SMEM_CARVEOUT": "select"}, "carveout-select"),
    ({"SGLANG_PRR_SMEM_CARVEOUT": "1"}, ""),  # only "max" / "select" ask, as in the launcher
    ({"SGLANG_PRR_INFLLM_CK": "fp32"}, "ck-fp32"), ({"SGLANG_PRR_INFLLM_CK": "bf16"}, ""),
    ({"SGLANG_PRR_INFLLM_RING": "ids-first"}, "ring-ids-first"),
    ({"SGLANG_PRR_INFLLM_RING": "serial"}, ""),
    ({"SGLANG_PRR_INFLLM_POOL": "loads-first"}, "pool-loads-first"),
    ({"SGLANG_PRR_INFLLM_POOL": "late"}, ""),
    ({"SGLANG_PRR_INFLLM_CK": "fp32", "SGLANG_PRR_INFLLM_VARIANT": "bulk"}, "ck-fp32+logits-bulk"),
    ({"SGLANG_PRR_INFLLM_VARIANT": "mma"}, "logits-mma"),
    ({"SGLANG_PRR_INFLLM_VARIANT": "pick"}, ""),  # only the launcher's three names force one
    ({"SGLANG_PRR_PREDICT_SMEM_KB": "200"}, "predict-smem-200"),
    ({"SGLANG_PRR_PREDICT_SMEM_KB": "0"}, ""), ({"SGLANG_PRR_PREDICT_SMEM_KB": "-3"}, ""),
    ({"SGLANG_PRR_INFLLM_CK": "fp32", "SGLANG_PRR_INFLLM_RING": "ids-first",
      "SGLANG_PRR_INFLLM_POOL": "loads-first"}, "ck-fp32+ring-ids-first+pool-loads-first"),
    ({"SGLANG_PRR_PDL": "1", "SGLANG_PRR_FOLD_NEW_KEYS": "0",
      "SGLANG_PRR_SELECT_KERNEL": "rowtail"}, "pdl+update-first+select-rowtail")])
def test_launch_column_names_the_knobs(bench, monkeypatch, env, want):
    """The ``launch`` column says which measuring knobs the servers inherit, so that their rows
    sit beside the default ones instead of replacing them."""
    for k in ("SGLANG_PRR_PDL", "SGLANG_PRR_FOLD_NEW_KEYS", "SGLANG_PRR_SELECT_KERNEL",
              "SGLANG_PRR_ATTN_GRID", "SGLANG_PRR_ATTN_MERGE", "SGLANG_PRR_SELECT_GRID",
              "SGLANG_PRR_SMEM_CARVEOUT", "SGLANG_PRR_ATTN_SPREAD", "SGLANG_PRR_SCORES_KERNEL",
              "SGLANG_PRR_TOPK", "SGLANG_PRR_ATTN_MERGE_SPLITS", "SGLANG_PRR_ATTN_PACK",
              "SGLANG_PRR_INFLLM_CK", "SGLANG_PRR_INFLLM_RING", "SGLANG_PRR_INFLLM_POOL",
              "SGLANG_PRR_INFLLM_VARIANT", "SGLANG_PRR_PREDICT_SMEM_KB"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert bench._launch() == want


LOG = """\
[2026-12-01 14:43:36] Decode batch, #running-req: 2, #token: 0, token usage: 0.00, cpu graph: False, gen throughput (token/s): 2.79, #queue-req: 0
[2026-12-01 14:43:37] Prefill batch, #new-seq: 2, #new-token: 32, #cached-token: 576, token usage: 0.00, #running-req: 0, #queue-req: 0, #pending-token: 0, cpu graph: False, input throughput (token/s): 72.27
[2026-12-01 14:43:37] Decode batch, #running-req: 2, #token: 608, token usage: 0.00, cuda graph: True, gen throughput (token/s): 2.74, #queue-req: 0
[2026-12-01 14:43:37] sglang_prr: something else, #running-req: 7
[2026-12-01 14:43:37] Decode batch [12], #running-req: 2, #token: 640, token usage: 0.00, cuda graph: True, gen throughput (token/s): 8.95, #queue-req: 0
"""


def test_decode_batch_from_the_log(bench):
    # the line before the measured prefill (an earlier request's last step) is not counted
    assert bench.logged_decode_batches(LOG) == [2, 2]
    assert bench.logged_prefills(LOG) == (1, 32, 576)
    assert bench.steady_check(2, [2, 2]) == (True, "")
    ok, why = bench.steady_check(2, [2, 1, 2])  # negative control: one step of one request
    assert not ok and "bs 1 x 1, bs 2 x 2" in why
    ok, why = bench.steady_check(2, [])
    assert not ok and "no decode step" in why
    staggered = LOG.replace("#running-req: 2, #token: 640", "#running-req: 1, #token: 640")
    assert bench.logged_decode_batches(staggered) == [2, 1]


def test_decode_batch_from_the_profile(bench):
    assert bench.steady_check(8, [8], {"step[DECODE bs=8]": 6}) == (True, "")
    ok, why = bench.steady_check(8, [8], {"step[DECODE bs=8]": 4, "step[DECODE bs=1]": 2})
    assert not ok and "{1: 2, 8: 4}" in why  # negative control: the batch-8 "point"
    ok, why = bench.steady_check(8, [8], {"step[DECODE bs=8]": 4,
                                          "step[EXTEND bs=1 toks=2048]": 2})
    assert not ok and "non-decode" in why
    ok, why = bench.steady_check(8, [8], {})
    assert not ok and "no decode step" in why


def test_timing_of_a_steady_window(bench):
    # two requests, first tokens at 1.0 and 1.2 s, then one token every 0.1 s (one a double)
    marks = [[(1.0, 1), (1.1, 1), (1.3, 2), (1.4, 1)],
             [(1.2, 1), (1.3, 1), (1.4, 1), (1.5, 1), (1.6, 1)]]
    r = bench.timing(marks)
    assert r["median_ttft_ms"] == pytest.approx(1200.0)
    assert r["median_itl_ms"] == pytest.approx(100.0)
    assert r["median_tpot_ms"] == pytest.approx(100.0)
    # after 1.2 s: 2 + 1 tokens of the first request, 4 of the second, over 0.4 s
    assert r["output_tok_s"] == pytest.approx(7 / 0.4)
    assert r["tokens"] == 10 and r["completed"] == 2
    with pytest.raises(RuntimeError):  # a request without tokens
        bench.timing([marks[0], []])


def test_timing_comes_from_the_pass_without_the_profiler(bench):
    """The profiler's start stalls the scheduler: a pass that it records has a 0.5 s gap after
    the first tokens. The timing must come from the unprofiled pass (100 ms steps, 20 tok/s);
    the profiled pass's own timing (the negative control) shows the stall."""
    calls = []

    def send(url, prompts, out, on_all_first=None):
        calls.append(on_all_first)
        gap = 0.0
        if on_all_first is not None:
            on_all_first()
            gap = 0.5
        return {"marks": [[(1.0, 1)] + [(1.1 + gap + 0.1 * i, 1) for i in range(out - 1)]
                          for _ in prompts]}

    class FakeProfile:
        started = 0

        def start(self):
            self.started += 1

        def summary(self, num_layers):
            return {"started": self.started, "layers": num_layers}

    prof = FakeProfile()
    r, between, s = bench.timed_then_profiled(send, "url", [[1], [2]], 9, prof, 4,
                                              lambda: len(calls))
    assert between == 1  # after the timed pass, before the profiled one
    assert calls == [None, prof.start] and s == {"started": 1, "layers": 4}
    assert r["median_tpot_ms"] == pytest.approx(100.0)
    assert r["output_tok_s"] == pytest.approx(16 / 0.8)
    stalled = bench.timing(send("url", [[1], [2]], 9, on_all_first=prof.start)["marks"])
    assert stalled["median_tpot_ms"] > 140.0 and stalled["output_tok_s"] < 13.0
    # without a profile: one pass, no summary
    calls.clear()
    r2, _, s2 = bench.timed_then_profiled(send, "url", [[1]], 9, None, 4)
    assert calls == [None] and s2 is None and r2["median_itl_ms"] == pytest.approx(100.0)


def test_passes_are_pooled(bench):
    """Three timed passes of 100 / 100 / 130 ms steps: the row's ITL is the median over all
    their ITLs (100 ms), each pass's median is kept, the profiled pass comes after all three;
    one pass (the control) is that pass's timing alone, with no per-pass column."""
    steps = iter([0.1, 0.1, 0.13, 0.1, 0.1])  # three timed passes, the profiled one, the control
    calls = []

    def send(url, prompts, out, on_all_first=None):
        calls.append(on_all_first)
        if on_all_first is not None:
            on_all_first()
        dt = next(steps)
        return {"marks": [[(1.0, 1)] + [(1.0 + dt * (i + 1), 1) for i in range(out - 1)]
                          for _ in prompts]}

    class FakeProfile:
        def start(self):
            pass

        def summary(self, num_layers):
            return {}

    prof = FakeProfile()
    r, between, _ = bench.timed_then_profiled(send, "url", [[1], [2]], 5, prof, 2,
                                              lambda: len(calls), passes=3)
    assert between == 3 and calls == [None, None, None, prof.start]
    assert r["median_itl_ms"] == pytest.approx(100.0)
    assert r["p90_itl_ms"] == pytest.approx(130.0)
    assert r["itl_pass_ms"] == "100.000;100.000;130.000"
    assert r["completed"] == 2 and r["tokens"] == 30
    assert r["output_tok_s"] == pytest.approx(20.0)  # the median pass's rate: 8 tokens in 0.4 s
    one = bench.pool_passes([bench.timing(send("url", [[1]], 5)["marks"])])
    assert one["itl_pass_ms"] is None and one["median_itl_ms"] == pytest.approx(100.0)


def test_rounds_keep_their_rows_and_show_their_ratios(bench, tmp_path):
    """Rows of two rounds of the same point sit side by side in the CSV (a round measured
    again replaces only itself), and the rounds table gives each round's ratio to serial DSA."""
    path = str(tmp_path / "serving.csv")
    row = lambda v, rnd, itl, method="quest", **kw: dict(  # noqa: E731
        variant=v, method=method, model="llama3-8b-shape", kind="grid", ctx=131072, batch=1,
        median_itl_ms=itl, round=rnd, **kw)
    rows = [row("serial", 1, 5.0), row("prr", 1, 5.2, predictor="side"),
            row("serial", 2, 5.1), row("prr", 2, 5.0, predictor="side")]
    bench._write(bench._merge([], rows), path)
    bench._write(bench._merge(bench._read(path), [row("serial", 2, 4.0)]), path)
    back = [(r["variant"], r["round"], r["median_itl_ms"]) for r in bench._read(path)]
    assert back == [("serial", "1", "5.0"), ("prr", "1", "5.2"), ("prr", "2", "5.0"),
                    ("serial", "2", "4.0")]
    table = bench.rounds_table(rows).splitlines()
    assert table[2] == ("| llama3-8b-shape grid 128K / 1 | 1 | serial 5.000, prr (side) "
                        "5.200 | prr (side) 1.040x |")
    assert table[3].endswith("| 2 | serial 5.100, prr (side) 5.000 | prr (side) 0.980x |")
    # a round without serial DSA or dense has no ratio
    assert bench.rounds_table([row("prr", 3, 5.0)]).splitlines()[2].endswith("| - |")
    # without serial DSA the ratio is to dense (SmolLM2's auto), whose rows carry method dense
    smol = [row("dense", 1, 1.6, method="dense"), row("auto", 1, 1.56), row("serial", 2, 2.0),
            row("dense", 2, 1.0, method="dense"), row("prr", 2, 3.0, method="infllm_v2")]
    t = bench.rounds_table(smol).splitlines()
    assert t[2].endswith("| 1 | dense 1.600, auto 1.560 | auto 0.975x |")
    assert t[3].endswith("| 2 | serial 2.000, dense 1.000, prr [infllm_v2] 3.000 | "
                         "dense 0.500x, prr [infllm_v2] 1.500x |")


def test_logprob_comparison(bench):
    ref = {"ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.0, -0.25, -2.0]}
    assert bench.compare_logprobs(ref, dict(ref)) == (0.0, None)
    got = {"ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.0 + 3e-3, -0.25, -2.0]}
    diff, first = bench.compare_logprobs(ref, got)
    assert diff == pytest.approx(3e-3) and first is None
    # negative control: another token at step 2; its logprob and those after are not compared
    got = {"ids": [5, 6, 9, 1], "logprobs": [-0.5, -1.0 + 1e-4, -9.0, -9.0]}
    diff, first = bench.compare_logprobs(ref, got)
    assert diff == pytest.approx(1e-4) and first == 2
    assert bench.compare_logprobs(ref, {"ids": [5, 6], "logprobs": [-0.5, -1.0]}) == (0.0, 2)


def test_text_prompts_are_real_text_and_deterministic(bench, tmp_path):
    from sglang_prr.tools import demo
    tok = str(Path(demo.demo_model_path()) / "tokenizer.json")
    lib = tmp_path / "Lib"
    lib.mkdir()
    for i, name in enumerate(["b_mod.py", "a_mod.py", "tiny.py", "c_mod.py"]):
        body = "x = 1\n" if name == "tiny.py" else f"def f{i}(x):\n    return x * {i}\n" * 200
        (lib / name).write_text(body)
    prompts, desc = bench.text_prompts(tok, 300, 2, lib=str(lib))
    again, desc2 = bench.text_prompts(tok, 300, 2, lib=str(lib))
    assert prompts == again and desc == desc2
    assert [len(p) for p in prompts] == [300, 300] and prompts[0] != prompts[1]
    from tokenizers import Tokenizer
    text = Tokenizer.from_file(tok).decode(prompts[0])
    assert text.startswith("# file: a_mod.py\ndef f1(x)")  # sorted, tiny files skipped
    assert "Lib/a_mod.py.." in desc and "python 3." in desc
    # negative control: other sources give other ids
    (lib / "a_mod.py").write_text("class A:\n    pass\n" * 300)
    assert bench.text_prompts(tok, 300, 2, lib=str(lib))[0] != prompts
    with pytest.raises(RuntimeError, match="tokens"):
        bench.text_prompts(tok, 10 ** 6, 1, lib=str(lib))
    files = bench.stdlib_files()  # the running interpreter's own Lib
    assert files == sorted(files) and any(f.name == "argparse.py" for f in files)


def test_csv_merge_old_rows_and_plot(bench, tmp_path):
    path = str(tmp_path / "serving.csv")
    old = [dict(variant="dense", ctx=4096, batch=1, median_itl_ms=4.7, reference=1),
           dict(variant="prr", ctx=32768, batch=8, median_itl_ms=9.0, reference=0)]
    with open(path, "w", newline="") as f:  # a CSV of the earlier columns
        w = csv.DictWriter(f, fieldnames=list(old[0]))
        w.writeheader()
        w.writerows(old)
    row = lambda v, kind, ctx, b, itl, tok, **kw: dict(
        variant=v, label=v, method=kw.get("method", "dense" if v == "dense" else "quest"),
        model=kw.get("model", "llama3-8b-shape"), kind=kind, ctx=ctx, batch=b,
        median_itl_ms=itl, output_tok_s=tok, kernels_per_step=kw.get("k"),
        kernels_per_layer=1.0, gpu_busy_ms_per_step=2.0, profile_bs=f"{b}:6", reference=0)
    new = [row("prr", "grid", 32768, 8, 8.0, 900.0, k=500.0),
           row("prr", "throughput", 32768, 16, 11.0, 1400.0),
           row("prr", "infllm", 32768, 1, 6.0, 160.0, method="infllm_v2"),
           row("prr", "smollm2", 7680, 1, 3.0, 300.0, model="smollm2-135m-instruct")]
    bench._write(bench._merge(bench._read(path), new), path)
    back = bench._read(path)
    keys = [(r["variant"], r["kind"], r["method"], r["ctx"], r["batch"]) for r in back]
    # the old prr 32K/8 row was replaced by the new grid row (same key), the others added
    assert keys == [("dense", "", "", "4096", "1"), ("prr", "grid", "quest", "32768", "8"),
                    ("prr", "throughput", "quest", "32768", "16"),
                    ("prr", "infllm", "infllm_v2", "32768", "1"),
                    ("prr", "smollm2", "quest", "7680", "1")]
    assert list(back[0])[:len(bench.COLUMNS)] == bench.COLUMNS
    assert bench._fill(back[0])["kind"] == "reference"
    # a PDL row of the same point sits beside the other; measured again, it replaces only itself
    pdl = dict(row("prr", "grid", 32768, 8, 7.5, 950.0), launch="pdl")
    for _ in range(2):
        bench._write(bench._merge(bench._read(path), [pdl]), path)
    back = bench._read(path)
    same = [(r["median_itl_ms"], r["launch"]) for r in back
            if (r["variant"], r["kind"], r["ctx"], r["batch"]) == ("prr", "grid", "32768", "8")]
    assert same == [("8.0", ""), ("7.5", "pdl")]
    # so does a side-predictor row (its own key), and the profile table tags both
    side = dict(row("prr", "grid", 32768, 8, 7.0, 950.0), predictor="side")
    bench._write(bench._merge(bench._read(path), [side]), path)
    back = bench._read(path)
    same = [(r["median_itl_ms"], r["launch"], r["predictor"]) for r in back
            if (r["variant"], r["kind"], r["ctx"], r["batch"]) == ("prr", "grid", "32768", "8")]
    assert same == [("8.0", "", ""), ("7.5", "pdl", ""), ("7.0", "", "side")]
    back = [r for r in back if r["launch"] != "pdl" and r["predictor"] != "side"]
    bench._write(back, path)
    # the throughput panel's rate: batch / median ITL, not output_tok_s
    assert bench._decode_rate(dict(batch="16", median_itl_ms="8.0")) == pytest.approx(2000.0)
    assert bench._decode_rate(dict(batch="16", median_itl_ms="")) is None
    bench._write_profile_table(path)
    table = (tmp_path / "serving_profile.md").read_text().splitlines()
    assert len(table) == 3 and table[2].startswith(
        "| prr | quest | llama3-8b-shape | grid | 32768 | 8 | 8:6 | 500.0 |")
    bench.main(["--plot-only", path])
    assert (tmp_path / "serving.png").stat().st_size > 10_000


@pytest.mark.server
def test_cpu_server_steady_batch_and_staggered_control(bench, tmp_path):
    """One CPU server (demo shape, 2 layers): a steady batch of 2 decodes bs = 2 at every
    logged and profiled step; the same point staggered (negative control) does not, and the
    check says so. About a minute on two cores."""
    from sglang_prr.tools import demo
    _, a = bench.parse_args(
        ["--device", "cpu", "--shape", "demo", "--layers", "2", "--out", "8", "--page", "16",
         "--top-k", "32", "--min-context", "64", "--profile", "--profile-steps", "3",
         "--passes", "2", "--csv", str(tmp_path / "serving.csv"), "--start-timeout", "600"])
    model = demo.shaped_model_dir(tmp_path / "demo-shape", num_hidden_layers=2,
                                  max_position_embeddings=1024)
    srv = bench.Server("prr", "quest", "demo-shape")
    points = [bench.Point(300, 2, "grid", "steady"), bench.Point(300, 2, "grid", "staggered")]
    rows = list(bench.run_server(srv, points, model, a, tmp_path, 2))
    steady, staggered = rows
    assert steady["arrival"] == "steady" and staggered["arrival"] == "staggered"
    assert steady["steady"] == 1, steady
    assert steady["decode_batch"] == steady["decode_batch_min"] == 2
    # every step of the 7 after the first token, in each of the two timed passes
    assert steady["decode_steps"] >= 2 * (a.out - 1)
    assert len(steady["itl_pass_ms"].split(";")) == 2
    assert steady["profile_bs"] == "2:3"
    assert steady["prefill_cached_frac"] > 0.9  # the measured prefill hit the warm cache
    assert steady["median_warm_ttft_ms"] is not None and steady["output_tok_s"] > 0
    assert 0.0 < steady["hit_rate"] <= 1.0 and steady["mean_repair_blocks"] is not None
    assert steady["delta"] == 1.5 and steady["completed"] == 2
    # negative control: request 1 is sent once request 0 has two tokens
    assert staggered["steady"] == 0, staggered
    assert staggered["decode_batch_min"] == 1
    assert staggered["prefill_cached_frac"] == 0.0  # cold: the cache was flushed


def test_rows_of_another_kernel_library_say_which(bench, tmp_path, monkeypatch):
    from sglang_prr.kernels import build
    lib = tmp_path / "old" / build.LIB_NAME
    lib.parent.mkdir()
    (lib.parent / build.STAMP_NAME).write_text("0123456789abcdef\n")
    prr, dense = bench.Server("prr", "quest", "m"), bench.Server("dense", "dense", "m")
    monkeypatch.delenv("SGLANG_PRR_KERNEL_LIB", raising=False)
    assert bench._library(prr) == ""  # the tree's own sources (control)
    monkeypatch.setenv("SGLANG_PRR_KERNEL_LIB", str(lib))
    assert bench._library(prr) == "0123456789abcdef" and bench._library(dense) == ""
    _, a = bench.parse_args([])
    assert bench._label(prr, a) == "PRR (exact), side predictor, library 01234567"
    (lib.parent / build.STAMP_NAME).write_text(build.source_hash())  # built from this tree
    assert bench._library(prr) == ""
    # the library is part of a row's key: both libraries' rows of a point stay
    rows = [dict(variant="prr", method="quest", model="m", kind="grid", ctx="1", batch="1",
                 library=x) for x in ("", "0123456789abcdef")]
    assert len(bench._merge(rows[:1], rows[1:])) == 2
    assert len(bench._merge(rows[:1], rows[:1])) == 1


def test_auto_needs_the_profile_of_its_model(bench, tmp_path, capsys):
    """SmolLM2's auto server reads SmolLM2's profile: a missing one is named before any server
    starts (a dry run only prints the command); the Llama-shape profile is not asked for."""
    missing = str(tmp_path / "smol.json")
    with pytest.raises(SystemExit):
        bench.main(["--only", "smollm2", "--variants", "auto", "--smollm2-profile", missing,
                    "--budget-profile", str(tmp_path / "llama.json"), "--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert missing in err and "llama.json" not in err
    bench.main(["--only", "smollm2", "--variants", "auto", "--smollm2-profile", missing,
                "--dry-run", "--workdir", str(tmp_path)])  # control: the dry run goes through
    assert missing in capsys.readouterr().out


def test_a_library_that_does_not_load_stops_the_run_before_its_first_server(bench, tmp_path,
                                                                           monkeypatch):
    """A kernel library built from other op declarations (or none that loads) is named before
    any server starts, not by each server minutes later; dense servers need no library."""
    started = []
    monkeypatch.setattr(bench, "run_server", lambda *a, **k: started.append(a) or iter(()))
    monkeypatch.setattr(bench.harness, "kernel_library_error", lambda: "boom: 1 of 20 ops differ")
    args = ["--only", "grid", "--contexts", "4096", "--batches", "1", "--shape", "demo",
            "--layers", "2", "--workdir", str(tmp_path), "--csv", str(tmp_path / "s.csv")]
    with pytest.raises(SystemExit, match="boom: 1 of 20 ops differ"):
        bench.main(args + ["--variants", "serial"])
    assert started == []
    bench.main(args + ["--variants", "dense"])  # control: no check, the server starts
    assert len(started) == 1
