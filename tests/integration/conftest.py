"""Session-scoped CPU servers on the demo model, one per configuration, started in parallel.

Every server runs ``python -m sglang_prr.launch_server`` (the user's command) with page/block
size 16, K = 2 blocks (+1 sink +1 local), ``min_context`` 64 tokens, so prompts of 100-300
tokens have 7-19 blocks: PRR really runs, and the choice of blocks changes the output (the demo
model's attention is peaked; ``test_dsa_small_k_differs_from_dense`` checks it).

Configurations:
  prr     PRR (exact), chunked prefill of 128 tokens, --enable-metrics, no --model-path
          (the launcher's default model, pinned to the demo by SGLANG_PRR_DEFAULT_MODEL=demo-tiny:
          the real default, SmolLM2, has its own servers in test_real_model.py)
  serial  serial DSA (--prr-serial), same K, same chunking: the baseline PRR(exact) must equal
  norep   PRR (exact) with the repair step disabled (negative control; debug env switch)
  full    PRR (exact) with K covering every block, chunked prefill
  dense   PRR off (--prr-method dense): SGLang's own dense attention, no chunking
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
from ports import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600
COMMON = ["--prr-block-size", "16", "--prr-top-k", "2", "--prr-top-k-unit", "blocks",
          "--prr-min-context", "64", "--prr-calib-queries", "8", "--max-total-tokens", "16384",
          "--max-running-requests", "32", "--random-seed", "0", "--log-level", "warning",
          "--skip-server-warmup", "--context-length", "1024"]
CONFIGS = {
    "prr": (COMMON + ["--chunked-prefill-size", "128", "--prr-metrics-interval", "20",
                      "--enable-metrics"], {"SGLANG_PRR_DEFAULT_MODEL": "demo-tiny"},
            False),
    "serial": (COMMON + ["--chunked-prefill-size", "128", "--prr-serial"], {}, True),
    "norep": (COMMON + ["--chunked-prefill-size", "128"], {"SGLANG_PRR_DEBUG_SKIP_REPAIR": "1"},
              True),
    "full": (COMMON[:2] + ["--prr-top-k", "64", "--prr-top-k-unit", "blocks"] + COMMON[6:] + ["--chunked-prefill-size", "128"],
             {}, True),
    "dense": (["--prr-method", "dense", "--page-size", "16", "--max-total-tokens", "16384",
               "--max-running-requests", "32", "--random-seed", "0", "--log-level", "warning",
               "--skip-server-warmup", "--context-length", "1024"], {}, True),
}


BIND_RETRIES = 2


class Server:
    def __init__(self, name, args, env, explicit_model, model_path, logdir, port=None):
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(logdir) / f"server-{name}.log"
        cmd = [sys.executable, "-m", "sglang_prr.launch_server", "--port", str(self.port)] + args
        if explicit_model:
            cmd += ["--model-path", model_path]
        e = dict(os.environ)
        e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
        e.pop("SGLANG_PRR_CONFIG", None)
        e.pop("SGLANG_PRR_STATS_FILE", None)
        e.update(env)
        self.cmd = cmd
        self.env = e
        self.ready = False
        self.model = model_path
        self.retries = BIND_RETRIES
        self._start()

    def _start(self, mode="w"):
        self._log = open(self.log_path, mode)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=str(REPO), start_new_session=True)

    def _restart_on_new_port(self) -> bool:
        """Start again on another port if the last start lost a bind race; False otherwise."""
        self._log.close()
        if self.retries == 0 or "already in use" not in self.log_path.read_text():
            return False
        self.retries -= 1
        i = self.cmd.index("--port") + 1
        self.port = free_port()
        self.cmd[i] = str(self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self._start(mode="a")  # keep the failed start's log above the retry's
        return True

    def wait(self):
        if self.ready:
            return self
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                if self._restart_on_new_port():
                    deadline = time.time() + START_TIMEOUT_S
                    continue
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n"
                                   + self.log_path.read_text()[-4000:])
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    self.ready = True
                    return self
            except requests.RequestException:
                pass
            time.sleep(2)
        raise RuntimeError(f"server {self.name} not ready in {START_TIMEOUT_S}s:\n"
                           + self.log_path.read_text()[-4000:])

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health_generate", timeout=60).status_code == 200
        except requests.RequestException:
            return False

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group this fixture started
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._log.close()


@pytest.fixture(scope="session")
def demo_model() -> str:
    from sglang_prr.demo import demo_model_path

    return demo_model_path()


@pytest.fixture(scope="session")
def servers(demo_model, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("servers")
    pool = {}
    try:
        for name, (args, env, explicit) in CONFIGS.items():
            pool[name] = Server(name, args, env, explicit, demo_model, logdir)
        yield pool
    finally:
        for s in pool.values():
            s.stop()


def _get(servers, name) -> Server:
    return servers[name].wait()


@pytest.fixture(scope="session")
def prr_server(servers):
    return _get(servers, "prr")


@pytest.fixture(scope="session")
def serial_server(servers):
    return _get(servers, "serial")


@pytest.fixture(scope="session")
def norep_server(servers):
    return _get(servers, "norep")


@pytest.fixture(scope="session")
def full_server(servers):
    return _get(servers, "full")


@pytest.fixture(scope="session")
def dense_server(servers):
    return _get(servers, "dense")
