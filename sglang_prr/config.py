"""PRRConfig: every PRR option, its default and its validation (the one source of truth).

The ``--prr-*`` server flags are generated from the fields of this dataclass
(``server_args_patch``), so a new option is added here once, with its help text and its check.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

METHODS = ("quest", "infllm_v2", "dense")
MODES = ("exact", "union")
PREDICTORS = ("fused", "side")
BLOCK_SIZES = (16, 32, 64, 128)
TOPK_UNITS = ("tokens", "blocks")

# The paper's calibration grid (section 5 of PRR.md): 4 x 5 x 4 = 80 candidates.
DEFAULT_ALPHAS = (0.2, 0.4, 0.6, 0.8)
DEFAULT_BETAS = (0.1, 0.2, 0.3, 0.4, 0.5)
DEFAULT_GAMMAS = (0.0, 0.25, 0.5, 0.75)

# InfLLM-v2 compresses keys with windows of 32 tokens at stride 16 (MiniCPM4's setting).
INFLLM_WINDOW = 32
INFLLM_STRIDE = 16


logger = logging.getLogger("sglang_prr")


class PRRConfigError(ValueError):
    """An invalid PRR option: the message names the option, the value and the allowed range."""


def _meta(help: str, **kw: Any) -> Dict[str, Any]:
    return {"help": help, **kw}


@dataclass
class PRRConfig:
    """Every PRR option. Field names map to flags: ``top_k`` -> ``--prr-top-k``."""

    method: str = field(default="quest", metadata=_meta(
        "Dynamic sparse attention method: quest | infllm_v2 | dense (dense turns PRR off).",
        choices=METHODS))
    block_size: int = field(default=64, metadata=_meta(
        "PRR block size in tokens; one block is one SGLang KV page, so it must equal --page-size.",
        choices=BLOCK_SIZES))
    top_k: int = field(default=2048, metadata=_meta(
        "Selection budget K, in --prr-top-k-unit (sink and local blocks are kept on top of it)."))
    top_k_unit: str = field(default="tokens", metadata=_meta(
        "Unit of --prr-top-k: tokens (rounded up to whole blocks) or blocks.", choices=TOPK_UNITS))
    budget: Union[float, str] = field(default=1.5, metadata=_meta(
        "Speculation budget delta: |P| <= delta*|A|; a number >= 1, or 'auto': per decode batch "
        "size, serial DSA or the fastest delta, from the latency profile (--prr-profile)."))
    max_budget: float = field(default=4.0, metadata=_meta(
        "Largest delta 'auto' may choose; fixes the static size of P in decode graphs."))
    profile: Optional[str] = field(default=None, metadata=_meta(
        "Latency profile (JSON) read by --prr-budget auto; made on the serving GPU by python -m "
        "sglang_prr.profile_budget."))
    mode: str = field(default="exact", metadata=_meta(
        "exact: attend exactly the selected set A (serial DSA semantics); union: attend P u A "
        "(the paper's kernel behaviour).", choices=MODES))
    predictor: str = field(default="side", metadata=_meta(
        "Where PRR's predictor step (Holt update, P(t+1)) runs: side, as its own launch after the "
        "selection on the side stream (off the layer's critical path); fused, in the selection's "
        "launch (one launch fewer, on the critical path: quest's epilogue, infllm_v2's CTAs "
        "beside its top-K's). The same bits either way.", choices=PREDICTORS))
    serial: bool = field(default=False, metadata=_meta(
        "Decode with serial DSA (score -> select -> attend) instead of PRR: the baseline that "
        "--prr-mode exact reproduces."))
    sink_blocks: int = field(default=1, metadata=_meta(
        "Leading blocks always attended (attention sink), not counted in K."))
    local_blocks: int = field(default=1, metadata=_meta(
        "Newest blocks always attended (the current partial block), not counted in K."))
    dense_layers: Tuple[int, ...] = field(default=(), metadata=_meta(
        "Comma-separated layer ids that always use dense attention (e.g. '0,1')."))
    min_context: int = field(default=4096, metadata=_meta(
        "Requests shorter than this many tokens attend every block (dense attention, through "
        "the same sparse kernels)."))
    calib_alphas: Tuple[float, ...] = field(default=DEFAULT_ALPHAS, metadata=_meta(
        "Calibration grid for the level smoothing alpha, each in (0, 1]."))
    calib_betas: Tuple[float, ...] = field(default=DEFAULT_BETAS, metadata=_meta(
        "Calibration grid for the trend smoothing beta, each in (0, 1]."))
    calib_gammas: Tuple[float, ...] = field(default=DEFAULT_GAMMAS, metadata=_meta(
        "Calibration grid for the trend weight gamma, each in [0, 1]."))
    calib_queries: int = field(default=32, metadata=_meta(
        "Prefill queries sampled per chunk for calibration (0 disables calibration)."))
    default_theta: Tuple[float, float, float] = field(default=(0.6, 0.3, 0.5), metadata=_meta(
        "(alpha, beta, gamma) used until the first calibration. A request that cannot calibrate "
        "(fewer than 2 new tokens, e.g. a radix-cache hit but for its last token) starts from "
        "the θ* last chosen per layer."))
    metrics_interval: int = field(default=0, metadata=_meta(
        "Log PRR metrics every N decode batches (0: never; /prr/stats always works)."))
    trace_path: Optional[str] = field(default=None, metadata=_meta(
        "Record per-step block scores of chosen requests/layers to this .npz-directory."))
    trace_layers: Tuple[int, ...] = field(default=(0,), metadata=_meta(
        "Layer ids recorded by --prr-trace-path."))
    trace_max_steps: int = field(default=256, metadata=_meta(
        "Decode steps recorded per traced request (bounds the trace size)."))
    trace_max_requests: int = field(default=8, metadata=_meta(
        "Requests recorded by --prr-trace-path before recording stops."))
    max_context_blocks: Optional[int] = field(default=None, metadata=_meta(
        "Cap on K and |P|, in blocks. The launcher sets it to ceil(context length / block "
        "size) from --context-length or the model's config (a smaller value given here wins); "
        "unset and unknown: K and |P| are not capped."))

    # ------------------------------------------------------------------ derived values
    @property
    def enabled(self) -> bool:
        return self.method != "dense"

    @property
    def requested_top_k_blocks(self) -> int:
        """K in blocks as given (tokens are rounded up to whole blocks), before the cap."""
        if self.top_k_unit == "blocks":
            return int(self.top_k)
        return -(-int(self.top_k) // int(self.block_size))

    @property
    def top_k_blocks(self) -> int:
        """K in blocks (tokens rounded up to whole blocks), at most ``max_context_blocks``."""
        k = self.requested_top_k_blocks
        if self.max_context_blocks is not None:
            k = min(k, int(self.max_context_blocks))
        return k

    @property
    def delta(self) -> float:
        """The fixed delta, or max_budget when 'auto' (the static upper bound)."""
        return float(self.max_budget) if self.budget == "auto" else float(self.budget)

    @property
    def predicted_blocks(self) -> int:
        """|P| in middle blocks: floor(delta * K), at least K, at most ``max_context_blocks``
        (this is the static width of P in the predictor state and the decode graphs)."""
        return self.predicted_blocks_for(self.delta)

    def predicted_blocks_for(self, delta: float) -> int:
        """|P| in middle blocks at budget ``delta`` (>= 1): floor(delta * K), at least K, at most
        ``max_context_blocks``."""
        k = self.top_k_blocks
        p = max(k, int(math.floor(float(delta) * k + 1e-9)))
        if self.max_context_blocks is not None:
            p = min(p, int(self.max_context_blocks))
        return p

    def cap_to_context(self, context_len: Optional[int]) -> "PRRConfig":
        """Cap K and |P| at the blocks of a ``context_len``-token context (ceil(context_len /
        block_size)); a smaller ``max_context_blocks`` already set is kept. Logs once, here,
        when the cap lowers K or |P|. ``None`` (context length unknown) changes nothing."""
        if context_len is None:
            return self
        context_len = _int("context_len", context_len)
        if context_len < 1:
            _fail("context_len", context_len, "an integer >= 1")
        blocks = -(-context_len // int(self.block_size))
        if self.max_context_blocks is not None:
            blocks = min(blocks, int(self.max_context_blocks))
        before = (self.top_k_blocks, self.predicted_blocks)
        self.max_context_blocks = blocks
        after = (self.top_k_blocks, self.predicted_blocks)
        if after != before:
            logger.warning("sglang_prr: K capped from %d to %d blocks and |P| from %d to %d "
                           "blocks: a %d-token context has %d blocks of %d tokens", before[0],
                           after[0], before[1], after[1], context_len, blocks, self.block_size)
        return self

    @property
    def theta_grid(self) -> List[Tuple[float, float, float]]:
        """The calibration candidates, alpha-major (alpha, beta, gamma)."""
        return [(a, b, g) for a in self.calib_alphas for b in self.calib_betas
                for g in self.calib_gammas]

    # ------------------------------------------------------------------ validation
    def validate(self) -> "PRRConfig":
        """Normalise types and check every value; raise PRRConfigError naming the bad one."""
        self.dense_layers = _int_tuple("dense_layers", self.dense_layers)
        self.trace_layers = _int_tuple("trace_layers", self.trace_layers)
        self.calib_alphas = _float_tuple("calib_alphas", self.calib_alphas)
        self.calib_betas = _float_tuple("calib_betas", self.calib_betas)
        self.calib_gammas = _float_tuple("calib_gammas", self.calib_gammas)
        self.default_theta = _float_tuple("default_theta", self.default_theta)

        _choice("method", self.method, METHODS)
        _choice("mode", self.mode, MODES)
        _choice("predictor", self.predictor, PREDICTORS)
        _choice("top_k_unit", self.top_k_unit, TOPK_UNITS)
        self.block_size = _int("block_size", self.block_size)
        _choice("block_size", self.block_size, BLOCK_SIZES)
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < 1:
            _fail("top_k", self.top_k, "an integer >= 1")
        if self.top_k_unit == "tokens" and self.top_k < self.block_size:
            _fail("top_k", self.top_k, f">= block_size ({self.block_size}) tokens")
        if isinstance(self.budget, str) and self.budget.strip().lower() == "auto":
            self.budget = "auto"
        else:
            try:
                self.budget = float(self.budget)
            except (TypeError, ValueError):
                _fail("budget", self.budget, "a number >= 1 or 'auto'")
            if not (self.budget >= 1.0 and math.isfinite(self.budget)):
                _fail("budget", self.budget, "a finite number >= 1 or 'auto'")
        self.max_budget = float(self.max_budget)
        if not (1.0 <= self.max_budget <= 64.0):
            _fail("max_budget", self.max_budget, "[1, 64]")
        if self.budget != "auto" and self.budget > self.max_budget:
            _fail("budget", self.budget, f"[1, max_budget={self.max_budget}]")
        if isinstance(self.serial, str):
            low = self.serial.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                _fail("serial", self.serial, "a boolean (true | false)")
            self.serial = low in ("1", "true", "yes", "on")
        self.serial = bool(self.serial)
        for name in ("sink_blocks", "local_blocks"):
            v = _int(name, getattr(self, name))
            if not 0 <= v <= 64:
                _fail(name, v, "[0, 64]")
            setattr(self, name, v)
        self.min_context = _int("min_context", self.min_context)
        if self.min_context < 0:
            _fail("min_context", self.min_context, "an integer >= 0")
        for name in ("dense_layers", "trace_layers"):
            for layer in getattr(self, name):
                if layer < 0:
                    _fail(name, layer, "layer ids >= 0")
        _grid("calib_alphas", self.calib_alphas, 0.0, 1.0, lo_open=True)
        _grid("calib_betas", self.calib_betas, 0.0, 1.0, lo_open=True)
        _grid("calib_gammas", self.calib_gammas, 0.0, 1.0, lo_open=False)
        if len(self.default_theta) != 3:
            _fail("default_theta", self.default_theta, "three numbers alpha,beta,gamma")
        a, b, g = self.default_theta
        _grid("default_theta (alpha)", (a,), 0.0, 1.0, lo_open=True)
        _grid("default_theta (beta)", (b,), 0.0, 1.0, lo_open=True)
        _grid("default_theta (gamma)", (g,), 0.0, 1.0, lo_open=False)
        for name in ("calib_queries", "metrics_interval", "trace_max_steps", "trace_max_requests"):
            v = _int(name, getattr(self, name))
            if v < 0:
                _fail(name, v, "an integer >= 0")
            setattr(self, name, v)
        if self.calib_queries == 1:
            _fail("calib_queries", 1, "0 (off) or >= 2 (the predictor needs a history)")
        if self.max_context_blocks is not None:
            self.max_context_blocks = _int("max_context_blocks", self.max_context_blocks)
            if self.max_context_blocks < 1:
                _fail("max_context_blocks", self.max_context_blocks, "an integer >= 1 (or unset)")
        return self

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(top_k_blocks=self.top_k_blocks, predicted_blocks=self.predicted_blocks)
        return d

    @classmethod
    def from_options(cls, **options: Any) -> "PRRConfig":
        """``PRRConfig(**options).validate()`` (``enable()``'s options), with a name that is no
        option a ``PRRConfigError`` naming it and the closest option (not Python's TypeError)."""
        _check_names(options)
        return cls(**options).validate()

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "PRRConfig":
        """The configuration of ``to_dict()`` (or of the JSON in ``SGLANG_PRR_CONFIG``): its
        derived values are recomputed, any other name that is no option is a
        ``PRRConfigError`` (a misspelt option was dropped without a word)."""
        _check_names(d, also=_DERIVED)
        return cls(**{k: v for k, v in d.items() if k not in _DERIVED}).validate()


# The values to_dict() adds to the options (derived from them; from_dict recomputes them).
_DERIVED = ("top_k_blocks", "predicted_blocks")


def _check_names(given: Dict[str, Any], also: Sequence[str] = ()) -> None:
    """Raise ``PRRConfigError`` for the first name of ``given`` neither a ``PRRConfig`` option
    (the options are listed in the message) nor in ``also``."""
    names = [f.name for f in dataclasses.fields(PRRConfig)]
    for key in given:
        if key not in names and key not in also:
            close = difflib.get_close_matches(str(key), list(names), n=1, cutoff=0.6)
            raise PRRConfigError(f"unknown PRR option {key!r}" + (
                f"; did you mean {close[0]}?" if close else
                f" (the options: {', '.join(names)})"))


# Values people reach for that are no value of the option, and what does what they want.
_SERIAL = "serial DSA is a decode mode of quest and infllm_v2: use --prr-serial"
_OFF = "to turn PRR off use --prr-method dense"
_VALUE_HINTS = {
    "method": {"serial": _SERIAL, "dsa": _SERIAL, "serial_dsa": _SERIAL, "serial-dsa": _SERIAL,
               "prr": "PRR runs on quest (the default) or infllm_v2: leave --prr-method out",
               "exact": "exact is a mode: use --prr-mode exact",
               "union": "union is a mode: use --prr-mode union",
               "off": _OFF, "none": _OFF},
    "mode": {"serial": "use --prr-serial", "dsa": "use --prr-serial", "dense": _OFF,
             "off": _OFF},
    "budget": {v: "to decode without speculation (serial DSA) use --prr-serial"
               for v in ("0", "0.0", "off", "none", "no", "serial", "false")},
}


def _hint(name: str, value: Any, choices: Sequence[Any] = ()) -> str:
    """What the user most likely meant by an invalid ``value`` of option ``name``: a known
    mix-up (``--prr-method serial`` -> ``--prr-serial``), else the closest spelling of a choice;
    '' when nothing fits."""
    v = str(value).strip().lower()
    known = _VALUE_HINTS.get(name, {}).get(v)
    if known:
        return known
    close = difflib.get_close_matches(v, [str(c) for c in choices], n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else ""


def _fail(name: str, value: Any, allowed: str, choices: Sequence[Any] = ()) -> None:
    hint = _hint(name, value, choices)
    raise PRRConfigError(f"invalid PRR option {name}={value!r}: allowed {allowed}"
                         + (f"; {hint}" if hint else ""))


def _choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        _fail(name, value, "one of " + " | ".join(str(c) for c in choices), choices)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        _fail(name, value, "an integer")
    try:
        f = float(value)
    except (TypeError, ValueError):
        _fail(name, value, "an integer")
    if not f.is_integer():
        _fail(name, value, "an integer")
    return int(f)


def _split(value: Any) -> Sequence[Any]:
    if value is None:
        return ()
    if isinstance(value, str):
        return [v for v in value.replace(" ", "").split(",") if v != ""]
    if isinstance(value, (int, float)):
        return (value,)
    return value


def _int_tuple(name: str, value: Any) -> Tuple[int, ...]:
    return tuple(_int(name, v) for v in _split(value))


def _float_tuple(name: str, value: Any) -> Tuple[float, ...]:
    out = []
    for v in _split(value):
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            _fail(name, value, "comma-separated numbers")
    return tuple(out)


def _grid(name: str, values: Sequence[float], lo: float, hi: float, lo_open: bool) -> None:
    rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
    if len(values) == 0:
        _fail(name, values, f"a non-empty list of values in {rng}")
    for v in values:
        if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
            _fail(name, v, f"values in {rng}")
