"""The launcher's console: the warnings the quiet default filters (and only those), the help
cache (built once per key), the ready line's request."""

from __future__ import annotations

import json
import os
import shlex
import warnings

from sglang_prr.serving import console
from sglang_prr.serving.launch_server import QUIET_WARNINGS


def test_quiet_warnings_filter_only_the_named_ones(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "default::DeprecationWarning")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.quiet_warnings(QUIET_WARNINGS)
        warnings.warn("Triton is not supported on current platform, roll back to CPU.")
        warnings.warn("Only CUDA, HIP and XPU support AWQ currently.")
        warnings.warn("Only CUDA, MUSA and NPU support GGUF quantization currently.")
        warnings.warn("ORJSONResponse is deprecated, FastAPI now serializes ...",
                      DeprecationWarning)
        warnings.warn("something else entirely")  # negative control: still shown
        warnings.warn("Triton is not supported", DeprecationWarning)  # another category
    assert [str(w.message) for w in seen] == ["something else entirely",
                                              "Triton is not supported"]
    env = os.environ["PYTHONWARNINGS"].split(",")
    assert env == ["default::DeprecationWarning", *QUIET_WARNINGS]  # kept, then ours
    console.quiet_warnings(QUIET_WARNINGS)  # twice: not appended again
    assert os.environ["PYTHONWARNINGS"].split(",") == env


def test_help_is_built_once_per_key(tmp_path):
    calls = []

    def build():
        calls.append(1)
        return "usage: x\n"

    assert console.cached_help(build, tmp_path) == "usage: x\n"
    assert console.cached_help(build, tmp_path) == "usage: x\n"
    assert len(calls) == 1 and len(list(tmp_path.iterdir())) == 1
    for f in tmp_path.iterdir():  # another key (e.g. SGLang upgraded): built again
        f.rename(tmp_path / "launch_server-help-other.txt")
    console.cached_help(build, tmp_path)
    assert len(calls) == 2


def test_ready_line_sends_a_greedy_bounded_chat_request():
    text = console.ready_message("http://127.0.0.1:30000", True, 52.4)
    first, chat, stats = text.splitlines()
    assert first == "ready in 52 s. PRR on. Query it with:"
    body = json.loads(shlex.split(chat)[-1])
    assert body["temperature"] == 0 and 0 < body["max_tokens"] <= 64
    assert stats.split() == ["curl", "http://127.0.0.1:30000/prr/stats"]
