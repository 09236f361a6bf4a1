"""The PRR server as a user meets it: HTTP and OpenAI APIs, concurrency, radix-cache hits,
aborts, the serving benchmark and ``/prr/stats`` (server started without --model-path)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import pytest
import requests

from helpers import (TIMEOUT_S, flush_cache, generate, logprob_table, max_logprob_diff,
                     prompt_ids)

pytestmark = pytest.mark.server

TOL = 1e-4
SEED = int(os.environ.get("PRR_TEST_SEED", random.randrange(1 << 30)))


def test_generate_text(prr_server):
    r = requests.post(prr_server.url + "/generate", json={
        "text": "the attention block " * 40,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}},
        timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["completion_tokens"] == 6
    assert out["meta_info"]["prompt_tokens"] > 64  # long enough for the sparse path
    assert isinstance(out["text"], str)


def test_openai_completions_and_chat(prr_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=prr_server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    c = client.completions.create(model=model, prompt="the key value cache " * 30, max_tokens=5,
                                  temperature=0, logprobs=3)
    assert c.choices[0].text is not None and c.usage.completion_tokens == 5
    assert len(c.choices[0].logprobs.token_logprobs) == 5
    assert all(lp <= 0 for lp in c.choices[0].logprobs.token_logprobs)
    ch = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "predict reuse repair " * 30}],
        max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    assert ch.choices[0].message.content is not None and ch.usage.completion_tokens == 5
    assert len(ch.choices[0].logprobs.content) == 5


def test_concurrent_equals_alone(prr_server):
    """16 requests of different lengths in one batch give the outputs they give alone."""
    print(f"PRR_TEST_SEED={SEED}")
    rng = random.Random(SEED)
    prompts = [prompt_ids(SEED + 100 + i, rng.randrange(70, 200)) for i in range(16)]
    flush_cache(prr_server)
    alone = [generate(prr_server, p, 6) for p in prompts[:4]]  # a sample, to bound the time
    flush_cache(prr_server)
    together = [None] * 16
    errors = []

    def run(i):
        try:
            together[i] = generate(prr_server, prompts[i], 6)
        except Exception as e:  # surfaced below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not errors, errors
    for i in range(4):
        d = max_logprob_diff(alone[i], together[i])
        assert d <= TOL, f"request {i}: batched vs alone logprob diff {d} (seed {SEED})"
    assert all(len(logprob_table(o)["ids"]) == 6 for o in together)


def test_radix_prefix_hit_reuses_summaries(prr_server):
    """A request whose prefix is cached (pages and their summaries shared) matches the same
    request computed from scratch after a cache flush (which also resets the PRR state)."""
    base = prompt_ids(SEED + 7, 160)
    full = base + prompt_ids(SEED + 8, 41)
    flush_cache(prr_server)
    generate(prr_server, base, 2)
    hit = generate(prr_server, full, 8)
    assert hit["meta_info"]["cached_tokens"] >= 144, hit["meta_info"]
    flush_cache(prr_server)
    cold = generate(prr_server, full, 8)
    assert cold["meta_info"]["cached_tokens"] == 0
    d = max_logprob_diff(hit, cold)
    assert d <= TOL, f"prefix hit vs cold logprob diff {d} (seed {SEED})"


def test_abort_mid_stream_leaves_server_healthy(prr_server):
    ids = prompt_ids(SEED + 9, 120)
    ref = generate(prr_server, ids, 4)
    with requests.post(prr_server.url + "/generate", json={
            "input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}},
            stream=True, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            if line:
                chunks += 1
            if chunks >= 3:
                break  # closing the connection aborts the request
    assert chunks >= 3
    assert prr_server.healthy()
    again = generate(prr_server, ids, 4)
    assert max_logprob_diff(ref, again) <= TOL


def test_bench_serving_random_ids(prr_server, tmp_path):
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
           "--base-url", prr_server.url, "--dataset-name", "random-ids", "--num-prompts", "4",
           "--random-input-len", "120", "--random-output-len", "6", "--random-range-ratio",
           "0.5", "--model", prr_server.model, "--tokenizer", prr_server.model,
           "--disable-tqdm", "--seed", str(SEED % 10000), "--output-file", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-3000:]
    line = [l for l in text.splitlines() if "Successful requests:" in l]
    assert line and int(line[-1].split()[-1]) == 4, text[-3000:]
    assert prr_server.healthy()


def test_prr_stats(prr_server):
    generate(prr_server, prompt_ids(SEED + 11, 150), 6)
    s = requests.get(prr_server.url + "/prr/stats", timeout=60).json()
    assert s["enabled"] is True
    assert s["config"]["block_size"] == 16 and s["config"]["top_k_blocks"] == 2
    assert s["decode_steps"] > 0 and s["sparse_rows"] > 0
    assert 0.0 <= s["hit_rate"] <= 1.0
    assert s["mean_selected_blocks"] == pytest.approx(4.0)  # K=2 + sink + local
    assert 1.0 <= s["delta"] <= s["config"]["predicted_blocks"] / 2 + 1
    # Chunked prefill (128-token chunks) calibrated every chunk of each request.
    assert s["calibrations"] > s["extend_batches"] // 2 > 0


def test_metrics_endpoint_exports_prr(prr_server):
    generate(prr_server, prompt_ids(SEED + 12, 120), 4)
    generate(prr_server, prompt_ids(SEED + 13, 90), 2)  # a later forward flushes the numbers
    text = requests.get(prr_server.url + "/metrics", timeout=60).text
    lines = [l for l in text.splitlines() if l.startswith("sglang:prr_hit_rate")]
    assert lines, text[-2000:]
    assert 0.0 <= float(lines[0].split()[-1]) <= 1.0


def _stats_keys(server):
    return list(requests.get(server.url + "/prr/stats", timeout=60).json())


def test_prr_stats_has_one_schema_on_every_server(prr_server, dense_server):
    """A server with PRR off answers with the same fields, in the same order, as a PRR server
    (it used to answer only config, enabled and decode_steps). Negative control: the comparison
    tells a schema with one field missing apart."""
    from sglang_prr.serving.stats import STATS_FIELDS

    prr, dense = _stats_keys(prr_server), _stats_keys(dense_server)
    assert prr == dense == list(STATS_FIELDS), (prr, dense)
    assert [k for k in prr if k != "dense_rows"] != dense
