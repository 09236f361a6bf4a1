"""Programmatic dependent launch (``SGLANG_PRR_PDL=1``) on the GPU: the same bits as without it.

With PDL a kernel may be scheduled while the kernel before it still runs, and only its
``griddepcontrol.wait`` (``pdl_begin`` in common.cuh) orders it after its inputs; a kernel that
read before the wait would see its predecessor's output half written. The decode step (PRR on two
streams, then serial DSA, in one CUDA graph) is replayed with new queries and lengths in two
processes that differ only in ``SGLANG_PRR_PDL``: every output must be bit-identical, and the
counters equal. The library reports which way it launched. Negative control: another seed gives
other bits. The environment is read once per process, hence the subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

from sm90 import require_sm90  # noqa: E402  (the SM90 gate, tests/gpu/sm90.py)

require_sm90()

NEEDS_KERNEL_LIBRARY = False  # each subprocess loads it

ROOT = Path(__file__).resolve().parents[2]

# One process: PRR (exact, two streams) and serial DSA captured in one graph, replayed STEPS
# times with queries and lengths from the seed; the outputs of every replay saved.
SCRIPT = r"""
import math, sys, torch
from sglang_prr import kernels
from sglang_prr.step import DecodeStep, new_layer_state
from sglang_prr.tools.synthetic import paged_kv
assert kernels.load(), kernels.load_error()
seed, out_path, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
g = torch.Generator().manual_seed(seed)
dev = torch.device("cuda")
batch, group, page, dtype = 3, 4, 64, torch.bfloat16
hk, d, ctx = 8, 128, 300 * page + 7
kv = paged_kv(batch, ctx + 16, page, hk, d, dtype=dtype, device=dev, generator=g)
R, nb = batch + 1, kv.table.shape[1]
mk = lambda serial: DecodeStep("quest", 32, 48, 1, 1, page, min_context=8 * page + 1,
                               exact=True, serial=serial, device=dev)
prr, ser = mk(False), mk(True)
state = new_layer_state(R, hk, nb, 48 + 2, (0.6, 0.3, 0.5), dev)  # |P| + sink + local
rows = kv.rows.flip(0)
qkv = torch.empty(batch, (hk * group + 2 * hk) * d, device=dev, dtype=dtype)
q = qkv[:, :hk * group * d].view(batch, hk * group, d)
seq = torch.full((batch,), ctx, device=dev, dtype=torch.long)
outs = {n: torch.empty(batch, hk * group, d, device=dev, dtype=dtype) for n in ("prr", "ser")}
stats = torch.zeros(4, dtype=torch.int64, device=dev)
scale = 1.0 / math.sqrt(d)

def body():
    for name, step in (("prr", prr), ("ser", ser)):
        b = step.plan(kv.req_to_token, rows, seq)
        outs[name].copy_(step.run(q, kv.k_buf, kv.v_buf, [kv.kmin, kv.kmax], b,
                                  state if name == "prr" else None,
                                  stats if name == "prr" else None, scale, dtype))

qkv.copy_(torch.randn(qkv.shape, generator=g).to(dev) * 3)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    body()
torch.cuda.current_stream().wait_stream(s)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    body()
saved = []
for t in range(steps):
    qkv.copy_(torch.randn(qkv.shape, generator=g).to(dev) * 3)
    seq.copy_(torch.tensor([ctx + t, ctx - 977 * t, 9 * page + 3 * t]))
    for o in outs.values():
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    saved.append({n: o.cpu() for n, o in outs.items()})
torch.save({"pdl": kernels.launches_with_pdl(), "outs": saved, "stats": stats.cpu()}, out_path)
"""


def _run(tmp_path: Path, seed: int, pdl: str, steps: int = 8) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PRR_PDL"}
    env["SGLANG_PRR_PDL"] = pdl
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = tmp_path / f"pdl{pdl}_seed{seed}.pt"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(seed), str(out), str(steps)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(out)


def test_decode_graph_with_pdl_gives_the_same_bits(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[pdl] seed={seed}")
    on, off = _run(tmp_path, seed, "1"), _run(tmp_path, seed, "0")
    assert on["pdl"] is True and off["pdl"] is False
    for t, (a, b) in enumerate(zip(on["outs"], off["outs"])):
        for name in ("prr", "ser"):
            assert torch.isfinite(a[name]).all(), (t, name)
            assert torch.equal(a[name], b[name]), (t, name)
        assert torch.equal(a["prr"], a["ser"]), t  # PRR (exact) == serial DSA, with PDL too
    assert torch.equal(on["stats"], off["stats"]) and int(on["stats"][3]) > 0
    # negative control: another seed, other bits
    other = _run(tmp_path, seed + 1, "1", steps=1)
    assert not torch.equal(other["outs"][0]["ser"], on["outs"][0]["ser"])
