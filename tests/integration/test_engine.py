"""``sgl.Engine`` with PRR, as a Python user runs it (CPU, the demo model).

One script in a child process, two engines (~1.5 min):

1. the README's ``engine-python`` block, verbatim but for its model path and its commented CPU
   line: the engine, whose page size is left out, decodes the long prompt sparsely
   (``read_stats()`` counts sparse rows and decode steps). Control: before the engine derived
   its page size from the block size, this engine decoded dense without a word (page 1 against
   block 16: sparse_rows 0);
2. an engine with the session servers' PRR configuration (conftest's ``COMMON``): its greedy
   logprobs equal serial DSA's server on the same prompts (1e-4, fp32), and differ from the
   dense server's (the negative control); before its first request ``read_stats()`` has none of
   the first engine's counts (the two share the process's statistics file).

And, in a few seconds each: a page size other than the block size is a ``PRRArgsError`` from
``sgl.Engine(...)``, and from SGLang's own launcher with ``SGLANG_PRR_CONFIG`` set, before any
process is spawned.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
from helpers import TOP_N, first_step_diff, generate, max_logprob_diff, prompt_ids
from readme import fenced_block, readme_text

pytestmark = pytest.mark.server

TOL = 1e-4  # as test_exactness: PRR (exact) and serial DSA differ in summation order only
DIFFERENT = 1e-2
NEW_TOKENS = 8
LENGTHS = (101, 230)  # 7 and 15 blocks of 16 tokens: above min_context (64), K = 2 blocks
SEED = int(os.environ.get("PRR_TEST_SEED", random.randrange(1 << 30)))
RUN_TIMEOUT_S = 900
CPU_MARK = "# on CPU also: "

# The second engine: the session servers' PRR settings (conftest.COMMON) as enable() and Engine
# arguments, and the CPU arguments the launcher adds there.
SERVERS_PRR = dict(block_size=16, top_k=2, top_k_unit="blocks", min_context=64, calib_queries=8)
SERVERS_ENGINE = dict(page_size=16, chunked_prefill_size=128, max_total_tokens=16384,
                      max_running_requests=32, random_seed=0, context_length=1024,
                      device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                      model_impl="transformers", dtype="float32")

# Appended to the README's script: its statistics, then the second engine's greedy outputs.
SECOND_ENGINE = """

if __name__ == "__main__":
    import json
    import sys

    print("PRR_TEST stats " + json.dumps(read_stats()), flush=True)
    spec = json.loads(sys.argv[1])
    enable(**spec["prr"])
    llm = sgl.Engine(model_path=spec["model"], **spec["engine"])
    print("PRR_TEST fresh " + json.dumps(read_stats()), flush=True)
    outs = [llm.generate(input_ids=ids, sampling_params=spec["sampling"], return_logprob=True,
                         top_logprobs_num=spec["top_n"]) for ids in spec["prompts"]]
    print("PRR_TEST outs " + json.dumps(outs), flush=True)
    llm.shutdown()
"""


def readme_script(model: str) -> str:
    """The README's engine script with the model path filled in and its CPU line uncommented."""
    block = fenced_block(readme_text(), "engine-python")
    assert block.count('model_path="..."') == 1, block
    lines = block.replace('model_path="..."', f"model_path={model!r}").splitlines()
    at = [i for i, line in enumerate(lines) if CPU_MARK in line]
    assert len(at) == 1, f"the README's engine script has no single '{CPU_MARK}' line:\n{block}"
    i = at[0]
    lines[i] = lines[i].replace(CPU_MARK, "")
    nxt = lines[i + 1]
    assert nxt.lstrip().startswith("# "), f"the CPU line continues on a comment line: {nxt!r}"
    lines[i + 1] = nxt.replace("# ", "", 1)
    return "\n".join(lines) + "\n"


def _marked(stdout: str, tag: str):
    found = [line[len(tag):] for line in stdout.splitlines() if line.startswith(tag)]
    assert len(found) == 1, f"{tag!r} printed {len(found)} times:\n{stdout[-3000:]}"
    return json.loads(found[0])


@pytest.fixture(scope="module")
def prompts():
    print(f"PRR_TEST_SEED={SEED}")
    return [prompt_ids(SEED + i, n) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def engine_run(demo_model, prompts, tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "engine_script.py"
    path.write_text(readme_script(demo_model) + SECOND_ENGINE)
    spec = {"model": demo_model, "prr": SERVERS_PRR, "engine": SERVERS_ENGINE,
            "prompts": prompts, "top_n": TOP_N,
            "sampling": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    env = dict(os.environ, SGLANG_PRR_CONFIG="", SGLANG_PRR_STATS_FILE="")
    p = subprocess.run([sys.executable, str(path), json.dumps(spec)], capture_output=True,
                       text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=path.parent)
    assert p.returncode == 0, (p.returncode, p.stdout[-3000:], p.stderr[-5000:])
    return {"stdout": p.stdout, "stats": _marked(p.stdout, "PRR_TEST stats "),
            "fresh": _marked(p.stdout, "PRR_TEST fresh "),
            "outs": _marked(p.stdout, "PRR_TEST outs ")}


def test_readme_engine_decodes_sparsely(engine_run):
    stats = engine_run["stats"]
    assert stats["enabled"] and stats["config"]["block_size"] == 16, stats
    # The prompt (~120 tokens of the demo tokenizer) is above min_context = 64: every decode
    # step of the 8 tokens but the prefill's is sparse, in every layer.
    assert stats["sparse_rows"] > 0 and stats["decode_steps"] > 0, stats
    assert stats["dense_rows"] == 0, stats
    lines = engine_run["stdout"].split("PRR_TEST stats ")[0].strip().splitlines()
    assert len(lines) >= 2 and "'sparse_rows'" in lines[-1], lines[-3:]  # the README's prints


def test_a_second_engine_does_not_report_the_first_ones_counts(engine_run):
    """The engines of one process share a statistics file: the second's ``read_stats()`` before
    its first request has none of the first's decode counts (control: the first's had them),
    and its configuration."""
    first, fresh = engine_run["stats"], engine_run["fresh"]
    assert first["decode_batches"] > 0 and first["config"]["top_k"] == 4, first
    assert fresh["decode_batches"] == 0 and fresh["sparse_rows"] == 0, fresh
    assert fresh["config"]["top_k"] == SERVERS_PRR["top_k"], fresh["config"]


def test_engine_prr_equals_serial_dsa_server(engine_run, serial_server, dense_server, prompts):
    outs = engine_run["outs"]
    assert len(outs) == len(prompts)
    for n, ids, out in zip(LENGTHS, prompts, outs):
        assert out["meta_info"]["completion_tokens"] == NEW_TOKENS, out["meta_info"]
        d = max_logprob_diff(out, generate(serial_server, ids, NEW_TOKENS))
        assert d <= TOL, f"len {n}: the engine's PRR vs serial DSA logprob diff {d} (seed {SEED})"
        # Control: the comparison sees attention: dense attention gives other logprobs.
        c = first_step_diff(out, generate(dense_server, ids, NEW_TOKENS))
        assert c > DIFFERENT, f"len {n}: the engine's PRR indistinguishable from dense ({c})"


def test_engine_page_size_other_than_the_block_is_refused(demo_model, tmp_path):
    script = tmp_path / "bad_page.py"
    script.write_text(textwrap.dedent(f"""
        import sglang as sgl
        from sglang_prr.plugin import enable

        if __name__ == "__main__":
            enable(block_size=16, top_k=4, top_k_unit="blocks", min_context=64)
            try:
                sgl.Engine(model_path={demo_model!r}, page_size=32, device="cpu",
                           attention_backend="torch_native", disable_cuda_graph=True,
                           model_impl="transformers", dtype="float32")
            except ValueError as e:
                print("REFUSED", type(e).__name__, e)
        """))
    env = dict(os.environ, SGLANG_PRR_CONFIG="", SGLANG_PRR_STATS_FILE="")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    refused = [line for line in p.stdout.splitlines() if line.startswith("REFUSED")]
    assert refused, (p.stdout[-2000:], p.stderr[-3000:])
    assert "PRRArgsError" in refused[0] and "32" in refused[0] and "16" in refused[0], refused


def test_sglang_own_launcher_with_the_config_checks_it(demo_model, tmp_path, monkeypatch):
    """``SGLANG_PRR_CONFIG`` set for SGLang's own launcher (the entry point applies the plugin):
    the same check, before any process starts: its page size (1) against the block size."""
    import importlib.metadata as md

    if not [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "prr"]:
        pytest.skip("sglang-prr is not pip-installed here (entry points need an install)")
    from sglang_prr.config import PRRConfig
    from sglang_prr.serving.harness import free_port
    from sglang_prr.serving.server_args_patch import export_config

    monkeypatch.setenv("SGLANG_PRR_CONFIG", "")  # export_config writes it: restored after
    config = export_config(PRRConfig(block_size=16, top_k=2, top_k_unit="blocks").validate())
    env = dict(os.environ, SGLANG_PRR_CONFIG=config, SGLANG_PRR_STATS_FILE="")
    p = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", demo_model,
                        "--device", "cpu", "--attention-backend", "torch_native",
                        "--disable-cuda-graph", "--model-impl", "transformers",
                        "--port", str(free_port())], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert p.returncode != 0, p.stderr[-3000:]
    assert "PRRArgsError" in p.stderr and "--page-size=1 must equal --prr-block-size=16" \
        in p.stderr, p.stderr[-3000:]
