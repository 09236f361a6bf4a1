"""The ``--prr-*`` flags (``sglang_prr.flags``) against SGLang's own: what the launcher fills
in (``complete_argv``), the combinations that cannot work (``check_compatibility``), the cap of K
and |P| at the context length (the last two, with the model's checks, once SGLang has resolved
its arguments: ``check_server_args``), the largest decode batch a runner carries (the budget's
bound), and how the configuration reaches every process.

The validated configuration travels to SGLang's spawned scheduler processes as JSON in the
environment variable ``SGLANG_PRR_CONFIG`` (children inherit the parent's environment), where
``sglang_prr.serving.plugin.apply()`` reads it back.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..budget import check_profile
from ..config import PRRConfig, PRRConfigError
from ..flags import FLAG_PREFIX, add_prr_args, flag_name, pop_prr_args

logger = logging.getLogger(__name__)

ENV_CONFIG = "SGLANG_PRR_CONFIG"


class PRRArgsError(ValueError):
    """An invalid PRR flag or an incompatible combination with SGLang's own flags."""


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose errors raise ``PRRArgsError`` instead of exiting (the caller decides)."""

    def error(self, message):
        raise PRRArgsError(message)


def prr_flag_names() -> List[str]:
    return [flag_name(f.name) for f in dataclasses.fields(PRRConfig)]


def _parse_prr(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    """The ``--prr-*`` flags of a command line, abbreviations included (SGLang's full parser
    takes them so), and the rest of it."""
    parser = _RaisingParser(prog="python -m sglang_prr.launch_server", add_help=False)
    add_prr_args(parser)
    return parser.parse_known_args(list(argv))


def given_prr_values(argv: Sequence[str]) -> Dict[str, Any]:
    """The ``--prr-*`` values a command line gives, by PRRConfig field, read as SGLang's parser
    reads them (``--prr-block-siz 16`` is ``block_size = 16``); empty where they do not parse
    (check_prr_argv says why)."""
    try:
        return pop_prr_args(_parse_prr(argv)[0])
    except PRRArgsError:
        return {}


def check_prr_argv(argv: Sequence[str]) -> PRRConfig:
    """Validate the ``--prr-*`` flags of a command line without SGLang (no torch either), so a
    bad value stops the launcher in about a second, before the imports and the model.

    Parses only the ``--prr-*`` flags (abbreviations as SGLang's full parser takes them);
    everything else is left for SGLang's parser. Raises ``PRRArgsError`` naming the flag or
    value, with a "did you mean" hint where one fits: an unknown ``--prr-*`` flag, a value
    ``PRRConfig.validate()`` or ``check_profile`` refuses, or ``--page-size``,
    ``--speculative-algorithm`` or ``--enable-mixed-chunk`` given against PRR (what
    ``check_compatibility`` can tell from the command line alone). Returns the configuration."""
    ns, rest = _parse_prr(argv)
    for tok in rest:
        name = tok.split("=", 1)[0]
        if name.startswith(FLAG_PREFIX):
            close = difflib.get_close_matches(name, prr_flag_names(), n=1, cutoff=0.6)
            raise PRRArgsError(f"unrecognized flag {name}" + (
                f"; did you mean {close[0]}?" if close else
                " (python -m sglang_prr.launch_server --help lists the --prr-* flags)"))
    try:
        cfg = config_from_given(pop_prr_args(ns))
    except PRRConfigError as e:
        raise PRRArgsError(str(e)) from e
    page = argv_value(argv, "--page-size")
    view = argparse.Namespace(
        page_size=int(page) if page and page.isdigit() else cfg.block_size,
        speculative_algorithm=argv_value(argv, "--speculative-algorithm"),
        enable_mixed_chunk=argv_has(argv, "--enable-mixed-chunk"))
    check_compatibility(cfg, view, has_cuda=None)
    return cfg


def config_from_given(given: Dict[str, Any]) -> PRRConfig:
    """A validated PRRConfig from user-given values (others keep their defaults), with the
    server-level rules on top (``--prr-budget auto`` needs a readable ``--prr-profile``) and
    no two given flags of which one would be ignored without a word."""
    cfg = check_profile(PRRConfig(**given).validate())
    ignored = None
    if given.get("serial") and cfg.method == "dense":
        ignored = "--prr-serial selects serial DSA, --prr-method dense turns the sparse path off"
    elif given.get("serial") and "mode" in given and cfg.mode != "exact":
        ignored = (f"--prr-mode {cfg.mode} has no effect with --prr-serial (serial DSA attends "
                   f"A alone)")
    elif "profile" in given and cfg.budget != "auto":
        ignored = (f"--prr-profile is read only with --prr-budget auto (this budget is "
                   f"{cfg.budget})")
    if ignored:
        raise PRRConfigError(f"conflicting PRR options: {ignored}; give one of them")
    return cfg


def context_len_of(server_args: Any) -> Optional[int]:
    """The context length the server will use, or None when it cannot be known cheaply.

    SGLang's own resolution (``ModelConfig.from_server_args``: ``--context-length`` if given,
    else the model config's length) when the model config loads; else ``--context-length``.
    """
    try:
        from sglang.srt.configs.model_config import ModelConfig

        n = int(ModelConfig.from_server_args(server_args).context_len)
        if n > 0:
            return n
    except Exception as e:  # never block startup on the estimate
        logger.debug("sglang_prr: model context length unknown (%s)", e)
    n = getattr(server_args, "context_length", None)
    return int(n) if n else None


def max_decode_batch_of(runner: Any) -> Optional[int]:
    """The most requests one decode forward of ``runner`` carries, CUDA-graph padding included:
    SGLang's graph buckets never exceed its request pool's rows (``req_to_token_pool.size``,
    ``--max-running-requests`` and a padding row), aligned as its graph runner aligns them.
    None when unknown (the budget then counts every profiled batch size)."""
    size = getattr(getattr(runner, "req_to_token_pool", None), "size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return None
    try:
        from sglang.srt.utils.common import get_cuda_graph_max_batch_size

        return max(int(get_cuda_graph_max_batch_size(runner.server_args, size)), size)
    except Exception as e:  # an unknown alignment: no bound rather than a wrong one
        logger.debug("sglang_prr: decode batch bound unknown (%s)", e)
        return None


def cap_to_context(cfg: PRRConfig, server_args: Any) -> Optional[int]:
    """Cap K and |P| of ``cfg`` at the server's context length, in blocks (logged once when
    it lowers them). Returns the context length used, or None (no cap: K and |P| stay as
    given, as for ``enable()`` without a known context)."""
    n = context_len_of(server_args)
    if n is None:
        logger.info("sglang_prr: context length unknown; K and |P| are not capped by it")
        return None
    cfg.cap_to_context(n)
    return n


def check_against_model(cfg: PRRConfig, server_args: Any) -> None:
    """The ``--prr-*`` values that only the model's config can judge, checked before SGLang
    starts (they failed in the scheduler after the model had loaded, with a traceback): layer
    ids of ``--prr-dense-layers`` / ``--prr-trace-layers`` in ``[0, num_layers)``, a
    ``--prr-trace-path`` that is (or can be made) a folder, and ``--prr-budget auto``'s profile
    measured for this layer shape (K and the page after ``cap_to_context``). Raises
    ``PRRArgsError``; a model config that does not load leaves the checks to the server."""
    if not cfg.enabled:
        return
    try:
        from sglang.srt.configs.model_config import ModelConfig

        mc = ModelConfig.from_server_args(server_args)
        layers = int(mc.num_hidden_layers)
    except Exception as e:  # never block startup on the model config itself
        logger.debug("sglang_prr: model config not loaded for the flag checks (%s)", e)
        return
    for flag, ids in (("--prr-dense-layers", cfg.dense_layers),
                      ("--prr-trace-layers", cfg.trace_layers if cfg.trace_path else ())):
        bad = [i for i in ids if not 0 <= int(i) < layers]
        if bad:
            raise PRRArgsError(f"{flag} {','.join(map(str, ids))}: the model has {layers} "
                               f"layers, so layer ids are in [0, {layers}); {bad} are not")
    if cfg.trace_path:
        try:
            os.makedirs(cfg.trace_path, exist_ok=True)
        except OSError as e:
            raise PRRArgsError(f"--prr-trace-path {cfg.trace_path}: not a folder traces can be "
                               f"written to ({e.strerror or e})") from None
    if cfg.budget == "auto" and not cfg.serial and cfg.profile:
        from ..budget import BudgetProfile, layer_shape

        # As the backend builds it, with the attention's tensor-parallel size taken as --tp
        # (data-parallel attention splits it otherwise: its head counts are left to the server).
        heads = {}
        if not getattr(server_args, "enable_dp_attention", False):
            tp = int(getattr(server_args, "tp_size", 1) or 1)
            heads = dict(num_kv_heads=mc.get_num_kv_heads(tp),
                         num_qo_heads=mc.get_num_attention_heads(tp))
        shape = layer_shape(cfg, cfg.block_size, int(mc.head_dim), **heads)
        try:
            BudgetProfile.load(cfg.profile).check_shape(shape)
        except (PRRConfigError, ValueError, OSError) as e:
            raise PRRArgsError(str(e)) from None


def check_server_args(cfg: PRRConfig, server_args: Any, has_cuda: bool) -> None:
    """Everything PRR checks once SGLang has resolved its arguments (``ServerArgs``), whatever
    started it (the launcher, ``sgl.Engine``): the combinations that cannot work, K and |P|
    capped at the context length (``cfg`` changes in place: export it again), and the values
    only the model's config can judge. Raises ``PRRArgsError``."""
    check_compatibility(cfg, server_args, has_cuda)
    if cfg.enabled:
        # K and |P| (and so the predictor state and the static decode widths) never exceed the
        # blocks of the context; without a known context length they stay as given.
        cap_to_context(cfg, server_args)
        check_against_model(cfg, server_args)


def check_compatibility(cfg: PRRConfig, server_args: Any, has_cuda: Optional[bool]) -> None:
    """Combinations of PRR with SGLang options that cannot work: raise ``PRRArgsError``.

    ``has_cuda`` None: the device is not known yet (the launcher's first check, before torch
    is imported), so the device-dependent rules are left for the second. Model-dependent limits
    (MLA, sliding-window attention) are only known once the model is loaded; the backend falls
    back to dense attention there, with one warning.
    """
    if not cfg.enabled:
        return
    page = int(getattr(server_args, "page_size", None) or 1)
    if page != cfg.block_size:
        raise PRRArgsError(
            f"--page-size={page} must equal --prr-block-size={cfg.block_size}: one PRR block is "
            f"one KV page (leave --page-size, or sgl.Engine's page_size, out to derive it from "
            f"the block size)")
    spec = getattr(server_args, "speculative_algorithm", None)
    if spec:
        raise PRRArgsError(
            f"--speculative-algorithm={spec} is not supported with PRR (the predictor state "
            f"assumes one new token per decode step); use --prr-method dense to disable PRR")
    if getattr(server_args, "enable_mixed_chunk", False):
        raise PRRArgsError(
            "--enable-mixed-chunk is not supported with PRR (decode tokens inside a prefill "
            "batch would skip the sparse path); remove it or use --prr-method dense")
    if has_cuda is None:
        return
    backend = getattr(server_args, "attention_backend", None)
    if not has_cuda and backend not in (None, "torch_native"):
        raise PRRArgsError(
            f"--attention-backend={backend} is not supported without a GPU; on CPU PRR runs on "
            f"torch_native (leave --attention-backend out)")
    if cfg.trace_path and has_cuda and not _decode_graphs_off(server_args):
        raise PRRArgsError(
            f"--prr-trace-path={cfg.trace_path} copies scores to the host each step and needs "
            f"the decode CUDA graphs off: --cuda-graph-backend-decode disabled")


def _decode_graphs_off(server_args: Any) -> bool:
    """Whether SGLang will run decode without CUDA graphs: any of its switches for it, on the
    parsed flags or on the resolved ``ServerArgs`` (``cuda_graph_config.decode.backend``)."""
    if (getattr(server_args, "disable_cuda_graph", False)
            or getattr(server_args, "disable_decode_cuda_graph", False)
            or getattr(server_args, "cuda_graph_backend_decode", None) == "disabled"):
        return True
    decode = getattr(getattr(server_args, "cuda_graph_config", None), "decode", None)
    return getattr(decode, "backend", None) == "disabled"


def export_config(cfg: PRRConfig) -> str:
    """Put the configuration in the environment for the spawned processes; return the JSON."""
    d = dataclasses.asdict(cfg)
    text = json.dumps(d)
    os.environ[ENV_CONFIG] = text
    return text


def load_config() -> Optional[PRRConfig]:
    """The configuration exported by the launcher (or set by the user), or None when absent."""
    text = os.environ.get(ENV_CONFIG)
    if not text:
        return None
    try:
        return PRRConfig.from_dict(json.loads(text))
    except (ValueError, TypeError) as e:
        raise PRRConfigError(f"invalid {ENV_CONFIG}: {e}") from e


def argv_has(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def argv_value(argv: Sequence[str], flag: str) -> Optional[str]:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


# Added on CPU unless given. CUDA graphs off under SGLang 0.5.17's names for it (its
# --disable-cuda-graph is deprecated and prints a warning): there is no CUDA to capture on.
CPU_FLAGS = (("--device", "cpu"), ("--attention-backend", "torch_native"),
             ("--cuda-graph-backend-decode", "disabled"),
             ("--cuda-graph-backend-prefill", "disabled"), ("--model-impl", "transformers"))
# A user's own CUDA-graph choice: then the launcher adds none of its graph flags.
USER_GRAPH_SWITCHES = ("--disable-cuda-graph", "--cuda-graph-config",
                       "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph",
                       "--cuda-graph-backend-decode", "--cuda-graph-backend-prefill")


def complete_argv(argv: List[str], has_cuda: bool, demo_path_fn=None) -> Tuple[List[str], List[str]]:
    """Fill in what the user left out: the demo model, the CPU serving flags, the page size.

    Returns ``(argv, notes)`` where notes describe each added flag (printed by the launcher).
    """
    argv = list(argv)
    notes = []
    if argv_has(argv, "--help") or argv_has(argv, "-h"):
        return argv, notes
    if not argv_has(argv, "--model-path") and not argv_has(argv, "--model"):
        if demo_path_fn is None:
            from ..tools.demo import demo_model_path as demo_path_fn
        path = demo_path_fn()
        argv += ["--model-path", path]
        notes.append(f"--model-path {path} (built-in demo model)")
    if not has_cuda:
        own_graphs = any(argv_has(argv, f) for f in USER_GRAPH_SWITCHES)
        for flag, val in CPU_FLAGS:
            if argv_has(argv, flag) or (own_graphs and flag.startswith("--cuda-graph-")):
                continue
            argv += [flag, val]
            notes.append(f"{flag} {val}")
    if not argv_has(argv, "--page-size"):
        # The block size as the parsers will read it (an abbreviated flag too: a look for the
        # exact name missed --prr-block-siz and added the default's page size against it).
        given = given_prr_values(argv)
        if given.get("method") != "dense":
            block = str(given.get("block_size", PRRConfig().block_size))
            argv += ["--page-size", block]
            notes.append(f"--page-size {block} (= --prr-block-size)")
    return argv, notes
