"""Speculation budget (PRR.md section 7): whether to speculate at all, and with which delta.

``min |A \\ P|  s.t.  |P| <= delta |A|``: a larger delta covers more of A, but the speculative pass
over P runs beside the selection and must fit in its window, or it lengthens the critical path;
when even P = A does not fit, serial DSA (no P, no side stream) is the faster step. Which of these
holds depends on the GPU, the layer's shape, the context and above all the batch size, so
``--prr-budget auto`` reads a profile measured once on the serving GPU by
``python -m sglang_prr.profile_budget`` (format version 2)::

    {"version": 2, "gpu": "NVIDIA H200",
     "shape": {"method": "quest", "num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128,
               "page_size": 64, "top_k_tokens": 2048, "summaries": "bfloat16,bfloat16"},
     "hit_rate": 0.7, "layers": 4, ...,
     "layer_us": [{"batch": 1, "context": 32768, "delta": 0.0, "us": 151.2}, ...]}

``layer_us`` is the time of one decoder layer (attention step plus the rest of the layer's GEMMs)
in a CUDA graph; ``delta`` 0 is serial DSA. The optional ``dense_us`` (``[{"batch", "context",
"us"}]``) times the same layer with dense attention (FlashInfer's decode, as SGLang runs it).
SGLang captures one decode graph per batch size, so the choice is made per batch size and stays
static inside each graph: for batch ``b`` the policy takes the profiled batch size nearest to
``b`` (in log2, ties to the larger) and the profiled contexts the server can serve (those up to
its context length; the smallest when none is). A batch size's graph serves every one of those
contexts, so a choice must not lose at any of them: a delta qualifies when it saves at least
``1 - SPECULATE_MARGIN`` of the layer against serial DSA at every context, and the qualifying delta
with the lowest mean time relative to serial DSA is chosen (serial DSA when none qualifies).
Dense attention (``DENSE``) is chosen when it saves that much against the sparse choice at every
context: below some context the sparse module's fixed cost exceeds dense attention. So ``auto`` is
never slower than serial DSA at a profiled point (up to the margin and the profile's noise), and
runs dense only where dense is faster at every context it serves. The choice is made on the host
when a forward is planned, never inside a graph.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from .config import PRRConfig, PRRConfigError, logger

PROFILE_VERSION = 2
# The deltas the profiler measures by default (0 = serial DSA).
DEFAULT_DELTAS = (0.0, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
# Speculate only when it saves at least 1% of the layer: smaller gains are within the noise of a
# profile, and serial DSA has no side stream to get wrong.
SPECULATE_MARGIN = 0.99
SHAPE_KEYS = ("method", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "top_k_tokens")
# A shape key that profile_budget records but a profile need not hold (older ones lack it): the
# summaries' dtypes (``DSAMethod.summary_dtypes``). A server whose summaries differ warns, as for
# the predictor's placement: the choice may not be its best, but the profile still describes its
# layer.
SUMMARIES_KEY = "summaries"
# describe()'s value for a batch size that decodes with dense attention.
DENSE = "dense"



def layer_shape(cfg: PRRConfig, page_size: int, head_dim: int,
                num_kv_heads: Optional[int] = None,
                num_qo_heads: Optional[int] = None) -> Dict[str, object]:
    """The ``SHAPE_KEYS`` a profile is checked against (``BudgetProfile.check_shape``): the
    method, the layer's head sizes (those known: a key left out is not compared), the page and
    K in tokens; and ``SUMMARIES_KEY``, the method's summary dtypes at this page (left out where
    the method refuses the page: the config's checks name that)."""
    from . import methods  # the methods import torch; the launcher's early checks do not need it

    shape: Dict[str, object] = dict(method=cfg.method, head_dim=head_dim, page_size=page_size,
                                    top_k_tokens=cfg.top_k_blocks * page_size)
    try:
        shape[SUMMARIES_KEY] = methods.get(cfg.method).summary_dtypes(page_size)
    except ValueError:
        pass
    if num_kv_heads is not None:
        shape["num_kv_heads"] = num_kv_heads
    if num_qo_heads is not None:
        shape["num_qo_heads"] = num_qo_heads
    return shape


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
    dense_us: Dict[Tuple[int, int], float] = field(default_factory=dict)  # (batch, context)

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
        dense: Dict[Tuple[int, int], float] = {}
        for i, e in enumerate(d.get("dense_us") or []):
            try:
                key2, t = (int(e["batch"]), int(e["context"])), float(e["us"])
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"PRR profile {where}: dense_us[{i}] = {e!r} needs batch, "
                                 f"context and us ({err})") from None
            if (key2[0], key2[1], 0.0) not in us or not (math.isfinite(t) and t > 0):
                raise ValueError(f"PRR profile {where}: dense_us[{i}] = {e!r} needs a finite "
                                 f"time > 0 at a profiled (batch, context) of layer_us")
            dense[key2] = t
        prof = cls(dict(shape), us, {k: v for k, v in d.items()
                                     if k not in ("shape", "layer_us", "dense_us")}, dense)
        for b in prof.batch_sizes:
            for c in prof.contexts:
                if (b, c, 0.0) not in us:
                    raise ValueError(f"PRR profile {where} lacks serial DSA (delta 0) at batch "
                                     f"{b}, context {c}: every point needs its baseline")
        return prof

    def to_dict(self) -> Dict[str, object]:
        rows = [{"batch": b, "context": c, "delta": dl, "us": round(t, 3)}
                for (b, c, dl), t in sorted(self.layer_us.items())]
        out = {**self.meta, "version": PROFILE_VERSION, "shape": self.shape, "layer_us": rows}
        if self.dense_us:
            out["dense_us"] = [{"batch": b, "context": c, "us": round(t, 3)}
                               for (b, c), t in sorted(self.dense_us.items())]
        return out

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

    def contexts_upto(self, max_context: Optional[int]) -> List[int]:
        """The profiled contexts a server of at most ``max_context`` tokens serves: those up to
        it (every one without a bound; the smallest when none is that short)."""
        if max_context is None:
            return self.contexts
        return [c for c in self.contexts if c <= max_context] or self.contexts[:1]

    def ratios(self, batch: int, contexts: Optional[List[int]] = None
               ) -> Dict[float, Dict[int, float]]:
        """delta -> {context: its layer time relative to serial DSA} over ``contexts`` (default:
        every profiled one), at the profiled batch size nearest to ``batch`` (deltas measured at
        every one of those contexts; serial DSA, delta 0, is 1.0 everywhere)."""
        b = self.nearest_batch(batch)
        ctxs = contexts or self.contexts
        deltas = sorted({dl for bb, _, dl in self.layer_us if bb == b})
        return {dl: {c: self.layer_us[(b, c, dl)] / self.layer_us[(b, c, 0.0)] for c in ctxs}
                for dl in deltas if all((b, c, dl) in self.layer_us for c in ctxs)}

    def choose(self, batch: int, max_budget: float,
               contexts: Optional[List[int]] = None) -> float:
        """The delta for batch size ``batch`` (0.0: serial DSA), at most ``max_budget``: of the
        deltas within the margin of serial DSA at every one of ``contexts``, the one of the
        lowest mean time."""
        ok = {dl: sum(r.values()) / len(r) for dl, r in self.ratios(batch, contexts).items()
              if 0 < dl <= max_budget + 1e-9 and max(r.values()) <= SPECULATE_MARGIN}
        return min(ok, key=lambda dl: (ok[dl], dl)) if ok else 0.0

    def dense_ratios(self, batch: int, contexts: Optional[List[int]] = None
                     ) -> Optional[Dict[int, float]]:
        """{context: dense attention's layer time relative to serial DSA} over ``contexts``, at
        the profiled batch size nearest to ``batch``; None when the profile has no dense timing
        at one of them."""
        b, ctxs = self.nearest_batch(batch), contexts or self.contexts
        if not all((b, c) in self.dense_us for c in ctxs):
            return None
        return {c: self.dense_us[(b, c)] / self.layer_us[(b, c, 0.0)] for c in ctxs}

    def dense_wins(self, batch: int, max_budget: float,
                   contexts: Optional[List[int]] = None) -> bool:
        """Whether dense attention saves at least ``1 - SPECULATE_MARGIN`` of the layer against
        the sparse choice (``choose``) at batch size ``batch``, at every one of ``contexts``."""
        dense = self.dense_ratios(batch, contexts)
        if dense is None:
            return False
        sparse = self.ratios(batch, contexts)[self.choose(batch, max_budget, contexts)]
        return all(dense[c] <= SPECULATE_MARGIN * sparse[c] for c in dense)

    def compared(self) -> Optional["BudgetProfile"]:
        """The profile at its ``compare`` entry's hit rate (``profile_budget
        --compare-hit-rate``: its speculative times, serial DSA's shared), or None."""
        cmp = self.meta.get("compare")
        if not cmp:
            return None
        us = {k: t for k, t in self.layer_us.items() if k[2] == 0.0}
        us.update({(int(e["batch"]), int(e["context"]), float(e["delta"])): float(e["us"])
                   for e in cmp["layer_us"]})
        return BudgetProfile(dict(self.shape), us, {"hit_rate": cmp["hit_rate"]},
                             dict(self.dense_us))

    def check_shape(self, shape: Mapping[str, object]) -> None:
        """Raise ``PRRConfigError`` unless the profile was measured for ``shape``."""
        diff = {k: (self.shape.get(k), shape.get(k)) for k in SHAPE_KEYS
                if k in shape and self.shape.get(k) != shape.get(k)}
        if diff:
            detail = ", ".join(f"{k}: profile {a!r} vs server {b!r}" for k, (a, b) in diff.items())
            raise PRRConfigError(
                f"invalid PRR option --prr-profile: measured for another layer shape ({detail}); "
                f"make one for this model with python -m sglang_prr.profile_budget")


def _span(xs) -> str:
    """``0.500-0.900x``, or ``0.600x`` for one value (or equal ones)."""
    xs = sorted(xs)
    lo, hi = f"{xs[0]:.3f}", f"{xs[-1]:.3f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def _what(dense: bool, delta: float) -> str:
    """What a batch size runs, in words."""
    return DENSE if dense else (f"PRR delta {delta:g}" if delta > 0 else "serial DSA")


class BudgetPolicy:
    """What each decode batch size runs: ``dense(batch)`` (dense attention) or the speculation
    budget ``delta(batch)`` (0.0 = serial DSA).

    Fixed by the config (``--prr-serial``: 0; a number: that delta for every batch; never dense)
    or, with ``--prr-budget auto``, chosen from the profile over the contexts the server serves
    (``cfg.max_context_blocks`` blocks: the launcher sets it from the context length) and the
    batch sizes it decodes (at most ``max_batch`` requests a step: the request pool's rows; None,
    any). ``shape`` (``SHAPE_KEYS``) is checked against the profile's when given.
    """

    def __init__(self, cfg: PRRConfig, shape: Optional[Mapping[str, object]] = None,
                 max_batch: Optional[int] = None):
        if max_batch is not None and (isinstance(max_batch, bool) or
                                      not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"BudgetPolicy: max_batch must be >= 1 or None, got {max_batch!r}")
        self.cfg = cfg
        self.max_batch = max_batch
        self.profile: Optional[BudgetProfile] = None
        self.contexts: Optional[List[int]] = None
        if cfg.enabled and not cfg.serial and cfg.budget == "auto":
            if not cfg.profile:
                raise PRRConfigError("invalid PRR option --prr-budget auto without "
                                     "--prr-profile (see python -m sglang_prr.profile_budget)")
            self.profile = BudgetProfile.load(cfg.profile)
            if shape is not None:
                self.profile.check_shape(shape)
            measured_with = self.profile.meta.get("predictor", "fused")
            if measured_with != cfg.predictor:
                logger.warning("sglang_prr: the profile %s was measured with --prr-predictor %s, "
                               "this server runs %s: its choices may not be this server's best",
                               cfg.profile, measured_with, cfg.predictor)
            theirs = self.profile.shape.get(SUMMARIES_KEY)
            ours = (shape or {}).get(SUMMARIES_KEY)
            if theirs is not None and ours is not None and theirs != ours:
                logger.warning("sglang_prr: the profile %s was measured with %s summaries, this "
                               "server stores %s: its choices may not be this server's best "
                               "(remake it with python -m sglang_prr.profile_budget)",
                               cfg.profile, theirs, ours)
            bound = cfg.max_context_blocks
            self.contexts = self.profile.contexts_upto(
                None if bound is None else int(bound) * cfg.block_size)
        self._cache: Dict[int, Tuple[bool, float]] = {}
        # Decided once: when every batch size the server decodes runs dense, no summary is kept,
        # so every batch size must run dense (``dense``), whatever the profile says of it.
        # Likewise, speculation (calibration, the side stream) is set up only when a batch size
        # the server decodes speculates, so no other batch size may (``delta``).
        reached = self.reachable_batch_sizes()
        self._always_dense = self.profile is not None and all(self._choice(b)[0] for b in reached)
        self._speculates = self.profile is None or (not self._always_dense and any(
            self._choice(b)[1] > 0 for b in reached))

    def _choice(self, batch: int) -> Tuple[bool, float]:
        """(dense, delta) of batch size ``batch`` under the profile, cached."""
        if batch not in self._cache:
            prof, mb = self.profile, self.cfg.max_budget
            dense = prof.dense_wins(batch, mb, self.contexts)
            self._cache[batch] = (dense, 0.0 if dense else prof.choose(batch, mb, self.contexts))
        return self._cache[batch]

    def reachable_batch_sizes(self) -> List[int]:
        """The profiled batch sizes that decide a batch size of at most ``max_batch`` (each maps
        to its nearest profiled one); every profiled one without a bound."""
        if self.profile is None:
            return []
        sizes = self.profile.batch_sizes
        if self.max_batch is None:
            return sizes
        # Past twice the largest profiled size every batch maps to the largest.
        top = min(self.max_batch, 2 * sizes[-1] + 1)
        return sorted({self.profile.nearest_batch(b) for b in range(1, top + 1)})

    def dense(self, batch: int) -> bool:
        """Whether batch size ``batch`` decodes with dense attention (``--prr-budget auto``
        only: where the profile measures dense faster than the sparse choice; every batch size
        when ``always_dense``)."""
        if self.cfg.serial or not self.cfg.enabled or self.profile is None:
            return False
        return self._always_dense or self._choice(batch)[0]

    def always_dense(self) -> bool:
        """Whether every batch size decodes with dense attention: ``--prr-budget auto`` with a
        profile that measures dense attention faster at every batch size the server decodes
        (``reachable_batch_sizes``: a server of at most 1 request a step is decided by batch 1
        alone). No request ever decodes sparse then, so the server updates no block summary and
        calibrates nothing, and a larger batch than ``max_batch`` would run dense too."""
        return self._always_dense  # a profile is loaded only for auto, never with serial DSA

    def delta(self, batch: int) -> float:
        if self.cfg.serial or not self.cfg.enabled:
            return 0.0
        if self.profile is None:
            return float(self.cfg.budget)
        return self._choice(batch)[1] if self._speculates else 0.0

    def predicted_blocks(self, batch: int) -> int:
        """|P| in middle blocks for batch size ``batch``; 0 for serial DSA (and dense)."""
        d = self.delta(batch)
        return 0 if d == 0 else self.cfg.predicted_blocks_for(d)

    def may_speculate(self) -> bool:
        """False when no batch size the server decodes speculates (calibration is then
        useless, and ``delta`` is 0 for every batch size)."""
        if self.cfg.serial or not self.cfg.enabled:
            return False
        return self._speculates

    def reasons(self) -> Dict[str, str]:
        """Why each profiled batch size runs what it runs (``describe``), in words: the best
        speculative delta's layer time relative to serial DSA (mean, and worst over the contexts
        the server serves) and dense attention's (its range), against the margin; a fixed budget
        says so under ``"*"``."""
        if self.cfg.serial or not self.cfg.enabled:
            return {"*": "serial DSA (--prr-serial)"}
        if self.profile is None:
            return {"*": f"fixed budget delta {float(self.cfg.budget):g}"}
        prof, out, ctxs = self.profile, {}, self.contexts
        over = ", ".join(f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in ctxs)
        reached = set(self.reachable_batch_sizes())
        for b in prof.batch_sizes:
            rat = {dl: r for dl, r in prof.ratios(b, ctxs).items()
                   if 0 < dl <= self.cfg.max_budget + 1e-9}
            dense, chosen = self._choice(b)
            dr = prof.dense_ratios(b, ctxs)
            dense_says = "" if dr is None else f"; dense attention {_span(dr.values())}"
            if not rat:
                why = "no speculative delta <= --prr-max-budget profiled"
            else:  # the chosen delta, or the one closest to qualifying (lowest worst case)
                stat = {dl: (max(r.values()), sum(r.values()) / len(r)) for dl, r in rat.items()}
                best = chosen if chosen > 0 else min(stat, key=lambda dl: (*stat[dl], dl))
                why = (f"the best delta {best:g} costs {stat[best][1]:.3f}x serial DSA per layer, "
                       f"up to {stat[best][0]:.3f}x")
            said = (f"{_what(dense, chosen)}: {why}{dense_says} (over {over}; margin "
                    f"{SPECULATE_MARGIN:g} at every context)")
            if b not in reached:  # what runs follows the reached sizes (``describe``)
                said = (f"{_what(self.dense(b), self.delta(b))}: not reached, this server "
                        f"decodes at most {self.max_batch} requests a step; the profile alone: "
                        f"{said}")
            out[str(b)] = said
        return out

    def describe(self) -> Dict[str, object]:
        """The choice per profiled batch size: ``"dense"`` or the delta (0.0: serial DSA); the
        fixed delta under ``"*"``."""
        if self.profile is None:
            return {"*": self.delta(1)}
        return {str(b): DENSE if self.dense(b) else self.delta(b)
                for b in self.profile.batch_sizes}
