"""The server harness on the real CPU server: ``python -m sglang_prr.launch_server`` on the demo
model with SGLang's CPU path, started, waited for, asked, stopped, its log kept; no process of it
outlives ``stop()``. (Every fixture server of this folder runs through the same harness; its
logic against a stand-in server: ``tests/unit/test_harness.py``.)"""

from __future__ import annotations

import psutil
import pytest
from conftest import START_TIMEOUT_S
from helpers import generate, prompt_ids

from sglang_prr.serving import harness

CPU = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
       "--model-impl", "transformers"]


@pytest.mark.server
def test_harness_runs_the_cpu_server(demo_model, tmp_path):
    args = ["--model-path", demo_model, "--prr-block-size", "16", "--prr-top-k", "2",
            "--prr-top-k-unit", "blocks", "--prr-min-context", "64", "--max-total-tokens",
            "4096", "--max-running-requests", "4", "--context-length", "512",
            "--skip-server-warmup", "--log-level", "info"] + CPU
    srv = harness.Server(args, tmp_path / "server.log", name="harness", start=False)
    assert not srv.healthy(timeout=2)  # control: nothing answers before the start
    with srv:
        srv.wait_ready(START_TIMEOUT_S)  # already ready: returns at once
        assert srv.healthy()
        out = generate(srv, prompt_ids(3, 120), max_new_tokens=4)
        assert len(out["meta_info"]["output_token_logprobs"]) == 4
        group = [psutil.Process(srv.proc.pid)]
        group += group[0].children(recursive=True)
        assert len(group) >= 3, group  # the supervisor, the server, SGLang's scheduler...
    assert srv.proc.poll() is not None and not srv.healthy(timeout=5)
    gone, alive = psutil.wait_procs(group, timeout=10)
    assert not alive, [p.pid for p in alive]
    log = srv.log_text()
    assert "sglang_prr:" in log and "POST /generate" in log, log[-2000:]
