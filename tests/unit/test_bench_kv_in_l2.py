"""bench_kv_in_l2.py on CPU (tiny sizes, the reference ops, wall clock): the gather reads exactly
the K/V rows a launch attends (the blocks' pages, every token and KV head, K and V), and every
case writes its row."""

from __future__ import annotations

import csv
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kernel_stages as stages  # noqa: E402
import bench_kv_in_l2 as kvl  # noqa: E402


def test_gather_reads_exactly_the_listed_blocks_rows():
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    B, page, ctx_blocks = 2, 16, 24
    k_buf, v_buf, sets, na = stages.attention_sets(B, 3 * page, page, ctx_blocks, 2, "cpu", g)
    s = sets[1]
    ids = s["idx"][:, 0, 1:4]  # three listed blocks a request (awkward: not the list's ends)
    out = kvl.gather_rows(k_buf, s, ids, page)()
    want = []
    for b in range(B):
        for i in ids[b].tolist():
            slot0 = int(s["table"][b, i]) * page
            want.append(torch.stack([k_buf[slot0:slot0 + page], v_buf[slot0:slot0 + page]], 1))
    assert torch.equal(out, torch.cat(want)), seed
    # Control: another set's blocks live on other pages, so their rows differ.
    other = kvl.gather_rows(k_buf, sets[0], sets[0]["idx"][:, 0, 1:4], page)()
    assert not torch.equal(other, out), seed


def test_every_case_writes_its_row(tmp_path):
    out = tmp_path / "kv.csv"
    rows = kvl.main(["--device", "cpu", "--quick", "--csv", str(out)])
    with open(out) as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) == 2 and list(got[0]) == kvl.COLUMNS
    assert [r["case"] for r in got] == ["serial (attention + merge)", "repair + merge"]
    assert all(float(r["cold_us"]) > 0 and float(r["gather_us"]) > 0 for r in got)
    for r in got:  # the trip is the control less the K/V-in-L2 form, both net of the gather
        assert abs(float(r["kv_trip_us"]) - (float(r["other_us"]) - float(r["own_us"]))) < 0.02
    assert (tmp_path / "kv.png").exists()
