"""bench_kernel_stages.py on CPU (tiny sizes, the reference ops, wall clock): every part writes
its rows, the bytes each row counts follow its sizes, and --append keeps earlier rows."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kernel_stages as bks  # noqa: E402


def _read(p):
    with open(p) as f:
        return list(csv.DictReader(f))


def test_rows_bytes_and_append(tmp_path):
    out = tmp_path / "k.csv"
    rows = bks.main(["--device", "cpu", "--quick", "--csv", str(out)])
    got = _read(out)
    assert len(got) == len(rows) > 0 and list(got[0]) == bks.COLUMNS
    cases = {(r["part"], r["case"]) for r in got}
    assert ("attention", "partials") in cases and ("selection", "select + predictor") in cases
    assert ("selection", "predictor (side)") in cases
    assert ("selection", "select (scores, A), serial") in cases
    assert ("selection", "scores alone") in cases
    assert ("selection", "select + fold, serial") in cases  # (the concurrent row: CUDA only)
    assert ("selection", "select + fold + write, serial") in cases
    assert {int(r["m_blocks"]) for r in got if r["case"].startswith("repair")} == {1, 2}
    assert all(float(r["cold_us"]) > 0 and float(r["warm_us"]) > 0 for r in got)
    # The bytes a row must read grow with its batch (serial attention, selection, predictor).
    for part, case in (("attention", "serial (attention + merge)"),
                       ("selection", "select (scores, A, M)"),
                       ("selection", "predictor (side)")):
        by_b = {int(r["batch"]): int(r["bytes"]) for r in got
                if r["part"] == part and r["case"] == case}
        assert by_b[2] == 2 * by_b[1], (part, by_b)
    assert (tmp_path / "k.png").exists()
    # --append keeps the earlier rows (control: without it they are replaced).
    bks.main(["--device", "cpu", "--quick", "--parts", "selection", "--append", "--csv",
              str(out)])
    assert len(_read(out)) == len(got) + 14  # 2 batch sizes x 7 selection cases
    bks.main(["--device", "cpu", "--quick", "--parts", "selection", "--csv", str(out)])
    assert len(_read(out)) == 14


def test_attn_launch_names_forced_settings_only(monkeypatch):
    """The attn_launch column names what the environment forces (the launch's shape rule runs
    unnamed); unknown values force nothing, as in the launcher."""
    for k in ("SGLANG_PRR_ATTN_GRID", "SGLANG_PRR_ATTN_MERGE", "SGLANG_PRR_ATTN_SPREAD",
              "SGLANG_PRR_ATTN_MERGE_SPLITS", "SGLANG_PRR_ATTN_PACK"):
        monkeypatch.delenv(k, raising=False)
    assert bks.attn_launch() == ""
    monkeypatch.setenv("SGLANG_PRR_ATTN_SPREAD", "1")  # only "row" forces anything
    assert bks.attn_launch() == ""
    monkeypatch.setenv("SGLANG_PRR_ATTN_GRID", "blocks")
    monkeypatch.setenv("SGLANG_PRR_ATTN_MERGE", "x")
    assert bks.attn_launch() == ""
    monkeypatch.setenv("SGLANG_PRR_ATTN_GRID", "entries")
    assert bks.attn_launch() == "grid-entries"
    monkeypatch.setenv("SGLANG_PRR_ATTN_MERGE", "fused")
    assert bks.attn_launch() == "grid-entries+merge-fused"
    monkeypatch.setenv("SGLANG_PRR_ATTN_GRID", "heads")
    monkeypatch.setenv("SGLANG_PRR_ATTN_MERGE", "split")
    assert bks.attn_launch() == "grid-heads+merge-split"
    monkeypatch.setenv("SGLANG_PRR_ATTN_MERGE", "ticket")
    assert bks.attn_launch() == "grid-heads+merge-ticket"
    monkeypatch.setenv("SGLANG_PRR_ATTN_SPREAD", "row")
    assert bks.attn_launch() == "grid-heads+merge-ticket+spread-row"
    for same in ("0", "-2", "x", "2x", "", "auto", "3 "):  # the launcher's shape rule
        monkeypatch.setenv("SGLANG_PRR_ATTN_MERGE_SPLITS", same)
        assert bks.attn_launch() == "grid-heads+merge-ticket+spread-row"
    for n, label in (("3", "3"), ("1", "1"), ("+2", "2"), (" 04", "4")):
        monkeypatch.setenv("SGLANG_PRR_ATTN_MERGE_SPLITS", n)
        assert bks.attn_launch() == f"grid-heads+merge-ticket+spread-row+merge-splits-{label}"
    for other in ("yes", "", "11", "00"):  # only "1" / "0" force, as in the launcher
        monkeypatch.setenv("SGLANG_PRR_ATTN_PACK", other)
        assert bks.attn_launch() == "grid-heads+merge-ticket+spread-row+merge-splits-4"
    monkeypatch.setenv("SGLANG_PRR_ATTN_PACK", "0")
    assert bks.attn_launch() == "grid-heads+merge-ticket+spread-row+merge-splits-4+pages-one"
    monkeypatch.setenv("SGLANG_PRR_ATTN_PACK", "1")
    assert bks.attn_launch() == "grid-heads+merge-ticket+spread-row+merge-splits-4+pages-packed"


def test_selection_tables_wider_than_the_context():
    """--table-ctx: the tables are as wide as asked, the requests keep their blocks (pages past
    them are 0), and the per-block state follows the table's width; without it the table is the
    context's width (the control)."""
    import torch
    g = torch.Generator().manual_seed(1)
    s = bks.selection_sets(2, 8, 1, 3, torch.device("cpu"), g, 16, NBt=32)[0]
    assert s["table"].shape == (2, 32) and s["level"].shape[-1] == 32
    assert torch.equal(s["table"][:, :8], torch.arange(16, dtype=torch.int32).view(2, 8) + 1)
    assert (s["table"][:, 8:] == 0).all() and (s["nblk"] == 8).all()
    narrow = bks.selection_sets(2, 8, 1, 3, torch.device("cpu"), g, 16)[0]
    assert narrow["table"].shape == (2, 8)


def test_table_ctx_column(tmp_path):
    out = tmp_path / "k.csv"
    bks.main(["--device", "cpu", "--quick", "--parts", "selection", "--table-ctx", "2048",
              "--csv", str(out)])
    got = _read(out)
    assert got and {r["table_ctx"] for r in got} == {"2048"}


def test_the_select_kernel_column_names_the_selection_knobs(monkeypatch):
    """The rows' ``select_kernel`` column: the forced path, then ``+grid-<v>``, ``+scores-warp``
    and ``+topk-scan`` for the knobs set; values the launchers ignore add nothing."""
    import knobs

    for k in ("SGLANG_PRR_SELECT_KERNEL", "SGLANG_PRR_SELECT_GRID", "SGLANG_PRR_SCORES_KERNEL",
              "SGLANG_PRR_TOPK"):
        monkeypatch.delenv(k, raising=False)
    assert knobs.select_kernel() == "auto"
    monkeypatch.setenv("SGLANG_PRR_TOPK", "walks")
    assert knobs.select_kernel() == "auto"
    monkeypatch.setenv("SGLANG_PRR_SELECT_KERNEL", "split")
    monkeypatch.setenv("SGLANG_PRR_TOPK", "scan")
    monkeypatch.setenv("SGLANG_PRR_SCORES_KERNEL", "warp")
    monkeypatch.setenv("SGLANG_PRR_SELECT_GRID", "3")
    assert knobs.select_kernel() == "split+grid-3+scores-warp+topk-scan"
