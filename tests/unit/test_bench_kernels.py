"""CPU checks of benchmarks/bench_kernels.py: the block lists FlashInfer gets (decode and
block-sparse) select our tokens, and the CLI / CSV / plot / summary paths run without a GPU."""

import math

import pytest
import torch

from sglang_prr import reference as ref

import bench_module


@pytest.fixture(scope="module")
def bench():
    return bench_module.load("bench_kernels")


def _lists(gen, B, Hk, nbr, n, pad):
    """Per-(request, KV head) ascending block lists of n blocks; with pad, random shorter counts
    (-1 padded) in some rows."""
    idx = torch.rand(B, Hk, nbr, generator=gen).topk(n, dim=-1).indices.sort(-1).values
    cnt = torch.full((B, Hk), n, dtype=torch.int32)
    if pad:
        cnt = torch.randint(0, n + 1, (B, Hk), generator=gen, dtype=torch.int32)
        cnt[0, 0] = n
        keep = torch.arange(n) < cnt.long().unsqueeze(-1)
        idx = torch.where(keep, idx, torch.full_like(idx, -1))
    return idx.to(torch.int32), cnt


# (batch, page, KV heads, blocks per request, listed blocks, padded counts)
CASES = [(1, 16, 1, 9, 4, False), (3, 64, 4, 13, 5, True), (17, 128, 8, 7, 3, False),
         (2, 256, 8, 5, 2, True), (5, 32, 2, 40, 40, False)]


@pytest.mark.parametrize("B,page,Hk,nbr,n,pad", CASES)
def test_request_lists_select_head0_tokens(bench, B, page, Hk, nbr, n, pad):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    table = (torch.randperm(B * nbr, generator=gen) + 1).view(B, nbr).to(torch.int32)
    idx, cnt = _lists(gen, B, Hk, nbr, n, pad)
    indptr, indices = bench.request_block_lists(table, idx, cnt, head=0)
    assert indptr.dtype == torch.int32 and indices.dtype == torch.int32
    assert int(indptr[0]) == 0 and int(indptr[-1]) == indices.numel() == int(cnt[:, 0].sum())
    differs = 0
    for b in range(B):
        got = bench.bsr_slots(indptr, indices, page, b)
        want = bench.list_slots(table, idx, cnt, page, b, 0)
        # independent spelling of the reference's slot rule: page(table[b, j]) * page_size + t
        direct = sorted(int(table[b, j]) * page + t for j in idx[b, 0, :int(cnt[b, 0])].tolist()
                        for t in range(page))
        assert got.tolist() == want.tolist() == direct
        assert got.numel() == int(cnt[b, 0]) * page
        # negative control: another KV head's list is a different token set (the first head
        # whose list differs; with short padded lists head 1 alone often matches head 0)
        other = [h for h in range(1, Hk) if not torch.equal(idx[b, h], idx[b, 0])]
        if other:
            differs += 1
            assert bench.list_slots(table, idx, cnt, page, b, other[0]).tolist() != got.tolist()
    # negative control: shifting the column blocks by one page moves every token
    if indices.numel():
        shifted = bench.bsr_slots(indptr, indices + 1, page, 0)
        assert shifted.tolist() != bench.bsr_slots(indptr, indices, page, 0).tolist()
    if Hk > 1 and n < nbr:
        assert differs > 0  # the per-head lists were really different somewhere


def _bsr_attention(q, k_buf, v_buf, indptr, indices, C, sm):
    """BlockSparseAttentionWrapper semantics (R = 1, NHD, non-causal) in fp64: row b attends to
    key/value rows ``indices[j] * C + t`` of the dense K/V, GQA head h -> KV head h // G."""
    B, Hq, D = q.shape
    Hk = k_buf.shape[1]
    G = Hq // Hk
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        cols = indices[int(indptr[b]):int(indptr[b + 1])].long()
        rows = (cols.unsqueeze(-1) * C + torch.arange(C)).flatten()
        k = k_buf[rows].double()  # [T, Hk, D]
        v = v_buf[rows].double()
        for h in range(Hq):
            p = torch.softmax(k[:, h // G] @ q[b, h].double() * sm, dim=0)
            out[b, h] = p @ v[:, h // G]
    return out


@pytest.mark.parametrize("B,page,Hk,G", [(1, 16, 1, 4), (3, 64, 2, 4), (17, 32, 8, 1),
                                         (2, 128, 4, 8)])
def test_bsr_attention_equals_reference_over_shared_list(bench, B, page, Hk, G):
    """FlashInfer's view (dense pool K/V, BSR of head 0's pages) computes what our reference
    computes when every KV head uses head 0's list: the check the benchmark runs on the GPU."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    D, nbr, n = 16, 11, 4
    Hq = Hk * G
    sm = 1.0 / math.sqrt(D)
    table = (torch.randperm(B * nbr, generator=gen) + 1).view(B, nbr).to(torch.int32)
    num_slots = (B * nbr + 1) * page
    k_buf = torch.randn(num_slots, Hk, D, generator=gen) * 2
    v_buf = torch.randn(num_slots, Hk, D, generator=gen)
    q = torch.randn(B, Hq, D, generator=gen) * 2
    seq = torch.full((B,), nbr * page, dtype=torch.int32)
    idx, cnt = _lists(gen, B, Hk, nbr, n, False)
    shared = idx[:, :1].expand_as(idx).contiguous()
    o_ref = ref.attend_set(q, k_buf, v_buf, table, seq, shared, cnt, page, sm)[0].double()
    indptr, indices = bench.request_block_lists(table, idx, cnt, head=0)
    o_bsr = _bsr_attention(q, k_buf, v_buf, indptr, indices, page, sm)
    rel = float((o_bsr - o_ref).norm() / o_ref.norm())
    assert rel < 1e-5, rel
    # negative controls: head 1's own list (per-head selection), and off-by-one pages
    if Hk > 1:
        o_own = ref.attend_set(q, k_buf, v_buf, table, seq, idx, cnt, page, sm)[0].double()
        assert float((o_bsr - o_own).norm() / o_own.norm()) > 1e-3
    n_pages = num_slots // page
    shifted = (indices % (n_pages - 1) + 1).to(torch.int32)  # next page, wrapping past page 0
    o_shift = _bsr_attention(q, k_buf, v_buf, indptr, shifted, page, sm)
    assert float((o_shift - o_ref).norm() / o_ref.norm()) > 1e-3


def _fake_rows():
    att, sel = [], []
    for B in (1, 8):
        for blk in (64, 128):
            for budget in (2048, 8192):
                r = {"batch": B, "block": blk, "budget": budget, "ours_partials_us": 10.0 + B,
                     "ours_full_us": 12.0 + B, "fi_decode_us": 13.0 + B, "note": ""}
                if blk == 64:  # an older CSV has no fi_bsa column; a failed point leaves it blank
                    r["fi_bsa_us"] = 14.5 + B
                att.append(r)
    for B in (1, 8):
        for ctx in (8192, 131072):
            sel.append({"batch": B, "context": ctx, "block": 64, "ours_select_us": 17.5 * B,
                        "ours_full_us": 32.0 * B, "fused_select_us": 7.5 * B,
                        "ref_select_us": 249.0 * B, "ref_full_us": 510.0 * B, "note": ""})
    return att, sel


def test_csv_plot_summary_without_gpu(bench, tmp_path):
    att, sel = _fake_rows()
    meta = {"gpu": "fake", "date": "2026-11-30"}
    wa = bench.CsvWriter(tmp_path / "kernels_attention.csv", meta)
    for r in att:
        wa(r)
    ws = bench.CsvWriter(tmp_path / "kernels_selection.csv", meta)
    for r in sel:
        ws(r)
    back = bench.read_csv(tmp_path / "kernels_attention.csv")
    assert len(back) == len(att) and back[0]["gpu"] == "fake"
    assert back[1]["fi_bsa_us"] == "15.5" and back[2]["fi_bsa_us"] == ""  # blank, not dropped
    text = bench.summary(back, bench.read_csv(tmp_path / "kernels_selection.csv"))
    lines = text.splitlines()
    row = [ln for ln in lines if ln.split()[:3] == ["8", "64", "8192"]][0]
    assert row.split()[3:] == ["18.0", "20.0", "21.0", "22.5"]
    row = [ln for ln in lines if ln.split()[:3] == ["1", "128", "2048"]][0]
    assert row.split()[-1] == "-"  # no fi_bsa there
    assert not [ln for ln in lines if ln.split()[:1] == ["32"]]  # batch 32 absent: no row
    sel_row = lines[-1].split()  # batch 8 at 128K: ours fused full fused_full ref ref_full
    assert sel_row == ["8", "140.0", "60.0", "256.0", "-", "1992.0", "4080.0"]
    assert "at 128K context" in text and "at 8K" not in text
    # the same from this run's float rows
    assert bench.summary(att, sel) == text
    # --plot-only: PNGs and the summary from the CSVs, no CUDA, no kernel library
    bench.main(["--plot-only", "--out", str(tmp_path)])
    for name in ("kernels_attention.png", "kernels_selection.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    (tmp_path / "empty").mkdir()
    assert bench.plot(tmp_path / "empty") == []  # no CSV, no PNG, no error


def test_cli(bench, tmp_path, capsys):
    a = bench.parse_args([])
    assert (a.batches, a.blocks, a.budgets) == ([1, 8, 32], [16, 32, 64, 128, 256],
                                                [1024, 2048, 4096, 6144, 8192])
    assert a.fi_tensor_cores == "on" and a.fi_bsa_backend == "auto" and a.reps == 30
    q = bench.parse_args(["--quick"])
    assert (q.batches, q.blocks, q.budgets, q.sel_contexts, q.reps) == (
        [1, 8], [16, 64], [2048, 8192], [8192, 131072], 15)
    for bad, word in ((["--budgets", "1000"], "multiple"), (["--blocks", "0"], "positive"),
                      (["--reps", "0"], "reps")):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert word in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="kernel library unavailable"):
            bench.main(["--quick", "--out", str(tmp_path)])


# ----------------------------------------------------------------------------- CPU dry run
class _FakeFlashInfer:
    """FlashInfer stand-in for the CPU dry run: every call is bound against the installed
    FlashInfer's real signature (a wrong keyword or arity fails here as it would on the GPU), and
    the attention is computed with the documented semantics (paged decode; BSR with R rows per
    block row, C columns per column block over a dense ``[N, Hk, D]`` K/V)."""

    def __init__(self, real, shift_bsa=0, fail_bsa=None):
        import types
        fake = self
        self.real = real
        self.plans = []

        def bind(fn, *a, **kw):
            import inspect
            bound = inspect.signature(fn).bind(None, *a, **kw)
            bound.apply_defaults()
            args = dict(bound.arguments)
            args.update(args.pop("kwargs", {}))  # decode's plan takes most options as **kwargs
            return args

        def attend(q, k, v, rows_of, sm):  # rows_of(b) -> KV rows of request b
            B, Hq, D = q.shape
            Hk = k.shape[1]
            G = Hq // Hk
            out = torch.empty(B, Hq, D)
            for b in range(B):
                rows = rows_of(b)
                kk, vv = k[rows].float(), v[rows].float()  # [T, Hk, D]
                logits = torch.einsum("hgd,thd->hgt", q[b].float().view(Hk, G, D), kk) * sm
                out[b] = torch.einsum("hgt,thd->hgd", torch.softmax(logits, -1), vv).reshape(Hq, D)
            return out

        class Decode:
            def __init__(self, *a, **kw):
                bind(real.BatchDecodeWithPagedKVCacheWrapper.__init__, *a, **kw)

            def plan(self, *a, **kw):
                self.p = bind(real.BatchDecodeWithPagedKVCacheWrapper.plan, *a, **kw)

            def run(self, *a, **kw):
                r = bind(real.BatchDecodeWithPagedKVCacheWrapper.run, *a, **kw)
                kc, vc = r["paged_kv_cache"]
                P, ip, ix = self.p["page_size"], self.p["indptr"], self.p["indices"]
                assert kc.shape[1] == P and int(self.p["last_page_len"].min()) == P
                k, v = kc.reshape(-1, *kc.shape[2:]), vc.reshape(-1, *vc.shape[2:])

                def rows_of(b):
                    pg = ix[int(ip[b]):int(ip[b + 1])].long()
                    return (pg.unsqueeze(-1) * P + torch.arange(P)).flatten()
                return attend(r["q"], k, v, rows_of, self.p["sm_scale"]).to(r["q"].dtype)

        class BSA:
            def __init__(self, *a, **kw):
                self.backend = bind(real.sparse.BlockSparseAttentionWrapper.__init__, *a,
                                    **kw).get("backend", "auto")

            def plan(self, *a, **kw):
                p = bind(real.sparse.BlockSparseAttentionWrapper.plan, *a, **kw)
                if fail_bsa and fail_bsa[0] == self.backend and p["C"] in fail_bsa[1]:
                    raise RuntimeError(fail_bsa[2])
                assert p["R"] == 1 and p["M"] == len(p["indptr"]) - 1 and p["N"] % p["C"] == 0
                assert int(p["indices"].max()) * p["C"] < p["N"]
                assert p["o_data_type"] == p["q_data_type"] == torch.bfloat16
                self.p = p
                self._backend = "fa3" if self.backend == "auto" else self.backend
                self._use_tensor_cores = True
                fake.plans.append(self._backend)

            def run(self, *a, **kw):
                r = bind(real.sparse.BlockSparseAttentionWrapper.run, *a, **kw)
                C, ip, ix = self.p["C"], self.p["indptr"], self.p["indices"] + shift_bsa
                assert r["k"].shape[0] == self.p["N"] and r["q"].shape[0] == self.p["M"]

                def rows_of(b):
                    cols = ix[int(ip[b]):int(ip[b + 1])].long() % (self.p["N"] // C)
                    return (cols.unsqueeze(-1) * C + torch.arange(C)).flatten()
                return attend(r["q"], r["k"], r["v"], rows_of, self.p["sm_scale"]).to(
                    self.p["o_data_type"])

        self.BatchDecodeWithPagedKVCacheWrapper = Decode
        self.sparse = types.SimpleNamespace(BlockSparseAttentionWrapper=BSA)
        self.__version__ = "fake"


@pytest.fixture
def dry(bench, monkeypatch):
    """bench_kernels with CPU tensors, the reference in place of the kernel library and a timer
    that runs every closure once (no CUDA anywhere)."""
    import types
    calls = {"n": 0}

    def fake_time(cs, reps, cold=False):
        for c in cs:
            c()
        calls["n"] += 1
        return 1.0 + calls["n"] + (0.5 if cold else 0.0), 0.9, 1.1

    def fake_warm_cold(cs, reps, warmup=1, device="cuda"):
        # cold = warm + 0.5 µs: the rows must take each column from its own timing
        return {"warm": fake_time(cs, reps), "cold": (calls["n"] + 1.5, 0.9, 1.1)}

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "LAYER", (8, 2, 32))  # GQA 4 as in the real layer, smaller
    monkeypatch.setattr(bench, "ROTATE_BYTES", 1)
    monkeypatch.setattr(bench, "FI_WORKSPACE", 64)
    monkeypatch.setattr(bench, "time_warm_cold", fake_warm_cold)
    monkeypatch.setattr(bench, "time_events", fake_time)
    monkeypatch.setattr(bench, "cuda_ops", lambda: types.SimpleNamespace(
        sparse_attn_partials=ref.sparse_attn_partials, quest_scores=ref.quest_scores,
        select_topk=ref.select_topk, set_difference=ref.set_difference,
        holt_update=ref.holt_update, predict_set=ref.predict_set))
    return bench


def _att_args(bench, tmp_path):
    return bench.parse_args(["--batches", "1", "3", "--blocks", "16", "64", "--budgets", "128",
                             "--context", "512", "--sel-contexts", "8192", "--out", str(tmp_path)])


def test_dry_run_attention_cpu(dry, tmp_path):
    flashinfer = pytest.importorskip("flashinfer")  # its signatures are what the stub binds to
    import flashinfer.sparse  # noqa: F401
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    args = _att_args(dry, tmp_path)
    args.copy_gbps = 1e-3  # the run's copy bandwidth (GB/s), for the _pct_copy columns
    # auto (fa3 in the stub) fails for page 16 only: fa2 takes that point, fa3 the others
    fake = _FakeFlashInfer(flashinfer, fail_bsa=("auto", (16,), "unsupported page size"))
    fi = dry.FiState(fake, [True], "auto")
    rows = dry.bench_attention(args, dry.CsvWriter(tmp_path / "a.csv", {"gpu": "cpu"}), fi)
    assert len(rows) == 4
    for r in rows:
        for key in ("ours_partials", "ours_full", "fi_decode", "fi_bsa"):
            assert r[f"{key}_us"] > 0 and r[f"{key}_GBps"] > 0, (key, r)
            # cold L2: its own timing (the stub's cold = warm + 0.5), its own GB/s and % copy
            assert r[f"{key}_cold_us"] == pytest.approx(r[f"{key}_us"] + 0.5), (key, r)
            assert r[f"{key}_cold_GBps"] * r[f"{key}_cold_us"] == pytest.approx(
                r["kv_bytes"] / 1e3)
            assert r[f"{key}_cold_pct_copy"] == pytest.approx(
                100 * r[f"{key}_cold_GBps"] / args.copy_gbps)
            assert r[f"{key}_pct_copy"] > r[f"{key}_cold_pct_copy"]
        assert r["speedup_fi_decode_cold"] == pytest.approx(
            r["fi_decode_cold_us"] / r["ours_partials_cold_us"])
        assert r["rotate"] == 4 and r["kv_bytes"] == r["batch"] * 2 * r["budget"] * 32 * 4
        # the stubs computed attention over head 0's tokens and matched ours on those tokens
        assert r["fi_decode_relerr"] < 1e-2 and r["fi_bsa_relerr"] < 1e-2, r
        assert "differs" not in r["note"]
        if r["block"] == 16:
            assert r["fi_bsa_backend"] == "fa2/fa2"
            assert "fi_bsa_auto failed: RuntimeError: unsupported page size" in r["note"]
        else:
            assert r["fi_bsa_backend"] == "fa3/auto" and "failed" not in r["note"]
    assert len(dry.read_csv(tmp_path / "a.csv")) == 4
    # negative control: a BSR one page off is caught by the same check
    fake = _FakeFlashInfer(flashinfer, shift_bsa=1)
    args.batches, args.blocks, args.budgets = [3], [64], [128]
    r = dry.bench_attention(args, dry.CsvWriter(tmp_path / "b.csv", {}), dry.FiState(
        fake, [True], "fa2"))[0]
    assert r["fi_bsa_relerr"] > 0.05 and "fi_bsa_fa2: output differs" in r["note"]
    assert r["fi_decode_relerr"] < 1e-2
    # both: each backend timed, fi_bsa = the faster
    fake = _FakeFlashInfer(flashinfer)
    r = dry.bench_attention(args, dry.CsvWriter(tmp_path / "d.csv", {}), dry.FiState(
        fake, [True], "both"))[0]
    assert fake.plans == ["fa3"] * 4 + ["fa2"] * 4  # R = 4 rotating sets, one plan each
    assert r["fi_bsa_us"] == min(r["fi_bsa_fa3_us"], r["fi_bsa_fa2_us"]) == r["fi_bsa_fa3_us"]
    assert r["fi_bsa_backend"] == "fa3/fa3" and r["note"] == ""
    # a build failure is not retried at later points
    fake = _FakeFlashInfer(flashinfer, fail_bsa=("fa3", (16, 64), "ninja: build stopped"))
    args.batches, args.blocks, args.budgets = [1], [16, 64], [128]
    rs = dry.bench_attention(args, dry.CsvWriter(tmp_path / "c.csv", {}), dry.FiState(
        fake, [True], "fa3"))
    assert "fi_bsa_fa3 failed: RuntimeError: ninja" in rs[0]["note"]
    assert "fi_bsa_fa3: skipped" in rs[1]["note"] and rs[1]["fi_bsa_backend"] == "fa2/fa2"


def test_dry_run_selection_cpu(dry, tmp_path):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    args = _att_args(dry, tmp_path)
    rows = dry.bench_selection(args, dry.CsvWriter(tmp_path / "s.csv", {"gpu": "cpu"}))
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 8192), (3, 8192)]
    fused = hasattr(torch.ops.sglang_prr, "quest_select")
    for r in rows:
        keys = ["ours_select", "ours_full", "ref_select", "ref_full"]
        keys += ["fused_select", "fused_full"] if fused else []
        for key in keys:
            assert r[f"{key}_us"] > 0 and r[f"{key}_GBps"] > 0, key
        # bf16 summaries by default (the server's): half the bytes of float32 ones
        assert r["sel_dtype"] == "bf16"
        assert r["rotate"] == 2 and r["summary_bytes"] == r["batch"] * 128 * 2 * 32 * 8 // 2
        assert r["ours_full_GBps"] * r["ours_full_us"] == pytest.approx(
            (r["summary_bytes"] + r["state_bytes"]) / 1e3)
        assert r["ours_full_cold_GBps"] * r["ours_full_cold_us"] == pytest.approx(
            (r["summary_bytes"] + r["state_bytes"]) / 1e3)
        assert r["ours_select_cold_us"] == pytest.approx(r["ours_select_us"] + 0.5)
        assert "ours_select_pct_copy" not in r  # no copy bandwidth measured in this run
        if not fused:
            assert "fused_select_us" not in r and "quest_select: absent" in r["note"]
    text = dry.summary([], [dict(r, context=131072) for r in rows])
    assert text.splitlines()[-1].split()[0] == "3"
    assert "cold L2" in text  # the rows have cold columns: the cold table follows


def test_cold_summary_names_the_target_columns_percent(bench):
    """The cold tables give the percent of the copy bandwidth of the partials and of the finished
    attention (``ours_full``), and of the selection and of the selection + predictor
    (``fused_full``): the columns the bandwidth targets are stated on, each under its name. A
    column a row lacks prints "-", not another column's value (the control)."""
    att = [{"batch": 8, "block": 64, "budget": 2048, "ours_partials_us": 30.0,
            "ours_partials_cold_us": 29.0, "ours_partials_cold_pct_copy": 55.2,
            "ours_full_us": 37.0, "ours_full_cold_us": 36.0, "ours_full_cold_pct_copy": 44.9}]
    sel = [{"batch": 8, "context": 131072, "block": 64, "ours_select_us": 50.0,
            "ours_select_cold_us": 49.0, "ours_select_cold_pct_copy": 33.0,
            "fused_full_cold_us": 62.0}]
    lines = bench.summary(att, sel).splitlines()
    cold = lines[lines.index(next(ln for ln in lines if "cold L2" in ln)):]
    assert "(% of copy: partials, full)" in cold[1]
    assert cold[2].split()[-2:] == ["55%", "45%"]
    assert "(% of copy: ours, fused_full)" in cold[4]
    assert cold[5].split()[-2:] == ["33%", "-"]


def test_copy_bandwidth_counts_read_and_write(dry, monkeypatch):
    """copy_GBps = 2 x bytes over the median copy time (read + write)."""
    def one_ms_per_copy(calls, reps, warmup, device):
        calls[0]()  # the copy itself runs
        return 1000.0, 1000.0, 1000.0

    monkeypatch.setattr(dry.common, "time_eager", one_ms_per_copy)
    assert dry.copy_bandwidth(1 << 20, reps=2) == pytest.approx(2 * (1 << 20) / 1e-3 / 1e9)


def test_summary_prints_every_point_of_the_run(bench):
    """Every (batch, block, budget) of the rows gets its line, 16-token pages and any budget
    included (the table once kept only blocks 64 / 128 and budgets 2048 / 8192, so a run over
    16-token pages printed none of its rows); control: a point the rows lack prints nothing."""
    att = [{"batch": b, "block": c, "budget": t, "ours_partials_us": 1.0 + b + c + t,
            "ours_full_us": 2.0} for b, c, t in ((1, 16, 2048), (8, 16, 1024), (32, 64, 4096))]
    lines = bench.summary(att, []).splitlines()
    keys = [tuple(ln.split()[:3]) for ln in lines]
    assert ("1", "16", "2048") in keys and ("8", "16", "1024") in keys
    assert ("32", "64", "4096") in keys and ("8", "64", "2048") not in keys
