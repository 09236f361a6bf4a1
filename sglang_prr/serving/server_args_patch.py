"""The ``--prr-*`` flags (``sglang_prr.flags``) against SGLang's own: what the launcher fills
in (``complete_argv``), the combinations that cannot work (``check_compatibility``), the cap of K
and |P| at the context length, and how the configuration reaches every process.

The validated configuration travels to SGLang's spawned scheduler processes as JSON in the
environment variable ``SGLANG_PRR_CONFIG`` (children inherit the parent's environment), where
``sglang_prr.serving.plugin.apply()`` reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..budget import check_profile
from ..config import PRRConfig, PRRConfigError

logger = logging.getLogger(__name__)

ENV_CONFIG = "SGLANG_PRR_CONFIG"


class PRRArgsError(ValueError):
    """An invalid PRR flag or an incompatible combination with SGLang's own flags."""


def config_from_given(given: Dict[str, Any]) -> PRRConfig:
    """A validated PRRConfig from user-given values (others keep their defaults), with the
    server-level rules on top (``--prr-budget auto`` needs a readable ``--prr-profile``)."""
    return check_profile(PRRConfig(**given).validate())


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


def check_compatibility(cfg: PRRConfig, server_args: Any, has_cuda: bool) -> None:
    """Combinations of PRR with SGLang options that cannot work: raise ``PRRArgsError``.

    Model-dependent limits (MLA, sliding-window attention) are only known once the model is
    loaded; the backend falls back to dense attention there, with one warning.
    """
    if not cfg.enabled:
        return
    page = int(getattr(server_args, "page_size", None) or 1)
    if page != cfg.block_size:
        raise PRRArgsError(
            f"--page-size={page} must equal --prr-block-size={cfg.block_size}: one PRR block is "
            f"one KV page (leave --page-size out to derive it from the block size)")
    spec = getattr(server_args, "speculative_algorithm", None)
    if spec:
        raise PRRArgsError(
            f"--speculative-algorithm={spec} is not supported with PRR (the predictor state "
            f"assumes one new token per decode step); use --prr-method dense to disable PRR")
    if getattr(server_args, "enable_mixed_chunk", False):
        raise PRRArgsError(
            "--enable-mixed-chunk is not supported with PRR (decode tokens inside a prefill "
            "batch would skip the sparse path); remove it or use --prr-method dense")
    backend = getattr(server_args, "attention_backend", None)
    if not has_cuda and backend not in (None, "torch_native"):
        raise PRRArgsError(
            f"--attention-backend={backend} is not supported without a GPU; on CPU PRR runs on "
            f"torch_native (leave --attention-backend out)")
    if cfg.trace_path and not getattr(server_args, "disable_cuda_graph", False) and has_cuda:
        raise PRRArgsError(
            f"--prr-trace-path={cfg.trace_path} copies scores to the host each step and needs "
            f"--disable-cuda-graph")


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
        for flag, val in (("--device", "cpu"), ("--attention-backend", "torch_native"),
                          ("--disable-cuda-graph", None), ("--model-impl", "transformers")):
            if not argv_has(argv, flag):
                argv += [flag] + ([val] if val is not None else [])
                notes.append(flag + (f" {val}" if val is not None else ""))
    if not argv_has(argv, "--page-size"):
        block = argv_value(argv, "--prr-block-size")
        method = argv_value(argv, "--prr-method")
        if method != "dense":
            block = block if block is not None else str(PRRConfig().block_size)
            argv += ["--page-size", block]
            notes.append(f"--page-size {block} (= --prr-block-size)")
    return argv, notes
