"""What the benchmark scripts share: CUDA-graph replay timing, warm and cold L2, and its summary
statistics.

One timer for every script, so that their numbers are measured the same way and can stand side
by side: the calls are warmed up on a side stream (JIT, allocator), captured in one CUDA graph,
and each replay is timed with CUDA events; a replay of ``R`` calls counts ``1/R`` per call.

Warm and cold L2. Replaying the same graph back to back leaves its inputs in the L2 (50-60 MB
on an H100/H200): a kernel then reads them at L2 speed, which it never does in the server,
where the layer's weights (hundreds of MB per layer) and the other layers' KV pass through the
L2 between two calls of one layer's attention. ``cold=True`` evicts the L2 before every timed
replay: ``L2Flush`` reads a buffer of ``FLUSH_FACTOR`` (2) times the L2 size
(``torch.cuda.get_device_properties(d).L2_cache_size``) on the timing stream, between the
previous replay's end event and the next one's start event, so the flush is outside the timed
span. It reads instead of writing, so the lines it leaves are clean: a flush by memset would leave
dirty lines whose write-back the timed kernel would pay, which the server's kernels (after GEMMs
that read weights) do not. Only the first call of a replay starts cold; benchmarks whose graph
holds R calls also rotate their inputs over more than the L2 so that the other calls are cold
too. Where warm and cold differ, the benchmarks report both.

On CPU (the tests' dry runs) there are no graphs: the calls run eagerly and are timed by the
wall clock, the flush reads a buffer of twice the largest CPU cache; the same code paths run.
"""

from __future__ import annotations

import csv
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

FLUSH_FACTOR = 2  # the flush reads this many times the L2 (the "more than 2x the L2")
CPU_CACHE_FALLBACK = 32 << 20  # when /sys does not say how large the CPU's caches are

_flushers: Dict[str, "L2Flush"] = {}


def pct(xs: Sequence[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (nearest rank, no interpolation)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))]


def summary(ts: Sequence[float]) -> Tuple[float, float, float]:
    """``(median, p10, p90)`` of the samples ``ts``."""
    return statistics.median(ts), pct(ts, 10), pct(ts, 90)


def _cpu_cache_bytes() -> int:
    """The largest cache of CPU 0 (the last level), from sysfs."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return max(sizes, default=CPU_CACHE_FALLBACK)


def l2_bytes(device="cuda") -> int:
    """The L2 size of a CUDA device (the last-level cache of the CPU for ``cpu``)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return _cpu_cache_bytes()
    return int(torch.cuda.get_device_properties(dev).L2_cache_size)


class L2Flush:
    """Evicts the L2 of ``device``: each call reads ``factor`` x its size (sums a buffer into
    one scalar), on the current stream. See the module docstring for why a read."""

    def __init__(self, device="cuda", factor: float = FLUSH_FACTOR):
        self.device = torch.device(device)
        self.nbytes = int(factor * l2_bytes(self.device))
        self.buf = torch.ones(max(self.nbytes // 4, 1), dtype=torch.float32, device=self.device)
        self.out = torch.empty((), dtype=torch.float32, device=self.device)
        self.calls = 0

    def __call__(self) -> None:
        torch.sum(self.buf, dim=0, out=self.out)
        self.calls += 1


def flusher(device="cuda") -> L2Flush:
    """One ``L2Flush`` per device and process (its buffer is twice the L2: allocated once)."""
    key = str(torch.device(device))
    if key not in _flushers:
        _flushers[key] = L2Flush(device)
    return _flushers[key]


def require_kernels(device) -> None:
    """Stop (SystemExit, naming why) when ``device`` is a CUDA device the kernel library does not
    serve: the ops would fall back to the torch reference, and a benchmark's rows would time it
    under the library's name. A CPU device passes (the reference is what it times)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    from sglang_prr import kernels
    if not kernels.active(dev):
        raise SystemExit(f"the SM90 kernel library does not serve {dev}: "
                         f"{kernels.load_error() or 'not an SM90 device'} (its rows would time "
                         "the torch reference)")


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None (and a line saying so) without it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt


def save_figure(fig, png: str, dpi: int = 110) -> None:
    """Lays out ``fig``, writes it to ``png`` and says so."""
    fig.tight_layout()
    fig.savefig(png, dpi=dpi)
    print(f"wrote {png}")


def write_rows(path, rows: Sequence[dict], columns: Sequence[str], append: bool = False
               ) -> List[dict]:
    """Write ``rows`` to the CSV at ``path`` under ``columns``, after the rows already there when
    ``append`` (a run adds its rows beside earlier runs'), and say so; returns every row
    written."""
    old: List[dict] = []
    if append and os.path.exists(path):
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    every = old + list(rows)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        w.writerows(every)
    print(f"wrote {len(rows)} rows to {path}")
    return every


def capture(calls: Sequence[Callable[[], object]], warmup: int = 1):
    """Run ``calls`` ``warmup`` times on a side stream, then capture them in one CUDA graph.

    Returns ``(graph, outputs)``: ``outputs`` are the captured calls' return values, the static
    tensors a replay writes. Nothing is replayed yet."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):  # warm-up outside capture (JIT, allocator)
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outputs = [c() for c in calls]
    return g, outputs


def time_replays(g, reps: int, calls_per_replay: int = 1, warmup: int = 1,
                 flush: Optional[Callable[[], None]] = None) -> Tuple[float, float, float]:
    """Per-call µs ``(median, p10, p90)`` over ``reps`` replays of ``g`` (after ``warmup``
    untimed replays). ``flush`` (e.g. an ``L2Flush``) runs before every replay, outside the
    events: the start event is recorded after it on the same stream."""
    for _ in range(warmup):
        if flush is not None:
            flush()
        g.replay()
    torch.cuda.synchronize()
    ts: List[float] = []
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        if flush is not None:
            flush()
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        ts.append(st.elapsed_time(en) * 1000.0 / calls_per_replay)
    return summary(ts)


def time_eager(calls: Sequence[Callable[[], object]], reps: int, warmup: int = 1,
               flush: Optional[Callable[[], None]] = None,
               device="cuda") -> Tuple[float, float, float]:
    """Per-call µs of the ``calls`` run eagerly (what a graph cannot capture): CUDA events
    around them on a CUDA ``device``, the wall clock on a CPU one. ``flush`` runs before every
    timed round, outside the timing."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        for c in calls:
            c()
    if cuda:
        torch.cuda.synchronize()
    ts: List[float] = []
    for _ in range(reps):
        if flush is not None:
            flush()
        if cuda:
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            for c in calls:
                c()
            en.record()
            en.synchronize()
            ts.append(st.elapsed_time(en) * 1000.0 / len(calls))
        else:
            t0 = time.perf_counter()
            for c in calls:
                c()
            ts.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return summary(ts)


def time_graph(calls: Sequence[Callable[[], object]], reps: int, warmup: int = 1,
               cold: bool = False, device="cuda") -> Tuple[float, float, float]:
    """Capture ``calls`` (R closures) in one graph; per-call µs ``(median, p10, p90)`` over
    ``reps`` replays. ``warmup``: eager rounds before the capture and untimed replays after.
    ``cold``: the L2 is flushed before every replay (``L2Flush``). On a CPU ``device`` the
    calls run eagerly under the wall clock (``time_eager``)."""
    flush = flusher(device) if cold else None
    if torch.device(device).type != "cuda":
        return time_eager(calls, reps, warmup, flush, device)
    g, _ = capture(calls, warmup)
    try:
        return time_replays(g, reps, len(calls), warmup, flush)
    finally:
        del g


def time_warm_cold(calls: Sequence[Callable[[], object]], reps: int, warmup: int = 1,
                   device="cuda") -> Dict[str, Tuple[float, float, float]]:
    """``{"warm": (median, p10, p90), "cold": (...)}`` of one capture of ``calls``: replays
    back to back, then replays each after an L2 flush."""
    if torch.device(device).type != "cuda":
        return {"warm": time_eager(calls, reps, warmup, None, device),
                "cold": time_eager(calls, reps, warmup, flusher(device), device)}
    g, _ = capture(calls, warmup)
    try:
        return {"warm": time_replays(g, reps, len(calls), warmup),
                "cold": time_replays(g, reps, len(calls), warmup, flusher(device))}
    finally:
        del g
