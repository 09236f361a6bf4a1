"""``--prr-budget auto`` with a profile whose dense attention is faster at every batch size the
server decodes (batch 1 and 2, the server's request pool at ``--max-running-requests 1``; the
profile measures it slower at 4-32, which this server never runs): the CPU server decodes with
SGLang's own dense attention (the inner backend), so its greedy logprobs are the dense server's;
``/prr/stats`` reports ``"dense"`` per batch size with the reason (the batch sizes it cannot
reach named so), and counts the decode rows as dense rows. Control: serial DSA (K = 2 blocks) on
the same prompts differs from dense, so the equality is not vacuous. (The in-process backend
tests have the same profile keep its summaries on a pool of more rows.)"""

from __future__ import annotations

import json
import os
import random

import pytest
import requests

from conftest import COMMON, START_TIMEOUT_S, start_server
from helpers import generate, max_logprob_diff, prompt_ids

pytestmark = pytest.mark.server

SEED = int(os.environ.get("PRR_TEST_SEED", random.randrange(1 << 30)))
LENGTHS = (131, 250)
NEW_TOKENS = 8
# The demo model's layer shape (tools/demo.py): 4 query / 2 KV heads of 32 dims; block 16, K = 2.
SHAPE = dict(method="quest", num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
             top_k_tokens=32)


def _profile(path, dense_rel) -> str:
    """Serial DSA 100 us, PRR 120, dense ``dense_rel(batch)`` x 100 at every batch size."""
    rows, dense = [], []
    for b in (1, 2, 4, 8, 16, 32):
        rows += [dict(batch=b, context=512, delta=0.0, us=100.0),
                 dict(batch=b, context=512, delta=1.5, us=120.0)]
        dense.append(dict(batch=b, context=512, us=100.0 * dense_rel(b)))
    path.write_text(json.dumps({"version": 2, "shape": SHAPE, "layer_us": rows,
                                "dense_us": dense}))
    return str(path)


@pytest.fixture(scope="module")
def auto_dense_server(demo_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("auto-dense")
    i = COMMON.index("--max-running-requests")
    common = COMMON[:i + 1] + ["1"] + COMMON[i + 2:]
    profile = _profile(d / "p.json", lambda b: 0.5 if b <= 2 else 1.5)
    args = common + ["--prr-budget", "auto", "--prr-profile", profile]
    srv = start_server("auto-dense", args, {}, True, demo_model, d)
    try:
        yield srv.wait_ready(START_TIMEOUT_S)
    finally:
        srv.stop()


def test_auto_runs_dense_where_the_profile_says(auto_dense_server, dense_server, serial_server):
    print(f"PRR_TEST_SEED={SEED}")
    prompts = [prompt_ids(SEED + i, n) for i, n in enumerate(LENGTHS)]
    for n, p in zip(LENGTHS, prompts):
        auto = generate(auto_dense_server, p, NEW_TOKENS)
        dense = generate(dense_server, p, NEW_TOKENS)
        serial = generate(serial_server, p, NEW_TOKENS)
        d = max_logprob_diff(auto, dense)
        assert d <= 1e-5, f"len {n}: auto (dense) vs dense logprob diff {d} (seed {SEED})"
        control = max_logprob_diff(serial, dense)
        assert control > 1e-2, f"len {n}: serial DSA matched dense ({control}, seed {SEED})"
    stats = requests.get(auto_dense_server.url + "/prr/stats", timeout=60).json()
    assert set(stats["budget"].values()) == {"dense"}, stats["budget"]
    why = stats["budget_reason"]
    assert why["1"].startswith("dense: ") and "not reached" not in why["1"], why
    assert why["4"].startswith("dense: not reached, this server decodes at most") and \
        "; the profile alone: serial DSA: " in why["4"], why
    assert stats["dense_rows"] > 0 and stats["decode_steps"] == 0, stats
