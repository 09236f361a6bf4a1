"""What a request must hold before SGLang hands it to its scheduler.

SGLang 0.5.17 checks the ranges of the sampling parameters (``SamplingParams.verify``) but not
their types, and some values that pass reach the scheduler process and take it down, with every
request in flight (measured on a CPU server, PRR on and off): a float ``max_new_tokens`` (a slice
index), a ``top_k`` of 2^31 or more (an int32 tensor), more top logprobs than the vocabulary has
(``topk``), a ``logprob_start_len`` below -1 (an assertion). Others give HTTP 500 (a string where
a number goes, an unknown key, a stop regex that does not compile) or run something else than
was asked (an empty stop string ends every answer after one token, ``n`` below 1 runs one
sample, a huge ``n`` copies the prompt until memory runs out, ``text`` given with ``input_ids``
is dropped and the ids are served).

``check_request`` refuses these with a ``ValueError`` naming the field, the value and what is
allowed, which SGLang turns into HTTP 400 before the request is tokenized further: the server and
its other requests keep running. A ``top_k`` above 2^30 (SGLang's own "every token") means every
token, and is passed on as that. ``check_input_ids`` refuses token ids outside the vocabulary
(they failed in the embedding lookup, in the scheduler).

``install()`` (called once per process by the plugin) puts them in SGLang's seams:
``TokenizerManager._validate_one_request`` runs both; ``GenerateReqInput``'s
``normalize_batch_and_arguments`` runs the sampling checks before it copies the prompt ``n``
times, and afterwards checks the fields SGLang reads per request (``check_per_request``: a list
``lora_id`` on a single request stopped the scheduler); the OpenAI layer's
``cache_salt``/``extra_key`` type error becomes a 400 (a ``ValueError``), not a 500.
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import re
import reprlib
from typing import Any, Optional

# SGLang's "no top-k" value (sampling_params.TOP_K_ALL); larger values overflow its int32 tensor.
TOP_K_ALL = 1 << 30
# Samples per request: SGLang copies the prompt n times before anything else (a MemoryError,
# answered with an empty 400, at n = 2^40; minutes of the tokenizer's time and gigabytes well
# below that). The bound is generous for best-of-n; more samples go in more requests.
N_MAX = 1024

# SamplingParams' fields that SGLang fills itself, left out of the message's list of keys.
_INTERNAL = ("_strs", "_len", "is_normalized")
_INTS = {"max_new_tokens": 0, "min_new_tokens": 0, "n": 1, "stream_interval": 1}
_REALS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
          "repetition_penalty")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 60, 60
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 4


def short_repr(value: Any) -> str:
    """``repr`` bounded in length and depth, whatever the nesting."""
    return _REPR.repr(value)


def _bad(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{field} must be {allowed}; got {short_repr(value)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@functools.lru_cache(maxsize=None)
def _struct_types(module: str, name: str) -> Optional[dict]:
    """The fields of SGLang's msgspec struct ``module.name`` with their types (None where it
    cannot say); read once, not per request."""
    try:
        import msgspec

        cls = getattr(importlib.import_module(module), name)
        return {f.name: f.type for f in msgspec.structs.fields(cls)} or None
    except Exception:  # pragma: no cover - SGLang missing or moved: no key or type check
        return None


@functools.lru_cache(maxsize=None)
def _struct_keys(module: str, name: str) -> Optional[frozenset]:
    types = _struct_types(module, name)
    return frozenset(types) if types else None


_SAMPLING = ("sglang.srt.sampling.sampling_params", "SamplingParams")


def _known_keys() -> Optional[frozenset]:
    """The sampling parameters SGLang's ``SamplingParams`` takes."""
    return _struct_keys(*_SAMPLING)


def _check_types(sp: dict) -> None:
    """Each value of ``SamplingParams``' field type (msgspec): a boolean where SGLang's
    detokenizer passes it to the tokenizer (an integer ``skip_special_tokens`` stopped it, and the
    server), a string where it compiles a grammar, integer token ids; ``logit_bias`` keyed by
    token ids. ``custom_params`` is a custom processor's own business."""
    types = _struct_types(*_SAMPLING)
    if not types:
        return
    import msgspec

    for key, value in sp.items():
        if key in types and key != "custom_params":
            try:
                msgspec.convert(value, types[key])
            except msgspec.ValidationError as e:
                raise _bad(f"sampling_params.{key}", value, f"of its type ({e})") from None
    bias = sp.get("logit_bias")
    for token in (bias or {}):
        if not (token.isdigit() and token.isascii()):
            raise _bad("sampling_params.logit_bias", bias, "an object keyed by token ids")


def check_sampling_params(sp: Any) -> None:
    """One request's ``sampling_params`` (a dict, or None for the defaults): known keys, integers
    where SGLang slices or counts with them, real numbers where it compares them, non-empty stop
    strings, stop regexes that compile. Clamps ``top_k`` above ``TOP_K_ALL`` to it, in place."""
    if sp is None:
        return
    if not isinstance(sp, dict):
        raise _bad("sampling_params", sp, "an object of sampling parameters")
    known = _known_keys()
    if known is not None:
        unknown = sorted(k for k in sp if k not in known)
        if unknown:
            raise ValueError(f"sampling_params has unknown keys {unknown}; allowed: "
                             f"{sorted(k for k in known if not k.endswith(_INTERNAL))}")
    _check_types(sp)
    for field, low in _INTS.items():
        v = sp.get(field)
        if v is not None and not (_is_int(v) and v >= low):
            raise _bad(f"sampling_params.{field}", v, f"an integer >= {low}")
    if (sp.get("n") or 1) > N_MAX:
        raise _bad("sampling_params.n", sp["n"], f"at most {N_MAX} samples in one request")
    for field in _REALS:
        v = sp.get(field)
        if v is not None and not (isinstance(v, numbers.Real) and not isinstance(v, bool)
                                  and math.isfinite(v)):
            raise _bad(f"sampling_params.{field}", v, "a finite number")
    top_k = sp.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or (top_k < 1 and top_k != -1):
            raise _bad("sampling_params.top_k", top_k, "-1 (every token) or an integer >= 1")
        if top_k > TOP_K_ALL:
            sp["top_k"] = TOP_K_ALL  # the same distribution: every token
    stop = sp.get("stop")
    for s in ([stop] if isinstance(stop, str) else stop or []):
        if not isinstance(s, str) or not s:
            raise _bad("sampling_params.stop", stop, "a non-empty string or a list of them "
                       "(an empty one would end every answer at once)")
    regex = sp.get("stop_regex")
    for s in ([regex] if isinstance(regex, str) else regex or []):
        try:
            re.compile(s)
        except (re.error, TypeError) as e:
            raise _bad("sampling_params.stop_regex", s, f"a regular expression ({e})") from None


def check_logprob_args(obj: Any, vocab_size: Optional[int]) -> None:
    """``top_logprobs_num`` at most the vocabulary's size and ``logprob_start_len`` -1 (the
    output only) or a prompt position, where the request asks for logprobs."""
    if not getattr(obj, "return_logprob", False):
        return
    top = getattr(obj, "top_logprobs_num", None)
    for v in (top if isinstance(top, list) else [top]):
        if v is not None and not (_is_int(v) and 0 <= v and (not vocab_size or v <= vocab_size)):
            raise _bad("top_logprobs_num", v, f"an integer in [0, {vocab_size}] (the vocabulary)"
                       if vocab_size else "an integer >= 0")
    start = getattr(obj, "logprob_start_len", None)
    for v in (start if isinstance(start, list) else [start]):
        if v is not None and not (_is_int(v) and v >= -1):
            raise _bad("logprob_start_len", v, "-1 (the output only) or a position >= 0")


def check_prompt(obj: Any) -> None:
    """One prompt per request: ``text`` with ``input_ids`` or ``input_embeds`` is refused, since
    SGLang would serve the ids (or embeddings) and drop the text without a word.
    (``input_ids`` with ``input_embeds`` is SGLang's own pairing and passes.)"""
    if getattr(obj, "text", None) is None:
        return
    given = [k for k in ("input_ids", "input_embeds") if getattr(obj, k, None) is not None]
    if given:
        raise ValueError(f"give the prompt once: text or {' or '.join(given)}, not both "
                         f"(the request has text and {' and '.join(given)})")


def check_request(obj: Any, vocab_size: Optional[int]) -> None:
    """Every check above on one request of SGLang's (``GenerateReqInput``; an embedding request
    has no sampling to check)."""
    check_prompt(obj)
    sp = getattr(obj, "sampling_params", None)
    for one in (sp if isinstance(sp, list) else [sp]):
        check_sampling_params(one)
    check_logprob_args(obj, vocab_size)


def check_input_ids(input_ids: Any, vocab_size: int) -> None:
    """Raise ``ValueError`` unless every id of ``input_ids`` (a list, or a batch of lists) is
    an integer in ``[0, vocab_size)``; the message names the first bad id and the range."""
    if hasattr(input_ids, "tolist"):  # a tensor or an array
        input_ids = input_ids.tolist()  # host-ok: request validation, before the scheduler
    if input_ids is None or len(input_ids) == 0:
        return
    seqs = input_ids if isinstance(input_ids[0], (list, tuple)) else [input_ids]
    for seq in seqs:
        if hasattr(seq, "tolist"):
            seq = seq.tolist()  # host-ok: request validation
        if len(seq) == 0:
            continue
        if not set(map(type, seq)) <= {int}:  # the fast path; numpy-style ints are fine too
            for t in seq:
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise ValueError(f"input_ids must be integer token ids; got {t!r}")
        lo, hi = min(seq), max(seq)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"input_ids contains token id {int(bad)} outside the model's vocabulary: "
                f"allowed ids are in [0, {vocab_size})")


# GenerateReqInput's fields that hold one value per request: a single request gives one value, a
# batch one value for all or a list of one per request. SGLang 0.5.17 indexes them per request
# after its normalization without checking: a list on a single request reached the scheduler and
# stopped it (lora_id) or gave HTTP 500; a list of the wrong length was an IndexError (500); a
# string lora_id on a batch was indexed by character, one letter per request.
_PER_REQUEST = ("rid", "sampling_params", "lora_id", "lora_path", "custom_logit_processor",
                "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
                "decode_tp_size", "extra_key", "return_sampling_mask", "return_hidden_states",
                "return_logprob", "logprob_start_len", "top_logprobs_num")


def check_per_request(obj: Any) -> None:
    """After SGLang's normalization of a ``GenerateReqInput`` (``is_single``, ``batch_size``, its
    sampling parameters one per request): each ``_PER_REQUEST`` field is one value on a single
    request and a list of one per request on a batch (a string ``lora_id`` on a batch is given to
    every request, as ``lora_path`` is); ``session_params`` holds only SessionParams' keys."""
    num = 1
    if obj.is_single:
        for name in _PER_REQUEST:
            v = getattr(obj, name, None)
            if isinstance(v, list):
                raise ValueError(f"{name} must be one value for a single request, not a list; "
                                 f"got {short_repr(v)}")
    else:
        sp = obj.sampling_params
        num = len(sp) if isinstance(sp, list) else obj.batch_size
        if isinstance(getattr(obj, "lora_id", None), str):
            obj.lora_id = [obj.lora_id] * num
        for name in _PER_REQUEST[1:]:  # rid: one per prompt, checked by SGLang itself
            v = getattr(obj, name, None)
            if isinstance(v, list) and len(v) != num:
                raise ValueError(f"{name} must be one value for all, or a list of one per "
                                 f"request ({num}, with n); got {short_repr(v)}")
    _check_embed_overrides(obj, num)
    keys = _struct_keys("sglang.srt.managers.io_struct", "SessionParams")
    sess = getattr(obj, "session_params", None)
    for one in (sess if isinstance(sess, list) else [sess]):
        if isinstance(one, dict) and keys is not None and not set(one) <= keys:
            raise _bad("session_params", one, f"an object with keys among {sorted(keys)}")


def _check_embed_overrides(obj: Any, num: int) -> None:
    """``positional_embed_overrides``: SGLang's ``PositionalEmbeds`` objects (tensors: the Python
    API's; no JSON value is one), one for all or a list of one per request of a batch. Another
    value reached the scheduler and stopped it."""
    pe = getattr(obj, "positional_embed_overrides", None)
    if pe is None:
        return
    try:
        from sglang.srt.managers.io_struct import PositionalEmbeds
    except Exception:  # pragma: no cover - SGLang without the type
        return
    items = pe if isinstance(pe, list) and not obj.is_single else [pe]
    if (isinstance(pe, list) and not obj.is_single and len(pe) != num) or not all(
            x is None or isinstance(x, PositionalEmbeds) for x in items):
        raise ValueError("positional_embed_overrides must be PositionalEmbeds (the Python API's; "
                         f"one, or a list of one per request); got {short_repr(pe)}")


# ----------------------------------------------------------------------------- SGLang's seams
def wrap_once(cls, name: str, make) -> None:
    """Replace ``cls.name`` by ``make(original)``, once (a second call leaves it)."""
    orig = getattr(cls, name)
    if not getattr(orig, "_prr_wrapped", False):
        new = make(orig)
        new._prr_wrapped = True
        setattr(cls, name, new)


def _validating(orig):
    def _validate_one_request(self, obj, input_ids):
        vocab = getattr(getattr(self, "model_config", None), "vocab_size", None)
        if vocab:
            check_input_ids(input_ids, int(vocab))
        check_request(obj, int(vocab) if vocab else None)
        return orig(self, obj, input_ids)
    return _validate_one_request


def _normalizing(orig):
    """``GenerateReqInput``'s and ``EmbeddingReqInput``'s normalization between the checks: the
    sampling parameters before it, the per-request fields after it. What SGLang's own code
    raises on a request's fields (an ``assert`` on a batch's rid, an ``IndexError`` on an empty
    list, a ``TypeError`` on a list where a dict goes) is the request's fault: ``ValueError``,
    which the routes answer with 400, not 500."""
    def normalize_batch_and_arguments(self):
        sp = self.sampling_params
        if isinstance(sp, list) and not sp:
            raise _bad("sampling_params", sp, "an object, or a list of one per request")
        for one in (sp if isinstance(sp, list) else [sp]):
            check_sampling_params(one)
        try:
            orig(self)
        except (AssertionError, AttributeError, IndexError, KeyError, TypeError) as e:
            raise ValueError("the request's fields do not fit together: "
                             f"{str(e) or type(e).__name__}") from None
        check_per_request(self)
    return normalize_batch_and_arguments


EXPERT_RECORD_COMMANDS = ("start_expert_distribution_record", "stop_expert_distribution_record",
                          "dump_expert_distribution_record")
_RECORDER_OFF = ("this server records no expert distribution: start it with "
                 "--expert-distribution-recorder-mode")


def _needs_expert_recorder(orig):
    """SGLang 0.5.17 sends the expert-distribution commands to a scheduler started without a
    recorder, whose stand-in raises there and stops it (the server with every request in
    flight). Refused here with ``ValueError`` instead: nothing is sent."""
    @functools.wraps(orig)
    async def method(self, *args, **kwargs):
        if getattr(self.server_args, "expert_distribution_recorder_mode", None) is None:
            raise ValueError(_RECORDER_OFF)
        return await orig(self, *args, **kwargs)
    return method


def _extra_key_as_value_error(orig):
    def _compute_extra_key(self, request):
        try:
            return orig(self, request)
        except TypeError as e:  # a wrong type in the request, not a server fault
            raise ValueError(str(e)) from None
    return _compute_extra_key


def install() -> None:
    """Put the checks in SGLang's seams (idempotent); a seam SGLang lacks is skipped."""
    try:
        from sglang.srt.managers.io_struct import EmbeddingReqInput, GenerateReqInput
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
    except Exception:  # pragma: no cover - SGLang without its request types
        return
    wrap_once(TokenizerManager, "_validate_one_request", _validating)
    for name in EXPERT_RECORD_COMMANDS:
        wrap_once(TokenizerManager, name, _needs_expert_recorder)
    for req in (GenerateReqInput, EmbeddingReqInput):
        wrap_once(req, "normalize_batch_and_arguments", _normalizing)
    try:
        from sglang.srt.entrypoints.openai.serving_base import OpenAIServingBase
    except Exception:  # pragma: no cover - no OpenAI layer
        return
    wrap_once(OpenAIServingBase, "_compute_extra_key", _extra_key_as_value_error)
