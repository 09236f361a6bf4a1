"""``python -m sglang_prr.launch_server [SGLang flags] [--prr-* flags]``: SGLang's server with PRR.

Without ``--model-path`` it serves the built-in demo model (``sglang_prr.demo``). Without a GPU
it adds ``--device cpu --attention-backend torch_native --disable-cuda-graph --model-impl
transformers``. Without ``--page-size`` the page size is the PRR block size. Invalid PRR values
and incompatible combinations exit with status 2 and a message naming the value and the
allowed range.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

from .config import PRRConfigError
from .server_args_patch import (PRRArgsError, add_prr_args, check_compatibility, complete_argv,
                                config_from_given, export_config, pop_prr_args)

logger = logging.getLogger("sglang_prr")

# Defaults on CPU when the user gives none: a modest KV pool (SGLang would otherwise size it from
# free host memory, which takes tens of seconds to allocate) and a matching request cap.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 262144
CPU_DEFAULT_MAX_RUNNING_REQUESTS = 64


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def build_parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog="python -m sglang_prr.launch_server",
        description="SGLang server with PRR (Predict, Reuse, Repair) sparse decoding. Without "
                    "--model-path it serves a tiny built-in demo model.")
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:  # the demo model is the default here
        if "--model-path" in action.option_strings:
            action.required = False
            action.help = (action.help or "") + " (default: the built-in PRR demo model)"
    add_prr_args(parser)
    return parser


def prepare(argv: List[str]):
    """Parse and validate; returns ``(server_args, cfg, notes)`` or raises ``SystemExit``."""
    from sglang.srt.server_args import ServerArgs

    has_cuda = _has_cuda()
    argv, notes = complete_argv(argv, has_cuda)
    if not has_cuda:
        from .server_args_patch import argv_has

        if not argv_has(argv, "--max-total-tokens"):
            argv += ["--max-total-tokens", str(CPU_DEFAULT_MAX_TOTAL_TOKENS)]
            notes.append(f"--max-total-tokens {CPU_DEFAULT_MAX_TOTAL_TOKENS}")
        if not argv_has(argv, "--dtype"):  # fp32 on CPU: half precision is slow and lossy there
            argv += ["--dtype", "float32"]
            notes.append("--dtype float32")
        if not argv_has(argv, "--max-running-requests"):
            argv += ["--max-running-requests", str(CPU_DEFAULT_MAX_RUNNING_REQUESTS)]
            notes.append(f"--max-running-requests {CPU_DEFAULT_MAX_RUNNING_REQUESTS}")
    parser = build_parser()
    ns = parser.parse_args(argv)
    given = pop_prr_args(ns)
    try:
        cfg = config_from_given(given)
    except PRRConfigError as e:
        parser.exit(2, f"error: {e}\n")
    logging.basicConfig(level=getattr(logging, ns.log_level.upper(), logging.INFO),
                        format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                        force=True)
    try:
        check_compatibility(cfg, ns, has_cuda)
    except PRRArgsError as e:
        parser.exit(2, f"error: {e}\n")
    export_config(cfg)
    server_args = ServerArgs.from_cli_args(ns)
    try:
        check_compatibility(cfg, server_args, has_cuda)  # after SGLang's own derivations
    except PRRArgsError as e:
        parser.exit(2, f"error: {e}\n")
    return server_args, cfg, notes


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return
    server_args, cfg, notes = prepare(argv)
    from . import plugin

    plugin.apply()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    for n in notes:
        logger.info("sglang_prr: added %s", n)
    url = f"http://{server_args.host}:{server_args.port}"
    logger.info("sglang_prr: PRR %s. Query it with:\n  curl %s/generate -H 'Content-Type: "
                "application/json' -d '{\"text\": \"the attention\", \"sampling_params\": "
                "{\"max_new_tokens\": 16}}'\n  curl %s/prr/stats", "on" if cfg.enabled else "off",
                url, url)
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.utils import kill_process_tree

    try:
        launch_server(server_args, run_scheduler_process_func=plugin.run_scheduler_process)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
