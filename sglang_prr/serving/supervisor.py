"""The launcher's supervisor: runs the SGLang server as a child process and stops it cleanly.

The command you run (``python -m sglang_prr.launch_server``) is this small supervisor (no torch,
no SGLang imported): it starts the server proper as its child (the same command with
``SGLANG_PRR_SUPERVISED=1``) and relays its exit status. On SIGTERM or SIGINT the supervisor
forwards the signal to the server (SGLang drains and stops), which runs in a session of its
own so that a terminal's Ctrl-C reaches the supervisor alone, waits up to
``SGLANG_PRR_STOP_GRACE_S`` seconds (default 15) for it to exit, then terminates and finally
kills every process still below it, and exits with 128 + the signal number; a second signal
skips the wait. It is a child subreaper on Linux, so processes orphaned by the server are still
found (their SIGQUIT, SGLang's "a child failed" signal to its parent, is passed on to the
server), and the server gets SIGTERM if the supervisor itself is killed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional

logger = logging.getLogger("sglang_prr")

# Set in the server process started by the supervisor (``launch_server.main``); set it yourself
# to run the server in the launching process (no supervisor).
ENV_SUPERVISED = "SGLANG_PRR_SUPERVISED"
ENV_STOP_GRACE = "SGLANG_PRR_STOP_GRACE_S"
DEFAULT_STOP_GRACE_S = 15.0  # SGLang's own drain + scheduler shutdown takes ~5-10 s when idle
TERM_WAIT_S = 3.0  # after SIGTERM to the leftovers, before SIGKILL


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
    # The server gets a session of its own: Ctrl-C in a terminal signals the whole foreground
    # process group, and SGLang's scheduler and detokenizer each died of it with a
    # KeyboardInterrupt traceback. Now only the supervisor gets it, and stops them in order.
    child = subprocess.Popen(cmd, env=env, start_new_session=os.name == "posix",
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
