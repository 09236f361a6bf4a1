"""What does prefill calibration cost? (the 80-candidate grid search of eqs 4-5)

Times the grid search on the scores of ``--rows`` sampled prefill queries
(PRRConfig.calib_queries) against every block of a prompt of length L, for L = 4K..128K, at block
64 and the Llama-3-8B layer shape (8 KV heads; 32 query heads, head dim 128 for the baseline),
K = 2048 tokens, delta = 1.5, the default 80 candidates, for ``--layers`` layers at once (the
server calibrates every sparse layer of a request together: ``--layers 32`` is one Llama-3-8B
request's chunk; the default 1 is one layer). Variants:

* ``grid``: ``calibration.grid_hit_rates``, what the server runs (``Calibrator.run``): on SM90
  the candidates are replayed by one kernel (``calib_grid_terms``), whose sums run in another
  order than torch's, so it is checked against ``ref`` by theta* (``grid_theta_equal``) and the
  largest difference of H; on CPU it is bitwise the reference (``grid_bitwise``);
* ``grid_torch`` (CUDA only): the same with the torch reference of ``calib_grid_terms``;
* ``ref``: ``ops.calibrate``, the reference (what the server ran before: it sorts
  ``[layers*80, Hk, NB]`` three times per sampled row);
* ``kern``: the reference loop through the CUDA op kernels (CUDA only).

Baseline: calibration must be small next to the prefill it hides in. As the stand-in for one
layer's prefill we time a dense causal attention of length L for one layer (torch SDPA, bf16,
GQA 32/8) on the same device; the full layer (projections, MLP) costs more, so the ratio shown is
pessimistic. On CPU the baseline is only run up to ``--baseline-max-len`` (it is quadratic).

On CUDA, calibration is timed both eagerly and replayed from a CUDA graph (``--no-graph`` skips
the graph), median of ``--repeats`` with CUDA events; the graph also with the L2 flushed before
every replay (``*_graph_cold_ms``, ``common.L2Flush``); on CPU, median wall time.

    PYTHONPATH=. python3 benchmarks/bench_calibration.py --out benchmarks/results/calibration_cpu.csv
    PYTHONPATH=. python3 benchmarks/bench_calibration.py --device cuda --batched \\
        --out benchmarks/results/calibration_h200.csv

``--batched`` adds ``calibrate_rows_batched``, an experimental row-batched form kept here to size
what batching the top-K over rows would buy (it is not used by the product)."""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_prr import calibration  # noqa: E402
from sglang_prr import ops  # noqa: E402
from sglang_prr import reference as ref  # noqa: E402
from sglang_prr.config import PRRConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the benchmarks' one graph timer)

LLAMA3_8B = dict(q_heads=32, kv_heads=8, head_dim=128)  # one layer of Llama-3-8B


def _time_cpu(fn: Callable[[], object], repeats: int, warmup: int = 1) -> List[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _time_cuda(fn: Callable[[], object], repeats: int, warmup: int = 3) -> List[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def calibrate_rows_batched(scores, nblk, k, n_pred, sink_blocks, local_blocks, alphas, betas,
                           gammas, impl=ops):
    """An experimental form of ``reference.calibrate`` (not used by the product): the Holt loop
    stays sequential (elementwise, one ``holt_update`` per row), but the predictions of all rows
    are kept and the top-K selections and eq 4 run once, batched over rows. Same per-row
    arithmetic, so ``H`` matches the reference up to fp32 reassociation of the final mean; peak
    memory grows by a factor of about ``Phi`` (all rows' predictions and sort buffers at once)."""
    R, Phi, Hk, nb = scores.shape
    C = alphas.numel()
    dev = scores.device
    n_keep = sink_blocks + local_blocks
    s = scores.float().unsqueeze(1).expand(R, C, Phi, Hk, nb).reshape(R * C, Phi, Hk, nb)
    nbk = nblk.long().unsqueeze(1).expand(R, C, Phi).reshape(R * C, Phi)
    a_, b_, g_ = (x.float().to(dev).repeat(R) for x in (alphas, betas, gammas))
    level = torch.zeros(R * C, Hk, nb, device=dev)
    trend = torch.zeros_like(level)
    n_init = torch.zeros(R * C, dtype=torch.long, device=dev)
    preds = torch.empty(max(Phi - 1, 0), R * C, Hk, nb, device=dev)
    for phi in range(Phi):
        if phi > 0:
            preds[phi - 1] = ref.holt_predict(level, trend, g_, n_init)
        impl.holt_update(level, trend, n_init, s[:, phi].contiguous(), nbk[:, phi].contiguous(),
                         a_, b_)
    if Phi < 2:
        return torch.zeros(R, C, device=dev)
    n_rows = nbk[:, 1:].transpose(0, 1).reshape(-1)  # [(Phi-1) * R*C], row-major like preds
    p_idx, p_cnt = impl.select_topk(preds.view(-1, Hk, nb), n_rows, n_pred, sink_blocks,
                                    local_blocks, n_pred + n_keep)
    # A depends on the request only: select once per (request, row), then repeat for candidates.
    rows = scores.float()[:, 1:].transpose(0, 1).reshape(-1, Hk, nb).contiguous()  # [(Phi-1)*R]
    a_idx, a_cnt = impl.select_topk(rows, nblk.long()[:, 1:].transpose(0, 1).reshape(-1).contiguous(),
                                    k, sink_blocks, local_blocks, k + n_keep)
    a_idx = a_idx.view(Phi - 1, R, 1, Hk, -1).expand(Phi - 1, R, C, Hk, k + n_keep)
    a_cnt = a_cnt.view(Phi - 1, R, 1, Hk).expand(Phi - 1, R, C, Hk)
    row_s = rows.view(Phi - 1, R, 1, Hk, nb).expand(Phi - 1, R, C, Hk, nb)
    _, middle = ref.kept_mask(n_rows, nb, sink_blocks, local_blocks)
    hit = ref.weighted_hit(row_s.reshape(-1, Hk, nb), a_idx.reshape(-1, Hk, k + n_keep),
                           a_cnt.reshape(-1, Hk), p_idx, p_cnt, middle.unsqueeze(1))
    return hit.mean(-1).view(Phi - 1, R * C).sum(0).div(Phi - 1).view(R, C)


def calib_inputs(L: int, rows: int, block: int, kv_heads: int, device: str, seed: int = 0,
                 layers: int = 1):
    """Scores ``[layers, rows, Hk, NB]`` of the last ``rows`` prompt positions (every block
    visible: the widest, costliest calibration of the prompt) and their causal block counts
    ``[layers, rows]`` (the same in every layer, as in the server)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nb = -(-L // block)
    pos = torch.arange(L - rows, L)
    nblk = ((pos + 1 + block - 1) // block).view(1, rows).expand(layers, rows).contiguous()
    s = torch.randn(layers, rows, kv_heads, nb, generator=g)
    s = torch.where(torch.arange(nb).view(1, 1, 1, nb) < nblk.view(layers, rows, 1, 1), s,
                    torch.full_like(s, float("-inf")))
    return s.to(device), nblk.to(device)


def bench_one(L: int, a: argparse.Namespace, cfg: PRRConfig) -> Dict[str, object]:
    dev = a.device
    cuda = dev.startswith("cuda")
    timer = _time_cuda if cuda else _time_cpu
    scores, nblk = calib_inputs(L, a.rows, a.block, a.kv_heads, dev, layers=a.layers)
    grid = torch.tensor(cfg.theta_grid, dtype=torch.float32, device=dev)
    al, be, ga = (grid[:, i].contiguous() for i in range(3))
    axes = [torch.tensor(x, dtype=torch.float32, device=dev)
            for x in (cfg.calib_alphas, cfg.calib_betas, cfg.calib_gammas)]
    k = cfg.top_k_blocks
    n_pred = cfg.predicted_blocks

    def calib_ref():
        return ops.calibrate(scores, nblk, k, n_pred, cfg.sink_blocks, cfg.local_blocks, al, be, ga)

    def calib_kern():  # the same loop, composed of the dispatching ops (CUDA kernels if loaded)
        return ref.calibrate(scores, nblk, k, n_pred, cfg.sink_blocks, cfg.local_blocks, al, be, ga,
                             impl=ops)

    def calib_grid():  # the product's path (Calibrator.run): the kernel on SM90
        return calibration.grid_hit_rates(scores, nblk, k, n_pred, cfg.sink_blocks,
                                          cfg.local_blocks, *axes)

    def calib_grid_torch():  # the same, with the candidates replayed by the torch reference
        return calibration.grid_hit_rates(scores, nblk, k, n_pred, cfg.sink_blocks,
                                          cfg.local_blocks, *axes, terms=ref.calib_grid_terms)

    row: Dict[str, object] = dict(device=torch.cuda.get_device_name() if cuda else "cpu",
                                  L=L, nb=scores.shape[-1], layers=a.layers, rows=a.rows,
                                  kv_heads=a.kv_heads, candidates=grid.shape[0], k_blocks=k,
                                  n_pred=n_pred)
    def calib_batched():
        return calibrate_rows_batched(scores, nblk, k, n_pred, cfg.sink_blocks, cfg.local_blocks,
                                      al, be, ga, impl=ops)

    variants = ([("grid", calib_grid)] + ([("grid_torch", calib_grid_torch)] if cuda else [])
                + ([] if a.no_ref else [("ref", calib_ref)])
                + ([("kern", calib_kern)] if cuda and a.kernels and not a.no_ref else []))
    if a.batched:
        variants.append(("batched", calib_batched))
    h_ref = calib_grid() if a.no_ref else calib_ref()
    h_grid = calib_grid()
    row["grid_bitwise"] = None if a.no_ref else bool(torch.equal(h_grid, h_ref))
    # theta* (first max per layer) of the product's path against the reference's.
    row["grid_theta_equal"] = None if a.no_ref else bool(torch.equal(
        ref.best_theta(h_grid), ref.best_theta(h_ref)))
    for name, fn in variants:
        t = timer(fn, a.repeats)
        row[f"{name}_ms"] = statistics.median(t)
        row[f"{name}_ms_min"] = min(t)
        row[f"{name}_ms_max"] = max(t)
        row[f"{name}_graph_ms"] = row[f"{name}_graph_cold_ms"] = None
        row[f"{name}_maxdiff_vs_ref"] = float((fn() - h_ref).abs().max())  # host-ok: benchmark
        if cuda and a.graph:
            gr = _capture(fn)
            # Replays timed like every benchmark's graphs (common.time_replays, in µs).
            row[f"{name}_graph_ms"] = common.time_replays(gr, a.repeats, warmup=3)[0] / 1e3
            # and with the L2 flushed before each replay, as after the layer's prefill GEMMs
            row[f"{name}_graph_cold_ms"] = common.time_replays(
                gr, a.repeats, warmup=3, flush=common.flusher())[0] / 1e3
            del gr
    # The candidates' replay alone (ops.calib_grid_terms: the kernel on SM90), A precomputed.
    wa, am = calibration.a_weights(scores, nblk, k, cfg.sink_blocks, cfg.local_blocks)
    row["terms_ms"] = statistics.median(timer(lambda: ops.calib_grid_terms(
        scores, nblk, wa, am, *axes, n_pred, cfg.sink_blocks, cfg.local_blocks), a.repeats))
    del wa, am
    # The product's form (eager is what the server runs: prefill is not graph-captured).
    row["calib_ms"] = row["grid_ms"]
    row["sdpa_ms"] = None
    if cuda or L <= a.baseline_max_len:
        dt = torch.bfloat16 if cuda else torch.float32
        gq = torch.Generator(device="cpu").manual_seed(1)
        q = torch.randn(1, a.q_heads, L, a.head_dim, generator=gq).to(dev, dt)
        kk = torch.randn(1, a.kv_heads, L, a.head_dim, generator=gq).to(dev, dt)
        vv = torch.randn(1, a.kv_heads, L, a.head_dim, generator=gq).to(dev, dt)

        def sdpa():
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True)

        row["sdpa_ms"] = statistics.median(timer(sdpa, max(3, a.repeats // 2)))
        del q, kk, vv
    row["ratio_pct"] = (100.0 * row["calib_ms"] / row["sdpa_ms"]) if row["sdpa_ms"] else None
    return row


def _capture(fn: Callable[[], torch.Tensor]) -> "torch.cuda.CUDAGraph":
    """Capture ``fn`` in a CUDA graph (the benchmarks' common capture) and check one replay."""
    gr, (static,) = common.capture([fn])
    gr.replay()
    torch.cuda.synchronize()
    eager = fn()
    if not torch.allclose(static, eager, atol=1e-6, rtol=0):
        raise RuntimeError("calibration replayed from a CUDA graph differs from eager: max diff "
                           f"{(static - eager).abs().max().item()}")  # host-ok: benchmark
    return gr


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536,131072",
                    help="prompt lengths L in tokens")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--rows", type=int, default=PRRConfig().calib_queries,
                    help="sampled prefill queries per calibration (calib_queries)")
    ap.add_argument("--kv-heads", type=int, default=LLAMA3_8B["kv_heads"])
    ap.add_argument("--q-heads", type=int, default=LLAMA3_8B["q_heads"])
    ap.add_argument("--head-dim", type=int, default=LLAMA3_8B["head_dim"])
    ap.add_argument("--top-k", type=int, default=2048, help="K in tokens")
    ap.add_argument("--budget", type=float, default=1.5, help="delta")
    ap.add_argument("--repeats", type=int, default=None, help="default: 20 on CUDA, 3 on CPU")
    ap.add_argument("--no-graph", dest="graph", action="store_false")
    ap.add_argument("--layers", type=int, default=1,
                    help="layers calibrated together (the server: every sparse layer, e.g. 32)")
    ap.add_argument("--no-ref", action="store_true",
                    help="time the product's path only (the reference is slow at --layers 32)")
    ap.add_argument("--batched", action="store_true",
                    help="also time the experimental row-batched form (calibrate_rows_batched)")
    ap.add_argument("--no-kernels", dest="kernels", action="store_false",
                    help="on CUDA, skip the variant composed of the registered CUDA op kernels")
    ap.add_argument("--baseline-max-len", type=int, default=8192,
                    help="longest L whose SDPA baseline runs on CPU")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="CSV path")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {a.device}: no CUDA device is available")
    if a.repeats is None:
        a.repeats = 20 if a.device.startswith("cuda") else 3
    cfg = PRRConfig(block_size=a.block, top_k=a.top_k, budget=a.budget,
                    calib_queries=a.rows).validate()
    rows = []
    for L in [int(x) for x in a.lengths.split(",") if x]:
        r = bench_one(L, a, cfg)
        rows.append(r)
        print(f"L={L}: best calibration {r['calib_ms']:.3f} ms, sdpa {_fmt(r['sdpa_ms'])} ms, "
              f"{r}", flush=True)
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)) or ".", exist_ok=True)
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)
    print(f"\ncalibration cost, {rows[0]['device']}, {a.layers} layer(s) x {a.rows} rows x "
          f"{a.kv_heads} KV heads x {rows[0]['candidates']} candidates, block {a.block}, "
          f"K={cfg.top_k_blocks} blocks, |P|={cfg.predicted_blocks}; grid = the product's path "
          f"(calibration.grid_hit_rates, bitwise = equal to ref); ref = reference ops, kern = the "
          f"same loop through the CUDA op kernels; baseline = one layer of dense causal SDPA "
          f"(GQA {a.q_heads}/{a.kv_heads}, d={a.head_dim}, "
          f"{'fp32' if a.device == 'cpu' else 'bf16'}); times in ms, median")
    print("| L | blocks | grid eager | of which terms | grid graph | grid torch eager | bitwise "
          "| theta* equal "
          "| ref eager | ref graph | kern eager | kern graph | batched graph (exp.) "
          "| SDPA 1 layer | grid eager / SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['L']} | {r['nb']} | {_fmt(r.get('grid_ms'), '.3f')} | "
              f"{_fmt(r.get('terms_ms'), '.3f')} | {_fmt(r.get('grid_graph_ms'), '.3f')} | {_fmt(r.get('grid_torch_ms'), '.3f')} | "
              f"{r['grid_bitwise']} | {r['grid_theta_equal']} | "
              f"{_fmt(r.get('ref_ms'), '.3f')} | "
              f"{_fmt(r.get('ref_graph_ms'), '.3f')} | {_fmt(r.get('kern_ms'), '.3f')} | "
              f"{_fmt(r.get('kern_graph_ms'), '.3f')} | "
              f"{_fmt(r.get('batched_graph_ms') or r.get('batched_ms'), '.3f')} | "
              f"{_fmt(r['sdpa_ms'], '.3f')} | "
              f"{'n/a' if r['ratio_pct'] is None else format(r['ratio_pct'], '.2f') + '%'} |")
    if a.out:
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
