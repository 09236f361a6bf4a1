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

from pathlib import Path

import pytest

from sglang_prr.serving import harness

# A SIGTERM to the test run (a CI runner's timeout) stops the servers below before it exits.
harness.stop_all_on_sigterm()

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


def start_server(name, args, env, explicit_model, model_path, logdir,
                 port=None) -> harness.Server:
    """``python -m sglang_prr.launch_server`` through the package's harness, started now and
    waited for with ``wait_ready()``; ``explicit_model`` adds ``--model-path model_path``
    (else the launcher's default model serves), ``env`` goes on top of the environment;
    ``port`` None: a free one."""
    args = list(args) + (["--model-path", model_path] if explicit_model else [])
    srv = harness.Server(args, Path(logdir) / f"server-{name}.log", name=name, env=env,
                         port=port)
    srv.model = model_path
    return srv


@pytest.fixture(scope="session")
def demo_model() -> str:
    from sglang_prr.tools.demo import demo_model_path

    return demo_model_path()


@pytest.fixture(scope="session")
def servers(demo_model, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("servers")
    pool = {}
    try:
        for name, (args, env, explicit) in CONFIGS.items():
            pool[name] = start_server(name, args, env, explicit, demo_model, logdir)
        yield pool
    finally:
        for s in pool.values():
            s.stop()


def _get(servers, name) -> harness.Server:
    return servers[name].wait_ready(START_TIMEOUT_S)


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
