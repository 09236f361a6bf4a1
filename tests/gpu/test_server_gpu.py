"""The PRR server on a GPU: SGLang's FlashInfer backend wrapped by PRR, decode in CUDA graphs.

Starts ``python -m sglang_prr.launch_server`` twice on a dummy-weight Llama-shaped model (head dim
128, GQA 4, block = page = 64 tokens) with CUDA graphs on: PRR (exact), then serial DSA with the same
K. Long prompts (> --prr-min-context) decode on the sparse path; the test checks that requests
finish with finite logprobs, that ``/prr/stats`` counts sparse decode steps with a hit rate, and that
PRR(exact)'s decode logprobs equal serial DSA's (the exactness property end to end, up to the
first greedy token where the two diverge, if any). Skipped without CUDA SM90 or SGLang.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from ports import free_port

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)
try:
    import sglang  # noqa: F401
except ImportError:
    pytest.skip("needs SGLang", allow_module_level=True)

from sglang_prr import demo  # noqa: E402

START_TIMEOUT = 420
MAX_NEW = 24
FLAGS = ["--load-format", "dummy", "--prr-block-size", "64", "--prr-top-k", "8",
         "--prr-top-k-unit", "blocks", "--prr-min-context", "1024", "--prr-calib-queries", "8",
         "--attention-backend", "flashinfer", "--sampling-backend", "pytorch",
         "--grammar-backend", "none", "--cuda-graph-max-bs", "4",
         "--disable-piecewise-cuda-graph", "--mem-fraction-static", "0.3",
         "--context-length", "16384", "--max-running-requests", "8", "--random-seed", "0",
         "--skip-server-warmup", "--log-level", "warning"]


def _model_dir(root: Path) -> str:
    """A Llama config with a PRR-relevant attention shape and the demo's offline tokenizer."""
    return demo.shaped_model_dir(
        root / "llama-gqa4-d128", hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, num_hidden_layers=4, intermediate_size=2048,
        max_position_embeddings=32768, torch_dtype="bfloat16")


def _post(url, payload, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _get(url, timeout=60):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read()) if "json" in r.headers.get("Content-Type", "") else r.read()


class Server:
    def __init__(self, model: str, extra, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "sglang_prr.launch_server", "--model-path", model,
               "--host", "127.0.0.1", "--port", str(self.port)] + FLAGS + extra
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < START_TIMEOUT:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        print(f"server up in {time.time() - t0:.0f} s: {' '.join(extra)}")
                        return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(2)
        tail = log.read_text()[-4000:]
        self.stop()
        pytest.fail(f"server did not start ({' '.join(extra)}):\n{tail}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1500, 3100, 4700)]


def _run(server: Server):
    outs = []
    for ids in _prompts():
        r = _post(server.url + "/generate", {
            "input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0,
                                "ignore_eos": True}})
        lp = r["meta_info"]["output_token_logprobs"]
        outs.append(([t[1] for t in lp], [t[0] for t in lp]))
    return outs


def _stats_after(server: Server):
    """/prr/stats is refreshed at the start of a forward, at most once a second on GPU: wait a
    second and send a one-token request so that the counts include the requests before it."""
    time.sleep(1.5)
    _post(server.url + "/generate", {"input_ids": [5, 6, 7],
                                     "sampling_params": {"max_new_tokens": 1}})
    return _get(server.url + "/prr/stats")


@pytest.fixture(scope="module")
def prr_run(tmp_path_factory):
    model = _model_dir(tmp_path_factory.mktemp("model"))
    logs = Path(os.environ.get("OUT", tmp_path_factory.mktemp("logs")))
    prr = Server(model, [], logs / "server_prr.log")
    try:
        out = _run(prr)
        stats = _stats_after(prr)
    finally:
        prr.stop()
    print("prr stats:", {k: stats.get(k) for k in ("decode_steps", "sparse_rows", "dense_rows",
                                                    "hit_rate", "mean_selected_blocks",
                                                    "mean_repair_blocks", "delta")})
    return model, logs, out, stats


def test_prr_server_decodes_sparse_in_cuda_graphs(prr_run):
    _, _, out, stats = prr_run
    for toks, lps in out:
        assert len(toks) == MAX_NEW and all(math.isfinite(x) for x in lps)
    assert stats["enabled"] is True
    # 3 prompts of 1500-4700 tokens (all >= --prr-min-context 1024) x 24 steps x 4 layers
    assert stats["sparse_rows"] > 0, stats
    assert 0.0 <= stats["hit_rate"] <= 1.0
    assert stats["mean_selected_blocks"] == pytest.approx(10.0)  # K = 8 + sink + local


def test_prr_server_on_gpu_equals_serial_dsa(prr_run):
    """Same property as the CPU integration suite (which holds its negative controls: a server
    without repair and a dense server differ), here through FlashInfer and CUDA graphs."""
    model, logs, out_prr, _ = prr_run
    serial = Server(model, ["--prr-serial"], logs / "server_serial.log")
    try:
        out_ser = _run(serial)
    finally:
        serial.stop()
    compared, worst = 0, 0.0
    for (tp, lp), (ts, ls) in zip(out_prr, out_ser):
        for a, b, x, y in zip(tp, ts, lp, ls):
            worst = max(worst, abs(x - y))
            compared += 1
            if a != b:  # greedy paths diverged (a near-tie): later steps are not comparable
                break
    print(f"compared {compared} decode logprobs, max |PRR - serial| = {worst:.2e}")
    assert compared >= 3 * 4
    assert worst < 2e-2
