"""``python -m sglang_prr.profile_budget``: the latency profile that ``--prr-budget auto`` reads.

For one layer shape (from ``--model-path`` or explicit head counts) it times one decoder layer
of the decode step, in CUDA graphs, over a grid of contexts x batch sizes x speculation budgets
delta (0 = serial DSA: no P, no side stream), and writes the profile JSON (``budget.py`` has the
format) and a table of each delta relative to serial DSA with the policy's choice per batch size.

What one timed layer holds, per batch row: the sparse decode step (``step.DecodeStep``: summary
and selection, attention over A; with delta > 0 the speculative pass over P beside the
selection, the repair with its exact merge, and the predictor step on the side stream) between
GEMMs of the layer's projections and MLP (``--hidden-size``/``--intermediate-size``; 0 leaves
them out), so that the predictor overlaps the rest of the layer as it does in the server.
``--layers`` such layers are captured in one graph (the side stream joins after the last) and
the replay time is divided by them.

The prediction's quality is held fixed at ``--hit-rate`` (of the selection's middle blocks when
|P| = K): the predictor state is the rank of each block's true score plus noise of a spread found
by bisection, with theta = 0 so that the state, and so P, stays the same over the replays. A
larger delta then covers more of A, as it does with a real predictor. ``--hit-rate real`` (the
default): the server's predictor (calibrated theta*) on the SmolLM2 block-score traces of
``--real-traces`` (``trace_replay.real_hit_rate``, 0.831; random weights give 0.62-0.72, 0.7 was
the old default). ``--compare-hit-rate`` (0.7; ``none``: off) times the speculative deltas at
that rate too: its table and choices are printed beside, kept in the profile's ``compare`` entry.
With the layer's GEMMs (``--hidden-size`` > 0) the L2 is cold by construction: over 400 MB of
weights per Llama-3-8B layer stream through it between two steps, as in the server. Each point
also times the layer with dense attention (``dense_decode``: FlashInfer's decode as SGLang runs
it; ``--no-dense`` skips it), so ``--prr-budget auto`` can run dense where it is faster.

    python -m sglang_prr.profile_budget --model-path meta-llama/Meta-Llama-3-8B \\
        --prr-top-k 2048 --prr-top-k-unit tokens --out profile_h200.json
    python -m sglang_prr.profile_budget --num-qo-heads 32 --num-kv-heads 8 --head-dim 128 \\
        --contexts 32768,131072 --batch-sizes 1,8 --out p.json
    python -m sglang_prr.profile_budget --device cpu --num-qo-heads 4 --num-kv-heads 2 \\
        --head-dim 16 --hidden-size 0 --prr-block-size 16 --prr-top-k 4 --prr-top-k-unit blocks \\
        --contexts 256 --batch-sizes 1,2 --deltas 0,1,2 --out p.json   # plumbing, eager on CPU

Every flag of the server's ``--prr-*`` family is accepted (method, K, block size, kept blocks,
max budget); the profile records the shape it was measured for and the server refuses a profile
of another shape. It records the summaries' dtypes too (InfLLM-v2's compressed keys follow
``SGLANG_PRR_INFLLM_CK``), and a server that stores others logs a warning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import contracts, ops, summaries
from ..budget import DEFAULT_DELTAS, PROFILE_VERSION, BudgetProfile, layer_shape
from ..config import PRRConfig
from ..flags import add_prr_args, pop_prr_args
from ..step import DecodeStep, LayerState
from . import trace_replay
from .dense_decode import dense_decode
from .profile_report import progress as _progress, table


def _ints(text: str) -> List[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return sorted(set(vals))


def _hit_rate(text: str):
    """A hit rate in 0..1, ``real`` (measured on the real traces at run time) or ``none``."""
    if text in ("real", "none"):
        return None if text == "none" else text
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text}: allowed 0..1 or 'real'")
    return v


def _deltas(text: str) -> List[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    bad = [v for v in vals if not (v == 0.0 or (v >= 1.0 and math.isfinite(v)))]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"deltas are 0 (serial DSA) or finite numbers >= 1, "
                                         f"got {text!r}")
    return sorted(set(vals) | {0.0})  # serial DSA is every point's baseline


def parse_args(argv: Optional[Sequence[str]] = None):
    ap = argparse.ArgumentParser(prog="python -m sglang_prr.profile_budget",
                                 description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="HF model folder (config.json) for the layer shape")
    ap.add_argument("--num-qo-heads", type=int)
    ap.add_argument("--num-kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--hidden-size", type=int, help="GEMMs around the step (0: none)")
    ap.add_argument("--intermediate-size", type=int)
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size: per-rank heads")
    ap.add_argument("--contexts", type=_ints, default=[8192, 32768, 131072])
    ap.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32],
                    help="the decode batch sizes the server captures graphs for")
    ap.add_argument("--deltas", type=_deltas, default=list(DEFAULT_DELTAS))
    ap.add_argument("--hit-rate", type=_hit_rate, default="real",
                    help="the prediction's hit rate at |P| = K (0..1), or 'real': measured on "
                         "the real traces (--real-traces)")
    ap.add_argument("--real-traces", default=trace_replay.REAL_TRACES,
                    help="block-score traces of a real model for --hit-rate real")
    ap.add_argument("--compare-hit-rate", type=_hit_rate, default=trace_replay.SYNTHETIC_HIT_RATE,
                    help="also time the speculative deltas at this hit rate and show its "
                         "choices beside the others ('none': skip)")
    ap.add_argument("--no-dense", dest="dense", action="store_false",
                    help="skip the dense-attention timing of each point (then auto never runs "
                         "dense)")
    ap.add_argument("--layers", type=int, default=4, help="layers per captured graph")
    ap.add_argument("--iters", type=int, default=20, help="replays per timing")
    ap.add_argument("--repeats", type=int, default=5, help="timings per point (median)")
    ap.add_argument("--max-tokens", type=int, default=1 << 21,
                    help="KV tokens allocated per point; rows beyond share pages")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="profile JSON to write")
    add_prr_args(ap)
    a = ap.parse_args(argv)
    try:
        a.cfg = PRRConfig(**pop_prr_args(a)).validate()
    except ValueError as e:
        ap.error(str(e))
    if a.cfg.method == "dense":
        ap.error("--prr-method dense has nothing to profile: give quest or infllm_v2")
    for name in ("layers", "iters", "repeats", "max_tokens", "tp"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(a, name)}: allowed >= 1")
    max_d = a.cfg.max_budget
    if any(d > max_d for d in a.deltas):
        ap.error(f"--deltas {a.deltas}: above --prr-max-budget {max_d} (the server's P width)")
    _resolve_shape(a, ap)
    return a


def _resolve_shape(a, ap) -> None:
    """Head counts and GEMM sizes from ``--model-path``'s config.json, explicit flags winning."""
    conf = {}
    if a.model_path:
        path = os.path.join(a.model_path, "config.json")
        try:
            with open(path) as f:
                conf = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"--model-path {a.model_path!r}: cannot read {path}: {e}")
        conf = conf.get("text_config", conf)
    heads = conf.get("num_attention_heads")
    pick = lambda v, *ks: v if v is not None else next((conf[k] for k in ks if k in conf), None)
    a.num_qo_heads = pick(a.num_qo_heads, "num_attention_heads")
    a.num_kv_heads = pick(a.num_kv_heads, "num_key_value_heads", "num_attention_heads")
    if a.head_dim is None:
        a.head_dim = conf.get("head_dim") or (conf["hidden_size"] // heads
                                              if heads and "hidden_size" in conf else None)
    a.hidden_size = pick(a.hidden_size, "hidden_size")
    a.intermediate_size = pick(a.intermediate_size, "intermediate_size")
    missing = [n for n in ("num_qo_heads", "num_kv_heads", "head_dim") if getattr(a, n) is None]
    if missing:
        ap.error("the layer shape needs --model-path or " +
                 ", ".join("--" + n.replace("_", "-") for n in missing))
    if a.num_qo_heads % a.tp or a.num_kv_heads % a.tp or a.num_qo_heads % a.num_kv_heads:
        ap.error(f"heads {a.num_qo_heads} q / {a.num_kv_heads} KV: KV heads must divide q "
                 f"heads, and --tp {a.tp} both")
    a.num_qo_heads //= a.tp
    a.num_kv_heads //= a.tp
    a.hidden_size = a.hidden_size or 0
    a.intermediate_size = a.intermediate_size or 4 * a.hidden_size


# ----------------------------------------------------------------------------- one point
class _Point:
    """KV pool, summaries, queries and per-layer predictor state of one (context, batch)."""

    def __init__(self, a, ctx: int, batch: int):
        cfg, dev = a.cfg, torch.device(a.device)
        dtype = getattr(torch, a.dtype)
        g = torch.Generator(device=dev).manual_seed(a.seed + 7919 * ctx + batch)
        page, Hq, Hk, D = cfg.block_size, a.num_qo_heads, a.num_kv_heads, a.head_dim
        self.ctx, self.batch, self.page = ctx, batch, page
        nb = -(-ctx // page)
        width = nb + 1  # room for the next step's block
        pool_pages = 1 + min(batch * width, max(width, -(-a.max_tokens // page)))
        # Row r owns pages 1 + ((r * width + j) mod (pool_pages - 1)): rows share pages only past
        # --max-tokens; page 0 is SGLang's padding page.
        j = torch.arange(width, device=dev)
        pages = torch.stack([1 + (r * width + j) % (pool_pages - 1) for r in range(batch)])
        slots = (pages[:, :, None] * page + torch.arange(page, device=dev)).view(batch, -1)
        self.req_to_token = torch.cat([torch.zeros_like(slots[:1]), slots]).int()
        self.rows = torch.arange(1, batch + 1, device=dev)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        n_slots = pool_pages * page
        self.k_buf = torch.randn(n_slots, Hk, D, generator=g, device=dev, dtype=dtype)
        self.v_buf = torch.randn(n_slots, Hk, D, generator=g, device=dev, dtype=dtype)
        self.summary = summaries.from_keys(cfg.method, self.k_buf.view(pool_pages, page, Hk, D))
        self.q = torch.randn(batch, Hq, D, generator=g, device=dev, dtype=dtype)
        self.scale = 1.0 / math.sqrt(D)
        self.g = g

    def state(self, a, layers: int, n_pred_width: int, step: DecodeStep,
              hit_rate: float) -> List[LayerState]:
        """Per-layer predictor state whose P hits ``hit_rate`` of A's middle blocks at |P| = K
        and stays fixed over replays (theta = 0: level + 0 * trend, no update)."""
        cfg, dev = a.cfg, self.q.device
        b = step.plan(self.req_to_token, self.rows, self.seq_lens)
        scores = ops.select_blocks(cfg.method, self.q, self.summary, b.table, b.seq_lens,
                                   self.page, self.scale).float()  # [B, Hk, NB]
        level = _levels_for_hit(scores, b.nblk, cfg.top_k_blocks, cfg.sink_blocks,
                                cfg.local_blocks, hit_rate, self.g)
        R, (B, Hk, NB) = self.batch + 1, level.shape
        out = []
        for _ in range(layers):
            lv = torch.zeros(R, Hk, NB, device=dev)
            lv[1:] = level
            # P is double-buffered (rows 2r, 2r + 1), like PRRState's.
            p_idx = torch.full((2 * R, Hk, n_pred_width + cfg.sink_blocks + cfg.local_blocks),
                               -1, dtype=torch.int32, device=dev)
            p_cnt = torch.zeros(2 * R, Hk, dtype=torch.int32, device=dev)
            n_init = torch.zeros(R, dtype=torch.long, device=dev)
            n_init[1:] = b.nblk
            theta = torch.zeros(R, 3, device=dev)
            st = LayerState(p_idx, p_cnt, lv, torch.zeros_like(lv), n_init, theta)
            if step.n_pred:
                # P(t) for the first replay, in both halves: what the predictor writes from this
                # state (theta = 0 keeps writing it).
                for half in (0, 1):
                    ops.predict_update_rows(st.level, st.trend, st.n_init, st.p_idx, st.p_cnt,
                                            st.theta, b.rows, scores, b.nblk, b.nblk_next,
                                            step.n_pred, cfg.sink_blocks, cfg.local_blocks,
                                            p_rows=2 * b.rows.long() + half)
            out.append(st)
        return out


def _levels_for_hit(scores, nblk, k: int, sink: int, local: int, hit: float, g) -> torch.Tensor:
    """Predictor levels ``[B, Hk, NB]``: the rank of each middle block's score plus Gaussian
    noise, its spread bisected so that the top-K of the levels holds ``hit`` of the top-K of the
    scores (averaged over rows and heads)."""
    B, Hk, NB = scores.shape
    ids = torch.arange(NB, device=scores.device)
    nb = nblk.view(B, 1, 1).to(ids.dtype)
    middle = (ids >= sink) & (ids < nb - local)
    kk = max(1, min(k, int(middle.sum(-1).min())))
    neg = torch.tensor(float("-inf"), device=scores.device)
    sc = torch.where(middle, scores, neg)
    rank = sc.argsort(-1).argsort(-1).float() / NB
    truth = torch.zeros_like(sc, dtype=torch.bool).scatter_(-1, sc.topk(kk, -1).indices, True)
    noise = torch.randn(sc.shape, generator=g, device=sc.device)

    def level(sig):
        return torch.where(middle, rank + sig * noise, neg)

    def rate(sig):
        top = level(sig).topk(kk, -1).indices
        return float(truth.gather(-1, top).float().mean())

    lo, hi = 0.0, 8.0
    for _ in range(24):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rate(mid) > hit else (lo, mid)
    return torch.where(middle, rank + 0.5 * (lo + hi) * noise, torch.zeros_like(rank))


# ----------------------------------------------------------------------------- timing
def _gemms(a, batch: int, dev, dtype):
    """The layer's projections and MLP around the attention step (None without hidden size)."""
    if not a.hidden_size:
        return None
    H, I, D = a.hidden_size, a.intermediate_size, a.head_dim
    Hq, Hk = a.num_qo_heads, a.num_kv_heads
    mk = lambda *s: torch.randn(*s, device=dev, dtype=dtype) * 0.02
    w = dict(qkv=mk(H, (Hq + 2 * Hk) * D), o=mk(Hq * D, H), gu=mk(H, 2 * I), d=mk(I, H))
    x = torch.randn(batch, H, device=dev, dtype=dtype)

    def before():
        return x @ w["qkv"]

    def after(o):
        h = o.reshape(batch, -1) @ w["o"]
        gu = h @ w["gu"]
        x.copy_((torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ w["d"])

    return before, after


def time_point(a, pt: _Point, delta: float, hit_rate: Optional[float] = None,
               dense=None) -> float:
    """Microseconds per layer of the decode step at budget ``delta`` (0: serial DSA), the
    prediction holding ``hit_rate`` (default ``a.hit_rate``); with ``dense`` (``attend(q)``,
    ``dense_decode``) the same layer with dense attention instead of the step."""
    cfg, dev = a.cfg, pt.q.device
    serial = delta == 0.0
    n_pred = 0 if serial else cfg.predicted_blocks_for(delta)
    step = DecodeStep(cfg.method, cfg.top_k_blocks, max(n_pred, cfg.top_k_blocks),
                      cfg.sink_blocks, cfg.local_blocks, pt.page, cfg.min_context,
                      exact=cfg.mode == "exact", serial=serial, device=dev,
                      fuse_predictor=cfg.predictor == "fused")
    hit = a.hit_rate if hit_rate is None else hit_rate
    states = pt.state(a, a.layers, step.n_pred, step, hit) if not serial else [None] * a.layers
    stats = contracts.new_stats(dev)
    k_buf, v_buf, dtype = pt.k_buf, pt.v_buf, pt.q.dtype
    gem = _gemms(a, pt.batch, dev, dtype)

    def forward():
        batch = None if dense else step.plan(pt.req_to_token, pt.rows, pt.seq_lens)
        for i, st in enumerate(states):
            if gem:
                gem[0]()
            o = dense(pt.q) if dense else step.run(pt.q, k_buf, v_buf, pt.summary, batch, st,
                                                   stats, pt.scale, dtype,
                                                   join=i == len(states) - 1)
            if gem:
                gem[1](o)

    if dev.type != "cuda":  # plumbing: eager, wall clock
        forward()
        t = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for _ in range(a.iters):
                forward()
            t.append((time.perf_counter() - t0) / (a.iters * a.layers) * 1e6)
        return statistics.median(t)
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up outside the capture (kernel loads, allocator)
            forward()
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(a.repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(a.iters):
            graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / (a.iters * a.layers))
    del graph
    return statistics.median(times)


# ----------------------------------------------------------------------------- main
def measure(a) -> BudgetProfile:
    """The profile at ``a.hit_rate``; with ``a.compare_hit_rate`` its speculative deltas are
    timed at that rate too (serial DSA predicts nothing: its time is shared), kept in the
    profile's ``compare`` entry (``BudgetProfile.compared`` reads it back)."""
    cfg = a.cfg
    compare = getattr(a, "compare_hit_rate", None)
    points = [(c, b) for c in a.contexts for b in a.batch_sizes]
    per_point = len(a.deltas) + (sum(1 for d in a.deltas if d) if compare is not None else 0)
    total = len(points) * (per_point + int(a.dense))
    us: Dict[tuple, float] = {}
    us_cmp: Dict[tuple, float] = {}
    dense_us: Dict[tuple, float] = {}
    done, t0 = 0, time.time()
    for ctx, batch in points:
        pt = _Point(a, ctx, batch)
        runs = [(d, None) for d in a.deltas]
        runs += [(d, compare) for d in a.deltas if d and compare is not None]
        for d, hit in runs:
            t = time_point(a, pt, d, hit)
            (us if hit is None else us_cmp)[(batch, ctx, d)] = t
            done += 1
            _progress(done, total, t0, f"ctx {ctx} batch {batch} delta {d:g}"
                      + (f" hit {hit:g}" if hit is not None else "") + f": {t:.1f} us/layer")
        attend = a.dense and dense_decode(pt.q, pt.k_buf, pt.v_buf, pt.req_to_token, pt.rows,
                                          pt.seq_lens, pt.page, pt.scale)
        if attend:
            dense_us[(batch, ctx)] = t = time_point(a, pt, 0.0, dense=attend)
            _progress(done + 1, total, t0, f"ctx {ctx} batch {batch} dense: {t:.1f} us/layer")
        done += int(a.dense)
        del pt
        if torch.device(a.device).type == "cuda":
            torch.cuda.empty_cache()
    print(file=sys.stderr)
    gpu = (torch.cuda.get_device_name(torch.device(a.device))
           if torch.device(a.device).type == "cuda" else "cpu")
    shape = layer_shape(cfg, cfg.block_size, a.head_dim, a.num_kv_heads, a.num_qo_heads)
    meta = dict(gpu=gpu, hit_rate=a.hit_rate,
                hit_rate_source=getattr(a, "hit_rate_source", "given"), layers=a.layers,
                hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, tp=a.tp,
                dtype=a.dtype, sink_blocks=cfg.sink_blocks, local_blocks=cfg.local_blocks,
                max_budget=cfg.max_budget, mode=cfg.mode, predictor=cfg.predictor,
                command="python -m sglang_prr.profile_budget " + " ".join(sys.argv[1:]),
                measured=time.strftime("%Y-%m-%d %H:%M:%S"), version=PROFILE_VERSION)
    if us_cmp:
        meta["compare"] = {
            "hit_rate": compare,
            "layer_us": [{"batch": b, "context": c, "delta": d, "us": round(t, 3)}
                         for (b, c, d), t in sorted(us_cmp.items())]}
    return BudgetProfile(shape, us, meta, dense_us)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    if torch.device(a.device).type == "cuda":
        if not torch.cuda.is_available():
            print("profile_budget: no CUDA device; the profile must be measured on the serving "
                  "GPU (--device cpu only checks the plumbing)", file=sys.stderr)
            return 2
        from .. import kernels

        kernels.load()
    a.hit_rate, a.hit_rate_source = trace_replay.profile_hit_rate(a.hit_rate, a.real_traces)
    print(f"hit rate {a.hit_rate} ({a.hit_rate_source})"
          + (f"; compared with {a.compare_hit_rate}" if a.compare_hit_rate is not None else ""),
          flush=True)
    prof = measure(a)
    prof.save(a.out)
    print(table(prof, a.cfg.max_budget))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
