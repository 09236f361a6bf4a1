"""The budget profiler's console output: its progress line and the profile's table (each
delta's and dense attention's layer time relative to serial DSA, and the policy's choice)."""

from __future__ import annotations

import sys
import time

from ..budget import DENSE, BudgetProfile


def progress(done: int, total: int, t0: float, what: str) -> None:
    width = 30
    fill = int(width * done / total)
    eta = (time.time() - t0) / done * (total - done)
    print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} eta {eta:4.0f} s  {what:50s}",
          end="", file=sys.stderr, flush=True)


def table(prof: BudgetProfile, max_budget: float) -> str:
    """Markdown: each delta's time relative to serial DSA, per batch and context (and dense
    attention's, when profiled), and the policy's choice per batch size over every profiled
    context; with a ``compare`` entry, each cell and choice is ``at the profile's hit rate / at
    the compare hit rate``."""
    profs = [prof] + [p for p in (prof.compared(),) if p is not None]
    deltas = sorted({d for _, _, d in prof.layer_us if d})
    dense = bool(prof.dense_us)

    def name(p, b):
        if p.dense_wins(b, max_budget):
            return DENSE
        d = p.choose(b, max_budget)
        return "serial" if d == 0 else f"delta {d:g}"

    lines = ["cells: layer time / serial DSA's at hit rate "
             + " / ".join(str(p.meta.get("hit_rate")) for p in profs), "",
             "| batch | context | serial us | " + " | ".join(f"d={d:g}" for d in deltas)
             + (" | dense" if dense else "") + " | choice |",
             "|" + "---|" * (4 + len(deltas) + int(dense))]
    for b in prof.batch_sizes:
        choice = " / ".join(name(p, b) for p in profs)
        for c in prof.contexts:
            base = prof.layer_us[(b, c, 0.0)]
            cells = [" / ".join(f"{p.layer_us[(b, c, d)] / base:.3f}" if (b, c, d) in p.layer_us
                                else "-" for p in profs) for d in deltas]
            if dense:
                cells.append(f"{prof.dense_us[(b, c)] / base:.3f}" if (b, c) in prof.dense_us
                             else "-")
            lines.append(f"| {b} | {c} | {base:.1f} | " + " | ".join(cells) + f" | {choice} |")
    return "\n".join(lines)
