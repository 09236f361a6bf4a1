"""HTTP 400, not 500, for request bodies SGLang's app cannot read, with messages that stay short.

Measured on SGLang 0.5.17 (FastAPI 0.165), PRR on or off:

* a body that fails validation gets 400 whose message is ``str(exc)``: every error with its whole
  ``input`` (the prompt, echoed back) and the endpoint's file and line. A body nested a few
  thousand levels deep makes that ``str`` overflow the stack: HTTP 500.
* ``/v1/chat/completions`` with a body that is not an object (``[]``, ``null``), or with a
  ``response_format`` that is not an object, fails inside the request model's own validator
  with an ``AttributeError``, which FastAPI does not turn into a validation error: HTTP 500.
* ``/v1/tokenize`` answered 500 to every request for a tokenizer without ``model_max_length``
  (``_patch_tokenize``).

``install(app)`` replaces the validation-error handler with one that names each error's place
and message and a bounded repr of the value (``validation_message``), in the same envelopes
(the OpenAI one; ``/v1/responses``' nested one; ``/v1/messages`` keeps SGLang's own, which
already scrubs), and wraps each route that reads a body so that a body whose validation raises
anything else gets 400 naming the field (``unreadable_body_message``). Only a failed request
pays: a body is validated again only after its route raised before answering.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Sequence

from .requests import short_repr, wrap_once

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


def _guard_route(route) -> None:
    """Wrap ``route.app`` (its ASGI app, inside the whole middleware stack): record the body as
    the route reads it; when the route raises before it answered and validating the recorded body
    raises the same way, answer 400 naming the field, else re-raise."""
    from pydantic import TypeAdapter

    inner, annotation = route.app, route.body_field.field_info.annotation
    adapter: list = []  # built on the first failure only

    def fails(body: Any) -> Optional[BaseException]:
        if not adapter:
            adapter.append(TypeAdapter(annotation))
        try:
            adapter[0].validate_python(body, from_attributes=True)
        except ValueError:  # pydantic's ValidationError: a 400 FastAPI already gives
            return None
        except Exception as e:  # noqa: BLE001 - the validator's own failure is the point
            return e
        return None

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
        except (AttributeError, TypeError, KeyError, IndexError) as err:
            body = _body_at_fault(chunks, fails) if not started[0] else _NOT_AT_FAULT
            if body is _NOT_AT_FAULT:
                raise err  # the failure is elsewhere (or answered already): SGLang's 500
            response = _json_response(scope.get("path", ""),
                                      unreadable_body_message(body, fails))
            await response(scope, recording_receive, send)

    route.app = app


def _tokenize_max_len(orig):
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


def _patch_tokenize() -> None:
    """``/v1/tokenize`` answers ``max_model_len`` from the tokenizer's ``model_max_length``, which
    Hugging Face sets to 10^30 for a tokenizer that names none: the response did not encode
    (HTTP 500 on every request). The server's context length is what it serves; it goes there."""
    try:
        from sglang.srt.entrypoints.openai.serving_tokenize import OpenAIServingTokenize
    except Exception:  # pragma: no cover - no OpenAI layer
        return
    wrap_once(OpenAIServingTokenize, "_handle_non_streaming_request", _tokenize_max_len)


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
    routes = [r for r in app.router.routes
              if isinstance(r, APIRoute) and r.body_field is not None]
    for r in routes:
        _guard_route(r)
    _patch_tokenize()
    return len(routes)
