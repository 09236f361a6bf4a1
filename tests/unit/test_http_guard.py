"""The HTTP 400s of ``sglang_prr/serving/http_guard.py``, on a small FastAPI app shaped like
SGLang's (a request model whose own validator fails with ``AttributeError`` on a non-object, as
``ChatCompletionRequest``'s does): without the guard such bodies get HTTP 500 (the control), with
it 400 naming the field; validation messages stay short and never name a file, whatever the
body's size or nesting."""

from __future__ import annotations

import json
import random
from typing import Optional

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from pydantic import BaseModel, model_validator  # noqa: E402

from sglang_prr.serving import http_guard  # noqa: E402


class Chat(BaseModel):
    messages: list
    max_tokens: int = 1
    response_format: Optional[dict] = None

    @model_validator(mode="before")
    @classmethod
    def _reads_response_format(cls, values):  # as SGLang's set_json_schema does
        rf = values.get("response_format")
        if rf is not None:
            rf.get("type")
        return values


def _app(guarded: bool):
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(req: Chat):
        return {"n": len(req.messages)}

    @app.post("/v1/responses")
    async def responses(req: Chat):
        return {"n": len(req.messages)}

    @app.post("/boom")
    async def boom(req: Chat):  # fails after validation: not the body's fault
        raise AttributeError("a bug elsewhere")

    @app.post("/remove_external_corpus")
    async def remove(request: Request):  # reads its body itself, as SGLang's does
        body = await request.json()
        return {"id": body.get("corpus_id")}

    @app.post("/flush")
    async def flush():  # reads no body, fails elsewhere
        raise AttributeError("a bug elsewhere")

    @app.post("/count_tokens")
    async def count(req: Chat):  # indexes the first message, as SGLang's count_tokens does
        return {"first": req.messages[0]}

    @app.post("/start_expert_distribution_record")
    async def start_record():  # the tokenizer manager's refusal (requests.py)
        raise ValueError("this server records no expert distribution")

    if guarded:
        assert http_guard.install(app) == 7
    return TestClient(app, raise_server_exceptions=False)


def _deep(n: int) -> str:
    return "[" * n + "]" * n  # as text: json.dumps itself cannot nest this deep


@pytest.mark.parametrize("body,field", [
    ([], "JSON object; got an array"), (None, "JSON object; got null"),
    (5, "JSON object; got a number"),
    ({"messages": [], "response_format": 5}, "body.response_format"),
    ({"messages": [], "response_format": [1, 2]}, "body.response_format"),
])
def test_a_body_the_model_cannot_read_gets_400_naming_it(body, field):
    plain, guarded = _app(False), _app(True)
    raw = {"content": json.dumps(body), "headers": {"Content-Type": "application/json"}}
    assert plain.post("/v1/chat/completions", **raw).status_code == 500  # the control
    r = guarded.post("/v1/chat/completions", **raw)
    assert r.status_code == 400, r.text
    assert field in r.json()["message"], r.text
    good = guarded.post("/v1/chat/completions", json={"messages": [1, 2],
                                                       "response_format": {"type": "x"}})
    assert good.status_code == 200 and good.json() == {"n": 2}


def test_a_failure_after_validation_stays_a_500():
    """The guard answers only for the body: a route that fails on a valid body keeps its 500."""
    r = _app(True).post("/boom", json={"messages": []})
    assert r.status_code == 500


def test_validation_messages_are_short_and_name_no_file():
    """A body nested thousands deep made SGLang's message overflow the stack (500); a long
    prompt was echoed back whole with the endpoint's file and line."""
    plain, guarded = _app(False), _app(True)
    prompt = "".join(random.choice("abcdef") for _ in range(20000))
    deep = '{"messages": [], "max_tokens": %s}' % _deep(500)
    for body in (json.dumps({"messages": prompt}), deep, json.dumps({"max_tokens": "x" * 5000})):
        r = guarded.post("/v1/chat/completions", content=body,
                         headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        msg = r.json()["message"]
        assert len(msg) < 600 and ".py" not in msg and "File " not in msg, msg
        assert "body.messages" in msg or "body.max_tokens" in msg, msg
    assert len(plain.post("/v1/chat/completions",
                          json={"messages": prompt}).text) > 20000  # the control: echoed


def test_short_repr_survives_any_depth():
    v: list = []
    for _ in range(100000):  # far past the interpreter's recursion limit
        v = [v]
    assert http_guard.short_repr(v) == "[[[...]]]"
    assert len(http_guard.short_repr("y" * 10 ** 6)) < 80


def test_responses_keeps_its_nested_envelope():
    r = _app(True).post("/v1/responses", json={"messages": 3})
    assert r.status_code == 400 and "body.messages" in r.json()["error"]["message"], r.text


def test_validation_message_counts_what_it_leaves_out():
    errors = [{"loc": ("body", f"f{i}"), "msg": "bad", "input": i} for i in range(11)]
    msg = http_guard.validation_message(errors)
    assert msg.startswith("11 validation errors") and "and 3 more" in msg
    assert "body.f7: bad; got 7" in msg and "body.f8" not in msg
    one = http_guard.validation_message([{"loc": ("body", 9), "msg": "JSON decode error",
                                          "type": "json_invalid", "input": {},
                                          "ctx": {"error": "unexpected end of data"}}])
    assert one == "1 validation error: body.9: JSON decode error (unexpected end of data)"
    long_loc = http_guard.validation_message([{"loc": ("body", "u" * 500), "msg": "m"}])
    assert len(long_loc) < 80 and "..." in long_loc


@pytest.mark.parametrize("body", [[], None, 5, "x"])
def test_a_route_reading_its_own_body_answers_a_non_object_with_400(body):
    """SGLang's /remove_external_corpus calls ``.get`` on whatever JSON came: 500 (the control);
    guarded, 400; an object still reaches the route, and a route that read no body and failed
    keeps its 500."""
    plain, guarded = _app(False), _app(True)
    raw = {"content": json.dumps(body), "headers": {"Content-Type": "application/json"}}
    assert plain.post("/remove_external_corpus", **raw).status_code == 500
    r = guarded.post("/remove_external_corpus", **raw)
    assert r.status_code == 400 and "JSON object" in r.json()["message"], r.text
    assert guarded.post("/remove_external_corpus", json={"corpus_id": 7}).json() == {"id": 7}
    assert guarded.post("/flush", **raw).status_code == 500


def test_a_refused_expert_record_command_is_a_400():
    assert _app(False).post("/start_expert_distribution_record").status_code == 500
    r = _app(True).post("/start_expert_distribution_record")
    assert r.status_code == 400 and "records no expert distribution" in r.json()["message"]


def test_an_empty_list_behind_an_index_error_is_a_400_naming_it():
    """An empty ``messages`` that the route indexes: 500 (the control), guarded 400 naming the
    field; a non-empty one is served, and an IndexError with no empty list stays a 500."""
    plain, guarded = _app(False), _app(True)
    assert plain.post("/count_tokens", json={"messages": []}).status_code == 500
    r = guarded.post("/count_tokens", json={"messages": [], "max_tokens": 2})
    assert r.status_code == 400 and "body.messages" in r.json()["message"], r.text
    assert "max_tokens" not in r.json()["message"]
    assert guarded.post("/count_tokens", json={"messages": ["a"]}).json() == {"first": "a"}
    assert http_guard.empty_lists_message([b'{"messages": [1]}']) == ""
    assert http_guard.empty_lists_message([b"[]"]) == ""
