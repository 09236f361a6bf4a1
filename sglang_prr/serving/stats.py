"""PRR statistics: the decode counters, the file behind ``GET /prr/stats``, Prometheus gauges.

``Stats`` (one per model runner, built by the backend) holds the counters: the selection kernel
sums |A|, |M|, |P| and the sparse rows on the device (``Stats.counters``, drained to exact host
ints only outside the decode step); the backend adds host counts of each batch. ``maybe_flush``
writes a JSON snapshot to ``stats_path()``, logs it every ``--prr-metrics-interval`` decode
batches and, with SGLang's ``--enable-metrics``, sets ``sglang:prr_*`` gauges. The scheduler
process writes the file; the HTTP process (the plugin's route) reads it with ``read_stats``. The
file's path is fixed in the launching process before the schedulers are spawned, so every
process inherits the same one.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from typing import Any, Dict

import torch

from .. import contracts
from ..config import PRRConfig
from .server_args_patch import load_config

logger = logging.getLogger("sglang_prr")

ENV_STATS = "SGLANG_PRR_STATS_FILE"
# On a GPU the statistics file is refreshed at most this often (a device->host copy).
STATS_FLUSH_SECONDS_GPU = 1.0

# Device counters of the selection kernel (int64): |A|, |M|, |P| summed over the sparse
# (request, KV head) rows of every layer-step, and the number of such rows (the layout is
# contracts.STATS_SLOTS).
_S_A, _S_M, _S_P, _S_ROWS = (contracts.STATS_SLOTS.index(n)
                             for n in ("selected", "repair", "predicted", "rows"))


def empty_stats() -> Dict[str, Any]:
    """Every field of ``GET /prr/stats``, in order, with its value before anything is counted.

    One schema for every server: a server with PRR off (``--prr-method dense``), or one that has
    not run a forward yet, answers with these values, so a script written against one server
    works against any. The README's ``/prr/stats`` table describes each field
    (``tests/unit/test_stats_schema.py`` keeps the two, and ``Stats.snapshot``, in step)."""
    return {
        "config": None,  # the active PRRConfig (to_dict), None without one
        "enabled": False,
        "decode_batches": 0,
        "decode_steps": 0,
        "serial_steps": 0,
        "budget": {},
        "budget_reason": {},
        "sparse_rows": 0,
        "dense_rows": 0,
        "hit_rate": None,
        "mean_selected_blocks": None,
        "mean_repair_blocks": None,
        "delta": None,
        "extend_batches": 0,
        "calibrations": 0,
        "theta_chosen": {},
        "time": None,  # when the scheduler last wrote the counters (Unix seconds)
    }


STATS_FIELDS = tuple(empty_stats())


def stats_path() -> str:
    """Where the scheduler writes PRR statistics for ``GET /prr/stats`` (one file per server)."""
    path = os.environ.get(ENV_STATS)
    if not path:
        path = os.path.join(tempfile.gettempdir(), f"sglang_prr_stats_{os.getpid()}.json")
        os.environ[ENV_STATS] = path
    return path


def clear_stats() -> None:
    """Forget what an earlier server of this process wrote (a second ``sgl.Engine``, which
    writes to the same file): ``read_stats`` answers ``empty_stats`` until the new one writes.
    Called before a server's processes are spawned."""
    try:
        os.remove(stats_path())
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.debug("sglang_prr: cannot remove the old stats file (%s)", e)


def _write(snap: Dict[str, Any]) -> None:
    """Replace the statistics file with ``snap`` (atomically: a reader sees one or the other)."""
    path = stats_path()
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(snap, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("sglang_prr: cannot write stats (%s)", e)


def write_fallback(cfg: PRRConfig, reason: str) -> None:
    """What ``/prr/stats`` says of a server whose model PRR cannot serve, which decodes with
    dense attention (``PRRBackend``'s fallback): ``enabled`` false, every decode dense, and why
    (it said ``enabled`` true with no counts, as a server that has not decoded yet). Written by
    the attention tensor-parallel rank 0 (the others fall back alike)."""
    if _attn_tp_rank() != 0:
        return
    snap = empty_stats()
    snap.update(config=cfg.to_dict(), enabled=False, budget={"*": "dense"},
                budget_reason={"*": f"dense attention: {reason}"}, time=time.time())
    _write(snap)


def read_stats() -> dict:
    """The latest statistics written by the scheduler, with the active configuration: every
    field of ``empty_stats()``, the counters at their initial values until the scheduler has
    written them (and for good where PRR is off: no scheduler counts)."""
    cfg = load_config()
    out = empty_stats()
    out.update(config=cfg.to_dict() if cfg else None, enabled=bool(cfg and cfg.enabled))
    try:
        with open(stats_path()) as f:
            written = json.load(f)
    except (OSError, ValueError):
        return out
    out.update((k, v) for k, v in written.items() if k in out)
    return out


class Stats:
    """Counters: the device's are drained to the host only outside the decode step."""

    def __init__(self, device, cfg: PRRConfig, server_args, speculates: bool = True):
        # Written by the selection kernel; drained (read, then zeroed) at each flush, so the
        # int64 sums never come near overflow and the host keeps exact Python ints.
        self.counters = contracts.new_stats(device)
        self.totals = [0] * len(contracts.STATS_SLOTS)
        self.cfg = cfg
        self.decode_batches = 0
        # Host counts, from the batch's host lengths (no device work in the decode step): layer-
        # steps of the sparse path, rows shorter than min_context (all blocks attended).
        self.decode_steps = 0
        self.serial_steps = 0  # layer-steps that the budget ran as serial DSA (no counters)
        self.dense_rows = 0
        self.budget: Dict[str, float] = {}  # the budget's choice per batch size
        self.budget_reason: Dict[str, str] = {}  # why, per batch size (BudgetPolicy.reasons)
        # False: serial DSA only (--prr-serial, or a budget that never speculates): no hit rate,
        # |M| or delta.
        self.speculates = bool(speculates) and not cfg.serial
        self.extend_batches = 0
        self.calibrations = 0
        self.theta_counts: Dict[str, int] = {}  # layer 0's theta*, drained from theta_hist
        self.theta_hist = torch.zeros(len(cfg.theta_grid), dtype=torch.int64, device=device)
        self._last_flush = 0.0
        self._last_logged = 0
        self._gauges = None
        self._enable_metrics = bool(getattr(server_args, "enable_metrics", False))
        self._on_gpu = torch.device(device).type == "cuda"
        # Under tensor parallelism every rank counts its own KV heads; rank 0 alone writes the
        # file behind /prr/stats, logs and exports (the ranks would overwrite each other).
        self.reporter = _attn_tp_rank() == 0

    def drain(self) -> None:
        """Move the device counters to the host totals (host-ok: called from
        init_forward_metadata, outside decode; the read waits for the steps already queued)."""
        for i, x in enumerate(self.counters.tolist()):  # host-ok: outside decode
            self.totals[i] += int(x)
        self.counters.zero_()
        for i, n in enumerate(self.theta_hist.tolist()):  # host-ok: outside decode
            if n:
                key = ",".join(f"{x:g}" for x in self.cfg.theta_grid[i])
                self.theta_counts[key] = self.theta_counts.get(key, 0) + int(n)
        self.theta_hist.zero_()

    def snapshot(self) -> Dict[str, Any]:
        """The counters, as the fields of ``empty_stats()`` less ``config`` and ``enabled``
        (which ``read_stats`` adds from the environment)."""
        self.drain()
        a = self.totals
        rows = a[_S_ROWS]
        # Serial DSA predicts nothing: its hit rate and budget are not applicable (None).
        prr = self.speculates and a[_S_A] > 0
        return {
            "decode_batches": self.decode_batches,
            "decode_steps": self.decode_steps,
            "serial_steps": self.serial_steps,
            "budget": dict(self.budget),
            "budget_reason": dict(self.budget_reason),
            "sparse_rows": rows,
            "dense_rows": self.dense_rows,
            "hit_rate": ((a[_S_A] - a[_S_M]) / a[_S_A]) if prr else None,
            "mean_selected_blocks": a[_S_A] / rows if rows else None,
            "mean_repair_blocks": a[_S_M] / rows if rows and self.speculates else None,
            "delta": (a[_S_P] / a[_S_A]) if prr else None,
            "extend_batches": self.extend_batches,
            "calibrations": self.calibrations,
            "theta_chosen": dict(self.theta_counts),
            "time": time.time(),
        }

    def count_batch(self, lens_cpu, real_rows: int, min_context: int, sparse_layers: int,
                    speculates: bool = True, dense: bool = False) -> None:
        """Host counts of one decode batch: its first ``real_rows`` host lengths (the rest is
        CUDA-graph padding) split at ``min_context`` like the decode step splits them;
        ``speculates``: False when the budget runs this batch as serial DSA; ``dense``: the
        budget runs it with dense attention (every row is a dense row)."""
        # (A dense batch reads no length: this runs on the host every decode step.)
        n_sparse = 0 if dense else _count_at_least(lens_cpu, real_rows, min_context)
        # Short rows count in every batch, also one without a long row (they were counted only
        # beside a long one, so a server that saw only short prompts reported 0).
        self.dense_rows += sparse_layers * (real_rows - n_sparse)
        if n_sparse == 0:
            return
        self.decode_steps += sparse_layers
        if not speculates and not self.cfg.serial:
            self.serial_steps += sparse_layers

    def maybe_flush(self, force: bool = False) -> None:
        now = time.time()
        interval = self.cfg.metrics_interval
        log_due = interval > 0 and self.decode_batches - self._last_logged >= interval
        if not (force or log_due or not self._on_gpu
                or now - self._last_flush >= STATS_FLUSH_SECONDS_GPU):
            return
        self._last_flush = now
        snap = self.snapshot()
        if not self.reporter:  # another tensor-parallel rank reports (its heads are alike)
            return
        _write(snap)
        if log_due:
            self._last_logged = self.decode_batches
            logger.info("PRR decode batches=%d hit_rate=%s |A|=%s |M|=%s delta=%s",
                        snap["decode_batches"], _fmt(snap["hit_rate"]),
                        _fmt(snap["mean_selected_blocks"]), _fmt(snap["mean_repair_blocks"]),
                        _fmt(snap["delta"]))
        if self._enable_metrics:
            self._export(snap)

    def _export(self, snap) -> None:
        try:
            from prometheus_client import Gauge

            if self._gauges is None:
                mk = lambda n, d: Gauge(f"sglang:prr_{n}", d, multiprocess_mode="mostrecent")
                self._gauges = {
                    "hit_rate": mk("hit_rate", "PRR hit rate |P n A| / |A| (cumulative)"),
                    "mean_repair_blocks": mk("repair_blocks", "Mean |M| per row, head, layer"),
                    "mean_selected_blocks": mk("selected_blocks", "Mean |A| per row, head, layer"),
                    "delta": mk("delta", "Speculation budget used: |P| / |A|"),
                    "decode_steps": mk("decode_steps", "PRR layer-steps run (cumulative)"),
                }
            for k, g in self._gauges.items():
                if snap.get(k) is not None:
                    g.set(float(snap[k]))
        except Exception as e:  # metrics must never break serving
            logger.debug("sglang_prr: prometheus export failed (%s)", e)


def _count_at_least(lens_cpu, n: int, bound: int) -> int:
    """How many of the first ``n`` host lengths are at least ``bound``. A Python list for the
    batch sizes a decode step usually has (a torch compare and sum costs ~10 µs of host time a
    step whatever the size), numpy's for longer ones."""
    if n <= 64:
        return sum(x >= bound for x in lens_cpu[:n].tolist())
    return int((lens_cpu[:n].numpy() >= bound).sum())


def _attn_tp_rank() -> int:
    """Attention tensor-parallel rank (0 without a parallel context, e.g. outside a server)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_rank)
    except Exception:
        return 0


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"
