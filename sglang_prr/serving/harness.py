"""Run a PRR server from Python: start, readiness, stop, logs. The tests' servers, the serving
benchmark and the trace recorder all start theirs here.

``Server(args, log)`` starts ``python -m sglang_prr.launch_server --host H --port P *args`` in a
process group of its own, stdout and stderr into ``log``; ``wait_ready()`` polls
``/health_generate`` until a one-token generation has gone through the scheduler and the
detokenizer (plain ``/health`` answers 200 once HTTP is up, before the model has decoded
anything); ``stop()`` sends SIGTERM to the group (the launcher's supervisor forwards it and stops
SGLang's processes) and SIGKILL to what is left after ``grace_s``. A start that lost its port to
another process before binding it (the log says "already in use") starts again on a new port.

A server lives in a session of its own, so it outlives the process that started it unless that
process stops it: every server still running when the interpreter exits is stopped then
(``stop_all``, registered with ``atexit``), and ``stop_all_on_sigterm()`` makes a SIGTERM (a CI
runner or a timeout stopping the tests or a benchmark) unwind as a KeyboardInterrupt, so that
the exit, and the stops, happen.

Standard library only: the server is a child process, so neither SGLang nor torch is imported
here.
"""

from __future__ import annotations

import atexit
import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Mapping, Optional, Sequence

# The folder that holds the package: on the child's PYTHONPATH, so that a checkout serves its
# own sources whatever is installed.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = (sys.executable, "-m", "sglang_prr.launch_server")
READY_PATH = "/health_generate"
START_TIMEOUT_S = 600.0  # a cold CPU start of SmolLM2 on 2 cores takes ~2 minutes
POLL_S = 2.0
PROBE_TIMEOUT_S = 30.0  # one /health_generate: SGLang gives its generation 20 s
# The launcher's supervisor waits SGLANG_PRR_STOP_GRACE_S (15 s by default) before it kills
# SGLang's processes itself; after twice that, the harness kills the group.
STOP_GRACE_S = 30.0
BIND_RETRIES = 2
LOG_TAIL_CHARS = 4000
# Settings of the calling process that must not reach a server it starts: a config exported by
# an earlier enable(), a stats file of another server, the repair switch of a negative control.
ENV_DROPPED = ("SGLANG_PRR_CONFIG", "SGLANG_PRR_STATS_FILE", "SGLANG_PRR_DEBUG_SKIP_REPAIR")

# SGLang's default port, which the README's commands use: tests/integration/test_newcomer.py
# serves there, so free_port() never hands it out.
README_PORT = 30000
_TAKEN: set = {README_PORT}


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message ends with its log's tail."""


def _ephemeral_range() -> tuple:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free port *below* the kernel's ephemeral range, never the same one twice per process.

    SGLang picks its internal ports (NCCL/gloo rendezvous, ...) with ``bind(0)``, i.e. from the
    ephemeral range, some seconds after start. An HTTP port from that same range can be taken
    by another server's internal port before uvicorn binds it (seen in CI: ``[Errno 98]``), so
    servers take theirs from below it (a machine whose ephemeral range starts low still has the
    restart on a lost bind).
    """
    lo = 20000
    hi = max(min(_ephemeral_range()[0], 32768) - 1, lo + 1000)
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(lo, hi)
        if port in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _TAKEN.add(port)
        return port
    raise RuntimeError(f"no free port in [{lo}, {hi}]")


def launch_command(args: Sequence[str], port: int, host: str = "127.0.0.1",
                   launcher: Sequence[str] = LAUNCHER) -> list:
    """The command line of a server on ``host:port`` with ``args`` (SGLang and --prr-* flags)."""
    return list(launcher) + ["--host", host, "--port", str(port)] + list(args)


def server_env(extra: Optional[Mapping[str, str]] = None) -> dict:
    """This process's environment without ``ENV_DROPPED``, the package's folder first on
    PYTHONPATH, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROPPED}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


KERNEL_CHECK = ("import sys\n"
                "from sglang_prr.kernels import loader\n"
                "ok = loader.load()\n"
                "print(loader.load_error() or '')\n"
                "sys.exit(0 if ok else 1)\n")


def kernel_library_error(timeout_s: float = 900.0) -> Optional[str]:
    """Why the kernel library the servers would load (``SGLANG_PRR_KERNEL_LIB``, else the build
    of these sources) does not load on this machine's GPU, or None when it loads: checked in a
    child process with the servers' environment, so that a library built from other sources
    stops a benchmark before its first server instead of each server minutes later. The first
    check of a checkout may build the library (as the first server would)."""
    try:
        r = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=server_env(),
                           cwd=str(PACKAGE_ROOT), capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"loading the kernel library took more than {timeout_s:.0f} s"
    if r.returncode == 0:
        return None
    lines = (r.stdout.strip() or r.stderr.strip()).splitlines()
    return lines[-1] if lines else f"the check exited with {r.returncode}"


def get(url: str, timeout: Optional[float] = None) -> int:
    """The HTTP status of ``GET url``; 0 when nothing answered in ``timeout`` seconds
    (``PROBE_TIMEOUT_S``)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout or PROBE_TIMEOUT_S) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError, http.client.HTTPException):  # refused, reset, timed out
        return 0


class Server:
    """One server process (see the module's docstring).

    ``args``: the flags after the launcher (``--host``/``--port`` are the harness's); ``log``:
    the log file; ``env``: variables on top of ``server_env()``; ``launcher``: the command
    that serves (``LAUNCHER``; tests put a stand-in there). Started at once unless
    ``start=False``, so that several servers start together and are waited for afterwards.
    """

    def __init__(self, args: Sequence[str], log, *, name: str = "server",
                 env: Optional[Mapping[str, str]] = None, host: str = "127.0.0.1",
                 port: Optional[int] = None, launcher: Sequence[str] = LAUNCHER,
                 start: bool = True):
        self.args = list(args)
        self.log_path = Path(log)
        self.name = name
        self.env = server_env(env)
        self.host = host
        self.port = port or free_port()
        self.launcher = list(launcher)
        self.proc: Optional[subprocess.Popen] = None
        self.ready = False
        self.retries = BIND_RETRIES
        self._log = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def cmd(self) -> list:
        return launch_command(self.args, self.port, self.host, self.launcher)

    def start(self, mode: str = "w") -> "Server":
        """Start the process (its own session and process group) with the log opened in
        ``mode`` ("a" keeps an earlier start's log above)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, mode)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=str(PACKAGE_ROOT),
                                     start_new_session=True)
        self.ready = False
        _started.add(self)
        return self

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.log_text()[-chars:]

    def _restart_on_new_port(self) -> bool:
        """Start again on another port if the last start lost its port; False otherwise."""
        if self.retries == 0 or "already in use" not in self.log_text().lower():
            return False
        self.retries -= 1
        self._log.close()
        self.port = free_port()
        self.start(mode="a")
        return True

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "Server":
        """Block until ``READY_PATH`` answers 200; ``ServerError`` (with the log's tail) if the
        process exits first or ``timeout`` seconds pass. Returns the server."""
        if self.ready:
            return self
        if self.proc is None:
            raise ServerError(f"server {self.name} was never started")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self._restart_on_new_port():
                    deadline = time.monotonic() + timeout
                    continue
                raise ServerError(f"server {self.name} exited with {self.proc.returncode}:\n"
                                  + self.log_tail())
            if get(self.url + READY_PATH) == 200:
                self.ready = True
                return self
            time.sleep(POLL_S)
        raise ServerError(f"server {self.name} not ready in {timeout:.0f} s:\n" + self.log_tail())

    def healthy(self, timeout: float = 60.0) -> bool:
        """Whether the server still answers a generation (``READY_PATH``)."""
        return get(self.url + READY_PATH, timeout) == 200

    def stop(self, grace_s: float = STOP_GRACE_S) -> Optional[int]:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; the exit status (None if
        never started). Safe to call twice."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:  # whatever is left in the group: a child that outlived its parent included
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        if self._log and not self._log.closed:
            self._log.close()
        self.ready = False
        return self.proc.returncode

    def __enter__(self) -> "Server":
        if self.proc is None:
            self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


# Every Server started in this process and not yet collected (stop_all's list).
_started: "weakref.WeakSet[Server]" = weakref.WeakSet()


def stop_all(grace_s: float = 5.0) -> int:
    """Stop every server this process started that is still running; how many were."""
    live = [s for s in list(_started) if s.proc is not None and s.proc.poll() is None]
    for srv in live:
        srv.stop(grace_s=grace_s)
    return len(live)


atexit.register(stop_all)


def stop_all_on_sigterm() -> None:
    """Make SIGTERM raise KeyboardInterrupt in the main thread (where its handler is still the
    default), so that the process unwinds, its ``finally`` blocks and fixtures' teardowns run
    and ``stop_all`` stops what is left at exit; without it a SIGTERM ends the process at once
    and its servers keep running in their own sessions."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
