"""Block-score traces: the file format, the server-side recorder, synthetic families, replay.

The PRR speedup depends on how well the predictor guesses the selected set ``A`` from the history
of block scores. This module holds everything needed to measure that on real or synthetic data.

Trace file format (version 1)
-----------------------------
A trace is a directory with one ``.npz`` file per request (``np.load(path, allow_pickle=False)``
reads it; nothing in it is pickled). Arrays:

* ``scores``: ``[steps, L, Hk, NB] float32``, the block scores ``IS`` of decode step ``s``, traced
  layer ``l`` (the ``l``-th entry of ``layers``), KV head ``h`` over the request's blocks, exactly
  as the selection saw them (Quest: summed upper bounds of the GQA group's logits; InfLLM-v2:
  max-pooled softmax mass). Entries at or past ``nblk[s]`` are ``-inf``.
* ``nblk``: ``[steps] int32``, blocks of the request at each step (``ceil(seq_len / block_size)``,
  the newest block is partial). Non-decreasing in a decode trace.
* ``layers``: ``[L] int32``, the model layer ids that were traced.
* ``meta``: a 0-d unicode array holding a JSON object with at least ``format``
  (``"sglang_prr.trace"``), ``version`` (1), ``rid``, ``method`` (quest | infllm_v2 | synthetic),
  ``block_size``, ``num_kv_heads``, ``source`` (``server`` or ``synthetic:<family>``); synthetic
  traces add ``family``, ``seed`` and ``params``; server traces add ``sink_blocks`` /
  ``local_blocks`` / ``top_k_blocks`` of the recording config.

The server records such files with ``--prr-trace-path DIR`` (plus ``--prr-trace-layers``,
``--prr-trace-max-steps``, ``--prr-trace-max-requests``) through ``TraceRecorder``; tracing copies
scores to the host every step, so it is a diagnostic mode that requires ``--disable-cuda-graph``.
``benchmarks/bench_predictor.py --trace DIR`` measures the predictor's hit rates on it.

Synthetic families
------------------
``generate(family, ...)`` draws a one-layer trace whose scores are, on a logit-like scale,
``IS[t, h, b] = base[t, h, b] + structure[t, h, b] + noise * e[t, h, b]``:

* ``base``: a per-block relevance field ``N(0, base^2)`` that drifts as an Ornstein-Uhlenbeck
  process (per-step correlation ``1 - base_drift``): the slow content drift of a real context;
* ``e``: per-step query fluctuation, unit variance, AR(1) in time with correlation ``rho``
  (default 0: independent from step to step; ``rho > 0`` makes consecutive fluctuations alike,
  which helps reuse-previous and shrinks what smoothing can gain);
* ``structure``: what the family is about (see ``FAMILIES``):

  - ``sink_local``: attention sink + local window, ``local_amp * exp(-age / window)`` on the
    newest blocks (age in blocks from the newest) plus ``sink_amp`` on the first ``sink_width``;
  - ``retrieval``: ``n_hot`` retrieval blocks per head at ``hot_amp``, each hopping to a new
    random block with probability ``hop`` per step (slow drift of *which* blocks matter);
  - ``topic_switch``: a hot set of ``n_hot`` blocks redrawn at random switch times (mean dwell
    ``dwell`` steps): abrupt changes;
  - ``periodic``: ``n_topics`` hot sets visited round-robin for ``dwell`` steps each, so each is
    revisited every ``n_topics * dwell`` steps (reasoning-style revisits);
  - ``noise``: no structure, i.i.d. scores each step (``base = 0``, ``rho = 0``): the adversarial
    floor, where any predictor overlaps ``A`` by about ``K / (middle blocks)``.

The structured families share one noise level, ``FIT_NOISE``, fitted on ``retrieval`` so that
"reuse the previous selection" overlaps 68% of ``A`` step to step (the paper's average); see
``fit_noise``, which bisects ``noise`` with the same replay (``replay``) the benchmark uses.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from . import ops
from . import reference as ref
from .config import PRRConfig, PRRConfigError

FORMAT = "sglang_prr.trace"
VERSION = 1

# ----------------------------------------------------------------------------- the format


@dataclass
class Trace:
    """One request's per-step block scores (numpy, host memory).

    scores: ``[steps, L, Hk, NB] float32`` (``-inf`` at or past ``nblk``); nblk: ``[steps]
    int32``; layers: the ``L`` traced layer ids; meta: the JSON metadata (see module docstring).
    """

    scores: np.ndarray
    nblk: np.ndarray
    layers: Tuple[int, ...]
    meta: Dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return int(self.scores.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.scores.shape[2])

    @property
    def num_blocks(self) -> int:
        return int(self.scores.shape[3])

    @property
    def rid(self) -> str:
        return str(self.meta.get("rid", ""))

    def validate(self) -> "Trace":
        """Check shapes and ranges; raise ValueError naming the bad value and the allowed one."""
        s, n = self.scores, self.nblk
        if s.ndim != 4:
            raise ValueError(f"trace scores must be [steps, layers, Hk, NB], got shape {s.shape}")
        if s.dtype != np.float32:
            raise ValueError(f"trace scores must be float32, got {s.dtype}")
        if n.shape != (s.shape[0],):
            raise ValueError(f"trace nblk must be [steps]=[{s.shape[0]}], got shape {n.shape}")
        if len(self.layers) != s.shape[1]:
            raise ValueError(f"trace has {s.shape[1]} layers of scores but layers="
                             f"{list(self.layers)}")
        if n.size and (int(n.min()) < 0 or int(n.max()) > s.shape[3]):
            raise ValueError(f"trace nblk must lie in [0, NB={s.shape[3]}], got "
                             f"[{int(n.min())}, {int(n.max())}]")
        bs = self.meta.get("block_size")
        if bs is not None and int(bs) <= 0:
            raise ValueError(f"trace block_size={bs}: expected a positive integer")
        return self

    def torch_rows(self, layer: int = 0) -> Tuple[Tensor, Tensor]:
        """``(scores [steps, Hk, NB] float32, nblk [steps] int64)`` of one traced layer (by index)."""
        return (torch.from_numpy(np.ascontiguousarray(self.scores[:, layer])),
                torch.from_numpy(self.nblk.astype(np.int64)))


def _meta_defaults(meta: Dict[str, Any]) -> Dict[str, Any]:
    out = {"format": FORMAT, "version": VERSION}
    out.update(meta)
    return out


def save_trace(path: str, trace: Trace) -> str:
    """Write one request's trace to ``path`` (``.npz`` appended if missing); returns the path."""
    trace.validate()
    if not path.endswith(".npz"):
        path += ".npz"
    scores = trace.scores.copy()
    past = np.arange(scores.shape[3])[None, :] >= trace.nblk[:, None]  # [steps, NB]
    scores[np.broadcast_to(past[:, None, None, :], scores.shape)] = -np.inf
    meta = _meta_defaults(trace.meta)
    meta.setdefault("num_kv_heads", trace.num_kv_heads)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez_compressed(path, scores=scores, nblk=trace.nblk.astype(np.int32),
                        layers=np.asarray(trace.layers, dtype=np.int32),
                        meta=np.array(json.dumps(meta, sort_keys=True)))
    return path


def load_trace(path: str) -> Trace:
    """Read one ``.npz`` trace file written by ``save_trace`` (or any writer of the format)."""
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in ("scores", "nblk", "layers", "meta") if k not in z.files]
        if missing:
            raise ValueError(f"{path}: not a PRR trace file, missing arrays {missing}")
        meta = json.loads(str(z["meta"]))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: format={meta.get('format')!r}, expected {FORMAT!r}")
        if int(meta.get("version", -1)) > VERSION:
            raise ValueError(f"{path}: trace version {meta.get('version')} is newer than the "
                             f"supported version {VERSION}")
        t = Trace(scores=z["scores"].astype(np.float32, copy=False),
                  nblk=z["nblk"].astype(np.int32, copy=False),
                  layers=tuple(int(x) for x in z["layers"]), meta=meta)
    return t.validate()


def load_traces(path: str) -> List[Trace]:
    """All traces under ``path``: a single ``.npz`` file or a directory of them (sorted by name)."""
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".npz"))
        if not files:
            raise ValueError(f"{path}: directory holds no .npz trace files")
        return [load_trace(os.path.join(path, f)) for f in files]
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace path {path!r} does not exist")
    return [load_trace(path)]


# ----------------------------------------------------------------------------- the recorder


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _RequestBuffer:
    def __init__(self, ordinal: int, layers: Sequence[int]):
        self.ordinal = ordinal
        self.rows: Dict[int, List[np.ndarray]] = {l: [] for l in layers}  # layer -> [Hk, nblk]
        self.nblk: Dict[int, List[int]] = {l: [] for l in layers}

    def steps(self) -> int:
        return min(len(v) for v in self.rows.values())


class TraceRecorder:
    """Records per-step block scores of the first ``cfg.trace_max_requests`` requests seen, for
    layers ``cfg.trace_layers``, up to ``cfg.trace_max_steps`` decode steps each, into
    ``cfg.trace_path`` (one ``.npz`` per request, see the module docstring).

    Memory is bounded by ``max_requests * max_steps * len(layers) * Hk * NB * 4`` bytes; a
    request's file is written as soon as it has ``max_steps`` steps, when ``finish(rid)`` is
    called (request done), or at ``close()`` (also registered with ``atexit``). Under tensor
    parallelism each rank's files get a ``rank<r>_`` prefix (its own KV heads). Recording copies scores to the host each step, so
    it is only used with CUDA graphs disabled (the caller validates that at startup).
    """

    def __init__(self, cfg: PRRConfig, num_layers: int, num_kv_heads: int,
                 file_prefix: str = "", extra_meta: Optional[Dict[str, Any]] = None):
        if not cfg.trace_path:
            raise PRRConfigError("invalid PRR option trace_path=None: TraceRecorder needs a "
                                 "directory path")
        if num_layers < 1 or num_kv_heads < 1:
            raise ValueError(f"TraceRecorder needs num_layers >= 1 and num_kv_heads >= 1, got "
                             f"{num_layers} and {num_kv_heads}")
        bad = [l for l in cfg.trace_layers if not 0 <= int(l) < num_layers]
        if bad:
            raise PRRConfigError(f"invalid PRR option trace_layers={bad}: allowed layer ids in "
                                 f"[0, {num_layers - 1}]")
        self.path = cfg.trace_path
        if not file_prefix and _world_size() > 1:
            # Tensor-parallel ranks record their own KV heads: keep their files apart.
            file_prefix = f"rank{torch.distributed.get_rank()}_"
        self.layers = tuple(sorted(set(int(l) for l in cfg.trace_layers)))
        self._layer_set = frozenset(self.layers)
        self.num_kv_heads = int(num_kv_heads)
        self.max_steps = int(cfg.trace_max_steps)
        self.max_requests = int(cfg.trace_max_requests)
        self.file_prefix = file_prefix
        self._meta = {"source": "server", "method": cfg.method, "block_size": int(cfg.block_size),
                      "num_kv_heads": int(num_kv_heads), "sink_blocks": int(cfg.sink_blocks),
                      "local_blocks": int(cfg.local_blocks),
                      "top_k_blocks": int(cfg.top_k_blocks), **(extra_meta or {})}
        self._active: Dict[str, _RequestBuffer] = {}
        self._done: Dict[str, str] = {}  # rid -> written file ("" when nothing was recorded)
        self._seen = 0
        self._closed = False
        self.written: List[str] = []
        os.makedirs(self.path, exist_ok=True)
        # Requests still running at shutdown are written then (close() is idempotent).
        atexit.register(self.close)

    @property
    def accepting(self) -> bool:
        """Whether a request not seen yet would still be recorded."""
        return (not self._closed and self.max_steps > 0 and self._seen < self.max_requests)

    def wants(self, layer_id: int) -> bool:
        """Cheap check for the decode path: does ``record`` for this layer do anything now?"""
        return (layer_id in self._layer_set and not self._closed and self.max_steps > 0
                and (self._seen < self.max_requests or bool(self._active)))

    def record(self, layer_id: int, rids: Sequence[str], scores: Tensor, nblk: Tensor) -> None:
        """Append one decode step of ``layer_id`` for the batch.

        rids: the ``B`` request ids of the batch rows; scores: ``[B, Hk, NB]`` (any device,
        any float dtype); nblk: ``[B]`` blocks of each request at this step.
        """
        if not self.wants(layer_id):
            return
        if scores.dim() != 3 or scores.shape[0] != len(rids) or scores.shape[1] != self.num_kv_heads:
            raise ValueError(f"TraceRecorder.record: scores must be [B={len(rids)}, "
                             f"Hk={self.num_kv_heads}, NB], got shape {tuple(scores.shape)}")
        if nblk.shape != (len(rids),):
            raise ValueError(f"TraceRecorder.record: nblk must be [B={len(rids)}], got shape "
                             f"{tuple(nblk.shape)}")
        rows: List[int] = []
        bufs: List[_RequestBuffer] = []
        for i, rid in enumerate(rids):
            rid = str(rid)
            buf = self._active.get(rid)
            if buf is None:
                if rid in self._done or self._seen >= self.max_requests:
                    continue
                buf = self._active[rid] = _RequestBuffer(self._seen, self.layers)
                self._seen += 1
            if len(buf.rows[layer_id]) >= self.max_steps:
                continue
            rows.append(i)
            bufs.append(buf)
        if not rows:
            return
        sel = torch.tensor(rows, dtype=torch.long, device=scores.device)
        host = scores.detach().index_select(0, sel).float().cpu().numpy()  # host-ok: tracing mode
        nb_host = nblk.detach().index_select(0, sel).long().cpu().numpy()  # host-ok: tracing mode
        for j, buf in enumerate(bufs):
            n = int(min(max(int(nb_host[j]), 0), host.shape[-1]))
            buf.rows[layer_id].append(host[j, :, :n].copy())
            buf.nblk[layer_id].append(n)
        for rid in [r for r in list(self._active) if self._active[r].steps() >= self.max_steps]:
            self.finish(rid)

    def finish(self, rid: str) -> Optional[str]:
        """Write a request's trace now (it finished); returns the file, or None if not traced."""
        rid = str(rid)
        buf = self._active.pop(rid, None)
        if buf is None:
            return None
        path = self._write(rid, buf)
        self._done[rid] = path or ""
        return path

    def close(self) -> List[str]:
        """Write every pending trace and stop recording (idempotent). Returns all files written."""
        for rid in list(self._active):
            self.finish(rid)
        self._closed = True
        return list(self.written)

    def _write(self, rid: str, buf: _RequestBuffer) -> Optional[str]:
        steps = buf.steps()
        if steps == 0:
            return None
        first = self.layers[0]
        nblk = np.asarray(buf.nblk[first][:steps], dtype=np.int32)
        nb = max(1, int(nblk.max()))
        scores = np.full((steps, len(self.layers), self.num_kv_heads, nb), -np.inf, np.float32)
        for li, layer in enumerate(self.layers):
            for s in range(steps):
                row = buf.rows[layer][s]
                scores[s, li, :, :row.shape[-1]] = row
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", rid)[:80]
        name = f"{self.file_prefix}{buf.ordinal:04d}_{safe}.npz"
        path = save_trace(os.path.join(self.path, name),
                          Trace(scores, nblk, self.layers, {**self._meta, "rid": rid}))
        self.written.append(path)
        return path

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- synthetic families

# Fitted on `retrieval` (defaults below, K = 32 blocks, block 64, 32K context, 8 KV heads) so that
# reuse-previous overlaps 68% of A step to step: `fit_noise("retrieval")` bisects the noise level
# with `replay` (the benchmark's overlap function) on seeds 0 and 1 and returned this value; the
# probes are listed in benchmarks/README-predictor.md (and in FIT_REPORT after a call).
FIT_NOISE = 0.361
FIT_TARGET = 0.68
# The headline geometry the fit refers to: K in blocks, prompt tokens (not a block multiple, so the
# newest block is partial), block size, KV heads, and steps per trace.
FIT_K_BLOCKS = 32
DEFAULT_CTX_TOKENS = 32731
DEFAULT_BLOCK_SIZE = 64
DEFAULT_KV_HEADS = 8
DEFAULT_STEPS = 192


@dataclass(frozen=True)
class Family:
    name: str
    doc: str
    params: Dict[str, float]
    structured: bool


FAMILIES: Dict[str, Family] = {
    "sink_local": Family(
        "sink_local", "attention sink + local window: recency decay over the newest blocks",
        dict(noise=FIT_NOISE, rho=0.0, base=1.0, base_drift=0.002, local_amp=3.0, window=12.0,
             sink_amp=2.0, sink_width=2), True),
    "retrieval": Family(
        "retrieval", "a few stable retrieval blocks that hop rarely (slow drift)",
        dict(noise=FIT_NOISE, rho=0.0, base=1.0, base_drift=0.002, n_hot=8, hot_amp=3.0,
             hop=0.003), True),
    "topic_switch": Family(
        "topic_switch", "hot set redrawn at random switch times (abrupt changes)",
        dict(noise=FIT_NOISE, rho=0.0, base=1.0, base_drift=0.002, n_hot=16, hot_amp=3.0,
             dwell=24.0), True),
    "periodic": Family(
        "periodic", "hot sets revisited round-robin (reasoning-style revisits)",
        dict(noise=FIT_NOISE, rho=0.0, base=1.0, base_drift=0.002, n_hot=12, hot_amp=3.0,
             n_topics=3, dwell=4), True),
    "noise": Family(
        "noise", "i.i.d. scores each step: the adversarial floor",
        dict(noise=1.0, rho=0.0, base=0.0, base_drift=0.0), False),
}


def _ar1(rng: np.random.Generator, shape: Tuple[int, ...], rho: float) -> np.ndarray:
    """Unit-variance AR(1) along axis 0 with lag-one correlation ``rho``."""
    e = rng.standard_normal(shape).astype(np.float64)
    c = math.sqrt(max(0.0, 1.0 - rho * rho))
    for t in range(1, shape[0]):
        e[t] = rho * e[t - 1] + c * e[t]
    return e


def _hot_sets(rng: np.random.Generator, heads: int, n: int, lo: int, hi: int) -> np.ndarray:
    """``[heads, n]`` distinct block ids in ``[lo, hi)`` per head."""
    n = min(n, hi - lo)
    return np.stack([rng.choice(np.arange(lo, hi), size=n, replace=False) for _ in range(heads)])


def generate(family: str, steps: int = DEFAULT_STEPS, num_kv_heads: int = DEFAULT_KV_HEADS,
             ctx_tokens: int = DEFAULT_CTX_TOKENS, block_size: int = DEFAULT_BLOCK_SIZE,
             seed: int = 0, sink_blocks: int = 1, local_blocks: int = 1, **params: float) -> Trace:
    """Draw one request's synthetic decode trace of ``steps`` steps (deterministic per seed).

    The request starts with ``ctx_tokens`` tokens and grows by one per step, so ``nblk[t] =
    ceil((ctx_tokens + t) / block_size)``. ``params`` override the family's defaults
    (``FAMILIES[family].params``); unknown names raise. Returns a one-layer ``Trace``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown trace family {family!r}: expected one of "
                         f"{' | '.join(FAMILIES)}")
    fam = FAMILIES[family]
    unknown = sorted(set(params) - set(fam.params))
    if unknown:
        raise ValueError(f"family {family!r} has no parameters {unknown}: allowed "
                         f"{sorted(fam.params)}")
    if steps < 1 or num_kv_heads < 1 or block_size < 1:
        raise ValueError(f"generate needs steps, num_kv_heads, block_size >= 1, got {steps}, "
                         f"{num_kv_heads}, {block_size}")
    p = {**fam.params, **params}
    nblk = ((ctx_tokens + np.arange(steps) + block_size - 1) // block_size).astype(np.int32)
    nb = int(nblk[-1])
    lo, hi = sink_blocks, int(nblk[0]) - local_blocks  # middle blocks of the prompt
    if hi - lo < 2:
        raise ValueError(f"ctx_tokens={ctx_tokens} gives {int(nblk[0])} blocks: need at least "
                         f"sink_blocks + local_blocks + 2 = {sink_blocks + local_blocks + 2}")
    # One stream per component so that changing one parameter leaves the others' draws alone.
    ss = np.random.SeedSequence([seed, sorted(FAMILIES).index(family)])
    r_base, r_noise, r_struct = (np.random.default_rng(s) for s in ss.spawn(3))
    shape = (steps, num_kv_heads, nb)

    base = np.zeros(shape)
    if p["base"] > 0:
        c = 1.0 - float(p["base_drift"])
        base = _ar1(r_base, shape, c) * float(p["base"])
    fluct = _ar1(r_noise, shape, float(p["rho"])) * float(p["noise"])
    struct = np.zeros(shape)
    ar_b = np.arange(nb)
    if family == "sink_local":
        age = (nblk[:, None] - 1 - ar_b[None, :]).astype(np.float64)  # [steps, NB]
        local = float(p["local_amp"]) * np.exp(-np.clip(age, 0, None) / float(p["window"]))
        sink = float(p["sink_amp"]) * (ar_b < int(p["sink_width"]))
        struct += (local + sink[None, :])[:, None, :]
    elif family == "retrieval":
        hot = _hot_sets(r_struct, num_kv_heads, int(p["n_hot"]), lo, hi)  # [Hk, n]
        for t in range(steps):
            move = r_struct.random(hot.shape) < float(p["hop"])
            if move.any():
                hot = hot.copy()
                for h, i in zip(*np.nonzero(move)):  # host-ok: numpy trace generator
                    free = np.setdiff1d(np.arange(lo, hi), hot[h])
                    hot[h, i] = r_struct.choice(free)
            np.put_along_axis(struct[t], hot, float(p["hot_amp"]), axis=-1)
    elif family == "topic_switch":
        hot = _hot_sets(r_struct, num_kv_heads, int(p["n_hot"]), lo, hi)
        for t in range(steps):
            if t > 0 and r_struct.random() < 1.0 / float(p["dwell"]):
                hot = _hot_sets(r_struct, num_kv_heads, int(p["n_hot"]), lo, hi)
            np.put_along_axis(struct[t], hot, float(p["hot_amp"]), axis=-1)
    elif family == "periodic":
        topics = [_hot_sets(r_struct, num_kv_heads, int(p["n_hot"]), lo, hi)
                  for _ in range(int(p["n_topics"]))]
        for t in range(steps):
            hot = topics[(t // int(p["dwell"])) % len(topics)]
            np.put_along_axis(struct[t], hot, float(p["hot_amp"]), axis=-1)
    scores = (base + struct + fluct).astype(np.float32)
    scores[np.broadcast_to(ar_b[None, None, :] >= nblk[:, None, None], shape)] = -np.inf
    meta = {"rid": f"{family}-{seed}", "method": "synthetic", "block_size": int(block_size),
            "num_kv_heads": int(num_kv_heads), "source": f"synthetic:{family}", "family": family,
            "seed": int(seed), "params": p, "sink_blocks": int(sink_blocks),
            "local_blocks": int(local_blocks)}
    return Trace(scores[:, None], nblk, (0,), meta).validate()


# ----------------------------------------------------------------------------- replay (hit rates)

REUSE_THETA = (1.0, 0.5, 0.0)  # alpha = 1, gamma = 0: the prediction is the previous step's scores


def replay(scores: Tensor, nblk: Tensor, k: int, n_pred: int, sink_blocks: int,
           local_blocks: int, thetas: Tensor, start: int = 1) -> Dict[str, Tensor]:
    """Run the Holt predictor for every candidate theta over traces and score its predictions.

    scores: ``[R, T, Hk, NB]`` block scores of ``R`` traces (rows in step order); nblk: ``[R, T]``;
    thetas: ``[C, 3]`` or per trace ``[R, C, 3]`` (alpha, beta, gamma). ``REUSE_THETA`` makes P = top-``n_pred`` of the
    previous step's scores (= the previous A when ``n_pred == k``). Uses the library's ops
    (``predict_set``, ``select_topk``, ``holt_update``) and eq 4's ``weighted_hit``; every step
    updates the state, steps ``>= max(start, 1)`` are measured over the middle blocks of ``A``.

    Returns per-step, per-head tensors ``[R, C, T_m, Hk]`` with ``T_m = T - max(start, 1)``:
    ``hit`` (eq 4, score-weighted), ``overlap`` (``|P n A| / |A|``), ``missed`` (``|A \\ P|``).
    """
    R, T, Hk, nb = scores.shape
    C = thetas.shape[-2]
    start = max(int(start), 1)
    dev = scores.device
    th = thetas.float().to(dev).expand(R, C, 3).reshape(R * C, 3)
    alpha, beta, gamma = (th[:, i].contiguous() for i in range(3))  # [R*C]
    level = torch.zeros(R * C, Hk, nb, device=dev)
    trend = torch.zeros_like(level)
    n_init = torch.zeros(R * C, dtype=torch.long, device=dev)
    hit, overlap, missed = [], [], []
    for t in range(T):
        row_r, n_r = scores[:, t].float(), nblk[:, t].long()  # [R, Hk, NB], [R]
        row = row_r.repeat_interleave(C, dim=0)
        n = n_r.repeat_interleave(C, dim=0)
        if t >= start:
            p_idx, p_cnt = ops.predict_set(level, trend, gamma, n_init, n, n_pred, sink_blocks,
                                           local_blocks)
            a_idx, a_cnt = ops.select_topk(row_r, n_r, k, sink_blocks, local_blocks,
                                           k + sink_blocks + local_blocks)
            a_idx, a_cnt = a_idx.repeat_interleave(C, 0), a_cnt.repeat_interleave(C, 0)
            _, middle = ref.kept_mask(n, nb, sink_blocks, local_blocks)
            middle = middle.unsqueeze(1)  # [R*C, 1, NB]
            hit.append(ref.weighted_hit(row, a_idx, a_cnt, p_idx, p_cnt, middle))
            a = ref.list_to_mask(a_idx, a_cnt, nb) & middle
            p = ref.list_to_mask(p_idx, p_cnt, nb)
            n_a = a.sum(-1)
            both = (a & p).sum(-1)
            overlap.append(torch.where(n_a > 0, both.float() / n_a.clamp(min=1).float(),
                                       torch.ones_like(n_a, dtype=torch.float32)))
            missed.append(n_a - both)
        ops.holt_update(level, trend, n_init, row, n, alpha, beta)
    out = {}
    for name, xs in (("hit", hit), ("overlap", overlap), ("missed", missed)):
        x = torch.stack(xs, 1) if xs else torch.zeros(R * C, 0, Hk)
        out[name] = x.view(R, C, -1, Hk)
    return out


def reuse_overlap(traces: Sequence[Trace], k: int, sink_blocks: int = 1,
                  local_blocks: int = 1) -> float:
    """Mean step-to-step overlap ``|A(t-1) n A(t)| / |A(t)|`` (middle blocks) over traces/layers."""
    vals = []
    for tr in traces:
        for li in range(len(tr.layers)):
            s, n = tr.torch_rows(li)
            r = replay(s[None], n[None], k, k, sink_blocks, local_blocks,
                       torch.tensor([REUSE_THETA]))
            vals.append(r["overlap"].mean().item())  # host-ok: offline analysis
    return float(np.mean(vals))


FIT_REPORT: Dict[str, Any] = {}


def fit_noise(family: str = "retrieval", target: float = FIT_TARGET, k: int = FIT_K_BLOCKS,
              seeds: Sequence[int] = (0, 1), lo: float = 0.05, hi: float = 3.0, iters: int = 14,
              tol: float = 0.005, **gen_kwargs: Any) -> float:
    """Bisect the family's ``noise`` so that reuse-previous overlaps ``target`` of A.

    Overlap falls monotonically (in expectation) as the per-step fluctuation grows, so bisection on
    ``[lo, hi]`` converges; each probe generates ``len(seeds)`` traces at the headline geometry
    (``gen_kwargs`` override it) and measures ``reuse_overlap``. Returns the fitted noise and
    fills ``FIT_REPORT`` with the probes.
    """
    probes = []

    def measure(noise: float) -> float:
        trs = [generate(family, seed=s, noise=noise, **gen_kwargs) for s in seeds]
        v = reuse_overlap(trs, k)
        probes.append((noise, v))
        return v

    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        v = measure(mid)
        if abs(v - target) <= tol:
            break
        if v > target:
            lo = mid
        else:
            hi = mid
    FIT_REPORT.clear()
    FIT_REPORT.update(family=family, target=target, k=k, seeds=list(seeds), probes=probes,
                      noise=mid, overlap=v)
    return mid
