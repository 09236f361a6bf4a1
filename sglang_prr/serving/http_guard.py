"""HTTP 400, not 500, for request bodies SGLang's app cannot read, with messages that stay short.

Measured on SGLang 0.5.17 (FastAPI 0.165), PRR on or off:

* a body that fails validation gets 400 whose message is ``str(exc)``: every error with its whole
  ``input`` (the prompt, echoed back) and the endpoint's file and line. A body nested a few
  thousand levels deep makes that ``str`` overflow the stack: HTTP 500.
* ``/v1/chat/completions`` with a body that is not an object (``[]``, ``null``), or with a
  ``response_format`` that is not an object, fails inside the request model's own validator
  with an ``AttributeError``, which FastAPI does not turn into a validation error: HTTP 500.
* ``/v1/tokenize`` answered 500 to every request for a tokenizer without ``model_max_length``
  (``_tokenize_max_len``).
* routes that read their JSON body themselves (``/remove_external_corpus``) answered a body that
  is not an object with 500; the expert-distribution commands on a server without a recorder
  stopped the scheduler (refused in ``requests``; their routes answer the refusal with 400).
* an empty ``messages`` (``/api/chat``, ``/v1/messages/count_tokens``) or ``input``
  (``/v1/responses``) was an ``IndexError`` (500); ``/v1/score`` with no ``label_token_ids``
  answered 500; the Ollama routes answered a request SGLang refuses (a prompt past the context)
  with 500, or broke their stream off after a 200; an unknown log level (``/configure_logging``)
  or tool-call parser (``/parse_function_call``) was a 500.

``install(app)`` replaces the validation-error handler with one that names each error's place
and message and a bounded repr of the value (``validation_message``), in the same envelopes
(the OpenAI one; ``/v1/responses``' nested one; ``/v1/messages`` keeps SGLang's own, which
already scrubs), and wraps each route that reads a body so that a body whose validation raises
anything else gets 400 naming the field (``unreadable_body_message``). Only a failed request
pays: a body is validated again only after its route raised before answering.
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Callable, Optional, Sequence

from .requests import EXPERT_RECORD_COMMANDS, short_repr, wrap_once

_MAX_ERRORS = 8  # errors listed in one message; the rest are counted
_MAX_LOC = 40  # characters of one part of an error's place
def _loc_part(x: Any) -> str:
    s = str(x)  # pydantic names union members in full: keep the start
    return s if len(s) <= _MAX_LOC else s[:_MAX_LOC - 3] + "..."


def _json_type(v: Any) -> str:
    for t, name in ((bool, "a boolean"), (dict, "an object"), (list, "an array"),
                    (str, "a string"), ((int, float), "a number")):
        if isinstance(v, t):
            return name
    return "null" if v is None else type(v).__name__


def validation_message(errors: Sequence[dict]) -> str:
    """One line per pydantic error (``loc: msg; got value``), at most ``_MAX_ERRORS`` of them,
    never a file name or an unbounded value."""
    parts = []
    for e in list(errors)[:_MAX_ERRORS]:
        where = ".".join(_loc_part(x) for x in e.get("loc", ())) or "body"
        msg = str(e.get("msg", "invalid value"))
        detail = (e.get("ctx") or {}).get("error")
        if detail is not None and str(detail) not in msg:
            msg += f" ({short_repr(str(detail))[1:-1]})"
        if "input" in e and e.get("type") not in ("missing", "json_invalid"):
            msg += f"; got {short_repr(e['input'])}"
        parts.append(f"{where}: {msg}")
    more = len(errors) - _MAX_ERRORS
    head = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}: "
    return head + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def unreadable_body_message(body: Any, fails: Callable[[Any], Optional[BaseException]]) -> str:
    """What is wrong with a body whose validation raised (not a validation error). ``fails(b)``
    validates ``b`` and returns the exception it raised, or None. The field is found by leaving
    out one top-level key at a time."""
    if not isinstance(body, dict):
        return f"the request body must be a JSON object; got {_json_type(body)}: " \
               f"{short_repr(body)}"
    for key in body:
        if fails({k: v for k, v in body.items() if k != key}) is None:
            return f"body.{key}: this endpoint cannot read {short_repr(body[key])} here " \
                   f"(is it an object where an object goes?)"
    return "the request body cannot be read by this endpoint"


def empty_lists_message(chunks: Sequence[bytes]) -> str:
    """The body's top-level fields that are empty lists, named, or '' when it has none. SGLang's
    chat template, the Anthropic token count and the Ollama chat index the first message: an
    IndexError (500) where the request gave none."""
    try:
        body = json.loads(b"".join(chunks) or b"null")
    except (ValueError, RecursionError):
        return ""
    empty = [k for k, v in body.items() if v == []] if isinstance(body, dict) else []
    if not empty:
        return ""
    return "; ".join(f"body.{k}: this endpoint needs at least one item here; got []"
                     for k in empty[:_MAX_ERRORS])


def error_body(path: str, message: str) -> dict:
    """SGLang's 400 envelope for ``path`` (``/v1/responses`` nests it under ``error``)."""
    if path.startswith("/v1/responses"):
        return {"error": {"message": message, "type": "Bad Request", "param": None,
                          "code": 400}}
    return {"object": "error", "message": message, "type": "Bad Request", "param": None,
            "code": 400}


def _json_response(path: str, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(path, message), status_code=400)


_NOT_AT_FAULT = object()


def _body_at_fault(chunks: Sequence[bytes], fails: Callable[[Any], Optional[BaseException]]):
    """The recorded body if validating it raises (so the body is what failed), else
    ``_NOT_AT_FAULT``."""
    try:
        body = json.loads(b"".join(chunks) or b"null")
    except (ValueError, RecursionError):  # not JSON: FastAPI's own 400 covers it
        return _NOT_AT_FAULT
    return body if fails(body) is not None else _NOT_AT_FAULT


def _not_an_object(body: Any) -> Optional[BaseException]:
    """``fails`` of a route that reads its JSON body itself, as an object."""
    return None if isinstance(body, dict) else TypeError("not a JSON object")


def _model_validation(route) -> Callable[[Any], Optional[BaseException]]:
    """``fails`` of a route with a body model: what validating a body with it raises, other
    than a validation error (FastAPI answers those with 400 already)."""
    from pydantic import TypeAdapter

    annotation = route.body_field.field_info.annotation
    adapter: list = []  # built on the first failure only

    def fails(body: Any) -> Optional[BaseException]:
        if not adapter:
            adapter.append(TypeAdapter(annotation))
        try:
            adapter[0].validate_python(body, from_attributes=True)
        except ValueError:  # pydantic's ValidationError
            return None
        except Exception as e:  # noqa: BLE001 - the validator's own failure is the point
            return e
        return None
    return fails


def _guard_route(route, raw: bool = False, refusals: bool = False) -> None:
    """Wrap ``route.app`` (its ASGI app, inside the whole middleware stack): record the body as
    the route reads it; when the route raises before it answered and validating the recorded body
    raises the same way, answer 400 naming the field, else re-raise. ``raw``: the route reads
    its JSON body itself (no model): the body is at fault when the route read one that is not an
    object. An ``IndexError`` with a top-level empty list in the body names that list.
    ``refusals``: the route does not catch the ``ValueError`` a request is refused with (SGLang's
    convention: its OpenAI routes answer it with 400), so it answers 400 with its message: the
    expert-distribution commands (``requests._needs_expert_recorder``) and ``_REFUSING``."""
    inner = route.app
    fails = _not_an_object if raw else _model_validation(route)

    async def app(scope, receive, send):
        chunks, started = [], [False]

        async def recording_receive():
            message = await receive()
            if message.get("type") == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def watching_send(message):
            started[0] = True
            await send(message)

        try:
            await inner(scope, recording_receive, watching_send)
        except (AttributeError, TypeError, KeyError, IndexError, ValueError) as err:
            if started[0] or (isinstance(err, ValueError) and not refusals):
                raise err  # answered already, or not a refusal: SGLang's own handling
            message = ""
            if isinstance(err, ValueError):
                message = str(err)
            elif chunks or not raw:  # a raw route that read no body: not the body
                body = _body_at_fault(chunks, fails)
                if body is not _NOT_AT_FAULT:
                    message = unreadable_body_message(body, fails)
                elif isinstance(err, IndexError):
                    message = empty_lists_message(chunks)
            if not message:
                raise err  # the failure is elsewhere: SGLang's 500
            await _json_response(scope.get("path", ""), message)(scope, recording_receive, send)

    route.app = app


_OLLAMA_GENERATION = ("/api/chat", "/api/generate")
# Routes whose ValueError is the request's (an unknown log level or tool-call parser), not
# caught by SGLang 0.5.17: HTTP 500.
_REFUSING = _OLLAMA_GENERATION + ("/configure_logging", "/parse_function_call")


def _first_chunk_early(orig):
    """An Ollama stream whose first chunk is awaited before the response is returned: a request
    SGLang refuses (``ValueError`` at the first chunk) then fails before the headers go out, and
    its route answers 400, where the stream broke off after a 200."""
    async def method(self, *args, **kwargs):
        response = await orig(self, *args, **kwargs)
        chunks = response.body_iterator
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            return response

        async def body():
            yield first
            async for chunk in chunks:
                yield chunk
        response.body_iterator = body()
        return response
    return method


def _score_labels(orig):
    """``/v1/score`` with ``label_token_ids: []`` asked for no logprobs and answered 500
    ("output_logprobs is empty"); refused with 400 by the route's own validation hook."""
    def _validate_request(self, request):
        if getattr(request, "label_token_ids", None) == []:
            return "label_token_ids: give at least one token id to score, or leave it out"
        return orig(self, request)
    return _validate_request


def _count_needs_messages(orig):
    """``/v1/messages/count_tokens`` with no messages failed in the chat template (an
    ``IndexError`` its handler answers with its own 500); refused with 400 in Anthropic's
    envelope."""
    async def handle_count_tokens(self, request, raw_request):
        if not getattr(request, "messages", None):
            return self._error_response(status_code=400, error_type="invalid_request_error",
                                        message="messages: give at least one message to count")
        return await orig(self, request, raw_request)
    return handle_count_tokens


def _tokenize_max_len(orig):
    """``/v1/tokenize`` answers ``max_model_len`` from the tokenizer's ``model_max_length``, which
    Hugging Face sets to 10^30 for a tokenizer that names none: the response did not encode
    (HTTP 500 on every request). The server's context length is what it serves; it goes there."""
    async def _handle_non_streaming_request(self, adapted_request, request, raw_request):
        out = await orig(self, adapted_request, request, raw_request)
        tm = self.tokenizer_manager
        limit = getattr(tm, "context_len", None) or getattr(
            getattr(tm, "model_config", None), "context_len", None)
        if limit and isinstance(getattr(out, "max_model_len", None), int) \
                and not 0 <= out.max_model_len <= limit:
            out.max_model_len = int(limit)
        return out
    return _handle_non_streaming_request


# SGLang's methods wrapped where a request made them answer 500 (or break a stream off):
# (module, class, method, wrapper). A layer or method this SGLang lacks is skipped.
_SGLANG_WRAPS = (
    ("sglang.srt.entrypoints.ollama.serving", "OllamaServing", "_stream_chat_response",
     _first_chunk_early),
    ("sglang.srt.entrypoints.ollama.serving", "OllamaServing", "_stream_generate_response",
     _first_chunk_early),
    ("sglang.srt.entrypoints.openai.serving_score", "OpenAIServingScore", "_validate_request",
     _score_labels),
    ("sglang.srt.entrypoints.anthropic.serving", "AnthropicServing", "handle_count_tokens",
     _count_needs_messages),
    ("sglang.srt.entrypoints.openai.serving_tokenize", "OpenAIServingTokenize",
     "_handle_non_streaming_request", _tokenize_max_len),
)


def _wrap_sglang() -> None:
    for module, cls_name, method, wrapper in _SGLANG_WRAPS:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except Exception:  # pragma: no cover - SGLang without that layer
            continue
        if hasattr(cls, method):
            wrap_once(cls, method, wrapper)


def install(app) -> int:
    """Install the handler and guard every route of ``app`` that reads a body; returns how many
    routes were guarded."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.routing import APIRoute

    original = app.exception_handlers.get(RequestValidationError)

    async def on_validation_error(request, exc):
        if original is not None and request.url.path.startswith("/v1/messages"):
            return await original(request, exc)  # Anthropic's envelope, already scrubbed
        return _json_response(request.url.path, validation_message(exc.errors()))

    app.exception_handlers[RequestValidationError] = on_validation_error
    routes = [r for r in app.router.routes if isinstance(r, APIRoute)
              and (r.body_field is not None or r.methods & {"POST", "PUT"})]
    for r in routes:
        _guard_route(r, raw=r.body_field is None, refusals=r.path in _REFUSING
                     or r.path.strip("/") in EXPERT_RECORD_COMMANDS)
    _wrap_sglang()
    return len(routes)
