"""One question: is decoding faster end to end in SGLang with PRR than with dense attention or
with serial DSA?

Starts ``python -m sglang_prr.launch_server`` once per variant (dense: ``--prr-method dense``,
i.e. SGLang's own FlashInfer attention; serial DSA: ``--prr-serial``; PRR exact), on a model of
Llama-3-8B's shape with random weights (``--load-format dummy``, the demo's offline tokenizer),
FlashInfer backend, decode in CUDA graphs, and sends ``batch`` concurrent streamed requests of
``ctx`` random token ids, ``out`` greedy output tokens each (ignore-eos). The decode time per
step is the median inter-token latency (ITL), timed per token arrival (``completion_tokens`` of
each streamed chunk, not its text: random weights often decode to empty strings, which is why
``sglang.benchmark.serving``, which times text, reports no ITL here). With ``out`` much larger
than the number of prefill chunks, most gaps are decode steps of the whole batch. TPOT and TTFT
are reported beside it, and the hit rate from ``/prr/stats``.

    python benchmarks/bench_serving.py --csv benchmarks/results/serving_h200.csv   # CUDA
    python benchmarks/bench_serving.py --variants prr --contexts 32768 --batches 8
    python benchmarks/bench_serving.py --plot-only benchmarks/results/serving_h200.csv

Random weights give random attention, so the hit rate here is not a real model's; what this
measures is the cost of each decode path at a real shape.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from ports import free_port  # noqa: E402  (ports outside the range SGLang draws its own from)

# Llama-3-8B: 32 layers, 32 query / 8 KV heads of 128, hidden 4096, MLP 14336.
LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 num_hidden_layers=32, intermediate_size=14336, rope_theta=500000.0,
                 torch_dtype="bfloat16")
VARIANTS = {
    "dense": ["--prr-method", "dense"],
    "serial": ["--prr-serial"],
    "prr": [],
}
LABELS = {"dense": "dense (FlashInfer)", "serial": "serial DSA", "prr": "PRR (exact)"}


def server_cmd(model: str, port: int, variant: str, a) -> list:
    ctx_len = max(a.contexts) + a.out + 64
    if a.device == "cpu":  # plumbing smoke run: SGLang's CPU path (no graphs, no FlashInfer)
        dev = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
               "--model-impl", "transformers"]
    else:
        dev = ["--attention-backend", "flashinfer", "--sampling-backend", "pytorch",
               "--disable-piecewise-cuda-graph", "--cuda-graph-max-bs", str(max(a.batches)),
               "--mem-fraction-static", str(a.mem_fraction)]
    return [sys.executable, "-m", "sglang_prr.launch_server", "--model-path", model,
            "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
            "--grammar-backend", "none", "--max-running-requests", str(max(a.batches)),
            "--context-length", str(ctx_len), "--random-seed", "0",
            "--skip-server-warmup", "--log-level", "warning",
            "--prr-block-size", str(a.page), "--prr-top-k", str(a.top_k),
            "--prr-top-k-unit", "tokens", "--prr-min-context", str(a.min_context)] + dev + \
        VARIANTS[variant]


def wait_ready(proc, url: str, log: Path, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(2)
    raise RuntimeError(f"server not ready in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def prr_stats(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/prr/stats", timeout=30) as r:
            return json.loads(r.read())
    except Exception:  # noqa: BLE001 - dense servers may not expose it
        return {}


def _stream_one(url: str, ids: list, out: int, t_start: float, res: list, i: int) -> None:
    """One streamed greedy request; the arrival time of every chunk that adds tokens."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": out, "temperature": 0.0,
                                           "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    marks, n = [], 0
    with urllib.request.urlopen(req, timeout=1800) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            k = json.loads(line[5:])["meta_info"]["completion_tokens"]
            if k > n:  # tokens, not text: random weights often decode to empty strings
                marks.append((time.perf_counter() - t_start, k - n))
                n = k
    res[i] = marks


def load_test(url: str, ctx: int, batch: int, out: int, seed: int) -> dict:
    """``batch`` concurrent streamed requests of ``ctx`` random token ids and ``out`` new tokens.
    Inter-token latencies are the gaps between token arrivals (a gap that brings k tokens counts
    as k gaps of 1/k of it); TTFT is the first arrival, TPOT the rest of the request over its
    ``out - 1`` tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 500) for _ in range(ctx)] for _ in range(batch)]
    res = [None] * batch
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_stream_one, args=(url, prompts[i], out, t0, res, i))
               for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if any(not m for m in res):
        raise RuntimeError("a request returned no tokens")
    itl, ttft, tpot, toks = [], [], [], 0
    for marks in res:
        ttft.append(marks[0][0])
        toks += sum(k for _, k in marks)
        if len(marks) > 1:
            tpot.append((marks[-1][0] - marks[0][0]) / max(sum(k for _, k in marks[1:]), 1))
        for (t_a, _), (t_b, k) in zip(marks, marks[1:]):
            itl += [(t_b - t_a) / k] * k
    ms = lambda xs, q=0.5: 1e3 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else None
    return dict(median_itl_ms=ms(itl), p90_itl_ms=ms(itl, 0.9), median_tpot_ms=ms(tpot),
                median_ttft_ms=ms(ttft), output_tok_s=toks / wall, completed=len(res))


def run_variant(variant: str, model: str, a, workdir: Path) -> list:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"server-{variant}.log"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    t0 = time.time()
    proc = subprocess.Popen(server_cmd(model, port, variant, a), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    rows = []
    try:
        wait_ready(proc, url, log, a.start_timeout)
        print(f"[{variant}] up in {time.time() - t0:.0f} s", flush=True)
        # Warm-up: short requests (first-call JIT and allocator paths).
        load_test(url, 256, max(a.batches), 8, 1)
        for ctx in a.contexts:
            for batch in a.batches:
                before = prr_stats(url)
                t1 = time.time()
                r = load_test(url, ctx, batch, a.out, a.seed + ctx + batch)
                time.sleep(1.5)  # /prr/stats refreshes at most once a second on GPU
                load_test(url, 64, 1, 2, 2)
                after = prr_stats(url)
                label = LABELS[variant] if a.device == "cuda" or variant != "dense" else \
                    "dense (torch_native)"
                rows.append(dict(
                    variant=label, ctx=ctx, batch=batch, out=a.out,
                    median_itl_ms=round(r["median_itl_ms"], 3),
                    p90_itl_ms=round(r["p90_itl_ms"], 3),
                    median_tpot_ms=round(r["median_tpot_ms"], 3),
                    median_ttft_ms=round(r["median_ttft_ms"], 1),
                    output_tok_s=round(r["output_tok_s"], 1),
                    completed=r["completed"],
                    hit_rate=_hit(before, after) if variant == "prr" else None,
                    wall_s=round(time.time() - t1, 1)))
                print(f"[{variant}] ctx={ctx} batch={batch}: ITL {rows[-1]['median_itl_ms']} ms"
                      f", TPOT {rows[-1]['median_tpot_ms']} ms, TTFT "
                      f"{rows[-1]['median_ttft_ms']} ms, hit {rows[-1]['hit_rate']}",
                      flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def _hit(before: dict, after: dict):
    """Hit rate of the decode steps between two /prr/stats snapshots (None without PRR)."""
    if not after or after.get("hit_rate") is None or not after.get("mean_selected_blocks"):
        return None
    def tot(s):
        a = (s.get("mean_selected_blocks") or 0.0) * s.get("sparse_rows", 0)
        m = (s.get("mean_repair_blocks") or 0.0) * s.get("sparse_rows", 0)
        return a, m
    a1, m1 = tot(after)
    a0, m0 = tot(before) if before else (0.0, 0.0)
    return round(1.0 - (m1 - m0) / (a1 - a0), 4) if a1 > a0 else None


def plot(csv_path: str, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(csv_path)))
    keys = sorted({(int(r["ctx"]), int(r["batch"])) for r in rows})
    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(keys), 3.6))
    w = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        ys = [next((float(r["median_itl_ms"]) for r in rows if r["variant"] == n
                    and (int(r["ctx"]), int(r["batch"])) == k), 0.0) for k in keys]
        ax.bar([j + i * w for j in range(len(keys))], ys, w, label=n)
    ax.set_xticks([j + w * (len(names) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"{c // 1024}K / b{b}" for c, b in keys])
    ax.set_ylabel("decode step (median ITL), ms")
    ax.set_title("End to end in SGLang, Llama-3-8B shape")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", type=int, default=256, help="output tokens per request")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2048, help="tokens")
    ap.add_argument("--min-context", type=int, default=4096, help="--prr-min-context")
    ap.add_argument("--layers", type=int, default=LLAMA3_8B["num_hidden_layers"])
    ap.add_argument("--shape", choices=["llama3-8b", "demo"], default="llama3-8b",
                    help="demo: the tiny demo model's shape (CPU smoke runs)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workdir", default=None, help="logs and raw JSON (default: a temp dir)")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "serving.csv"))
    ap.add_argument("--plot-only", metavar="CSV")
    a = ap.parse_args(argv)
    if a.plot_only:
        plot(a.plot_only, os.path.splitext(a.plot_only)[0] + ".png")
        return []
    from sglang_prr import demo

    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="prr-serving-"))
    workdir.mkdir(parents=True, exist_ok=True)
    shape = LLAMA3_8B if a.shape == "llama3-8b" else {}
    model = demo.shaped_model_dir(
        workdir / f"{a.shape}-shape", **{**shape, "num_hidden_layers": a.layers,
                                         "max_position_embeddings": max(a.contexts) + a.out + 64})
    rows = []
    for v in a.variants:
        rows += run_variant(v, model, a, workdir)
        _write(rows, a.csv)  # after each variant: a later failure keeps the earlier rows
    print(f"{'variant':22s} {'ctx':>7s} {'batch':>5s} {'ITL ms':>8s} {'TPOT ms':>8s} "
          f"{'TTFT ms':>9s} {'hit':>6s}")
    for r in rows:
        print(f"{r['variant']:22s} {r['ctx']:7d} {r['batch']:5d} {r['median_itl_ms']:8.2f} "
              f"{r['median_tpot_ms']:8.2f} {r['median_ttft_ms']:9.1f} {str(r['hit_rate']):>6s}")
    if rows:
        plot(a.csv, os.path.splitext(a.csv)[0] + ".png")
    return rows


def _write(rows, path):
    if not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
