"""One question: is decoding faster end to end in SGLang with PRR than with dense attention or
with serial DSA?

Starts ``python -m sglang_prr.launch_server`` once per variant (dense: ``--prr-method dense``,
i.e. SGLang's own FlashInfer attention; serial DSA: ``--prr-serial``; PRR exact; PRR with
``--prr-budget auto`` and the profile of ``--budget-profile``, which decides per batch size
whether to speculate), on a model of
Llama-3-8B's shape with random weights (``--load-format dummy``, the demo's offline tokenizer),
FlashInfer backend, decode in CUDA graphs, page (= PRR block) 64, K = 2048 tokens, delta 1.5,
and sends ``batch`` concurrent streamed requests of ``ctx`` random token ids, ``out`` greedy
output tokens each (ignore-eos). The decode time per step is the median inter-token latency
(ITL), timed per token arrival (``completion_tokens`` of each streamed chunk, not its text:
random weights often decode to empty strings, which is why ``sglang.benchmark.serving``, which
times text, reports no ITL here). With ``out`` much larger than the number of prefill chunks,
most gaps are decode steps of the whole batch. TPOT and TTFT are reported beside it, and the
hit rate from ``/prr/stats``.

The default grid is contexts 32K and 128K x batches 1 and 8 without 128K / batch 8 (its KV
cache and prefill cost more memory and time than one device call has; ``--skip`` with no
value brings it back), plus one dense-only reference row at 4K / batch 1
(``--dense-ref-ctx``). Each server first decodes one request of its longest context, so JIT
compilation and first-use costs stay out of the measured rows.

``--profile``: once every request of a point has its first token (the server is decoding),
``/start_profile`` records the next ``--profile-steps`` forward steps with the torch profiler
(CUPTI sees the kernels of CUDA-graph replays); ``profile_trace.py`` turns the trace into
kernels and GPU-busy time per decode step and per layer (CSV columns), one markdown file of the
top kernels per point and one summary table (``<csv stem>_profile*.md``). The profiler's start
and trace export stall the scheduler inside the measured requests: the median ITL stays a
decode step, TPOT and p90 ITL include the stall.

    python benchmarks/bench_serving.py --profile --csv benchmarks/results/serving_h200.csv
    python benchmarks/bench_serving.py --variants prr --contexts 32768 --batches 8
    python benchmarks/bench_serving.py --variants serial --append --csv ...  # add rows to a CSV
    python benchmarks/bench_serving.py --plot-only benchmarks/results/serving_h200.csv
    python benchmarks/bench_serving.py --device cpu --shape demo --layers 2 --contexts 300 \\
        --batches 1 --out 8 --page 16 --top-k 32 --min-context 64 --dense-ref-ctx 0  # plumbing

Random weights give random attention, so the hit rate here is not a real model's; what this
measures is the cost of each decode path at a real shape.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import signal
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
sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_trace  # noqa: E402
from ports import free_port  # noqa: E402  (ports outside the range SGLang draws its own from)

# Llama-3-8B: 32 layers, 32 query / 8 KV heads of 128, hidden 4096, MLP 14336.
LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 num_hidden_layers=32, intermediate_size=14336, rope_theta=500000.0,
                 torch_dtype="bfloat16")
VARIANTS = {
    "dense": ["--prr-method", "dense"],
    "serial": ["--prr-serial"],
    "prr": [],
    "auto": [],  # --prr-budget auto --prr-profile (--budget-profile), see server_cmd
}
LABELS = {"dense": "dense (FlashInfer)", "serial": "serial DSA", "prr": "PRR (exact)",
          "auto": "PRR auto budget"}
WARMUP_OUT = 4  # output tokens of the warm-up request: prefill plus a few decode graph replays
PROFILE_WAIT_S = 60  # how long a trace may take to appear once the requests are done
COLUMNS = ["variant", "label", "ctx", "batch", "out", "median_itl_ms", "p90_itl_ms",
           "median_tpot_ms", "median_ttft_ms", "output_tok_s", "completed", "hit_rate",
           "kernels_per_step", "gpu_busy_ms_per_step", "kernels_per_layer", "reference",
           "wall_s"]


def _point(text: str) -> tuple:
    """``CTXxBATCH`` (e.g. ``131072x8``) -> ``(ctx, batch)``."""
    try:
        ctx, batch = text.lower().split("x")
        return int(ctx), int(batch)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected CTXxBATCH (e.g. 131072x8), got {text!r}") from None


def plan(a) -> dict:
    """variant -> its points ``(ctx, batch, reference)``, in ascending order.

    The grid is ``contexts x batches`` less ``--skip``; the dense server also measures the
    reference point (``--dense-ref-ctx``, batch 1) unless the grid already holds it.
    """
    skip = set(a.skip)
    grid = [(c, b) for c in a.contexts for b in a.batches if (c, b) not in skip]
    out = {}
    for v in a.variants:
        pts = [(c, b, False) for c, b in grid]
        if v == "dense" and a.dense_ref_ctx and (a.dense_ref_ctx, 1) not in grid:
            pts.append((a.dense_ref_ctx, 1, True))
        out[v] = sorted(pts)
    return out


def server_cmd(model: str, port: int, variant: str, points: list, a) -> list:
    ctx_len = max(c for c, _, _ in points) + a.out + 64
    max_bs = max(b for _, b, _ in points)
    if a.device == "cpu":  # plumbing smoke run: SGLang's CPU path (no graphs, no FlashInfer)
        dev = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
               "--model-impl", "transformers"]
    else:
        dev = ["--attention-backend", "flashinfer", "--sampling-backend", "pytorch",
               "--disable-piecewise-cuda-graph", "--cuda-graph-max-bs", str(max_bs),
               "--mem-fraction-static", str(a.mem_fraction)]
    # --page-size for every variant: the launcher derives it from the block size only with PRR
    # on, and the dense baseline should read the same paged KV layout.
    return [sys.executable, "-m", "sglang_prr.launch_server", "--model-path", model,
            "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
            "--grammar-backend", "none", "--max-running-requests", str(max_bs),
            "--context-length", str(ctx_len), "--random-seed", "0",
            "--skip-server-warmup", "--log-level", "warning", "--page-size", str(a.page),
            "--prr-block-size", str(a.page), "--prr-top-k", str(a.top_k),
            "--prr-top-k-unit", "tokens", "--prr-min-context", str(a.min_context)] + dev + \
        (["--prr-budget", "auto", "--prr-profile", a.budget_profile] if variant == "auto"
         else ["--prr-budget", str(a.budget)]) + VARIANTS[variant]


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


def post_json(url: str, body: dict, timeout: float = 300) -> str:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode(errors="replace")


def _stream_one(url: str, ids: list, out: int, t_start: float, res: list, i: int,
                first: threading.Event) -> None:
    """One streamed greedy request; the arrival time of every chunk that adds tokens. ``first``
    is set at the first token (and on failure, so that nobody waits for it forever)."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": out, "temperature": 0.0,
                                           "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    marks, n = [], 0
    try:
        with urllib.request.urlopen(req, timeout=1800) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                k = json.loads(line[5:])["meta_info"]["completion_tokens"]
                if k > n:  # tokens, not text: random weights often decode to empty strings
                    marks.append((time.perf_counter() - t_start, k - n))
                    n = k
                    if len(marks) == 1:
                        first.set()
    finally:
        first.set()
    res[i] = marks


def load_test(url: str, ctx: int, batch: int, out: int, seed: int, on_decode=None) -> dict:
    """``batch`` concurrent streamed requests of ``ctx`` random token ids and ``out`` new tokens.
    Inter-token latencies are the gaps between token arrivals (a gap that brings k tokens counts
    as k gaps of 1/k of it); TTFT is the first arrival, TPOT the rest of the request over its
    ``out - 1`` tokens. ``on_decode`` runs in a thread of its own once every request has its
    first token: from then on the batch is decoding (prefills of later requests would otherwise
    interleave with the first ones' decode steps)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 500) for _ in range(ctx)] for _ in range(batch)]
    res = [None] * batch
    firsts = [threading.Event() for _ in range(batch)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_stream_one,
                                args=(url, prompts[i], out, t0, res, i, firsts[i]))
               for i in range(batch)]
    if on_decode is not None:
        def fire():
            for e in firsts:
                e.wait()
            on_decode()
        threads.append(threading.Thread(target=fire))
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


class Profile:
    """One ``/start_profile`` of a load test, fired by ``load_test``'s ``on_decode``."""

    def __init__(self, url: str, out_dir: Path, steps: int):
        self.url, self.out_dir, self.steps = url, out_dir, steps
        self.t_start, self.error = None, None

    def start(self) -> None:
        self.t_start = time.time()
        try:
            post_json(self.url + "/start_profile",
                      {"output_dir": str(self.out_dir), "num_steps": self.steps,
                       "activities": ["GPU", "CPU"]})
        except Exception as e:  # noqa: BLE001 - a failed profile must not fail the timing
            self.error = f"{type(e).__name__}: {e}"

    def summary(self, num_layers: int):
        """The trace's ``profile_trace.summarize`` dict, or None (printed why)."""
        if self.t_start is None or self.error:
            print(f"  profile not started: {self.error or 'no first token'}", flush=True)
            return None
        path = newest_trace(self.out_dir, self.t_start - 1, PROFILE_WAIT_S)
        if path is None:
            # Still recording (fewer forward steps than asked): stop it so that the next
            # point can profile, and drop the partial trace, which has fewer than N steps.
            try:
                post_json(self.url + "/stop_profile", {})
            except Exception:  # noqa: BLE001 - it may have finished meanwhile
                pass
            print(f"  no trace under {self.out_dir} after {PROFILE_WAIT_S} s", flush=True)
            return None
        try:
            s = profile_trace.summarize(path, num_layers, self.steps)
        except (OSError, EOFError, ValueError, KeyError) as e:
            print(f"  unreadable trace {path}: {e}", flush=True)
            return None
        s["trace"] = str(path)
        decode = sum(n for name, n in s["step_spans"].items() if "DECODE" in name)
        if s["step_spans"] and decode != self.steps:
            print(f"  the trace holds {s['step_spans']}, not {self.steps} decode steps",
                  flush=True)
        return s


def newest_trace(root: Path, since: float, timeout: float):
    """The newest ``*.trace.json.gz`` under ``root`` modified after ``since``, once its size
    holds still for a poll (the export gzips as it writes); None after ``timeout`` s."""
    deadline, seen = time.time() + timeout, None
    while True:
        found = [(p.stat().st_mtime, p) for p in root.rglob("*.trace.json.gz")
                 if p.stat().st_mtime >= since]
        if found:
            path = max(found)[1]
            size = path.stat().st_size
            if size and seen == (path, size):
                return path
            seen = (path, size)
        if time.time() > deadline:
            return None
        time.sleep(1)


def run_variant(variant: str, points: list, model: str, a, workdir: Path):
    """Start the variant's server, warm it up and yield one CSV row per point."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"server-{variant}.log"
    prof_dir = workdir / f"profile-{variant}"
    prof_dir.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               SGLANG_TORCH_PROFILER_DIR=str(prof_dir))
    t0 = time.time()
    proc = subprocess.Popen(server_cmd(model, port, variant, points, a), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    label = LABELS[variant] if a.device == "cuda" or variant != "dense" else \
        "dense (torch_native)"
    try:
        wait_ready(proc, url, log, a.start_timeout)
        print(f"[{variant}] up in {time.time() - t0:.0f} s", flush=True)
        t1 = time.time()
        longest = max(c for c, _, _ in points)
        load_test(url, longest, 1, WARMUP_OUT, 1)
        print(f"[{variant}] warm-up ({longest} tokens) {time.time() - t1:.0f} s", flush=True)
        for ctx, batch, reference in points:
            before = prr_stats(url)
            t1 = time.time()
            prof = Profile(url, prof_dir, a.profile_steps) if a.profile else None
            r = load_test(url, ctx, batch, a.out, a.seed + ctx + batch,
                          on_decode=prof.start if prof else None)
            # The trace before the next request: a profile still short of its steps would
            # otherwise record that request's steps too.
            s = prof.summary(a.layers) if prof else None
            time.sleep(1.5)  # /prr/stats refreshes at most once a second on GPU
            load_test(url, 64, 1, 2, 2)
            after = prr_stats(url)
            row = dict(
                variant=variant, label=label, ctx=ctx, batch=batch, out=a.out,
                median_itl_ms=round(r["median_itl_ms"], 3),
                p90_itl_ms=round(r["p90_itl_ms"], 3),
                median_tpot_ms=round(r["median_tpot_ms"], 3),
                median_ttft_ms=round(r["median_ttft_ms"], 1),
                output_tok_s=round(r["output_tok_s"], 1),
                completed=r["completed"],
                hit_rate=_hit(before, after) if variant in ("prr", "auto") else None,
                kernels_per_step=round(s["kernels_per_step"], 2) if s else None,
                gpu_busy_ms_per_step=round(s["gpu_busy_ms_per_step"], 4) if s else None,
                kernels_per_layer=round(s["kernels_per_layer"], 3) if s else None,
                reference=int(reference),
                wall_s=round(time.time() - t1, 1))
            if s:
                md = _profile_path(a.csv, f"_{variant}_{ctx}_{batch}")
                md.write_text(profile_trace.markdown(
                    s, f"{label}, ctx {ctx}, batch {batch} ({Path(s['trace']).name})"))
            print(f"[{variant}] ctx={ctx} batch={batch}: ITL {row['median_itl_ms']} ms, TPOT "
                  f"{row['median_tpot_ms']} ms, TTFT {row['median_ttft_ms']} ms, hit "
                  f"{row['hit_rate']}, kernels/step {row['kernels_per_step']}, GPU-busy ms/step "
                  f"{row['gpu_busy_ms_per_step']}", flush=True)
            yield row
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


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


def _profile_path(csv_path: str, suffix: str = "") -> Path:
    """``<csv stem>_profile<suffix>.md`` next to the CSV."""
    p = Path(csv_path)
    return p.with_name(f"{p.stem}_profile{suffix}.md")


def _ctx(c: int) -> str:
    return f"{c // 1024}K" if c >= 1024 else str(c)


def plot(csv_path: str, png: str) -> None:
    """Median ITL bars per (ctx, batch) and variant; reference rows as horizontal lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(csv_path)))
    refs = [r for r in rows if r.get("reference") == "1"]
    bars = [r for r in rows if r.get("reference") != "1"]
    name = lambda r: r.get("label") or r["variant"]  # CSVs before the label column: variant
    keys = sorted({(int(r["ctx"]), int(r["batch"])) for r in bars})
    names = list(dict.fromkeys(name(r) for r in bars))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * max(len(keys), 2), 3.6))
    w = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        ys = [next((float(r["median_itl_ms"]) for r in bars if name(r) == n
                    and (int(r["ctx"]), int(r["batch"])) == k), 0.0) for k in keys]
        ax.bar([j + i * w for j in range(len(keys))], ys, w, label=n)
    for r in refs:
        ax.axhline(float(r["median_itl_ms"]), ls="--", lw=1, color="0.35",
                   label=f"{name(r)}, {_ctx(int(r['ctx']))} / b{r['batch']} (reference)")
    ax.set_xticks([j + w * (len(names) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"{_ctx(c)} / b{b}" for c, b in keys])
    ax.set_ylabel("decode step (median ITL), ms")
    ax.set_title("End to end in SGLang, Llama-3-8B shape")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--skip", type=_point, nargs="*", default=[(131072, 8)], metavar="CTXxBATCH",
                    help="grid points left out (default: 131072x8; give --skip alone to run "
                         "every point)")
    ap.add_argument("--dense-ref-ctx", type=int, default=4096,
                    help="also run dense alone at this context, batch 1, as a reference row "
                         "(0: no reference row)")
    ap.add_argument("--out", type=int, default=128, help="output tokens per request")
    ap.add_argument("--page", type=int, default=64, help="KV page = PRR block, tokens")
    ap.add_argument("--top-k", type=int, default=2048, help="K, tokens")
    ap.add_argument("--budget", default="1.5", help="--prr-budget (delta) of the prr variant")
    ap.add_argument("--budget-profile", default=str(ROOT / "benchmarks" / "results" /
                                                    "budget_profile_h200.json"),
                    help="--prr-profile of the auto variant (python -m "
                         "sglang_prr.profile_budget)")
    ap.add_argument("--min-context", type=int, default=4096, help="--prr-min-context")
    ap.add_argument("--layers", type=int, default=LLAMA3_8B["num_hidden_layers"])
    ap.add_argument("--shape", choices=["llama3-8b", "demo"], default="llama3-8b",
                    help="demo: the tiny demo model's shape (CPU smoke runs)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--profile", action="store_true",
                    help="profile --profile-steps decode steps of every point (see above)")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--workdir", default=None,
                    help="server logs and profiler traces (default: a temp dir)")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "serving.csv"))
    ap.add_argument("--append", action="store_true",
                    help="keep the CSV's rows (a new row replaces one of the same variant, ctx "
                         "and batch): one table from several invocations")
    ap.add_argument("--plot-only", metavar="CSV")
    a = ap.parse_args(argv)
    if a.plot_only:
        plot(a.plot_only, os.path.splitext(a.plot_only)[0] + ".png")
        return []
    if "auto" in a.variants and not os.path.exists(a.budget_profile):
        ap.error(f"the auto variant needs its budget profile {a.budget_profile!r}: make it with "
                 f"python -m sglang_prr.profile_budget (or leave auto out of --variants)")
    from sglang_prr import demo

    # `timeout` sends SIGTERM: exit through the finally blocks, which stop the server (a server
    # left running would hold the GPU memory the next invocation needs).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_run = time.time()
    points = plan(a)
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="prr-serving-"))
    workdir.mkdir(parents=True, exist_ok=True)
    shape = LLAMA3_8B if a.shape == "llama3-8b" else {}
    longest = max(c for pts in points.values() for c, _, _ in pts) if any(points.values()) \
        else 0
    model = demo.shaped_model_dir(
        workdir / f"{a.shape}-shape", **{**shape, "num_hidden_layers": a.layers,
                                         "max_position_embeddings": longest + a.out + 64})
    kept = _read(a.csv) if a.append else []
    rows = []
    for v in a.variants:
        if not points[v]:
            print(f"[{v}] no points left (--skip)", flush=True)
            continue
        t_v = time.time()
        for row in run_variant(v, points[v], model, a, workdir):
            rows.append(row)
            # After each point: a later failure or timeout keeps the rows so far.
            _write(_merge(kept, rows), a.csv)
            if a.profile:
                _write_profile_table(a.csv)
        print(f"[{v}] server total {time.time() - t_v:.0f} s", flush=True)
    print(f"{'variant':8s} {'ctx':>7s} {'batch':>5s} {'ITL ms':>8s} {'TPOT ms':>8s} "
          f"{'TTFT ms':>9s} {'hit':>6s} {'kern/step':>9s} {'busy ms':>8s}")
    for r in rows:
        print(f"{r['variant']:8s} {r['ctx']:7d} {r['batch']:5d} {r['median_itl_ms']:8.2f} "
              f"{r['median_tpot_ms']:8.2f} {r['median_ttft_ms']:9.1f} {str(r['hit_rate']):>6s} "
              f"{str(r['kernels_per_step']):>9s} {str(r['gpu_busy_ms_per_step']):>8s}")
    if rows:
        plot(a.csv, os.path.splitext(a.csv)[0] + ".png")
    print(f"total runtime {time.time() - t_run:.0f} s (workdir {workdir})", flush=True)
    return rows


def _read(path) -> list:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _merge(old: list, new: list) -> list:
    """``old`` rows without those that ``new`` measures again (same variant, ctx, batch), then
    ``new``."""
    key = lambda r: (str(r["variant"]), int(r["ctx"]), int(r["batch"]))
    again = {key(r) for r in new}
    return [r for r in old if key(r) not in again] + new


def _write(rows, path):
    if not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    extra = [k for r in rows for k in r if k not in COLUMNS]  # columns of older CSVs
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS + list(dict.fromkeys(extra)), restval="")
        w.writeheader()
        w.writerows(rows)


def _write_profile_table(csv_path: str) -> None:
    """``<csv stem>_profile.md``: the profiled rows of the whole CSV (appended runs too)."""
    rows = [r for r in _read(csv_path) if r.get("kernels_per_step")]
    lines = ["| variant | ctx | batch | kernels/step | kernels/layer | GPU-busy ms/step | "
             "median ITL ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['ctx']} | {r['batch']} | {r['kernels_per_step']} | "
              f"{r['kernels_per_layer']} | {r['gpu_busy_ms_per_step']} | {r['median_itl_ms']} |"
              for r in rows]
    _profile_path(csv_path).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
