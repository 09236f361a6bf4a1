"""What the benchmark scripts share: CUDA-graph replay timing and its summary statistics.

One timer for every script, so that their numbers are measured the same way and can stand side
by side: the calls are warmed up on a side stream (JIT, allocator), captured in one CUDA graph,
and each replay is timed with CUDA events; a replay of ``R`` calls counts ``1/R`` per call.
"""

from __future__ import annotations

import statistics
from typing import Callable, List, Sequence, Tuple

import torch


def pct(xs: Sequence[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (nearest rank, no interpolation)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))]


def summary(ts: Sequence[float]) -> Tuple[float, float, float]:
    """``(median, p10, p90)`` of the samples ``ts``."""
    return statistics.median(ts), pct(ts, 10), pct(ts, 90)


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


def time_replays(g, reps: int, calls_per_replay: int = 1,
                 warmup: int = 1) -> Tuple[float, float, float]:
    """Per-call µs ``(median, p10, p90)`` over ``reps`` replays of ``g`` (after ``warmup``
    untimed replays)."""
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    ts: List[float] = []
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        ts.append(st.elapsed_time(en) * 1000.0 / calls_per_replay)
    return summary(ts)


def time_graph(calls: Sequence[Callable[[], object]], reps: int,
               warmup: int = 1) -> Tuple[float, float, float]:
    """Capture ``calls`` (R closures) in one graph; per-call µs ``(median, p10, p90)`` over
    ``reps`` replays. ``warmup``: eager rounds before the capture and untimed replays after."""
    g, _ = capture(calls, warmup)
    try:
        return time_replays(g, reps, len(calls), warmup)
    finally:
        del g
