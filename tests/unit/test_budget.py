"""Speculation budget: the profile format, the policy's choice per batch size, and the decode
step that follows it (serial DSA where speculation does not pay, the best delta elsewhere)."""

from __future__ import annotations

import json
import logging
import os
import random

import pytest
import torch

from sglang_prr import ops
from sglang_prr.tools import profile_budget
from sglang_prr.budget import (SPECULATE_MARGIN, BudgetPolicy, BudgetProfile, check_profile,
                               layer_shape)
from sglang_prr.config import PRRConfig, PRRConfigError
from sglang_prr.step import DecodeStep, new_layer_state
from sglang_prr.tools.synthetic import paged_kv

SHAPE = dict(method="quest", num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=64,
             top_k_tokens=2048)


def _profile(rel, contexts=(32768, 131072), base=100.0, shape=SHAPE):
    """A profile whose delta d at batch b takes ``rel[b][d]`` x serial DSA at every context."""
    rows = []
    for b, by_delta in rel.items():
        for c in contexts:
            rows.append(dict(batch=b, context=c, delta=0.0, us=base * (1 + c / 1e6)))
            rows += [dict(batch=b, context=c, delta=d, us=base * (1 + c / 1e6) * r)
                     for d, r in by_delta.items()]
    return {"version": 2, "shape": dict(shape), "layer_us": rows}


def _write(tmp_path, d, name="profile.json"):
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return str(p)


def _cfg(path=None, **kw):
    base = dict(budget="auto", profile=path, top_k=2048, top_k_unit="tokens", block_size=64)
    return PRRConfig(**{**base, **kw}).validate()


def test_policy_picks_serial_where_speculation_does_not_pay(tmp_path):
    prof = _profile({1: {1.0: 1.05, 1.5: 1.10, 2.0: 1.2},     # PRR slower: serial
                     8: {1.0: 0.97, 1.5: 0.93, 2.0: 0.95},     # PRR faster: the best delta
                     32: {1.0: 0.995, 1.5: 1.0, 2.0: 1.01}})   # within the margin: serial
    pol = BudgetPolicy(_cfg(_write(tmp_path, prof)), SHAPE)
    assert pol.delta(1) == 0.0 and pol.predicted_blocks(1) == 0
    assert pol.delta(8) == 1.5 and pol.predicted_blocks(8) == 48  # floor(1.5 * 32)
    assert pol.delta(32) == 0.0  # 0.995 > SPECULATE_MARGIN
    assert SPECULATE_MARGIN < 0.995
    # Unprofiled batch sizes take the nearest profiled one in log2 (ties to the larger).
    assert pol.delta(2) == 0.0 and pol.delta(3) == 1.5 and pol.delta(5) == 1.5
    assert pol.delta(16) == 0.0 and pol.delta(160) == 0.0
    assert pol.may_speculate()
    assert pol.describe() == {"1": 0.0, "8": 1.5, "32": 0.0}
    why = pol.reasons()
    assert list(why) == ["1", "8", "32"]
    assert why["1"] == ("serial DSA: the best delta 1 costs 1.050x serial DSA per layer, up to "
                        "1.050x (over 32K, 128K; margin 0.99 at every context)")
    assert why["8"].startswith("PRR delta 1.5: the best delta 1.5 costs 0.930x")
    assert why["32"].startswith("serial DSA: the best delta 1 costs 0.995x")
    assert "dense" not in " ".join(why.values())  # no dense timing in this profile
    # Never above max_budget (the static width of P).
    capped = BudgetPolicy(_cfg(_write(tmp_path, prof), max_budget=1.25), SHAPE)
    assert capped.delta(8) == 1.0


def test_policy_is_never_slower_at_any_context(tmp_path):
    """The graph of a batch size serves every context: a delta that wins on average but loses at
    one context is not chosen; of the deltas that win at every context, the lowest mean."""
    def policy(r15, r2):
        rows = []
        for c, a, b in zip((32768, 131072), r15, r2):
            rows += [dict(batch=1, context=c, delta=0.0, us=50.0),
                     dict(batch=1, context=c, delta=1.5, us=50.0 * a),
                     dict(batch=1, context=c, delta=2.0, us=50.0 * b)]
        return BudgetPolicy(_cfg(_write(tmp_path, {"version": 2, "shape": SHAPE,
                                                   "layer_us": rows})), SHAPE)
    pol = policy((0.8, 1.05), (1.2, 1.2))  # delta 1.5: mean 0.925, but 5% slower at 128K
    assert pol.delta(1) == 0.0 and not pol.may_speculate()
    assert pol.reasons()["1"].startswith("serial DSA: the best delta 1.5 costs 0.925x serial "
                                         "DSA per layer, up to 1.050x")
    pol = policy((0.8, 1.05), (0.98, 0.98))  # delta 2 wins everywhere, by less on average
    assert pol.delta(1) == 2.0
    pol = policy((0.9, 0.97), (0.98, 0.98))  # both win everywhere: the lower mean
    assert pol.delta(1) == 1.5


def test_fixed_and_serial_budgets():
    assert BudgetPolicy(PRRConfig(budget=2.0).validate()).delta(7) == 2.0
    assert BudgetPolicy(PRRConfig(serial=True).validate()).delta(7) == 0.0
    assert not BudgetPolicy(PRRConfig(serial=True).validate()).may_speculate()
    assert BudgetPolicy(PRRConfig(budget=2.0).validate()).reasons() == {
        "*": "fixed budget delta 2"}
    assert BudgetPolicy(PRRConfig(serial=True).validate()).reasons() == {
        "*": "serial DSA (--prr-serial)"}
    with pytest.raises(PRRConfigError, match="--prr-profile"):
        BudgetPolicy(PRRConfig(budget="auto").validate())


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(version=1), "version"),
    (lambda d: d.pop("shape"), "shape"),
    (lambda d: d["shape"].pop("head_dim"), "shape"),
    (lambda d: d.update(layer_us=[]), "no layer_us"),
    (lambda d: d["layer_us"][1].update(us=float("nan")), "finite"),
    (lambda d: d["layer_us"][1].update(delta=0.5), "delta 0 or >= 1"),
    (lambda d: d["layer_us"][1].pop("batch"), "needs batch"),
    (lambda d: d.update(layer_us=[r for r in d["layer_us"] if r["delta"] != 0.0]),
     "lacks serial DSA"),
])
def test_bad_profile_is_a_clear_error(tmp_path, mutate, match):
    d = _profile({1: {1.5: 0.9}})
    BudgetProfile.from_dict(json.loads(json.dumps(d)))  # control: the unmutated one loads
    mutate(d)
    with pytest.raises(ValueError, match=match):
        BudgetProfile.load(_write(tmp_path, d))
    # The launcher's rule names the flag.
    with pytest.raises(PRRConfigError, match="--prr-profile"):
        check_profile(_cfg(_write(tmp_path, d)))


def test_profile_of_another_shape_is_refused(tmp_path):
    path = _write(tmp_path, _profile({1: {1.5: 0.9}}))
    BudgetPolicy(_cfg(path), SHAPE)  # control
    with pytest.raises(PRRConfigError, match="head_dim: profile 128 vs server 64"):
        BudgetPolicy(_cfg(path), {**SHAPE, "head_dim": 64})


def test_layer_shape_records_the_summaries_dtypes(monkeypatch):
    """The shape a profile records and a server checks names the summaries' dtypes: Quest's
    bounds, InfLLM-v2's compressed keys as SGLANG_PRR_INFLLM_CK stores them."""
    monkeypatch.delenv("SGLANG_PRR_INFLLM_CK", raising=False)

    def cfg(method):
        return PRRConfig(method=method, top_k=2048, top_k_unit="tokens", block_size=64).validate()

    quest = layer_shape(cfg("quest"), 64, 128, 8, 32)
    assert quest["summaries"] == "bfloat16,bfloat16"
    assert {k: quest[k] for k in SHAPE} == SHAPE  # the other keys as before
    inf = cfg("infllm_v2")
    bf16 = layer_shape(inf, 64, 128, 8, 32)["summaries"]
    monkeypatch.setenv("SGLANG_PRR_INFLLM_CK", "fp32")
    fp32 = layer_shape(inf, 64, 128, 8, 32)["summaries"]
    assert (bf16, fp32) == ("bfloat16", "float32")
    # A page the method refuses leaves the key out (the config's own check names the page).
    assert "summaries" not in layer_shape(inf, 40, 128, 8, 32)


def test_profile_of_other_summaries_warns(tmp_path, caplog):
    """A profile measured with other summary dtypes is used with a warning naming both; one with
    the server's, or one that does not record them (older profiles), without."""
    server = {**SHAPE, "summaries": "bfloat16"}

    def warnings_for(profile_shape):
        path = _write(tmp_path, _profile({1: {1.5: 0.9}}, shape=profile_shape))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sglang_prr"):
            pol = BudgetPolicy(_cfg(path), server)
        assert pol.delta(1) == 1.5  # still the profile's choice
        return [r.getMessage() for r in caplog.records if "summaries" in r.getMessage()]

    (msg,) = warnings_for({**SHAPE, "summaries": "float32"})
    assert "float32" in msg and "bfloat16" in msg and "profile_budget" in msg
    assert warnings_for({**SHAPE, "summaries": "bfloat16"}) == []  # control: the same dtypes
    assert warnings_for(SHAPE) == []


def test_profile_round_trip(tmp_path):
    prof = BudgetProfile.from_dict(_profile({1: {1.0: 1.1}, 4: {1.5: 0.9}}))
    prof.save(str(tmp_path / "p.json"))
    back = BudgetProfile.load(str(tmp_path / "p.json"))
    assert back.layer_us == pytest.approx(prof.layer_us, abs=1e-3) and back.shape == prof.shape
    assert back.batch_sizes == [1, 4] and back.contexts == [32768, 131072]


# ----------------------------------------------------------------------------- the step
def _step_world(seed, batch, ctx, page=16, hq=4, hk=2, d=16):
    g = torch.Generator().manual_seed(seed)
    kv = paged_kv(batch, ctx, page, hk, d, dtype=torch.float32, device=torch.device("cpu"),
                  generator=g, spare_tokens=page)
    q = torch.randn(batch, hq, d, generator=g) * 3
    return kv, q


def _state(rows, hk, nb, width):
    return new_layer_state(rows, hk, nb, width, (0.5, 0.3, 0.2), torch.device("cpu"))


def test_step_follows_the_budget_per_batch_size():
    """Batch 1 runs serial DSA (P untouched), batch 3 speculates over its budget's |P|; both
    equal serial DSA (exact), and P(t+1) has the chosen width's count."""
    seed = random.randrange(1 << 30)
    page, k, sink, local, width = 16, 2, 1, 1, 6
    kv, q = _step_world(seed, 3, 200, page)
    nb = kv.table.shape[1]
    budget = {1: 0, 3: 3}.__getitem__
    auto = DecodeStep("quest", k, width, sink, local, page, 0, exact=True, serial=False,
                      device=torch.device("cpu"), budget=budget)
    serial = DecodeStep("quest", k, width, sink, local, page, 0, exact=True, serial=True,
                        device=torch.device("cpu"))
    st = _state(4, 2, nb, width + sink + local)
    seq = torch.full((3,), 200)
    g = torch.Generator().manual_seed(seed + 1)
    for rows in ([1, 2, 3], [2], [1, 2, 3], [3]):
        r = torch.tensor(rows)
        q = torch.randn(3, 4, 16, generator=g) * 3  # a new query every step
        b = auto.plan(kv.req_to_token, r, seq[: len(rows)])
        assert b.n_pred == budget(len(rows))
        before = (st.p_idx.clone(), st.level.clone())
        o = auto.run(q[r - 1], kv.k_buf, kv.v_buf, [kv.kmin, kv.kmax], b, st, None, 0.25,
                     torch.float32)
        ref = serial.run(q[r - 1], kv.k_buf, kv.v_buf, [kv.kmin, kv.kmax],
                         serial.plan(kv.req_to_token, r, seq[: len(rows)]), None, None, 0.25,
                         torch.float32)
        assert (o - ref).abs().max() < 1e-5, f"seed {seed}: rows {rows}"
        if b.n_pred == 0:  # serial forward: the predictor state is left alone
            assert torch.equal(st.p_idx, before[0]) and torch.equal(st.level, before[1])
        else:  # speculative forward: P(t+1) of |P| = 3 middle blocks + kept ones, at p_nxt
            assert not torch.equal(st.level, before[1])
            cnt = st.p_cnt[b.p_nxt]
            assert int(cnt.max()) <= 3 + sink + local and int(cnt.min()) > 0
            assert (st.p_idx[b.p_nxt][..., 3 + sink + local:] == -1).all()
    with pytest.raises(ValueError, match="budget gave"):
        DecodeStep("quest", k, width, sink, local, page, 0, exact=True, serial=False,
                   device=torch.device("cpu"), budget=lambda b: width + 1
                   ).plan(kv.req_to_token, torch.tensor([1]), seq[:1])


def test_predict_rows_into_a_wider_pool_matches_the_exact_width():
    """P(t+1) written into the pool's wider P equals the exact-width result, -1 padded."""
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    R, Hk, NB, n_pred, sink, local = 5, 2, 24, 4, 1, 2
    mk = lambda: (torch.randn(R, Hk, NB, generator=g), torch.zeros(R, Hk, NB))
    level, trend = mk()
    scores = torch.randn(3, Hk, NB, generator=g)
    rows, nblk = torch.tensor([4, 1, 2]), torch.tensor([20, 24, 9])
    theta = torch.rand(R, 3, generator=g)
    outs = []
    for width in (n_pred + sink + local, n_pred + sink + local + 5):
        st = [level.clone(), trend.clone(), torch.zeros(R, dtype=torch.long),
              torch.full((R, Hk, width), 7, dtype=torch.int32), torch.zeros(R, Hk, dtype=torch.int32)]
        ops.predict_update_rows(st[0], st[1], st[2], st[3], st[4], theta, rows, scores, nblk,
                                nblk, n_pred, sink, local)
        outs.append(st)
    narrow, wide = outs
    w = narrow[3].shape[-1]
    assert torch.equal(wide[3][rows, :, :w], narrow[3][rows]) and torch.equal(wide[4], narrow[4])
    assert (wide[3][rows, :, w:] == -1).all()
    assert (wide[3][0] == 7).all()  # rows outside the batch untouched (control)
    with pytest.raises(ValueError, match="p_idx.shape"):
        ops.predict_update_rows(level, trend, torch.zeros(R, dtype=torch.long),
                                torch.zeros(R, Hk, 2, dtype=torch.int32),
                                torch.zeros(R, Hk, dtype=torch.int32), theta, rows, scores, nblk,
                                nblk, n_pred, sink, local)


# ----------------------------------------------------------------------------- the profiler
def test_profiler_plumbing_on_cpu(tmp_path, capsys):
    """The profiler's whole path on CPU (eager): a profile the policy loads and decides from."""
    out = tmp_path / "p.json"
    rc = profile_budget.main([
        "--device", "cpu", "--num-qo-heads", "4", "--num-kv-heads", "2", "--head-dim", "16",
        "--hidden-size", "32", "--prr-block-size", "16", "--prr-top-k", "3",
        "--prr-top-k-unit", "blocks", "--prr-min-context", "64", "--contexts", "200",
        "--batch-sizes", "1,2", "--deltas", "1,2", "--iters", "1", "--repeats", "1",
        "--layers", "2", "--dtype", "float32", "--hit-rate", "0.9", "--compare-hit-rate", "0.5",
        "--out", str(out)])
    assert rc == 0
    prof = BudgetProfile.load(str(out))
    assert prof.batch_sizes == [1, 2] and prof.contexts == [200]
    assert sorted({d for _, _, d in prof.layer_us}) == [0.0, 1.0, 2.0]  # serial added
    assert prof.shape == dict(method="quest", num_qo_heads=4, num_kv_heads=2, head_dim=16,
                              page_size=16, top_k_tokens=48, summaries="bfloat16,bfloat16")
    text = capsys.readouterr().out
    assert "cells: layer time / serial DSA's at hit rate 0.9 / 0.5" in text
    pol = BudgetPolicy(_cfg(str(out), top_k=3, top_k_unit="blocks", block_size=16),
                       prof.shape)
    assert pol.delta(1) in (0.0, 1.0, 2.0)
    # the compare hit rate: its own speculative times, serial DSA's shared
    assert prof.meta["hit_rate"] == 0.9 and prof.meta["compare"]["hit_rate"] == 0.5
    assert prof.meta["predictor"] == "side"  # --prr-predictor (default), which the server compares
    cmp = prof.compared()
    assert cmp.meta["hit_rate"] == 0.5 and set(cmp.layer_us) == set(prof.layer_us)
    assert all(cmp.layer_us[k] == prof.layer_us[k] for k in prof.layer_us if k[2] == 0.0)
    assert any(cmp.layer_us[k] != prof.layer_us[k] for k in prof.layer_us if k[2] > 0.0)
    rows = [ln for ln in profile_budget.table(prof, 4.0).splitlines() if ln.startswith("| 1 |")]
    cell = rows[0].split("|")[4].strip()  # d=1: real / compare
    assert cell == (f"{prof.layer_us[(1, 200, 1.0)] / prof.layer_us[(1, 200, 0.0)]:.3f} / "
                    f"{cmp.layer_us[(1, 200, 1.0)] / prof.layer_us[(1, 200, 0.0)]:.3f}")
    assert rows[0].split("|")[-2].strip().count("/") == 1  # the two choices
    bare = BudgetProfile(prof.shape, prof.layer_us, {"hit_rate": 0.9})  # no compare entry
    assert bare.compared() is None
    assert " / " not in "\n".join(profile_budget.table(bare, 4.0).splitlines()[2:])
    # dense attention timed at every point, a column of the table; --no-dense: none
    assert set(prof.dense_us) == {(1, 200), (2, 200)} and all(t > 0 for t in prof.dense_us.values())
    assert "| dense | choice |" in text
    rc = profile_budget.main(["--no-dense" if x == "--out" else x for x in [
        "--device", "cpu", "--num-qo-heads", "4", "--num-kv-heads", "2", "--head-dim", "16",
        "--hidden-size", "0", "--prr-block-size", "16", "--prr-top-k", "3", "--prr-top-k-unit",
        "blocks", "--contexts", "200", "--batch-sizes", "1", "--deltas", "1", "--iters", "1",
        "--repeats", "1", "--layers", "1", "--dtype", "float32", "--hit-rate", "0.9",
        "--compare-hit-rate", "none", "--out"]] + ["--out", str(out)])
    assert rc == 0 and BudgetProfile.load(str(out)).dense_us == {}


def test_dense_decode_pages_and_output(seed):
    """The dense layer the profile times: FlashInfer's page table of each request (its pages in
    order, the last one's fill) from SGLang's slot table, and on CPU the reference's dense
    attention over those pages; control: another request's pages give another output."""
    from sglang_prr import reference as ref
    from sglang_prr.tools.dense_decode import dense_decode, paged_indices
    g = torch.Generator().manual_seed(seed)
    page, Hk, D, B = 16, 2, 8, 3
    lens = torch.tensor([33, 16, 70])
    perm = torch.randperm(40, generator=g) + 1  # pages in any order, page 0 unused
    req_to_token = torch.zeros(B + 1, 80, dtype=torch.int32)
    for r in range(1, B + 1):
        pages = perm[(r - 1) * 5:r * 5]
        req_to_token[r] = (pages[:, None] * page + torch.arange(page)).reshape(-1)
    rows = torch.tensor([3, 1, 2])
    indptr, indices, last = paged_indices(req_to_token, rows, lens, page)
    assert indptr.tolist() == [0, 3, 4, 9] and last.tolist() == [1, 16, 6]
    table = ref.block_table(req_to_token, rows, page)
    want = torch.cat([table[b, :n] for b, n in enumerate([3, 1, 5])])
    assert indices.tolist() == want.tolist()
    k = torch.randn(41 * page, Hk, D, generator=g)
    v = torch.randn(41 * page, Hk, D, generator=g)
    q = torch.randn(B, 4, D, generator=g)
    o = dense_decode(q, k, v, req_to_token, rows, lens, page, 0.3)(q)
    assert torch.equal(o, ref.dense_attention(q, k, v, table, lens, page, 0.3))
    other = dense_decode(q, k, v, req_to_token, rows.roll(1), lens, page, 0.3)(q)
    assert not torch.allclose(other, o)


def test_profiler_hit_rate_real_from_traces_or_recorded(tmp_path, monkeypatch):
    """--hit-rate real: trace_replay.real_hit_rate's |P n A| / |A| at |P| = K on the traces
    (tests/unit/test_trace_replay_real.py checks that number), or the recorded value when the
    folder holds no trace; a number is taken as given."""
    from sglang_prr.tools import trace_replay
    seen = []

    def fake(path, k=None, delta=1.0, calib_rows=None):
        seen.append((path, delta))
        if path != "traces":
            raise FileNotFoundError(path)
        return dict(overlap=0.83114, per_layer={0: 0.8, 10: 0.9}, traces=4, k=16)

    monkeypatch.setattr(trace_replay, "real_hit_rate", fake)
    rate, where = trace_replay.profile_hit_rate("real", "traces")
    assert rate == 0.8311 and seen == [("traces", 1.0)]  # at |P| = K
    assert "4 requests" in where and "K = 16 blocks" in where and "layer 10 0.900" in where
    rate, where = trace_replay.profile_hit_rate("real", str(tmp_path / "none"))
    assert rate == trace_replay.REAL_HIT_RATE_AT_K and "recorded" in where
    assert trace_replay.profile_hit_rate(0.7, "traces") == (0.7, "given (--hit-rate)")
    assert len(seen) == 2  # a given number reads no trace
    # the repository's own traces are named relative to it (the profile travels between
    # machines); a folder outside it keeps its path, as the control
    assert trace_replay._shown(trace_replay.REAL_TRACES) == os.path.join("benchmarks", "results", "real_traces")
    assert trace_replay._shown(str(tmp_path / "t")) == str(tmp_path / "t")
    a = profile_budget.parse_args(["--device", "cpu", "--num-qo-heads", "4", "--num-kv-heads",
                                   "2", "--head-dim", "16", "--out", str(tmp_path / "p.json")])
    assert a.hit_rate == "real" and a.compare_hit_rate == 0.7  # the defaults


@pytest.mark.parametrize("argv, match", [
    (["--contexts", "0"], "integers >= 1"),
    (["--deltas", "0.5"], "deltas are 0"),
    (["--deltas", "8"], "max-budget"),
    (["--hit-rate", "1.5"], "hit-rate"),
    (["--hit-rate", "high"], "allowed 0..1 or 'real'"),
    (["--compare-hit-rate", "-0.1"], "allowed 0..1"),
    (["--prr-method", "dense"], "nothing to profile"),
    (["--num-kv-heads", "3"], "must divide"),
])
def test_profiler_rejects_bad_flags(tmp_path, capsys, argv, match):
    base = ["--device", "cpu", "--num-qo-heads", "4", "--num-kv-heads", "2", "--head-dim", "16",
            "--out", str(tmp_path / "p.json")]
    with pytest.raises(SystemExit) as e:
        profile_budget.parse_args(base + argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def _with_dense(prof, dense_rel):
    """``prof`` plus dense timings: ``dense_rel[b][c]`` x serial DSA at (batch b, context c)."""
    base = {(r["batch"], r["context"]): r["us"] for r in prof["layer_us"] if r["delta"] == 0.0}
    prof["dense_us"] = [dict(batch=b, context=c, us=base[(b, c)] * r)
                        for b, by_ctx in dense_rel.items() for c, r in by_ctx.items()]
    return prof


def test_dense_where_dense_wins(tmp_path):
    """A batch size runs dense attention where the profile measures it faster than the sparse
    choice by the margin; elsewhere serial DSA or the best delta. Controls: without dense timings
    nothing runs dense, and a dense time within the margin of PRR's does not win."""
    ctxs = (8192, 131072)
    prof = _profile({1: {1.0: 1.05}, 8: {1.5: 0.90}, 32: {1.5: 0.90}}, contexts=ctxs)
    _with_dense(prof, {1: {8192: 0.5, 131072: 0.9},      # dense wins at every context
                       8: {8192: 0.6, 131072: 1.0},      # mean 0.8, but not at 128K: PRR
                       32: {8192: 0.85, 131072: 0.88}})  # below PRR's 0.891 everywhere: dense
    pol = BudgetPolicy(_cfg(_write(tmp_path, prof)), SHAPE)
    assert [pol.dense(b) for b in (1, 8, 32)] == [True, False, True]
    assert pol.delta(1) == 0.0 and pol.predicted_blocks(1) == 0 and pol.delta(8) == 1.5
    assert pol.describe() == {"1": "dense", "8": 1.5, "32": "dense"}
    why = pol.reasons()
    assert why["1"].startswith("dense: ") and "dense attention 0.500-0.900x" in why["1"]
    assert why["8"].startswith("PRR delta 1.5: ") and "dense attention 0.600-1.000x" in why["8"]
    assert pol.may_speculate()  # batch 32 speculates
    assert not pol.always_dense()  # batch 8 runs PRR
    _with_dense(prof, {b: {8192: 0.5, 131072: 0.8} for b in (1, 8, 32)})
    every = BudgetPolicy(_cfg(_write(tmp_path, prof, "every.json")), SHAPE)
    assert every.always_dense() and not every.may_speculate()
    assert all(every.dense(b) for b in (1, 2, 8, 64))  # unprofiled sizes: the nearest one
    # control: the same profile without its dense timings never runs dense
    plain = {k: v for k, v in prof.items() if k != "dense_us"}
    pol = BudgetPolicy(_cfg(_write(tmp_path, plain, "plain.json")), SHAPE)
    assert not any(pol.dense(b) for b in (1, 8, 32)) and pol.delta(32) == 1.5
    # --prr-serial is serial DSA even with a profile that says dense
    serial = BudgetPolicy(_cfg(_write(tmp_path, prof), serial=True), SHAPE)
    assert not serial.dense(1) and not serial.always_dense()


def test_dense_over_the_contexts_the_server_serves(tmp_path):
    """Dense attention wins at 8K and loses at 128K: a server of 128K tokens may serve either and
    runs serial DSA; one whose context length is 8K (max_context_blocks) sees only 8K and runs
    dense; a server shorter than every profiled context takes the shortest."""
    prof = _with_dense(_profile({1: {1.0: 1.05}}, contexts=(8192, 131072)),
                       {1: {8192: 0.6, 131072: 3.0}})
    path = _write(tmp_path, prof)
    assert not BudgetPolicy(_cfg(path), SHAPE).dense(1)
    assert not BudgetPolicy(_cfg(path, max_context_blocks=131072 // 64), SHAPE).dense(1)
    short = BudgetPolicy(_cfg(path, max_context_blocks=8192 // 64), SHAPE)
    assert short.dense(1) and short.contexts == [8192] and "(over 8K; " in short.reasons()["1"]
    tiny = BudgetPolicy(_cfg(path, max_context_blocks=2), SHAPE)
    assert tiny.contexts == [8192] and tiny.dense(1)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["dense_us"][0].update(us=float("inf")), "finite"),
    (lambda d: d["dense_us"][0].update(context=4096), "profiled"),
    (lambda d: d["dense_us"][0].pop("us"), "needs batch, context and us"),
])
def test_bad_dense_timing_is_a_clear_error(tmp_path, mutate, match):
    d = _with_dense(_profile({1: {1.5: 0.9}}), {1: {32768: 0.8, 131072: 0.9}})
    BudgetProfile.load(_write(tmp_path, d))  # control: the good profile loads
    mutate(d)
    with pytest.raises(ValueError, match=match):
        BudgetProfile.load(_write(tmp_path, d, "bad.json"))


def test_dense_timings_survive_save_and_load(tmp_path):
    d = _with_dense(_profile({1: {1.5: 0.9}}), {1: {32768: 0.8, 131072: 0.9}})
    prof = BudgetProfile.load(_write(tmp_path, d))
    out = tmp_path / "again.json"
    prof.save(str(out))
    again = BudgetProfile.load(str(out))
    assert again.dense_us == {k: round(t, 3) for k, t in prof.dense_us.items()}
    assert len(again.dense_us) == 2
    assert "dense_us" not in again.meta


def test_profile_of_the_other_predictor_placement_is_named(tmp_path, caplog):
    """A server whose --prr-predictor differs from the profile's says so (and still decides);
    a profile without the field was measured fused (the placement before the flag)."""
    prof = _profile({1: {1.0: 1.05}})
    legacy = _write(tmp_path, prof, "legacy.json")
    side = _write(tmp_path, {**prof, "predictor": "side"}, "side.json")
    with caplog.at_level(logging.WARNING, logger="sglang_prr"):
        BudgetPolicy(_cfg(legacy, predictor="fused"), SHAPE)  # control: the same placement
        BudgetPolicy(_cfg(side, predictor="side"), SHAPE)
        assert not [r for r in caplog.records if "--prr-predictor" in r.getMessage()]
        pol = BudgetPolicy(_cfg(legacy, predictor="side"), SHAPE)
    msgs = [r.getMessage() for r in caplog.records if "--prr-predictor" in r.getMessage()]
    assert len(msgs) == 1 and "measured with --prr-predictor fused" in msgs[0] and \
        "runs side" in msgs[0], msgs
    assert pol.delta(1) == 0.0


def _dense_small_prr_large(tmp_path):
    """Dense wins at batch 1 (every context), PRR (delta 1.5) at batch 8, serial DSA at 32."""
    ctxs = (8192, 131072)
    prof = _profile({1: {1.0: 1.05}, 8: {1.5: 0.90}, 32: {1.0: 1.02}}, contexts=ctxs)
    _with_dense(prof, {1: {8192: 0.7, 131072: 0.8}, 8: {8192: 2.0, 131072: 3.0},
                       32: {8192: 2.0, 131072: 4.0}})
    return _write(tmp_path, prof)


@pytest.mark.parametrize("max_batch, reached, always", [
    (1, [1], True), (2, [1], True),  # 2 is nearer 1 than 8 in log2
    (3, [1, 8], False), (8, [1, 8], False), (12, [1, 8], False), (23, [1, 8, 32], False),
    (4096, [1, 8, 32], False), (None, [1, 8, 32], False)])
def test_the_batch_sizes_a_server_decodes_decide_always_dense(tmp_path, max_batch, reached,
                                                              always):
    """A server that decodes at most ``max_batch`` requests a step is decided by the profiled
    batch sizes those map to: dense at every one of them keeps no summary and speculates never,
    and then every batch size runs dense and none speculates, whatever the profile says of a
    batch it cannot reach (the summaries such a batch would read are not kept)."""
    pol = BudgetPolicy(_cfg(_dense_small_prr_large(tmp_path)), SHAPE, max_batch)
    assert pol.reachable_batch_sizes() == reached
    assert pol.always_dense() is always and pol.may_speculate() is (not always)
    assert pol.dense(1)  # dense wins at batch 1 under either bound
    if always:
        assert all(pol.dense(b) for b in (1, 5, 8, 32, 100))
        assert [pol.delta(b) for b in (1, 8, 32)] == [0.0, 0.0, 0.0]
        assert pol.describe() == {"1": "dense", "8": "dense", "32": "dense"}
        why = pol.reasons()
        assert why["8"].startswith(f"dense: not reached, this server decodes at most "
                                   f"{max_batch} requests a step; the profile alone: PRR delta "
                                   f"1.5: "), why["8"]
        assert why["1"].startswith("dense: ") and "not reached" not in why["1"]
    else:  # control: the unbounded choices
        assert [pol.dense(b) for b in (1, 8, 32)] == [True, False, False]
        assert [pol.delta(b) for b in (1, 8, 32)] == [0.0, 1.5, 0.0]
        why = pol.reasons()["32"]
        assert why.startswith("serial DSA: not reached" if 32 not in reached else
                              "serial DSA: the best delta"), why


def test_a_bound_where_no_reached_batch_speculates_turns_speculation_off(tmp_path):
    """PRR wins only at batch 32: a server of at most 4 requests never speculates (delta 0 for
    every batch size, calibration off); control: at most 32 requests speculates at 32."""
    prof = _profile({1: {1.0: 1.05}, 8: {1.0: 1.03}, 32: {1.5: 0.9}})
    path = _write(tmp_path, prof)
    small = BudgetPolicy(_cfg(path), SHAPE, 4)
    assert not small.may_speculate() and not small.always_dense()
    assert [small.delta(b) for b in (1, 8, 32, 64)] == [0.0] * 4
    large = BudgetPolicy(_cfg(path), SHAPE, 32)
    assert large.may_speculate() and large.delta(32) == 1.5 and large.delta(8) == 0.0


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_a_bad_batch_bound_is_named(tmp_path, bad):
    path = _dense_small_prr_large(tmp_path)
    BudgetPolicy(_cfg(path), SHAPE, 1)  # control
    with pytest.raises(ValueError, match=f"max_batch must be >= 1 or None, got {bad!r}"):
        BudgetPolicy(_cfg(path), SHAPE, bad)


def test_the_decode_batch_bound_of_a_runner(monkeypatch):
    """The request pool's rows, aligned as SGLang's graph runner aligns its buckets; unknown (no
    bound) without a pool or when the alignment cannot be read."""
    from types import SimpleNamespace

    import sglang.srt.utils.common as common
    from sglang_prr.serving.server_args_patch import max_decode_batch_of

    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(size=5), server_args=object())
    monkeypatch.setattr(common, "get_cuda_graph_max_batch_size", lambda sa, n: -(-n // 4) * 4)
    assert max_decode_batch_of(runner) == 8
    monkeypatch.setattr(common, "get_cuda_graph_max_batch_size", lambda sa, n: n)
    assert max_decode_batch_of(runner) == 5
    for pool in (None, SimpleNamespace(size=0), SimpleNamespace(size=True), SimpleNamespace()):
        assert max_decode_batch_of(SimpleNamespace(req_to_token_pool=pool, server_args=None)) \
            is None

    def unknown(sa, n):
        raise RuntimeError("no parallel context")
    monkeypatch.setattr(common, "get_cuda_graph_max_batch_size", unknown)
    assert max_decode_batch_of(runner) is None
