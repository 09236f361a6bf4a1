"""Speculation budget delta (PRR.md section 7): how large P may be at a given context length.

``min |A \\ P|  s.t.  |P| <= delta |A|``: a larger delta covers more of A, but the speculative pass
must fit inside the selection window or it lengthens the critical path. ``--prr-budget auto``
reads an offline profile measured once per (model shape, GPU, DSA method):

```json
{"shape": {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128, "page_size": 64},
 "gpu": "NVIDIA H200", "method": "quest", "top_k_tokens": 2048,
 "selection_us": {"4096": 6.1, "32768": 7.0, "131072": 9.5},
 "spec_attn_us": {"1.0": 5.2, "1.5": 6.0, "2.0": 6.9, "3.0": 8.8, "4.0": 10.7}}
```

``selection_us`` maps context length to the selection latency, ``spec_attn_us`` maps delta to the
latency of the speculative attention over ``delta * K`` blocks. The policy picks the largest delta
whose speculative pass still fits in the selection window at the batch's longest context
(selection latency interpolated linearly in log-context), clamped to ``[1, max_budget]``. It runs
on the host at plan time (``seq_lens`` on the CPU are known then), never inside the decode graph:
the graph's P has the static width of ``max_budget`` and only its device-side count changes.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from typing import Dict, Optional

from .config import PRRConfig

# Without a profile, 'auto' uses the paper's default operating point.
FALLBACK_DELTA = 1.5


@dataclass
class BudgetProfile:
    selection_us: Dict[int, float]
    spec_attn_us: Dict[float, float]

    @classmethod
    def load(cls, path: str) -> "BudgetProfile":
        with open(path) as f:
            d = json.load(f)
        try:
            sel = {int(k): float(v) for k, v in d["selection_us"].items()}
            spec = {float(k): float(v) for k, v in d["spec_attn_us"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"PRR profile {path!r} lacks selection_us/spec_attn_us maps: {e}")
        if not sel or not spec:
            raise ValueError(f"PRR profile {path!r} has an empty selection_us or spec_attn_us map")
        if any(k < 1.0 for k in spec):
            raise ValueError(f"PRR profile {path!r}: spec_attn_us keys are deltas >= 1, got "
                             f"{sorted(spec)}")
        return cls(sel, spec)

    def selection_at(self, context: int) -> float:
        """Selection latency at ``context`` tokens, linear in log-context between the points."""
        xs = sorted(self.selection_us)
        if context <= xs[0]:
            return self.selection_us[xs[0]]
        if context >= xs[-1]:
            return self.selection_us[xs[-1]]
        i = bisect.bisect_right(xs, context)
        x0, x1 = xs[i - 1], xs[i]
        t = (math.log(context) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return self.selection_us[x0] * (1 - t) + self.selection_us[x1] * t

    def delta_for(self, context: int, max_budget: float) -> float:
        """Largest profiled delta <= max_budget whose speculative pass fits the selection window;
        1.0 when none fits (P = |A| still overlaps the most it can)."""
        window = self.selection_at(context)
        best = 1.0
        for d, us in sorted(self.spec_attn_us.items()):
            if d <= max_budget and us <= window:
                best = max(best, d)
        return best


class BudgetPolicy:
    """Chooses delta per batch on the host; fixed when ``cfg.budget`` is a number."""

    def __init__(self, cfg: PRRConfig):
        self.cfg = cfg
        self.profile: Optional[BudgetProfile] = None
        if cfg.budget == "auto" and cfg.profile:
            self.profile = BudgetProfile.load(cfg.profile)

    def delta(self, max_context: int) -> float:
        if self.cfg.budget != "auto":
            return float(self.cfg.budget)
        if self.profile is None:
            return min(FALLBACK_DELTA, self.cfg.max_budget)
        return self.profile.delta_for(max_context, self.cfg.max_budget)

    def predicted_blocks(self, max_context: int) -> int:
        """|P| in middle blocks for the batch: floor(delta * K), within the static width."""
        k = self.cfg.top_k_blocks
        return min(self.cfg.predicted_blocks, max(k, int(math.floor(self.delta(max_context) * k + 1e-9))))
