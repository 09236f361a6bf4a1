"""The server harness (``sglang_prr.serving.harness``) against a stand-in server: a small HTTP
server with the launcher's ``--host``/``--port`` flags that answers ``/health_generate`` with
503 until it is "ready", can exit at once, can start a child, and loses its port when the port
is taken. The same harness on the real CPU server: ``tests/integration/test_harness_server.py``
and every integration fixture."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from sglang_prr.serving import harness

FAKE = '''
import http.server, subprocess, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
ready_after = float(args[args.index("--ready-after") + 1]) if "--ready-after" in args else 0.0
print("fake: starting", flush=True)
if "--exit" in args:
    print("fake: --exit given, bad flag", flush=True)
    sys.exit(2)
if "--child" in args:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
t0 = time.monotonic()

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        up = self.path == "/health_generate" and time.monotonic() - t0 >= ready_after
        self.send_response(200 if up else 503)
        self.end_headers()

    def log_message(self, *a):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Handler)
print("fake: serving on", port, flush=True)
server.serve_forever()
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    monkeypatch.setattr(harness, "POLL_S", 0.2)
    monkeypatch.setattr(harness, "PROBE_TIMEOUT_S", 2.0)  # a held port accepts, never answers
    started = []

    def make(*args, **kw):
        kw.setdefault("launcher", [sys.executable, str(script)])
        srv = harness.Server(list(args), tmp_path / f"server-{len(started)}.log", **kw)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop(grace_s=5)


def test_ready_only_once_a_generation_answers(fake):
    srv = fake("--ready-after", "2")
    t0 = time.monotonic()
    assert srv.wait_ready(timeout=60) is srv and srv.ready
    assert time.monotonic() - t0 >= 2.0  # it waited through the 503s
    assert srv.healthy()
    assert srv.stop(grace_s=5) is not None
    assert not srv.healthy(timeout=2)
    assert "fake: serving on" in srv.log_text()


def test_not_ready_in_time_is_an_error_with_the_log(fake):
    """Control of the test above: a server that never becomes ready is reported, not waited
    for without end."""
    srv = fake("--ready-after", "600")
    with pytest.raises(harness.ServerError, match="not ready in 1 s") as e:
        srv.wait_ready(timeout=1)
    assert "fake: starting" in str(e.value)
    assert not srv.healthy(timeout=2)


def test_exit_before_ready_is_an_error_with_the_log(fake):
    srv = fake("--exit")
    with pytest.raises(harness.ServerError, match="exited with 2") as e:
        srv.wait_ready(timeout=60)
    assert "bad flag" in str(e.value)


def test_lost_port_starts_again_on_another(fake):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        srv = fake(port=taken)
        srv.wait_ready(timeout=60)
        assert srv.port != taken and srv.healthy()
        log = srv.log_text()
        assert "already in use" in log.lower() and "fake: serving on" in log  # both starts
        # Control: without a retry left, the lost port is the error it is.
        srv2 = fake(port=taken, start=False)
        srv2.retries = 0
        srv2.start()
        with pytest.raises(harness.ServerError, match="already in use"):
            srv2.wait_ready(timeout=60)


def _child_of(srv, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = psutil.Process(srv.proc.pid).children(recursive=True)
        if kids:
            return kids[0]
        time.sleep(0.1)
    raise AssertionError("the stand-in started no child")


def test_stop_ends_the_whole_process_group(fake):
    srv = fake("--child").wait_ready(timeout=60)
    kid = _child_of(srv)
    srv.stop(grace_s=5)
    kid.wait(timeout=10)  # ends, or raises psutil.TimeoutExpired
    assert not kid.is_running()
    # Control: stopping the launcher alone (proc.terminate, as a test once did) leaves its
    # child running.
    other = fake("--child").wait_ready(timeout=60)
    orphan = _child_of(other)
    other.proc.terminate()
    other.proc.wait(timeout=10)
    time.sleep(0.5)
    assert orphan.is_running() and orphan.status() != psutil.STATUS_ZOMBIE
    other.stop(grace_s=1)  # the group still exists: the harness ends it
    orphan.wait(timeout=10)


# A process that starts a stand-in server (with a child), prints the server's pid and sleeps;
# argv: the stand-in's script, the log, 1 to install stop_all_on_sigterm.
SIGTERM_SCRIPT = r"""
import sys, time
from sglang_prr.serving import harness
harness.POLL_S = 0.2
if sys.argv[3] == "1":
    harness.stop_all_on_sigterm()
srv = harness.Server(["--child"], sys.argv[2], launcher=[sys.executable, sys.argv[1]])
srv.wait_ready(timeout=60)
print(srv.proc.pid, flush=True)
time.sleep(600)
"""


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` runs (zombies left to their reaper do not count)."""
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            pass
    return False


@pytest.mark.parametrize("install", [True, False])
def test_a_sigterm_stops_the_servers_of_the_process(tmp_path, install):
    """With ``stop_all_on_sigterm`` a SIGTERM to a process that started a server (a CI runner or
    a timeout ending the tests) stops the server's whole group before the process exits
    (``stop_all`` at exit). Control: without it the process ends at once and its server, in a
    session of its own, keeps running."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(harness.PACKAGE_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(script),
                             str(tmp_path / "server.log"), "1" if install else "0"],
                            stdout=subprocess.PIPE, text=True, env=env)
    pid = int(proc.stdout.readline())  # the server's group: it leads a session of its own
    assert _group_running(pid)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while install and _group_running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    running = _group_running(pid)
    if running:
        os.killpg(pid, signal.SIGKILL)
    assert running is not install, (install, running)


def test_context_manager_stops_on_error(fake):
    srv = fake("--ready-after", "0", start=False)
    with pytest.raises(ZeroDivisionError):
        with srv:
            assert srv.healthy()
            1 / 0
    assert srv.proc.poll() is not None


def test_command_and_environment(monkeypatch):
    assert harness.launch_command(["--x", "1"], 1234) == [
        sys.executable, "-m", "sglang_prr.launch_server", "--host", "127.0.0.1", "--port",
        "1234", "--x", "1"]
    monkeypatch.setenv("SGLANG_PRR_CONFIG", "{}")
    monkeypatch.setenv("SGLANG_PRR_DEBUG_SKIP_REPAIR", "1")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = harness.server_env({"SGLANG_PRR_DEBUG_SKIP_REPAIR": "1", "X": "y"})
    assert "SGLANG_PRR_CONFIG" not in env and env["X"] == "y"
    assert env["SGLANG_PRR_DEBUG_SKIP_REPAIR"] == "1"  # given explicitly: kept
    assert env["PYTHONPATH"].split(os.pathsep) == [str(harness.PACKAGE_ROOT), "/elsewhere"]
    assert (harness.PACKAGE_ROOT / "sglang_prr" / "serving" / "harness.py").exists()
    assert "SGLANG_PRR_DEBUG_SKIP_REPAIR" not in harness.server_env()


def test_ports_distinct_bindable_and_below_ephemeral_range():
    lo, _ = harness._ephemeral_range()
    ports = [harness.free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports), ports
    for p in ports:
        if lo > 21000:
            assert p < lo, (p, lo)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_port_taken_by_another_socket_is_skipped(monkeypatch):
    import random

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # Every draw returns the held port first, then a fresh one: free_port must skip it.
        draws = iter([taken, taken] + [p for p in range(23456, 23656) if p != taken])
        monkeypatch.setattr(random.Random, "randint", lambda self, a, b: next(draws))
        held.listen()
        port = harness.free_port()
    assert port != taken
