"""Block-score traces: the file format and the server-side recorder.

The PRR speedup depends on how well the predictor guesses the selected set ``A`` from the history
of block scores. This module holds the data that is measured on: the per-step block scores of
real requests, in a file format that synthetic traces (``trace_families``) share, and the
measurement itself is ``trace_replay``.

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
scores to the host every step, so it is a diagnostic mode that needs the decode CUDA graphs off
(``--cuda-graph-backend-decode disabled``; on a CPU there are none).
``benchmarks/bench_predictor.py --trace DIR`` measures the predictor's hit rates on it
(``trace_replay.replay``); ``trace_families`` draws synthetic traces in the same format.
"""

from __future__ import annotations

import atexit
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from ..config import PRRConfig, PRRConfigError

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
        """``(scores [steps, Hk, NB] float32, nblk [steps] int64)`` of one traced layer (by
        index)."""
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
    parallelism each rank's files get a ``rank<r>_`` prefix (its own KV heads). Recording copies
    scores to the host each step, so it is only used with CUDA graphs disabled (the caller
    validates that at startup).
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
        if (scores.dim() != 3 or scores.shape[0] != len(rids)
                or scores.shape[1] != self.num_kv_heads):
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
