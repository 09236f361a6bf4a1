"""``python -m sglang_prr``: a self-contained run of the PRR decode ops (no model, no server).

Builds a paged KV cache with a drifting set of "important" blocks, decodes a few steps with
serial DSA and with PRR, and prints per step the prediction hit rate, |M| and the difference
between the two outputs (exact mode: fp32 rounding only). Runs on CPU (reference ops) or CUDA.
"""

from __future__ import annotations

import argparse
import math

import torch

from . import ops
from .config import PRRConfig
from .tools.synthetic import paged_kv


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=1024, help="tokens")
    ap.add_argument("--budget", type=float, default=1.5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    cfg = PRRConfig(block_size=a.block_size, top_k=a.top_k, budget=a.budget).validate()
    dev, page = torch.device(a.device), cfg.block_size
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
