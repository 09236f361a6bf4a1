"""``python -m sglang_prr``: a self-contained run of the PRR decode ops (no model, no server).

Builds a paged KV cache with a drifting set of "important" blocks, decodes a few steps with
serial DSA and with PRR, and prints per step the prediction hit rate, |M| and the difference
between the two outputs (exact mode: fp32 rounding only). Runs on CPU (reference ops) or CUDA.
"""

from __future__ import annotations

import argparse
import math

HEADER = """\
PRR decode ops on a synthetic paged KV cache (no model, no server). Each step decodes the same
queries twice: serial DSA (score the blocks, select the top-K set A, attend over A) and PRR
(attend over the predicted set P while A is selected, then repair: attend over the missed blocks
M = A \\ P and merge). Columns, means over the batch's rows and KV heads:
  step            decode step
  hit(|P&A|/|A|)  share of the selected blocks A that the prediction P already held (0 at
                  step 0: nothing is predicted before a first selection)
  |M|(mean)       blocks repaired per row and KV head (selected but not predicted)
  max|PRR-DSA|    largest difference between the two outputs: PRR (exact) attends exactly A,
                  so only fp32 rounding (~1e-6) is expected"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sglang_prr",
        description="Run PRR's decode ops against serial DSA on a synthetic paged KV cache "
                    "(no model, no server) and print, per decode step, the prediction's hit "
                    "rate, the repaired blocks |M| and the difference of the two outputs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--context", type=int, default=8192,
                    help="tokens already in each request's KV cache")
    ap.add_argument("--batch", type=int, default=2, help="requests decoded together")
    ap.add_argument("--steps", type=int, default=8, help="decode steps")
    ap.add_argument("--block-size", type=int, default=64,
                    help="tokens per block (one KV page): 16, 32, 64 or 128")
    ap.add_argument("--top-k", type=int, default=1024,
                    help="selection budget K in tokens (rounded up to whole blocks)")
    ap.add_argument("--budget", type=float, default=1.5,
                    help="speculation budget delta: |P| <= delta * K blocks")
    ap.add_argument("--device", default="auto",
                    help="cpu, cuda, or auto (cuda when available)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic cache and queries")
    return ap


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)  # before torch's import: --help answers at once
    import torch

    from . import ops
    from .config import PRRConfig
    from .tools.synthetic import paged_kv

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    cfg = PRRConfig(block_size=a.block_size, top_k=a.top_k, budget=a.budget).validate()
    dev, page = torch.device(device), cfg.block_size
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    B, Hk, G, D = a.batch, 8, 4, 128
    # A few blocks hold keys aligned with a slowly drifting query direction.
    topic = torch.randn(B, Hk, D, generator=g)
    kv = paged_kv(B, a.context + a.steps, page, Hk, D, dtype=torch.float32, device=dev,
                  generator=g, topic=topic, hot_blocks=12, hot_scale=0.5)
    k_buf, v_buf, table, kmin, kmax = kv.k_buf, kv.v_buf, kv.table, kv.kmin, kv.kmax
    nb, k, n_pred = table.shape[1], cfg.top_k_blocks, cfg.predicted_blocks
    level = torch.zeros(B, Hk, nb, device=dev)
    trend = torch.zeros_like(level)
    n_init = torch.zeros(B, dtype=torch.long, device=dev)
    theta = torch.tensor([cfg.default_theta] * B, device=dev)
    p_idx = torch.full((B, Hk, n_pred + 2), -1, dtype=torch.int32, device=dev)
    p_cnt = torch.zeros(B, Hk, dtype=torch.int32, device=dev)
    scale = 1.0 / math.sqrt(D)
    print(HEADER)
    print(f"device={dev} batch={B} context={a.context} block={page} K={k} blocks |P|<={n_pred}")
    print("step  hit(|P&A|/|A|)  |M|(mean)  max|PRR-DSA|")
    for step in range(a.steps):
        seq = torch.full((B,), a.context + step, device=dev)
        drift = torch.randn(B, Hk, D, generator=g).to(dev) * 0.3
        q = ((topic.to(dev) + drift).repeat_interleave(G, 1) * 4.0
             + torch.randn(B, Hk * G, D, generator=g).to(dev))
        o_dsa, _, _, _ = ops.dsa_decode(q, k_buf, v_buf, [kmin, kmax], table, seq, "quest", k, 1,
                                        1, page, scale)
        o, a_idx, a_cnt, m_idx, m_cnt, p_idx, p_cnt = ops.prr_decode(
            q, k_buf, v_buf, [kmin, kmax], table, seq, p_idx, p_cnt, level, trend, n_init, theta,
            "quest", k, n_pred, 1, 1, page, scale)
        hit = 1.0 - (m_cnt.float() / a_cnt.float()).mean().item()  # host-ok: demo printout
        print(f"{step:4d}  {hit:14.3f}  {m_cnt.float().mean().item():9.2f}  "  # host-ok
              f"{(o - o_dsa).abs().max().item():.2e}")  # host-ok


if __name__ == "__main__":
    main()
