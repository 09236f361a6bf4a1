"""Robustness of the served PRR server (issue "Robustness").

1. Token ids outside the vocabulary (``/generate`` single and batched, ``/v1/completions`` with a
   token-id prompt) are rejected with HTTP 400 before the scheduler, and the server stays
   healthy (they used to kill the scheduler with an IndexError in the embedding).
2. ``--prr-top-k`` larger than the context is capped at the context's blocks (K, |P| and the
   static widths sized from them), from ``--context-length`` or the model config.
3. ``--prr-budget auto`` without ``--prr-profile`` stops the launcher (exit 2).
4. SIGTERM/SIGINT to the launcher stop every process below it within 30 s.

Server starts: the token-id checks use the shared ``prr_server``; this module adds two starts of
its own (one to /health then SIGTERM, one stopped by SIGTERM during startup).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import requests
from conftest import COMMON, START_TIMEOUT_S, start_server
from helpers import generate, prompt_ids

from sglang_prr.serving import launch_server, supervisor
from sglang_prr.serving.server_args_patch import ENV_CONFIG

REPO = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 30
VOCAB = 512  # for the checks without a model


@pytest.fixture
def clean_env(monkeypatch):
    """prepare() exports the configuration: restore the environment afterwards."""
    monkeypatch.setenv(ENV_CONFIG, "x")
    monkeypatch.delenv(ENV_CONFIG)
    return monkeypatch


# --------------------------------------------------------------- 1. token ids outside the vocab
BAD_IDS = [[1, 2, 999999, 5], [1, -3, 5]]


@pytest.fixture(scope="module")
def demo_config(demo_model):
    """The demo model's config.json (vocab_size, max_position_embeddings)."""
    return json.loads((Path(demo_model) / "config.json").read_text())


def test_check_input_ids_names_the_bad_id():
    from sglang_prr.serving.requests import check_input_ids

    check_input_ids([0, 5, VOCAB - 1], VOCAB)  # the edges are fine
    check_input_ids([[1, 2], [3]], VOCAB)
    for ids, bad in ((BAD_IDS[0], "999999"), (BAD_IDS[1], "-3"), ([[1, 2], [4, -1]], "-1"),
                     ([1.5], "1.5")):
        with pytest.raises(ValueError) as e:
            check_input_ids(ids, VOCAB)
        assert bad in str(e.value), str(e.value)
    assert "[0, 512)" in str(pytest.raises(ValueError, check_input_ids, [VOCAB], VOCAB).value)


def test_request_validation_patch_is_idempotent():
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sglang_prr.serving import plugin

    plugin._patch_request_validation()
    first = TokenizerManager._validate_one_request
    plugin._patched.discard("request_validation")
    plugin._patch_request_validation()  # a second apply() must not wrap twice
    assert TokenizerManager._validate_one_request is first
    assert getattr(first, "_prr_wrapped", False)

    class _TM:  # just what the wrapper reads
        model_config = type("MC", (), {"vocab_size": VOCAB})()

    with pytest.raises(ValueError, match="999999"):
        first(_TM(), None, BAD_IDS[0])


def test_a_huge_n_is_refused_before_the_prompt_is_copied():
    """SGLang copies the prompt n times in ``normalize_batch_and_arguments``, before
    ``_validate_one_request``: n = 2^40 was a MemoryError there (an empty 400). The check runs
    first; the control, n at the bound, expands."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_prr.serving import plugin
    from sglang_prr.serving.requests import N_MAX

    plugin._patch_request_validation()
    plugin._patched.discard("request_validation")
    plugin._patch_request_validation()
    assert getattr(GenerateReqInput.normalize_batch_and_arguments, "_prr_wrapped", False)
    for n in (2 ** 40, N_MAX + 1):
        req = GenerateReqInput(text="hi", sampling_params={"n": n, "max_new_tokens": 1})
        with pytest.raises(ValueError, match=f"sampling_params.n must be at most {N_MAX}"):
            req.normalize_batch_and_arguments()
    ok = GenerateReqInput(text="hi", sampling_params={"n": N_MAX, "max_new_tokens": 1})
    ok.normalize_batch_and_arguments()
    assert ok.batch_size == 1 and len(ok.text) == N_MAX


def test_per_request_fields_and_a_list_cache_key_are_checked():
    """A single request with a list ``rid`` passed normalization and failed later (HTTP 500,
    "unhashable type"), a list ``lora_id`` stopped the scheduler; lists of the wrong length on a
    batch were IndexErrors (500) and a string ``lora_id`` on a batch went to its requests one
    letter each; a list ``cache_salt``/``extra_key`` was a TypeError in the OpenAI layer (500).
    Each is a ValueError now (SGLang answers 400) or served as meant; the controls pass."""
    from types import SimpleNamespace

    from sglang.srt.entrypoints.openai.serving_base import OpenAIServingBase
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_prr.serving import requests as request_checks

    request_checks.install()
    with pytest.raises(ValueError, match="rid must be one value"):
        GenerateReqInput(text="hi", rid=["x"]).normalize_batch_and_arguments()
    GenerateReqInput(text="hi", rid="x").normalize_batch_and_arguments()
    batch = GenerateReqInput(text=["a", "b"], rid=["x", "y"])
    batch.normalize_batch_and_arguments()
    assert batch.rid == ["x", "y"]
    # the fields SGLang reads per request (a list lora_id on one request stopped the scheduler)
    for kw in ({"lora_id": ["x"]}, {"sampling_params": [{}]}, {"lora_path": ["p"]},
               {"return_logprob": [True]}, {"session_params": {"a": 1}},
               {"positional_embed_overrides": ["x"]}, {"positional_embed_overrides": {}}):
        field = next(iter(kw))
        with pytest.raises(ValueError, match=field):
            GenerateReqInput(text="hi", **kw).normalize_batch_and_arguments()
    one = GenerateReqInput(text="hi", lora_id="x", session_params={"id": "s"})
    one.normalize_batch_and_arguments()  # the control: one value each
    two = GenerateReqInput(text=["a", "b"], lora_id="xy")
    two.normalize_batch_and_arguments()
    assert [two[i].lora_id for i in range(2)] == ["xy", "xy"]  # SGLang alone: "x", "y"
    for kw in ({"lora_id": ["x"]}, {"bootstrap_port": [1, 2, 3]},
               {"lora_id": ["a", "b"], "sampling_params": {"n": 2}}):
        with pytest.raises(ValueError, match="one per"):
            GenerateReqInput(text=["a", "b"], **kw).normalize_batch_and_arguments()
    fine = GenerateReqInput(text=["a", "b"], lora_id=["p", "q"], extra_key=["k", "l"])
    fine.normalize_batch_and_arguments()
    assert [fine[i].lora_id for i in range(2)] == ["p", "q"]
    # an empty list, and SGLang's own failures on a request's fields, on both request types
    from sglang.srt.managers.io_struct import EmbeddingReqInput
    for req, kw, match in ((GenerateReqInput, {"sampling_params": []}, "sampling_params"),
                           (EmbeddingReqInput, {"sampling_params": []}, "sampling_params"),
                           (EmbeddingReqInput, {"rid": ["x"]}, "rid must be one value"),
                           (EmbeddingReqInput, {"sampling_params": [{}]}, "do not fit together"),
                           (EmbeddingReqInput, {"input_ids": []}, "do not fit together")):
        with pytest.raises(ValueError, match=match):
            obj = req(**({"input_ids": kw.pop("input_ids")} if "input_ids" in kw else
                         {"text": "hi"}), **kw)
            obj.normalize_batch_and_arguments()
    emb = EmbeddingReqInput(text=["a", "b"], rid=["x", "y"])
    emb.normalize_batch_and_arguments()  # the control
    assert emb.batch_size == 2 and emb.sampling_params == [{"max_new_tokens": 0}] * 2
    key = OpenAIServingBase._compute_extra_key
    with pytest.raises(ValueError, match="extra_key must be a string"):
        key(None, SimpleNamespace(cache_salt=None, extra_key=["x"]))
    assert key(None, SimpleNamespace(cache_salt="s", extra_key="k")) == "sk"


def test_expert_record_commands_need_a_recorder():
    """SGLang sends the expert-distribution commands to a scheduler without a recorder, whose
    stand-in raises and stops it. Refused before anything is sent; with a recorder mode they go
    through (the control: the stand-in manager has nothing to send with)."""
    import asyncio
    from types import SimpleNamespace

    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sglang_prr.serving import requests as request_checks

    request_checks.install()
    for name in request_checks.EXPERT_RECORD_COMMANDS:
        method = getattr(TokenizerManager, name)
        off = SimpleNamespace(server_args=SimpleNamespace(expert_distribution_recorder_mode=None))
        with pytest.raises(ValueError, match="--expert-distribution-recorder-mode"):
            asyncio.run(method(off))
        on = SimpleNamespace(server_args=SimpleNamespace(expert_distribution_recorder_mode="stat"))
        with pytest.raises(AttributeError):
            asyncio.run(method(on))


def _post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=120)


@pytest.mark.server
def test_out_of_vocab_ids_get_400_and_the_server_survives(prr_server, demo_config):
    vocab = int(demo_config["vocab_size"])
    sp = {"max_new_tokens": 2, "temperature": 0.0}
    for ids in BAD_IDS + [[1, 2, vocab]]:
        r = _post(prr_server, "/generate", {"input_ids": ids, "sampling_params": sp})
        assert r.status_code == 400, (ids, r.status_code, r.text[:500])
        assert "vocabulary" in r.text and f"[0, {vocab})" in r.text, r.text[:500]
    # Batched: one bad row rejects the request.
    r = _post(prr_server, "/generate", {"input_ids": [[1, 2, 3], [4, 999999]],
                                        "sampling_params": sp})
    assert r.status_code == 400, r.text[:500]
    r = _post(prr_server, "/generate", {"input_ids": [[1, 2, 3], [4, -1]],
                                        "sampling_params": sp})
    assert r.status_code == 400, r.text[:500]
    # OpenAI completions with token-id prompts (single and batched).
    for prompt in ([1, 2, 999999], [[1, 2], [3, -4]]):
        r = _post(prr_server, "/v1/completions",
                  {"model": "default", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400, (prompt, r.status_code, r.text[:500])
        assert "vocabulary" in r.text, r.text[:500]
    # Still serving: health, a valid request, a valid batch and a valid completion.
    assert prr_server.healthy()
    out = generate(prr_server, prompt_ids(11, 40), max_new_tokens=2)
    assert len(out["meta_info"]["output_token_logprobs"]) == 2
    r = _post(prr_server, "/generate", {"input_ids": [[1, 2, 3], [4, vocab - 1]],
                                        "sampling_params": sp})
    assert r.status_code == 200 and len(r.json()) == 2, r.text[:500]
    r = _post(prr_server, "/v1/completions", {"model": "default", "prompt": [1, 2, 3],
                                              "max_tokens": 2})
    assert r.status_code == 200, r.text[:500]


@pytest.mark.server
def test_arguments_that_stopped_the_scheduler_get_400_and_the_server_survives(prr_server,
                                                                              demo_config):
    """Requests whose arguments SGLang 0.5.17 passed on to its scheduler, which then failed and
    took the server down with every request in flight (a float max_new_tokens, top_k >= 2^31,
    more top logprobs than the vocabulary, logprob_start_len < -1), and a few that gave HTTP 500
    or ran something else than asked: each gets 400 naming its field, the server keeps serving
    the same greedy tokens, and top_k past 2^30 is served as every token."""
    vocab = int(demo_config["vocab_size"])
    ids = prompt_ids(7, 50)
    before = generate(prr_server, ids, max_new_tokens=3)["meta_info"]["output_token_logprobs"]
    sp = {"max_new_tokens": 3, "temperature": 0.0}
    gen = lambda **kw: {"input_ids": ids, "sampling_params": dict(sp), **kw}  # noqa: E731
    bad = [
        ("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2.5}},
         "max_new_tokens"),
        ("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2,
                                                              "temperature": 1.0,
                                                              "top_k": 2 ** 31}}, None),
        ("/generate", gen(return_logprob=True, top_logprobs_num=vocab + 1), "top_logprobs_num"),
        ("/generate", gen(return_logprob=True, top_logprobs_num=vocab + 1, stream=True),
         "top_logprobs_num"),
        ("/v1/completions", {"model": "default", "prompt": ids, "max_tokens": 2,
                             "logprobs": vocab + 500}, "top_logprobs_num"),
        ("/generate", gen(return_logprob=True, logprob_start_len=-5), "logprob_start_len"),
        ("/generate", {"input_ids": ids, "sampling_params": {"temperature": "hot"}},
         "temperature"),
        ("/generate", {"input_ids": ids, "sampling_params": {"bogus": 1}}, "bogus"),
        ("/generate", {"input_ids": ids, "sampling_params": {"stop": ""}}, "stop"),
        ("/generate", {"input_ids": ids, "sampling_params": {"n": 0}}, "n must"),
    ]
    for path, body, field in bad:
        r = _post(prr_server, path, body)
        if field is None:  # top_k past 2^30: every token, served
            assert r.status_code == 200, (body, r.status_code, r.text[:300])
        else:  # a stream may carry its error as an event after a 200 header
            assert r.status_code == 400 or body.get("stream"), (path, body, r.status_code,
                                                                  r.text[:300])
            assert field in r.text, r.text[:300]
        assert prr_server.healthy(), (path, body)
    after = generate(prr_server, ids, max_new_tokens=3)["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in after] == [t[1] for t in before]  # the same greedy ids
    # control: the edge values are served
    ok = _post(prr_server, "/generate", gen(return_logprob=True, top_logprobs_num=vocab,
                                            logprob_start_len=-1))
    assert ok.status_code == 200, ok.text[:300]


@pytest.mark.server
def test_bodies_that_gave_500_get_400_and_constrained_decoding_runs_on_cpu(prr_server):
    """Bodies SGLang 0.5.17 answered with 500 (a chat body that is not an object, a
    response_format that is not one, a body nested thousands deep, a list rid or cache key, an n
    of 2^40, unknown session keys), a list lora_id or positional_embed_overrides on one request
    (each stopped the scheduler), validation messages that echoed the whole body with the
    endpoint's file and line, a prompt given as text and ids (the text was dropped), a
    regex-constrained request, which stopped a CPU server, /v1/tokenize (500 on every
    request for a tokenizer without a model_max_length), an empty sampling_params list, a list rid
    on /encode, a body that is not an object on a route that reads its own, the expert-
    distribution commands on a server without a recorder (they stopped the scheduler), empty
    messages / input / label_token_ids, Ollama requests past the context (500, or a stream
    broken off after a 200), and an integer skip_special_tokens (it stopped the detokenizer)."""
    url = prr_server.url
    hdr = {"Content-Type": "application/json"}
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0}
    deep = "[" * 5000 + "]" * 5000
    cases = [
        ("/v1/chat/completions", "[]", "JSON object"),
        ("/v1/chat/completions", "null", "JSON object"),
        ("/v1/chat/completions", json.dumps({**chat, "response_format": 5}),
         "body.response_format"),
        ("/generate", '{"text": %s}' % deep, "body.text"),
        ("/v1/completions", '{"prompt": %s}' % deep, "body.prompt"),
        ("/generate", json.dumps({"text": "x" * 50000, "sampling_params": 3}),
         "body.sampling_params"),
        ("/generate", json.dumps({"text": "hello", "input_ids": [1, 2, 3]}), "not both"),
        ("/generate", json.dumps({"text": "hi", "rid": ["x"]}), "rid must be one value"),
        ("/v1/chat/completions", json.dumps({**chat, "rid": ["x"]}), "rid must be one value"),
        ("/v1/chat/completions", json.dumps({**chat, "extra_key": ["x"]}), "extra_key"),
        ("/v1/chat/completions", json.dumps({**chat, "n": 2 ** 40}), "sampling_params.n"),
        ("/generate", json.dumps({"text": "hi", "lora_id": ["x"]}), "lora_id"),
        ("/generate", json.dumps({"text": "hi", "sampling_params": [{}]}), "sampling_params"),
        ("/generate", json.dumps({"text": "hi", "session_params": {"a": 1}}), "session_params"),
        ("/generate", json.dumps({"text": "hi", "positional_embed_overrides": ["x"]}),
         "positional_embed_overrides"),
        ("/generate", json.dumps({"text": "hi", "sampling_params": []}), "sampling_params"),
        ("/generate", json.dumps({"text": "hi", "sampling_params": {"skip_special_tokens": -1}}),
         "sampling_params.skip_special_tokens"),
        ("/encode", json.dumps({"text": "hi", "rid": []}), "rid must be one value"),
        ("/classify", json.dumps({"text": "hi", "sampling_params": []}), "sampling_params"),
        ("/remove_external_corpus", "[]", "JSON object"),
        ("/start_expert_distribution_record", "{}", "records no expert distribution"),
        ("/dump_expert_distribution_record", "{}", "records no expert distribution"),
        ("/api/chat", json.dumps({"model": "m", "messages": []}), "body.messages"),
        ("/v1/messages/count_tokens", json.dumps({"model": "m", "messages": []}), "messages"),
        ("/v1/responses", json.dumps({"model": "m", "input": []}), "body.input"),
        ("/v1/score", json.dumps({"model": "m", "query": "q", "items": ["a"],
                                  "label_token_ids": []}), "label_token_ids"),
        ("/configure_logging", json.dumps({"log_level": "loud"}), "Unknown level"),
        ("/parse_function_call", json.dumps({"text": "x", "tool_call_parser": "nope",
                                             "tools": []}), "tool_call_parser"),
        # Ollama's default num_predict (2048) is past the demo's context: stream or not
        ("/api/generate", json.dumps({"model": "m", "prompt": "hi"}), "context length"),
        ("/api/generate", json.dumps({"model": "m", "prompt": "hi", "stream": False}),
         "context length"),
    ]
    for path, body, field in cases:
        r = requests.post(url + path, data=body, headers=hdr, timeout=120)
        assert r.status_code == 400, (path, body[:80], r.status_code, r.text[:300])
        assert field in r.text and len(r.text) < 2000 and ".py" not in r.text, r.text[:300]
        assert prr_server.healthy(), (path, body[:80])
    short = _post(prr_server, "/api/generate", {"model": "m", "prompt": "hi",
                                                 "options": {"num_predict": 3}})
    assert short.status_code == 200 and '"done":true' in short.text.replace(" ", "")  # control
    # constrained decoding: the answer matches the regex; unconstrained (the control) it need not
    r = _post(prr_server, "/v1/chat/completions", {**chat, "max_tokens": 8,
                                                   "regex": "[0-9]{3}"})
    assert r.status_code == 200, r.text[:300]
    assert re.fullmatch("[0-9]{3}", r.json()["choices"][0]["message"]["content"]), r.text[:300]
    free = _post(prr_server, "/v1/chat/completions", chat).json()
    assert not re.fullmatch("[0-9]{3}", free["choices"][0]["message"]["content"])
    # /v1/tokenize: the demo tokenizer names no model_max_length (HF's 10^30 did not encode: 500)
    tok = _post(prr_server, "/v1/tokenize", {"prompt": ["a", "b c"]})
    assert tok.status_code == 200 and tok.json()["max_model_len"] == 1024, tok.text[:300]
    assert [len(t) for t in tok.json()["tokens"]] == tok.json()["count"]
    assert prr_server.healthy()


# --------------------------------------------------------------- 2. K and |P| capped at the context
def test_top_k_capped_at_the_context_length(clean_env, demo_model, demo_config):

    big = ["--model-path", demo_model, "--prr-block-size", "16", "--prr-top-k", "1000000",
           "--prr-top-k-unit", "tokens"]
    _, cfg, _ = launch_server.prepare(big + ["--context-length", "1000"])
    assert cfg.max_context_blocks == 63  # ceil(1000 / 16)
    assert cfg.top_k_blocks == 63 and cfg.predicted_blocks == 63
    exported = json.loads(os.environ[ENV_CONFIG])  # what the scheduler processes read
    assert exported["max_context_blocks"] == 63
    from sglang_prr.serving.server_args_patch import load_config

    child = load_config()
    assert child.top_k_blocks == 63 and child.predicted_blocks == 63
    # Without --context-length: the model config's length.
    _, cfg, _ = launch_server.prepare(big)
    blocks = -(-int(demo_config["max_position_embeddings"]) // 16)
    assert cfg.max_context_blocks == blocks and cfg.predicted_blocks == blocks
    # A K that fits is left alone (negative control).
    _, cfg, _ = launch_server.prepare(["--model-path", demo_model, "--prr-block-size", "16",
                                       "--prr-top-k", "4", "--prr-top-k-unit", "blocks",
                                       "--context-length", "1000"])
    assert cfg.top_k_blocks == 4 and cfg.predicted_blocks == 6


def test_unknown_context_length_leaves_k_uncapped():
    """SGLang's ServerArgs already loads the model config, so the launcher always knows the
    context; where it cannot (no loadable config, no --context-length) K stays as given."""
    from types import SimpleNamespace

    from sglang_prr.config import PRRConfig
    from sglang_prr.serving.server_args_patch import cap_to_context, context_len_of

    no_model = SimpleNamespace(model_path="/nonexistent-model", context_length=None)
    cfg = PRRConfig(top_k=100, top_k_unit="blocks", block_size=16).validate()
    assert context_len_of(no_model) is None and cap_to_context(cfg, no_model) is None
    assert cfg.max_context_blocks is None and cfg.top_k_blocks == 100
    given = SimpleNamespace(model_path="/nonexistent-model", context_length=320)
    assert cap_to_context(cfg, given) == 320 and cfg.top_k_blocks == 20


# --------------------------------------------------------------- 3. budget auto needs a profile
def test_budget_auto_without_profile_exits_2(clean_env, capsys):

    with pytest.raises(SystemExit) as e:
        launch_server.prepare(["--model-path", "/nonexistent-model", "--prr-budget", "auto"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "--prr-budget auto" in err and "--prr-profile" in err, err[-2000:]
    assert "python -m sglang_prr.profile_budget" in err, err[-2000:]
    with pytest.raises(SystemExit) as e:  # a profile that cannot be read: also refused
        launch_server.prepare(["--model-path", "/nonexistent-model", "--prr-budget", "auto",
                               "--prr-profile", "/nonexistent-profile.json"])
    assert e.value.code == 2
    assert "/nonexistent-profile.json" in capsys.readouterr().err


def test_budget_auto_with_profile_is_accepted(clean_env, tmp_path, demo_model):

    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"version": 2, "shape": dict(
        method="quest", num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
        top_k_tokens=64), "layer_us": [{"batch": 1, "context": 300, "delta": 0, "us": 5.0},
                                       {"batch": 1, "context": 300, "delta": 1.0, "us": 4.0}]}))
    shape = ["--prr-block-size", "16", "--prr-top-k", "64", "--prr-top-k-unit", "tokens"]
    _, cfg, _ = launch_server.prepare(["--model-path", demo_model, "--prr-budget", "auto",
                                       "--prr-profile", str(prof)] + shape)
    assert cfg.budget == "auto" and cfg.profile == str(prof)
    # With PRR off the budget is unused: no profile needed.
    _, cfg, _ = launch_server.prepare(["--model-path", demo_model, "--prr-method", "dense",
                                       "--prr-budget", "auto"])
    assert not cfg.enabled


# --------------------------------------------------------------- 4. signals stop every child
_alive = supervisor._alive  # the supervisor's own liveness check (zombies are not alive)


def _describe(procs, width=80):
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid}:{' '.join(p.cmdline())[:width]}")
        except psutil.Error:
            out.append(str(p.pid))
    return out


def _assert_all_stop(launcher: subprocess.Popen, sig: int, within: float = STOP_WITHIN_S):
    me = psutil.Process(launcher.pid)
    before = me.children(recursive=True)
    assert before, "the launcher has no child processes"
    os.kill(launcher.pid, sig)
    t0 = time.monotonic()
    procs = [me] + before
    while time.monotonic() - t0 < within and _alive(procs):
        time.sleep(0.2)
    left = _alive(procs)
    took = time.monotonic() - t0
    for p in left:  # do not leak them into the rest of the session
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not left, f"alive {took:.0f}s after {signal.Signals(sig).name}: {_describe(left)}"
    return launcher.wait(timeout=10), took


@pytest.mark.server
def test_sigterm_after_health_stops_every_child(demo_model, tmp_path):
    """Also the end-to-end check of item 2: K = 10^6 tokens is served, capped at 64 blocks."""
    args = COMMON[:2] + ["--prr-top-k", "1000000", "--prr-top-k-unit", "tokens"] + COMMON[6:]
    assert "--context-length" in args and args[args.index("--context-length") + 1] == "1024"
    srv = start_server("sigterm", args, {}, True, demo_model, tmp_path)
    try:
        srv.wait_ready(START_TIMEOUT_S)
        stats = requests.get(srv.url + "/prr/stats", timeout=30).json()
        cfg = stats["config"]
        assert cfg["max_context_blocks"] == 64, cfg  # 1024 / 16
        assert cfg["top_k_blocks"] == 64 and cfg["predicted_blocks"] == 64, cfg
        out = generate(srv, prompt_ids(5, 300), max_new_tokens=4)
        assert len(out["meta_info"]["output_token_logprobs"]) == 4
        r = requests.post(srv.url + "/generate", json={"input_ids": [1, -3, 5]}, timeout=60)
        assert r.status_code == 400 and srv.healthy(), r.text[:300]
        rc, took = _assert_all_stop(srv.proc, signal.SIGTERM)
        assert rc == 128 + signal.SIGTERM, rc
        print(f"stopped {took:.1f}s after SIGTERM")
    finally:
        srv.stop()


@pytest.mark.server
def test_sigterm_during_startup_stops_every_child(demo_model, tmp_path):
    """A signal while SGLang's processes start (before SGLang's own handlers exist) used to
    leave the detokenizer and the multiprocessing resource tracker running."""
    srv = start_server("sigterm-startup", list(COMMON), {}, True, demo_model, tmp_path)
    try:
        me = psutil.Process(srv.proc.pid)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and srv.proc.poll() is None:
            # As soon as SGLang has spawned the scheduler and the detokenizer, while they
            # still import (before they can notice that their parent is gone).
            spawned = [c for c in _describe(me.children(recursive=True), width=1000)
                       if "spawn_main" in c or "sglang::" in c]
            if len(spawned) >= 2:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the scheduler never started:\n" + srv.log_path.read_text()[-3000:])
        rc, took = _assert_all_stop(srv.proc, signal.SIGTERM)
        assert rc == 128 + signal.SIGTERM, rc
        print(f"stopped {took:.1f}s after SIGTERM during startup")
    finally:
        srv.stop()


FAKE_SERVER = textwrap.dedent("""
    # A server whose processes ignore SIGTERM and SIGINT, with an orphaned grandchild.
    import os, signal, subprocess, sys, time
    ignore = "import signal, time; [signal.signal(s, signal.SIG_IGN) for s in " \\
             "(signal.SIGTERM, signal.SIGINT)]; time.sleep(600)"
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    kid = subprocess.Popen([sys.executable, "-c", ignore])
    # Double fork: the middle process exits, its child is re-parented (to the supervisor).
    mid = subprocess.Popen([sys.executable, "-c",
                            "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                            + repr(ignore) + "]); print('ok')"])
    mid.wait()
    open(sys.argv[1], "w").write("ready")
    time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_supervisor_kills_stubborn_and_orphaned_children(sig, tmp_path):
    """The supervisor without SGLang: children that ignore the signal are killed after the
    grace period, and orphans re-parented to it are found too."""
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    ready = tmp_path / "ready"
    env = dict(os.environ, SGLANG_PRR_STOP_GRACE_S="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    code = ("import sys; from sglang_prr.serving.supervisor import supervise; "
            f"sys.exit(supervise([], cmd=[sys.executable, {str(fake)!r}, {str(ready)!r}]))")
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=str(REPO),
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.1)
        assert ready.exists(), "the fake server did not start"
        time.sleep(0.5)
        n = len(psutil.Process(launcher.pid).children(recursive=True))
        assert n >= 3, n  # fake server, its child, the orphan
        rc, took = _assert_all_stop(launcher, sig, within=20)
        assert rc == 128 + sig and took >= 1.0, (rc, took)  # the grace period was honoured
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
