"""Programmatic dependent launch (``SGLANG_PRR_PDL=1``) on the GPU: the same bits as without it;
likewise the largest shared-memory carveout (``SGLANG_PRR_SMEM_CARVEOUT=max`` for every kernel,
``=select`` for PRR's one-pass selection alone) and the predictor's shared-memory floor
(``SGLANG_PRR_PREDICT_SMEM_KB``).

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

# One process: PRR (exact, two streams) and serial DSA captured in one graph
# (test_decode_step.DecodeGraph, Llama-3-8B's 8 KV heads and GQA 4, K = 32 blocks of 64 tokens,
# |P| = 48), replayed STEPS times with queries and lengths from the seed; every output saved.
SCRIPT = r"""
import sys, torch
from sglang_prr import kernels
from test_decode_step import DecodeGraph
assert kernels.load(), kernels.load_error()
seed, out_path, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dg = DecodeGraph(torch.Generator().manual_seed(seed), 3, 4, 64, torch.bfloat16, hk=8,
                 ctx=300 * 64 + 7, k=32, n_pred=48)
saved = []
for t in range(steps):
    outs = dg.replay([dg.ctx + t, dg.ctx - 977 * t, 9 * 64 + 3 * t, 1])
    saved.append({n: o[:3].cpu() for n, o in outs.items()})
torch.save({"pdl": kernels.launches_with_pdl(), "outs": saved, "stats": dg.stats.cpu()}, out_path)
"""


def _run(tmp_path: Path, seed: int, pdl: str, steps: int = 8, carveout: str = "") -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SGLANG_PRR_PDL", "SGLANG_PRR_SMEM_CARVEOUT")}
    env["SGLANG_PRR_PDL"] = pdl
    if carveout:
        env["SGLANG_PRR_SMEM_CARVEOUT"] = carveout
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "gpu")]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    out = tmp_path / f"pdl{pdl}_carveout{carveout or 'default'}_seed{seed}.pt"
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


@pytest.mark.parametrize("carveout", ["max", "select"])
def test_decode_graph_with_the_largest_carveout_gives_the_same_bits(tmp_path, carveout):
    """``SGLANG_PRR_SMEM_CARVEOUT=max`` (every kernel asks for the SM's whole shared memory, so
    that PRR's two streams' kernels can share an SM) and ``=select`` (the one-pass selection
    alone asks) launch without error and change no bit of the decode step; another seed is the
    negative control."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[carveout={carveout}] seed={seed}")
    on, off = _run(tmp_path, seed, "0", carveout=carveout), _run(tmp_path, seed, "0")
    for t, (a, b) in enumerate(zip(on["outs"], off["outs"])):
        for name in ("prr", "ser"):
            assert torch.isfinite(a[name]).all(), (t, name)
            assert torch.equal(a[name], b[name]), (t, name)
        assert torch.equal(a["prr"], a["ser"]), t
    assert torch.equal(on["stats"], off["stats"]) and int(on["stats"][3]) > 0
    other = _run(tmp_path, seed + 1, "0", steps=1, carveout=carveout)
    assert not torch.equal(other["outs"][0]["ser"], on["outs"][0]["ser"])


# One process: the predictor's step over rows of 2048 blocks (the 128K / block-64 shape) from the
# seed, its state and P(t+1) saved; the reference's beside them.
PREDICT_SCRIPT = r"""
import sys, torch
from sglang_prr import custom_ops as ops, kernels
from sglang_prr import reference as ref
assert kernels.load(), kernels.load_error()
seed, out_path = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(seed)
R, B, Hk, NB, n_pred = 5, 3, 8, 2048, 48
state = [torch.randn(R, Hk, NB, generator=g), torch.randn(R, Hk, NB, generator=g) * 0.1,
         torch.randint(NB // 2, NB, (R,), generator=g),
         torch.full((2 * R, Hk, n_pred + 2), -1, dtype=torch.int32),
         torch.zeros(2 * R, Hk, dtype=torch.int32)]
theta = torch.rand(R, 3, generator=g) * 0.8 + 0.1
rows = torch.tensor([3, 1, 4])
scores = torch.randn(B, Hk, NB, generator=g)
nblk = torch.randint(NB - 300, NB - 1, (B,), generator=g)
want = [t.clone() for t in state]
ref.predict_update_rows(*want, theta, rows, scores, nblk, nblk + 1, n_pred, 1, 1,
                        p_rows=2 * rows + 1)
got = [t.cuda() for t in state]
ops.predict_update_rows(*got, theta.cuda(), rows.cuda(), scores.cuda(), nblk.cuda(),
                        (nblk + 1).cuda(), n_pred, 1, 1, p_rows=(2 * rows + 1).cuda())
torch.save({"got": [t.cpu() for t in got], "want": want}, out_path)
"""


def _predict(tmp_path: Path, seed: int, smem_kb: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PRR_PREDICT_SMEM_KB"}
    if smem_kb:
        env["SGLANG_PRR_PREDICT_SMEM_KB"] = smem_kb
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = tmp_path / f"predict_smem{smem_kb or 'default'}_seed{seed}.pt"
    r = subprocess.run([sys.executable, "-c", PREDICT_SCRIPT, str(seed), str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("smem_kb", ["212", "100000"])
def test_predictor_with_a_shared_memory_floor_gives_the_same_bits(tmp_path, smem_kb):
    """``SGLANG_PRR_PREDICT_SMEM_KB`` (the predictor's CTAs ask for that much shared memory, so
    that no other kernel's CTA needing more than what is left shares their SMs; a floor above the
    device's limit is cut to it) launches without error and changes no bit of the state or of
    P(t+1), which equal the reference's; another seed is the negative control."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[predict smem={smem_kb}] seed={seed}")
    on, off = _predict(tmp_path, seed, smem_kb), _predict(tmp_path, seed, "")
    for name, a, b, w in zip(("level", "trend", "n_init", "p_idx", "p_cnt"), on["got"],
                             off["got"], on["want"]):
        assert torch.equal(a, b), name
        assert torch.equal(a, w), name  # rounded op by op like the reference
    assert int(on["got"][4].sum()) > 0  # P(t+1) was written
    other = _predict(tmp_path, seed + 1, smem_kb)
    assert not torch.equal(other["got"][3], on["got"][3]), "control: another seed"
