"""Kernels and GPU-busy time per decode step, from a torch-profiler chrome trace.

SGLang's ``/start_profile`` (``num_steps`` N) writes a ``*.trace.json.gz`` of the next N forward
steps. CUPTI records every kernel a CUDA-graph replay launches as an event of category
``kernel`` with its duration (``dur``, µs), so the launches and the GPU-busy time of one decode
step are the totals of those events over N. Everything else in the trace (``cuda_runtime``,
``cpu_op``, ``python_function``, memcpy/memset, annotations) is host-side or not a kernel and is
left out. Busy time is the sum of kernel durations: kernels that overlap on two streams count
twice, which is what "GPU work per step" means here, not wall time.

Beside the busy time, the wall time of PRR's own work: the kernels of the ``prr::`` namespace
(selection, predictor, attention, repair, summaries) form clusters on the timeline, each running
until a kernel of another namespace starts after all of its kernels ended (the layer's GEMMs);
the clusters' spans from first start to last end are the time a layer's sparse path holds the
GPU, so two streams that overlap count once (``sparse_wall_us_per_layer``: their sum per step and
layer). Serial DSA's and PRR's critical paths compare through it, where summed kernel times
double-count the overlap. Inside the clusters, each of PRR's kernels (by name and by its place
among the cluster's kernels of that name: PRR's speculative attention and its repair are the same
kernel) gets its mean start and end from the cluster's start and its stream
(``sparse_layout``): which launch waits on which, and what the critical path is made of.

The host side (``host_summary``): the CUDA runtime and driver calls a step, those of them that wait
for the device (``SYNC_CALLS``: SGLang's own one a step; PRR should add none), and the host time of
PRR's own Python a step: the exclusive time (own time less its children's) of every CPU event whose
nearest Python frame is in ``sglang_prr/`` (the built-ins and torch ops it calls count as its own;
SGLang's functions it calls do not), the scheduler's entry ``ENTRY_FRAMES`` left out (the whole loop
runs under it). Python frames are in the trace when the profiler records stacks (SGLang's
``/start_profile`` does with the CPU activity); without them the PRR figure is 0.

The per-step numbers divide by the caller's step count (the N the profiler was asked for).
SGLang also marks each forward step with a span ``step[DECODE bs=8]`` (``user_annotation``);
those spans are counted beside it, to check that the recorded steps were N decode steps of the
expected batch (SGLang does not call ``profiler.step()``: there are no ``ProfilerStep#``).

    python benchmarks/profile_trace.py TRACE.trace.json.gz --layers 32 --steps 6
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

TOP = 15
# CUDA runtime / driver calls that block the host until the device (or a stream) catches up.
SYNC_CALLS = {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMemcpy2D", "cuCtxSynchronize",
              "cuStreamSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2"}
PRR_FRAME = re.compile(r"(^|[/\\])sglang_prr[/\\][^()]*\.py\(")  # "…/sglang_prr/x.py(12): f"
PY_FRAME = re.compile(r"\.py\(\d+\)")
ENTRY_FRAMES = ("run_scheduler_process",)  # PRR's wrappers around a whole process's loop
HOST_CATS = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver")
OWN = "prr::"  # PRR's kernels live in this C++ namespace (their demangled names start with it)
NAME_WIDTH = 110  # kernel names are long C++ template instantiations; the table shows their head


def load_events(path) -> list:
    """The ``traceEvents`` of a chrome trace (gzip-compressed when the name ends in ``.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(path, num_layers: int, steps: int, top: int = TOP) -> dict:
    """Kernel launches and GPU-busy time per step and per layer of the trace at ``path``.

    Returns ``kernels`` (total), ``kernels_per_step``, ``gpu_busy_ms_per_step``,
    ``kernels_per_layer`` (per step and layer), ``top``: up to ``top`` tuples
    ``(name, count per step, µs per step)``, most time first, and ``step_spans``: SGLang's step
    span names and how often each occurs (``{"step[DECODE bs=8]": 6}``; empty without them).
    """
    if steps < 1 or num_layers < 1:
        raise ValueError(f"steps ({steps}) and num_layers ({num_layers}) must be >= 1")
    count, us, spans = defaultdict(int), defaultdict(float), defaultdict(int)
    kernels_at = []  # (start, end, PRR's own, name, stream) of every kernel: the sparse path
    events = load_events(path)
    for e in events:
        cat, name = str(e.get("cat", "")).lower(), e.get("name", "?")
        if cat == "kernel":
            count[name] += 1
            us[name] += float(e.get("dur", 0.0))
            t0 = float(e.get("ts", 0.0))
            kernels_at.append((t0, t0 + float(e.get("dur", 0.0)), OWN in name, name,
                               e.get("tid", "?")))
        elif cat == "user_annotation" and name.startswith("step["):
            spans[name] += 1  # the CPU span only: its gpu_user_annotation twin is the same step
    kernels = sum(count.values())
    ranked = sorted(count, key=lambda n: (-us[n], n))[:top]
    return dict(
        steps=steps, num_layers=num_layers, kernels=kernels,
        kernels_per_step=kernels / steps,
        gpu_busy_ms_per_step=sum(us.values()) / 1e3 / steps,
        kernels_per_layer=kernels / steps / num_layers,
        top=[(n, count[n] / steps, us[n] / steps) for n in ranked],
        step_spans=dict(sorted(spans.items())),
        sparse_wall_us_per_layer=sum(sparse_spans(kernels_at)) / steps / num_layers,
        sparse_layout=sparse_layout(kernels_at), host=host_summary(events, steps))


def host_summary(events, steps: int) -> dict:
    """The host side of the recorded steps (module docstring): ``runtime_calls_per_step``,
    ``host_syncs_per_step`` (``SYNC_CALLS``), ``syncs`` (``{name: count}``) and
    ``prr_host_us_per_step`` (PRR's own Python and what it calls, exclusive time)."""
    if steps < 1:
        raise ValueError(f"steps ({steps}) must be >= 1")
    runtime, syncs = 0, defaultdict(int)
    by_thread = defaultdict(list)
    for e in events:
        cat = str(e.get("cat", "")).lower()
        if cat not in HOST_CATS or "ts" not in e:
            continue
        if cat in ("cuda_runtime", "cuda_driver"):
            runtime += 1
            if e.get("name") in SYNC_CALLS:
                syncs[e["name"]] += 1
        t0 = float(e["ts"])
        by_thread[(e.get("pid"), e.get("tid"))].append((t0, t0 + float(e.get("dur", 0.0)),
                                                         cat, str(e.get("name", ""))))
    prr_us = sum(_prr_exclusive_us(evs) for evs in by_thread.values())
    return dict(runtime_calls_per_step=runtime / steps,
                host_syncs_per_step=sum(syncs.values()) / steps, syncs=dict(sorted(syncs.items())),
                prr_host_us_per_step=prr_us / steps)


def _prr_exclusive_us(evs) -> float:
    """Exclusive µs of one thread's events ``(start, end, cat, name)`` owned by PRR's Python:
    events nest by time; an event's owner is its own frame's package for a Python frame of a
    ``.py`` file, else its parent's (built-ins, torch ops, runtime calls)."""
    total, stack = 0.0, []  # stack entries: [end, owned, exclusive µs so far]
    for t0, t1, cat, name in sorted(evs, key=lambda x: (x[0], -x[1])):
        while stack and t0 >= stack[-1][0]:
            total += _close(stack)
        parent_owned = stack[-1][1] if stack else False
        if cat == "python_function" and PY_FRAME.search(name):
            owned = bool(PRR_FRAME.search(name)) and not name.endswith(ENTRY_FRAMES)
        else:
            owned = parent_owned
        if stack:
            stack[-1][2] -= min(t1, stack[-1][0]) - t0  # the parent's time inside this child
        stack.append([t1, owned, t1 - t0])
    while stack:
        total += _close(stack)
    return total


def _close(stack) -> float:
    _, owned, excl = stack.pop()
    return max(excl, 0.0) if owned else 0.0


def sparse_clusters(kernels_at) -> list:
    """The clusters of PRR's own kernels: ``kernels_at`` holds ``(start, end, own, ...)`` per
    kernel; a cluster starts at an own kernel and ends when a kernel of another kind starts after
    every kernel of the cluster has ended (kernels of another kind that overlap it, on another
    stream, do not end it). Each cluster: ``(start, end, its own kernels' tuples in start
    order)``."""
    out, cur = [], None
    for k in sorted(kernels_at, key=lambda k: (k[0], k[1])):
        t0, t1, own = k[0], k[1], k[2]
        if own:
            if cur is None:
                cur = [t0, t1, []]
            cur[1] = max(cur[1], t1)
            cur[2].append(k)
        elif cur is not None and t0 >= cur[1]:
            out.append(tuple(cur))
            cur = None
    if cur is not None:
        out.append(tuple(cur))
    return out


def sparse_spans(kernels_at) -> list:
    """Wall spans (µs) of the clusters of PRR's own kernels (``sparse_clusters``)."""
    return [t1 - t0 for t0, t1, _ in sparse_clusters(kernels_at)]


def short_name(name: str) -> str:
    """A kernel's name without its namespace prefix and its argument list:
    ``void prr::(anonymous namespace)::f<int, 1>(prr::A)`` -> ``f<int, 1>``."""
    name = re.sub(r"^void\s+", "", name)
    name = re.sub(r"^prr::", "", name.replace("(anonymous namespace)::", ""))
    depth = 0
    for i, c in enumerate(name):  # cut at the argument list: the first "(" outside <...>
        depth += {"<": 1, ">": -1}.get(c, 0)
        if c == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


def sparse_layout(kernels_at) -> list:
    """PRR's kernels inside their clusters (``sparse_clusters``), each by short name and place
    among the cluster's kernels of that name (1 = the first): the clusters that hold it, its mean
    start and end (µs) from the cluster's start, its mean duration, and the stream it ran on most.
    Sorted by mean start; ``kernels_at`` tuples need ``(start, end, own, name, stream)``."""
    acc = {}
    for c0, _, ks in sparse_clusters(kernels_at):
        seen = defaultdict(int)
        for k in ks:
            name = short_name(k[3])
            seen[name] += 1
            a = acc.setdefault((name, seen[name]), dict(n=0, start=0.0, dur=0.0,
                                                        streams=defaultdict(int)))
            a["n"] += 1
            a["start"] += k[0] - c0
            a["dur"] += k[1] - k[0]
            a["streams"][k[4]] += 1
    rows = [dict(kernel=name, place=place, clusters=a["n"], start_us=a["start"] / a["n"],
                 dur_us=a["dur"] / a["n"], end_us=(a["start"] + a["dur"]) / a["n"],
                 stream=max(a["streams"], key=a["streams"].get))
            for (name, place), a in acc.items()]
    return sorted(rows, key=lambda r: (r["start_us"], r["kernel"], r["place"]))


STEP_RE = re.compile(r"step\[(\w+) bs=(\d+)\]")


def step_batches(step_spans: dict):
    """SGLang's step spans (``summarize``'s ``step_spans``) split into ``({batch: decode
    steps}, {other span: count})``: the batch size of every recorded decode step, and the
    steps that were not decode steps (prefill, mixed) or carry no batch size."""
    bs, other = {}, {}
    for name, n in step_spans.items():
        m = STEP_RE.fullmatch(name)
        if m and m.group(1) == "DECODE":
            bs[int(m.group(2))] = bs.get(int(m.group(2)), 0) + n
        else:
            other[name] = n
    return dict(sorted(bs.items())), other


def _cell(name: str) -> str:
    """A kernel name fit for one markdown table cell."""
    name = name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 1] + "…"
    return name.replace("|", "\\|")


def markdown(s: dict, title: str = "") -> str:
    """The summary as markdown: the totals, then the top kernels per step."""
    lines = [f"## {title}", ""] if title else []
    lines += [f"{s['steps']} profiled steps, {s['num_layers']} layers: "
              f"{s['kernels_per_step']:.1f} kernels/step, {s['kernels_per_layer']:.2f} "
              f"kernels/layer, {s['gpu_busy_ms_per_step']:.3f} ms GPU-busy/step"
              + (f", PRR's kernels {s['sparse_wall_us_per_layer']:.1f} µs wall/layer"
                 if s.get("sparse_wall_us_per_layer") else ""), ""]
    h = s.get("host")
    if h:
        lines += [f"host: {h['runtime_calls_per_step']:.1f} runtime calls/step, "
                  f"{h['host_syncs_per_step']:.2f} synchronising"
                  + (" (" + ", ".join(f"{n} x {k}" for k, n in h["syncs"].items()) + ")"
                     if h["syncs"] else "")
                  + f", PRR's Python {h['prr_host_us_per_step']:.1f} µs/step", ""]
    if s["step_spans"]:
        lines += ["recorded steps: " + ", ".join(f"{n} x {k}" for k, n in s["step_spans"].items()),
                  ""]
    lines += ["| kernel | count/step | µs/step | share |", "|---|---:|---:|---:|"]
    busy_us = s["gpu_busy_ms_per_step"] * 1e3
    for name, n, t in s["top"]:
        share = f"{100 * t / busy_us:.1f}%" if busy_us else "-"
        lines.append(f"| `{_cell(name)}` | {n:.2f} | {t:.1f} | {share} |")
    if s.get("sparse_layout"):
        lines += ["", "PRR's kernels in their clusters (mean µs from the cluster's start; #: the "
                  "kernel's place among the cluster's launches of that name):", "",
                  "| kernel | # | stream | clusters | starts | µs | ends |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for r in s["sparse_layout"]:
            lines.append(f"| `{_cell(r['kernel'])}` | {r['place']} | {r['stream']} | "
                         f"{r['clusters']} | {r['start_us']:.1f} | {r['dur_us']:.1f} | "
                         f"{r['end_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="*.trace.json.gz (or plain .json) written by the profiler")
    ap.add_argument("--layers", type=int, required=True, help="model layers (kernels/layer)")
    ap.add_argument("--steps", type=int, required=True,
                    help="forward steps the profiler recorded (the num_steps it was given)")
    ap.add_argument("--top", type=int, default=TOP)
    a = ap.parse_args(argv)
    s = summarize(a.trace, a.layers, a.steps, a.top)
    print(markdown(s, Path(a.trace).name), end="")
    return s


if __name__ == "__main__":
    main()
