"""The request checks the server runs before SGLang's scheduler sees a request
(``sglang_prr/serving/requests.py``): each argument that used to stop the scheduler, or gave
HTTP 500, or ran something else than asked, is refused by name; beside each, the valid value of
the same field passes (the control)."""

from __future__ import annotations

import random

import pytest

from sglang_prr.serving.requests import (TOP_K_ALL, check_request, check_sampling_params)

VOCAB = 512


class Req:
    """What the checks read of SGLang's GenerateReqInput."""

    def __init__(self, sampling_params=None, **kw):
        self.sampling_params = sampling_params
        self.return_logprob = kw.get("return_logprob", False)
        self.top_logprobs_num = kw.get("top_logprobs_num", 0)
        self.logprob_start_len = kw.get("logprob_start_len", -1)


@pytest.mark.parametrize("field,bad,good", [
    ("max_new_tokens", 2.5, 2), ("max_new_tokens", 2.0, 0), ("max_new_tokens", True, 1),
    ("max_new_tokens", "abc", 128), ("min_new_tokens", -1, 0), ("n", 0, 1), ("n", -3, 2),
    ("temperature", "hot", 0.7), ("temperature", float("nan"), 0), ("top_p", None, 0.9),
    ("top_k", 0, 1), ("top_k", 2.0, 2), ("top_k", -2, -1), ("stop", "", "x"),
    ("stop", ["a", ""], ["a", "b"]), ("stop", [3], ["3"]), ("stop_regex", "(", "a+"),
    ("stream_interval", 0, 1), ("n", 1025, 1024), ("n", 2 ** 40, 7),
    # SamplingParams' own field types: an integer skip_special_tokens reached the detokenizer's
    # tokenizer call and stopped the server
    ("skip_special_tokens", -1, False), ("skip_special_tokens", None, True),
    ("spaces_between_special_tokens", "yes", True), ("no_stop_trim", 1, True),
    ("ignore_eos", [], True), ("json_schema", {}, '{"type": "object"}'), ("regex", 5, "a+"),
    ("stop_token_ids", [[1]], [1, 2]), ("logit_bias", {"5": "x"}, {"5": -1.5}),
    ("logit_bias", {"a": 1}, {"17": 2}), ("sampling_seed", "7", 7),
])
def test_each_bad_sampling_value_is_refused_by_name(field, bad, good):
    if bad is not None or field in ("skip_special_tokens",):
        with pytest.raises(ValueError, match=f"sampling_params.{field}") as e:
            check_sampling_params({"max_new_tokens": 4, field: bad})
        assert repr(bad)[:20] in str(e.value)
    sp = {"max_new_tokens": 4, field: good}
    check_sampling_params(sp)  # control
    assert sp[field] == good


def test_unknown_keys_are_named_and_sglang_s_own_pass():
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]") as e:
        check_sampling_params({"max_new_tokens": 2, "bogus": 1})
    assert "temperature" in str(e.value) and "stop_strs" not in str(e.value)
    check_sampling_params({"json_schema": None, "ignore_eos": True, "logit_bias": {"3": 1.0},
                           "custom_params": None, "no_stop_trim": False})
    for not_a_dict in ([], "x", 3):
        with pytest.raises(ValueError, match="sampling_params"):
            check_sampling_params(not_a_dict)
    check_sampling_params(None)  # the defaults


def test_top_k_past_every_token_means_every_token():
    k = random.randint(TOP_K_ALL + 1, 2 ** 62)
    sp = {"top_k": k}
    check_sampling_params(sp)
    assert sp["top_k"] == TOP_K_ALL  # was an int32 overflow in the scheduler
    sp = {"top_k": TOP_K_ALL - 1}
    check_sampling_params(sp)
    assert sp["top_k"] == TOP_K_ALL - 1  # control: a k below is kept


def test_logprob_arguments():
    for bad in (VOCAB + 1, 10 ** 6, -1, 1.5):
        with pytest.raises(ValueError, match="top_logprobs_num") as e:
            check_request(Req({}, return_logprob=True, top_logprobs_num=bad), VOCAB)
        assert f"[0, {VOCAB}]" in str(e.value)
    for bad in (-2, -5, 0.5):
        with pytest.raises(ValueError, match="logprob_start_len"):
            check_request(Req({}, return_logprob=True, logprob_start_len=bad), VOCAB)
    # controls: the edges, batch lists, and no logprobs asked (nothing read)
    check_request(Req({}, return_logprob=True, top_logprobs_num=VOCAB, logprob_start_len=0),
                  VOCAB)
    check_request(Req([{}, {"top_k": 5}], return_logprob=True, top_logprobs_num=[0, 3],
                      logprob_start_len=[-1, 7]), VOCAB)
    check_request(Req({}, return_logprob=False, top_logprobs_num=10 ** 6), VOCAB)
    with pytest.raises(ValueError, match="sampling_params.n"):
        check_request(Req([{}, {"n": 0}]), VOCAB)


class Prompt:
    def __init__(self, **kw):
        self.text, self.input_ids, self.input_embeds = (kw.get(k) for k in
                                                        ("text", "input_ids", "input_embeds"))
        self.sampling_params = None


@pytest.mark.parametrize("given", [("text", "input_ids"), ("text", "input_embeds"),
                                   ("text", "input_ids", "input_embeds")])
def test_a_prompt_given_twice_is_refused(given):
    """SGLang serves the ids and drops the text without a word: the request is refused, naming
    both; an empty text counts as given."""
    values = {"text": "", "input_ids": [1, 2], "input_embeds": [[0.0]]}
    with pytest.raises(ValueError, match="not both") as e:
        check_request(Prompt(**{k: values[k] for k in given}), VOCAB)
    assert all(k in str(e.value) for k in given)


@pytest.mark.parametrize("given", [("text",), ("input_ids",), ("input_embeds",),
                                   ("input_ids", "input_embeds")])
def test_one_prompt_passes(given):
    """The control: one prompt (or SGLang's own ids-with-embeddings pairing) passes."""
    values = {"text": "hi", "input_ids": [1, 2], "input_embeds": [[0.0]]}
    check_request(Prompt(**{k: values[k] for k in given}), VOCAB)
