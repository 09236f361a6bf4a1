"""Speculation budget (PRR.md section 7): whether to speculate at all, and with which delta.

``min |A \\ P|  s.t.  |P| <= delta |A|``: a larger delta covers more of A, but the speculative pass
over P runs beside the selection and must fit in its window, or it lengthens the critical path;
when even P = A does not fit, serial DSA (no P, no side stream) is the faster step. Which of these
holds depends on the GPU, the layer's shape, the context and above all the batch size, so
``--prr-budget auto`` reads a profile measured once on the serving GPU by
``python -m sglang_prr.profile_budget`` (format version 2)::

    {"version": 2, "gpu": "NVIDIA H200",
     "shape": {"method": "quest", "num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128,
               "page_size": 64, "top_k_tokens": 2048},
     "hit_rate": 0.7, "layers": 4, ...,
     "layer_us": [{"batch": 1, "context": 32768, "delta": 0.0, "us": 151.2}, ...]}

``layer_us`` is the time of one decoder layer (attention step plus the rest of the layer's GEMMs)
in a CUDA graph; ``delta`` 0 is serial DSA. SGLang captures one decode graph per batch size, so
the choice is made per batch size and stays static inside each graph: for batch ``b`` the policy
takes the profiled batch size nearest to ``b`` (in log2, ties to the larger), averages over the
profiled contexts each delta's time relative to serial DSA, and picks the fastest delta, or serial
DSA when no delta saves at least ``1 - SPECULATE_MARGIN`` of the layer. The choice is made on the
host when a forward is planned, never inside a graph.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from .config import PRRConfig, PRRConfigError

PROFILE_VERSION = 2
# The deltas the profiler measures by default (0 = serial DSA).
DEFAULT_DELTAS = (0.0, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
# Speculate only when it saves at least 1% of the layer: smaller gains are within the noise of a
# profile, and serial DSA has no side stream to get wrong.
SPECULATE_MARGIN = 0.99
SHAPE_KEYS = ("method", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "top_k_tokens")



def check_profile(cfg: PRRConfig) -> PRRConfig:
    """The server-level rule for ``budget='auto'``: it needs a readable profile; returns ``cfg``.

    Not part of ``PRRConfig.validate()`` (a config may be built before its profile exists), but
    a server started with ``--prr-budget auto`` and no readable ``--prr-profile`` would only
    fail in the scheduler; the launcher refuses both up front. Whether the profile was measured
    for the model's shape is checked where the shape is known (the backend).
    """
    if not (cfg.enabled and cfg.budget == "auto"):
        return cfg
    if not cfg.profile:
        raise PRRConfigError(
            "invalid PRR option --prr-budget auto without --prr-profile: 'auto' picks delta "
            "from an offline latency profile; give --prr-profile PATH (a profile JSON made by "
            "`python -m sglang_prr.profile_budget --model-path MODEL --out PROFILE.json` on the "
            "serving GPU) or a fixed number, e.g. --prr-budget 1.5")
    try:
        BudgetProfile.load(cfg.profile)
    except (OSError, ValueError) as e:
        raise PRRConfigError(
            f"invalid PRR option --prr-profile={cfg.profile!r} for --prr-budget auto: {e} "
            f"(allowed: a profile JSON made by python -m sglang_prr.profile_budget)") from e
    return cfg

@dataclass
class BudgetProfile:
    """A measured profile: ``layer_us[(batch, context, delta)]`` in microseconds per layer."""

    shape: Dict[str, object]
    layer_us: Dict[Tuple[int, int, float], float]
    meta: Dict[str, object] = field(default_factory=dict)

    # ------------------------------------------------------------------ file format
    @classmethod
    def load(cls, path: str) -> "BudgetProfile":
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"PRR profile {path!r} is not JSON: {e}") from None
        return cls.from_dict(d, where=repr(path))

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "profile") -> "BudgetProfile":
        if not isinstance(d, Mapping) or d.get("version") != PROFILE_VERSION:
            got = d.get("version") if isinstance(d, Mapping) else type(d).__name__
            raise ValueError(f"PRR profile {where} has version {got!r}, expected "
                             f"{PROFILE_VERSION} (make it with python -m "
                             f"sglang_prr.profile_budget)")
        shape = d.get("shape")
        if not isinstance(shape, Mapping) or any(k not in shape for k in SHAPE_KEYS):
            raise ValueError(f"PRR profile {where}: 'shape' must hold {list(SHAPE_KEYS)}, got "
                             f"{shape!r}")
        us: Dict[Tuple[int, int, float], float] = {}
        for i, e in enumerate(d.get("layer_us") or []):
            try:
                key = (int(e["batch"]), int(e["context"]), float(e["delta"]))
                t = float(e["us"])
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"PRR profile {where}: layer_us[{i}] = {e!r} needs batch, "
                                 f"context, delta and us ({err})") from None
            if key[0] < 1 or key[1] < 1 or not (key[2] == 0.0 or key[2] >= 1.0):
                raise ValueError(f"PRR profile {where}: layer_us[{i}] has batch {key[0]}, "
                                 f"context {key[1]}, delta {key[2]} (need batch, context >= 1 "
                                 f"and delta 0 or >= 1)")
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"PRR profile {where}: layer_us[{i}] has us = {t} (need a "
                                 f"finite time > 0)")
            us[key] = t
        if not us:
            raise ValueError(f"PRR profile {where} has no layer_us entries")
        prof = cls(dict(shape), us, {k: v for k, v in d.items()
                                     if k not in ("shape", "layer_us")})
        for b in prof.batch_sizes:
            for c in prof.contexts:
                if (b, c, 0.0) not in us:
                    raise ValueError(f"PRR profile {where} lacks serial DSA (delta 0) at batch "
                                     f"{b}, context {c}: every point needs its baseline")
        return prof

    def to_dict(self) -> Dict[str, object]:
        rows = [{"batch": b, "context": c, "delta": dl, "us": round(t, 3)}
                for (b, c, dl), t in sorted(self.layer_us.items())]
        return {**self.meta, "version": PROFILE_VERSION, "shape": self.shape, "layer_us": rows}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    # ------------------------------------------------------------------ queries
    @property
    def batch_sizes(self) -> List[int]:
        return sorted({b for b, _, _ in self.layer_us})

    @property
    def contexts(self) -> List[int]:
        return sorted({c for _, c, _ in self.layer_us})

    def nearest_batch(self, batch: int) -> int:
        """The profiled batch size nearest to ``batch`` in log2 (ties to the larger)."""
        lb = math.log2(max(int(batch), 1))
        return min(self.batch_sizes, key=lambda b: (abs(math.log2(b) - lb), -b))

    def relative(self, batch: int) -> Dict[float, float]:
        """delta -> mean over the profiled contexts of its layer time relative to serial DSA,
        at the profiled batch size nearest to ``batch`` (deltas measured at every context)."""
        b = self.nearest_batch(batch)
        ctxs = self.contexts
        deltas = sorted({dl for bb, _, dl in self.layer_us if bb == b})
        out = {}
        for dl in deltas:
            if all((b, c, dl) in self.layer_us for c in ctxs):
                out[dl] = sum(self.layer_us[(b, c, dl)] / self.layer_us[(b, c, 0.0)]
                              for c in ctxs) / len(ctxs)
        return out

    def choose(self, batch: int, max_budget: float) -> float:
        """The delta for batch size ``batch`` (0.0: serial DSA), at most ``max_budget``."""
        rel = {dl: r for dl, r in self.relative(batch).items() if dl <= max_budget + 1e-9}
        spec = {dl: r for dl, r in rel.items() if dl > 0}
        if not spec:
            return 0.0
        best = min(spec, key=lambda dl: (spec[dl], dl))
        return best if spec[best] <= SPECULATE_MARGIN else 0.0

    def compared(self) -> Optional["BudgetProfile"]:
        """The profile at its ``compare`` entry's hit rate (``profile_budget
        --compare-hit-rate``: its speculative times, serial DSA's shared), or None."""
        cmp = self.meta.get("compare")
        if not cmp:
            return None
        us = {k: t for k, t in self.layer_us.items() if k[2] == 0.0}
        us.update({(int(e["batch"]), int(e["context"]), float(e["delta"])): float(e["us"])
                   for e in cmp["layer_us"]})
        return BudgetProfile(dict(self.shape), us, {"hit_rate": cmp["hit_rate"]})

    def check_shape(self, shape: Mapping[str, object]) -> None:
        """Raise ``PRRConfigError`` unless the profile was measured for ``shape``."""
        diff = {k: (self.shape.get(k), shape.get(k)) for k in SHAPE_KEYS
                if k in shape and self.shape.get(k) != shape.get(k)}
        if diff:
            detail = ", ".join(f"{k}: profile {a!r} vs server {b!r}" for k, (a, b) in diff.items())
            raise PRRConfigError(
                f"invalid PRR option --prr-profile: measured for another layer shape ({detail}); "
                f"make one for this model with python -m sglang_prr.profile_budget")


class BudgetPolicy:
    """The speculation budget of each decode batch size: ``delta(batch)`` (0.0 = serial DSA).

    Fixed by the config (``--prr-serial``: 0; a number: that delta for every batch) or, with
    ``--prr-budget auto``, chosen from the profile. ``shape`` (``SHAPE_KEYS``) is checked
    against the profile's when given.
    """

    def __init__(self, cfg: PRRConfig, shape: Optional[Mapping[str, object]] = None):
        self.cfg = cfg
        self.profile: Optional[BudgetProfile] = None
        if cfg.enabled and not cfg.serial and cfg.budget == "auto":
            if not cfg.profile:
                raise PRRConfigError("invalid PRR option --prr-budget auto without "
                                     "--prr-profile (see python -m sglang_prr.profile_budget)")
            self.profile = BudgetProfile.load(cfg.profile)
            if shape is not None:
                self.profile.check_shape(shape)
        self._cache: Dict[int, float] = {}

    def delta(self, batch: int) -> float:
        if self.cfg.serial or not self.cfg.enabled:
            return 0.0
        if self.profile is None:
            return float(self.cfg.budget)
        if batch not in self._cache:
            self._cache[batch] = self.profile.choose(batch, self.cfg.max_budget)
        return self._cache[batch]

    def predicted_blocks(self, batch: int) -> int:
        """|P| in middle blocks for batch size ``batch``; 0 for serial DSA."""
        d = self.delta(batch)
        return 0 if d == 0 else self.cfg.predicted_blocks_for(d)

    def may_speculate(self) -> bool:
        """False when no batch size ever speculates (calibration is then useless)."""
        if self.cfg.serial or not self.cfg.enabled:
            return False
        if self.profile is None:
            return True
        return any(self.profile.choose(b, self.cfg.max_budget) > 0
                   for b in self.profile.batch_sizes)

    def reasons(self) -> Dict[str, str]:
        """Why each profiled batch size runs what it runs (``describe``), in words: the
        fastest speculative delta's layer time relative to serial DSA (mean over the profiled
        contexts) against the margin; a fixed budget says so under ``"*"``."""
        if self.cfg.serial or not self.cfg.enabled:
            return {"*": "serial DSA (--prr-serial)"}
        if self.profile is None:
            return {"*": f"fixed budget delta {float(self.cfg.budget):g}"}
        prof, out = self.profile, {}
        ctx = ", ".join(f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in prof.contexts)
        for b in prof.batch_sizes:
            rel = {dl: r for dl, r in prof.relative(b).items()
                   if 0 < dl <= self.cfg.max_budget + 1e-9}
            chosen = prof.choose(b, self.cfg.max_budget)
            if not rel:
                out[str(b)] = "serial DSA: no speculative delta <= --prr-max-budget profiled"
                continue
            best = min(rel, key=lambda dl: (rel[dl], dl))
            cost = f"delta {best:g} costs {rel[best]:.3f}x serial DSA per layer (mean over {ctx})"
            out[str(b)] = (f"PRR, {cost}" if chosen > 0 else
                           f"serial DSA: the fastest {cost}, above the {SPECULATE_MARGIN:g} margin")
        return out

    def describe(self) -> Dict[str, float]:
        """The choice per profiled batch size (or the fixed delta under ``"*"``)."""
        if self.profile is None:
            return {"*": self.delta(1)}
        return {str(b): self.profile.choose(b, self.cfg.max_budget)
                for b in self.profile.batch_sizes}
