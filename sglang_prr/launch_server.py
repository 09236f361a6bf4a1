"""``python -m sglang_prr.launch_server [SGLang flags] [--prr-* flags]``: SGLang's server with PRR.

Without ``--model-path`` it serves the built-in demo model (``sglang_prr.demo``). Without a GPU
it adds ``--device cpu --attention-backend torch_native --disable-cuda-graph --model-impl
transformers``. Without ``--page-size`` the page size is the PRR block size. Invalid PRR values
and incompatible combinations exit with status 2 and a message naming the value and the
allowed range.

Process layout: the command you run is a small supervisor (no torch, no SGLang imported) that
starts the server proper as its child (the same command with ``SGLANG_PRR_SUPERVISED=1``) and
relays its exit status. On SIGTERM or SIGINT the supervisor forwards the signal to the server
(SGLang drains and stops), waits up to ``SGLANG_PRR_STOP_GRACE_S`` seconds (default 15) for it
to exit, then terminates and finally kills every process still below it, and exits with 128 +
the signal number; a second signal skips the wait. It is a child subreaper on Linux, so
processes orphaned by the server are still found (their SIGQUIT, SGLang's "a child failed"
signal to its parent, is passed on to the server), and the server gets SIGTERM if the
supervisor itself is killed.
Set ``SGLANG_PRR_SUPERVISED=1`` to run the server in the launching process instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional

from .config import PRRConfigError
from .server_args_patch import (PRRArgsError, add_prr_args, cap_to_context, check_compatibility,
                                complete_argv, config_from_given, export_config, pop_prr_args)

logger = logging.getLogger("sglang_prr")

# Defaults on CPU when the user gives none: a modest KV pool (SGLang would otherwise size it from
# free host memory, which takes tens of seconds to allocate) and a matching request cap.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 262144
CPU_DEFAULT_MAX_RUNNING_REQUESTS = 64

# Set in the server process started by the supervisor (``main``); set it yourself to run the
# server in the launching process (no supervisor).
ENV_SUPERVISED = "SGLANG_PRR_SUPERVISED"
ENV_STOP_GRACE = "SGLANG_PRR_STOP_GRACE_S"
DEFAULT_STOP_GRACE_S = 15.0  # SGLang's own drain + scheduler shutdown takes ~5-10 s when idle
TERM_WAIT_S = 3.0  # after SIGTERM to the leftovers, before SIGKILL


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
    if cfg.enabled:
        # K and |P| (and so the predictor state and the static decode widths) never exceed the
        # blocks of the context; without a known context length they stay as given.
        cap_to_context(cfg, server_args)
        export_config(cfg)
    return server_args, cfg, notes


def serve(argv: List[str]) -> None:
    """Run the SGLang server with PRR in this process (what the supervisor's child runs)."""
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


# ----------------------------------------------------------------------------- supervisor
def _prctl(option: int, arg: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except Exception:  # best effort: psutil still finds the descendants that keep their parent
        pass


PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _child_preexec() -> None:
    # The server gets SIGTERM if the supervisor dies without cleaning up (e.g. SIGKILL).
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop_grace_s() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_STOP_GRACE, DEFAULT_STOP_GRACE_S)))
    except ValueError:
        return DEFAULT_STOP_GRACE_S


def _descendants(me) -> list:
    import psutil

    try:
        return me.children(recursive=True)
    except psutil.Error:
        return []


def _reap(me, keep_pid: int) -> None:
    """Collect exited orphans that were re-parented to the supervisor (never the server,
    whose status ``subprocess`` collects)."""
    import psutil

    try:
        kids = me.children()
    except psutil.Error:
        return
    for p in kids:
        if p.pid == keep_pid:
            continue
        try:
            os.waitpid(p.pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _alive(procs) -> list:
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _end_all(me, known: dict, child) -> None:
    """SIGTERM, then SIGKILL, every process still below the supervisor (and the ones seen
    before that may have been re-parented elsewhere)."""
    import psutil

    for p in _descendants(me):
        known.setdefault(p.pid, p)
    procs = _alive(known.values())
    if procs:
        logger.warning("sglang_prr: stopping %d leftover process(es): %s", len(procs),
                       " ".join(str(p.pid) for p in procs))
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, procs = psutil.wait_procs(procs, timeout=TERM_WAIT_S)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=TERM_WAIT_S)
    try:
        child.wait(timeout=TERM_WAIT_S)
    except subprocess.TimeoutExpired:
        pass
    _reap(me, child.pid)


def supervise(argv: List[str], cmd: Optional[List[str]] = None) -> int:
    """Start the server as a child process; stop it and everything below it on SIGTERM/SIGINT.

    ``cmd`` replaces the server command (tests). Returns the exit status: the server's own (2
    for invalid flags), or 128 + the signal number when stopped by a signal.
    """
    import psutil

    from .server_args_patch import argv_value

    level = str(argv_value(argv, "--log-level") or "info").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    got: List[int] = []
    quits: List[int] = []

    def on_signal(signum, frame):  # only record: the loop below does the work
        (quits if signum == signal.SIGQUIT else got).append(signum)

    # Handlers before the child exists, so that no signal can orphan it. SIGQUIT is SGLang's
    # "a child failed" signal to its parent; an orphaned SGLang process re-parented here sends
    # it to us, so it is passed on to the server (or ends the run when the server is gone).
    sigs = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGQUIT] if hasattr(signal, "SIGQUIT")
                                              else [])
    old = {s: signal.signal(s, on_signal) for s in sigs}
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    me = psutil.Process()
    env = dict(os.environ)
    env[ENV_SUPERVISED] = "1"
    known: dict = {}
    cmd = cmd or [sys.executable, "-m", "sglang_prr.launch_server", *argv]
    child = subprocess.Popen(cmd, env=env,
                             preexec_fn=_child_preexec if os.name == "posix" else None)
    try:
        polls = 0
        while not got:
            try:
                rc = child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                rc = None
            polls += 1
            if polls % 4 == 0:  # every ~2 s: remember who is below us, collect orphans
                for p in _descendants(me):
                    known.setdefault(p.pid, p)
                _reap(me, child.pid)
            if quits and rc is None and not got:
                quits.clear()
                try:
                    child.send_signal(signal.SIGQUIT)  # SGLang's handler ends its process tree
                except ProcessLookupError:
                    pass
            if rc is not None and not got:
                _end_all(me, known, child)  # what a crashed server left behind
                return rc if rc >= 0 else 128 - rc
        sig = got[0]
        logger.info("sglang_prr: %s received; stopping the server (pid %d)",
                    signal.Signals(sig).name, child.pid)
        for p in _descendants(me):
            known.setdefault(p.pid, p)
        if child.poll() is None:
            try:
                child.send_signal(sig)  # SGLang's own graceful stop first
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _stop_grace_s()
        while time.monotonic() < deadline and len(got) < 2:
            for p in _descendants(me):
                known.setdefault(p.pid, p)
            _reap(me, child.pid)
            if child.poll() is not None:  # the server is gone: what is left are orphans
                break
            time.sleep(0.2)
        _end_all(me, known, child)
        return 128 + sig
    finally:
        if child.poll() is None:  # an exception above: never leave the server behind
            _end_all(me, known, child)
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return
    if os.environ.pop(ENV_SUPERVISED, None) == "1":  # not inherited by SGLang's processes
        serve(argv)
        return
    sys.exit(supervise(argv))


if __name__ == "__main__":
    main()
