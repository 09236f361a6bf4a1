"""One question: where a small attention launch's time goes, link by link of its chain.

At batch 1 an attention launch is a chain of dependent steps in each CTA (the list's round trip,
the page's, the K/V copies, the block's partial, the merge's ticket, the sort and barrier, the
rows' merge), and its time is the slowest CTA's chain plus the CTAs' dispatch. This benchmark
reads the kernel's timing probe: every CTA records the SM clock at each link (``kTlEntry`` ..
``kTlExit`` in ``kernels/attn_block.cuh``), ``%globaltimer`` at entry and exit, and its SM. Each
probed launch runs eagerly after an L2 flush, on fresh inputs of ``bench_kernel_stages``' cases
(the Llama-3-8B layer, K = 2048 tokens, page 64, a 128K table).

The probe exists only in a library built with ``SGLANG_PRR_PROBES=1``::

  SGLANG_PRR_PROBES=1 python -m sglang_prr.kernels.build .kprobe
  SGLANG_PRR_KERNEL_LIB=.kprobe/libsglang_prr_kernels.so python benchmarks/bench_attn_timeline.py

Rows (CSV): per case and phase, the median / p90 / max over the CTAs that reach the phase, of
all ``--reps`` launches, in µs (the clock's stamps are converted at the SM's rated clock, which
an H200 under load runs at), and the launch-wide ``dispatch`` (a CTA's entry after the launch's
first, from ``%globaltimer``) and ``span`` (first entry to last exit); ``ctas_per_sm`` is the
most CTAs of one launch on one SM. Phases: ``lists`` (entry to the list's entries and the repeat
check), ``page`` (to the first chunk's copies issued: the page id's round trip), ``kv`` (to the
chunk's K/V in shared memory), ``mma`` (the block's MMAs and online softmax), ``combine`` (the
warps' combine and the partial's stores), ``arrival`` (the merge's ticket), ``sort_barrier``
(the entries' sort and the group's barrier), ``rows`` (the merge of this CTA's items) and
``cta`` (entry to exit).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
import bench_kernel_stages as stages  # noqa: E402  (the cases' inputs)
from sglang_prr.kernels import build  # noqa: E402

class Chain(NamedTuple):
    """A probed kernel's record: the names of its slots (probe.cuh's entry, exit and id slots
    and the kernel's links), its phases (name, from slot, to slot) in chain order, the last
    one the CTA's whole time, and the environment variable that turns its probe on."""
    slots: List[str]
    phases: List[tuple]
    env: str

    def order(self) -> List[str]:
        """The stamps in chain order: entry, each link, exit."""
        first, last = self.phases[-1][1:]
        links = [b for _, _, b in self.phases[:-1] if b != last]
        return [first] + links + [last]


# The attention's record (attn_block.cuh's AttnLink) and the phases between its stamps.
ATTENTION = Chain(
    slots=["entry_ns", "sm", "entry", "lists", "issued", "kv", "partial", "arrival", "rows",
           "exit", "exit_ns", "id", "mma", "spare13", "spare14", "spare15"],
    phases=[("lists", "entry", "lists"), ("page", "lists", "issued"), ("kv", "issued", "kv"),
            ("mma", "kv", "mma"), ("combine", "mma", "partial"),
            ("arrival", "partial", "arrival"), ("sort_barrier", "arrival", "rows"),
            ("rows", "rows", "exit"), ("cta", "entry", "exit")],
    env="SGLANG_PRR_ATTN_TIMELINE")
SLOTS, PHASES = ATTENTION.slots, ATTENTION.phases
COLUMNS = ["case", "batch", "m_blocks", "phase", "ctas", "median_us", "p90_us", "max_us",
           "ctas_per_sm", "library"]


def phase_samples(rec: torch.Tensor, khz: int, chain: Chain = ATTENTION
                  ) -> Dict[str, List[float]]:
    """Per-phase durations in µs of one launch's records ``rec [ctas, 16]`` (int64; a slot a CTA
    never reached is 0, and phases ending or starting there are left out), ``dispatch`` and
    ``span`` from the global timer. Raises on a record whose stamps run backwards."""
    col = {name: rec[:, i].tolist() for i, name in enumerate(chain.slots)}
    out: Dict[str, List[float]] = {name: [] for name, _, _ in chain.phases}
    us = 1e3 / khz  # µs per clock
    order = chain.order()
    for c in range(rec.shape[0]):
        seen = [(s, col[s][c]) for s in order if col[s][c] != 0]
        for (s0, t0), (s1, t1) in zip(seen, seen[1:]):
            if t1 < t0:
                raise ValueError(f"CTA {c}: stamp {s1} ({t1}) before {s0} ({t0})")
        for name, a, b in chain.phases:
            if col[a][c] and col[b][c]:
                out[name].append((col[b][c] - col[a][c]) * us)
    entries = [t for t in col["entry_ns"] if t]
    exits = [t for t in col["exit_ns"] if t]
    if entries:
        t0 = min(entries)
        out["dispatch"] = [(t - t0) / 1e3 for t in entries]
        out["span"] = [(max(exits) - t0) / 1e3] if exits else []
    return out


def ctas_per_sm(rec: torch.Tensor) -> int:
    """The most CTAs of one launch that ran on one SM."""
    entered = rec[:, SLOTS.index("entry")] != 0
    sms = rec[entered, SLOTS.index("sm")]
    return int(torch.bincount(sms).max()) if sms.numel() else 0


def summarize(case: str, B: int, m: int, launches: Sequence[Dict[str, List[float]]],
              per_sm: int, chain: Chain = ATTENTION) -> List[dict]:
    """One row per phase: the distribution over every CTA of every launch."""
    rows = []
    names = [p for p, _, _ in chain.phases] + ["dispatch", "span"]
    for name in names:
        xs = sorted(x for L in launches for x in L.get(name, []))
        if not xs:
            continue
        rows.append(dict(case=case, batch=B, m_blocks=m, phase=name, ctas=len(xs),
                         median_us=round(common.pct(xs, 50), 3),
                         p90_us=round(common.pct(xs, 90), 3), max_us=round(xs[-1], 3),
                         ctas_per_sm=per_sm, library=build.library_tag()))
    return rows


def probe(fn, dev, chain: Chain = ATTENTION) -> tuple:
    """Run ``fn`` eagerly after an L2 flush with the chain's probe on; the records of its last
    probed launch and the clock (kHz)."""
    flush = common.flusher(dev)
    os.environ[chain.env] = "1"
    try:
        flush()
        fn()
        rec, khz = torch.ops.sglang_prr_cuda.probe_timeline()
    finally:
        del os.environ[chain.env]
    if rec.shape[0] == 0:
        raise SystemExit("no records: the library has no probes (build it with "
                         "SGLANG_PRR_PROBES=1 python -m sglang_prr.kernels.build DIR and point "
                         "SGLANG_PRR_KERNEL_LIB at it)")
    return rec, khz


def run_case(case: str, B: int, m: int, calls, dev, chain: Chain = ATTENTION) -> List[dict]:
    """Probe each call (one launch of the chain's kernel; the records are its last launch's)
    and summarize."""
    launches, per_sm = [], 0
    for fn in calls:
        rec, khz = probe(fn, dev, chain)
        launches.append(phase_samples(rec, khz, chain))
        per_sm = max(per_sm, ctas_per_sm(rec))
    rows = summarize(case, B, m, launches, per_sm, chain)
    for r in rows:
        print(f"{case:28s} {r['phase']:12s} n={r['ctas']:<5d} median {r['median_us']:7.2f}  "
              f"p90 {r['p90_us']:7.2f}  max {r['max_us']:7.2f} us  ({per_sm} CTAs/SM max)")
    return rows


def plot(rows: Sequence[dict], png: str, chain: Chain = ATTENTION) -> None:
    """Median µs of each link of the chain, stacked per case (the launch's span beside it)."""
    plt = common.pyplot()
    if plt is None:
        return
    cases = list(dict.fromkeys(r["case"] for r in rows))
    links = [p for p, _, _ in chain.phases[:-1]]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(cases) + 1.5))
    for i, case in enumerate(cases):
        got = {r["phase"]: float(r["median_us"]) for r in rows if r["case"] == case}
        left = 0.0
        for j, p in enumerate(links):
            w = got.get(p, 0.0)
            ax.barh(i, w, left=left, color=f"C{j}", label=p if i == 0 else None)
            left += w
        if "span" in got:
            ax.plot([got["span"]], [i], "k|", markersize=14, label="span" if i == 0 else None)
    ax.set_yticks(range(len(cases)), cases)
    ax.set_xlabel("µs (median CTA's links; | the launch's span)")
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    common.save_figure(fig, png, dpi=120)


def add_run_args(ap: argparse.ArgumentParser, csv_name: str) -> None:
    """A timeline benchmark's --reps, --csv (results/<csv_name> by default) and --append."""
    ap.add_argument("--reps", type=int, default=20, help="probed launches a case")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / csv_name))
    ap.add_argument("--append", action="store_true")


def probe_device(name: str) -> torch.device:
    """The CUDA device whose kernel library the probes run in; stops without one."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{name} needs a CUDA SM90 device and the kernel library")
    dev = torch.device("cuda")
    common.require_kernels(dev)
    return dev


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=131072, help="the table's tokens")
    ap.add_argument("--tokens", type=int, default=2048, help="K: the listed tokens")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--repair-blocks", type=int, nargs="*", default=[1, 13])
    add_run_args(ap, "attn_timeline_h200.csv")
    a = ap.parse_args(argv)
    dev = probe_device("bench_attn_timeline")
    g = torch.Generator().manual_seed(0)
    page, sm = a.page, 1.0 / math.sqrt(stages.D)
    k_buf, v_buf, sets, na = stages.attention_sets(1, a.tokens, page, a.ctx // page, a.reps, dev,
                                                   g)
    rows = []
    rows += run_case("serial (attention + merge)", 1, 0,
                     [lambda s=s: stages.attention_merge_set(s, k_buf, v_buf, page, sm)
                      for s in sets], dev)
    rows += run_case("partials", 1, 0,
                     [lambda s=s: stages.partials_set(s, k_buf, v_buf, page, sm) for s in sets],
                     dev)
    for m in a.repair_blocks:
        calls = []
        for s in sets:
            mi, mc, pc = stages.repair_lists(s, na, m)
            o_s, l_s = stages.partials_set(s, k_buf, v_buf, page, sm, s["idx"], pc)
            calls.append(lambda s=s, o_s=o_s, l_s=l_s, mi=mi, mc=mc, pc=pc:
                         stages.repair_merge_set(s, k_buf, v_buf, page, sm, o_s, l_s, mi, mc,
                                                 s["idx"], pc))
        rows += run_case(f"repair + merge, |M| = {m}", 1, m, calls, dev)
    every = common.write_rows(a.csv, rows, COLUMNS, append=a.append)
    plot([r for r in every if r["library"] == build.library_tag()],
         os.path.splitext(a.csv)[0] + ".png")


if __name__ == "__main__":
    main()
