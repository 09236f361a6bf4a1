"""SGLang frontend programs (``sgl.function`` over ``RuntimeEndpoint``) against the PRR server.

A program that forks, selects and generates runs on the PRR server as on any SGLang server:
its greedy generation with logprobs equals serial DSA's server running the same program
(1e-4, fp32), differs from the dense server's (the negative control), and the PRR server
counts the program's decode steps on its sparse path (``/prr/stats``).
"""

from __future__ import annotations

import os
import random

import pytest
import requests
from helpers import TOP_N, first_step_diff, max_logprob_diff

pytestmark = pytest.mark.server

sgl = pytest.importorskip("sglang")

TOL = 1e-4
DIFFERENT = 1e-2
NEW_TOKENS = 8
SEED = int(os.environ.get("PRR_TEST_SEED", random.randrange(1 << 30)))
WORDS = ("the", "attention", "block", "predict", "reuse", "repair", "cache", "key", "value",
         "query", "sparse", "dense", "page", "token", "layer", "head")


@sgl.function
def notes(s, context, topics):
    """Two branches over one long context (forks share its prefix), a select, a generation."""
    s += context
    forks = s.fork(2)
    for f, topic in zip(forks, topics):
        f += " about " + topic + ":"
        f += sgl.gen("aside", max_tokens=4, temperature=0)
    s += " so the answer is" + sgl.select("pick", choices=[" yes", " no"])
    s += sgl.gen("answer", max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                 return_logprob=True, top_logprobs_num=TOP_N)
    s["asides"] = [f["aside"] for f in forks]


def _context(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(150))  # ~150 tokens: above min_context


def _run(server, context):
    state = notes.run(context=context, topics=["keys", "values"],
                      backend=sgl.RuntimeEndpoint(server.url))
    return state


def _stats(server):
    return requests.get(server.url + "/prr/stats", timeout=60).json()


def test_program_on_prr_equals_serial_dsa(prr_server, serial_server, dense_server):
    print(f"PRR_TEST_SEED={SEED}")
    context = _context(SEED)
    before = _stats(prr_server)
    prr = _run(prr_server, context)
    after = _stats(prr_server)
    assert prr["pick"] in (" yes", " no") and len(prr["asides"]) == 2, prr.text()
    # The program's generations decoded on the sparse path: 3 requests, >= 2 decode steps each.
    assert after["sparse_rows"] > before["sparse_rows"], (before, after)
    assert after["decode_steps"] >= before["decode_steps"] + 3, (before, after)
    out = {"meta_info": prr.get_meta_info("answer")}
    assert len(out["meta_info"]["output_token_logprobs"]) == NEW_TOKENS, out
    serial = _run(serial_server, context)
    assert serial["pick"] == prr["pick"]  # the select scores the prefill: dense in both
    d = max_logprob_diff(out, {"meta_info": serial.get_meta_info("answer")})
    assert d <= TOL, f"the program's answer: PRR vs serial DSA logprob diff {d} (seed {SEED})"
    dense = _run(dense_server, context)
    c = first_step_diff(out, {"meta_info": dense.get_meta_info("answer")})
    assert c > DIFFERENT, f"PRR's answer indistinguishable from dense attention's ({c})"
