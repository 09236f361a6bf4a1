"""What the launcher prints: ``--help`` (cached), the quiet default log, the server's one-line
summary and the line that says it is ready and how to query it.

The launcher's own lines go to stderr whatever ``--log-level`` says (which model answers, what
the server is and where to send requests are never noise); SGLang's lines follow its log level.
Nothing here imports SGLang or torch: the supervisor prints help with it in a fraction of a
second once the text is cached.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, List, Optional

PREFIX = "sglang_prr: "
# The parts of this package that shape ``--help`` (with SGLang's own parser, keyed separately),
# relative to the package's folder.
_HELP_SOURCES = ("config.py", "flags.py", "serving/server_args_patch.py",
                 "serving/launch_server.py")


def say(msg: str) -> None:
    """One launcher line on stderr, printed whatever the log level."""
    print(PREFIX + msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- quiet log
def quiet_warnings(filters: Iterable[str]) -> None:
    """Ignore these Python warnings (``-W`` syntax) in this process and in every process it
    starts (through ``PYTHONWARNINGS``, which SGLang's spawned processes inherit)."""
    filters = list(filters)
    for f in filters:
        action, message, category = (f.split(":") + ["", ""])[:3]
        # As -W reads it: the message is a literal prefix, the category a builtin warning.
        warnings.filterwarnings(action, message=re.escape(message),
                                category=getattr(builtins, category or "Warning", Warning))
    have = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join(have + [f for f in filters if f not in have])


# ------------------------------------------------------------------------------- summary
def summary(server_args: Any, cfg: Any, context_len: Optional[int], sglang_version: str) -> str:
    """One line for what SGLang's ``server_args=`` dump (14K characters) told: the device and
    attention backend, the KV pool, the limits and PRR's configuration."""
    sa = server_args
    pool = (f"KV pool {sa.max_total_tokens} tokens" if getattr(sa, "max_total_tokens", None)
            else f"KV pool sized by SGLang (--mem-fraction-static "
                 f"{getattr(sa, 'mem_fraction_static', None)})")
    parts = [f"SGLang {sglang_version} on {getattr(sa, 'device', None) or 'auto'}",
             f"{getattr(sa, 'attention_backend', None) or 'default'} attention",
             str(getattr(sa, "dtype", "auto")), f"page {sa.page_size} tokens", pool]
    if getattr(sa, "max_running_requests", None):
        parts.append(f"up to {sa.max_running_requests} requests")
    if context_len:
        parts.append(f"context {context_len} tokens")
    if cfg.enabled:
        prr = (f"PRR on: {cfg.method}, {'serial DSA' if cfg.serial else cfg.mode}, "
               f"K = {cfg.top_k_blocks} blocks"
               + ("" if cfg.serial else f", |P| <= {cfg.predicted_blocks}")
               + f", sparse from {cfg.min_context} tokens")
    else:
        prr = "PRR off (--prr-method dense)"
    return ", ".join(parts) + "; " + prr


def added(notes: List[str]) -> Optional[str]:
    return ("added for this machine: " + ", ".join(notes)) if notes else None


def ready_message(url: str, enabled: bool, seconds: float) -> str:
    """The last line of a start: ready, and the two requests that show it works."""
    chat = ('{"model": "default", "messages": [{"role": "user", "content": '
            '"What is the capital of France?"}], "temperature": 0, "max_tokens": 32}')
    return (f"ready in {seconds:.0f} s. PRR {'on' if enabled else 'off'}. Query it with:\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{chat}'\n  curl {url}/prr/stats")


# ------------------------------------------------------------------------------- help
def help_key(columns: Optional[int] = None) -> str:
    """What ``--help``'s text depends on: SGLang's version and its ``server_args.py``, the
    plugins that may add flags to SGLang's parser, this package's flag sources, Python's
    version (argparse's layout) and the terminal width. Read without importing SGLang."""
    import importlib.metadata as md

    h = hashlib.sha256()
    try:
        dist = md.distribution("sglang")
        st = Path(dist.locate_file("sglang/srt/server_args.py")).stat()
        h.update(f"{dist.version} {st.st_size} {st.st_mtime_ns}".encode())
    except (md.PackageNotFoundError, OSError):
        h.update(b"sglang ?")
    for ep in sorted(md.entry_points(group="sglang.srt.plugins"), key=lambda e: e.name):
        version = getattr(getattr(ep, "dist", None), "version", "?")
        h.update(f"{ep.name}={ep.value} {version}".encode())
    package = Path(__file__).resolve().parents[1]
    for name in _HELP_SOURCES:
        h.update((package / name).read_bytes())
    cols = columns if columns is not None else shutil.get_terminal_size().columns
    h.update(f"{sys.version_info[:2]} {cols}".encode())
    return h.hexdigest()[:16]


def cached_help(build: Callable[[], str], cache_dir: Path) -> str:
    """``--help``'s text: built once with SGLang's parser (``build``: ~15 s, SGLang's import),
    then read from ``cache_dir`` while ``help_key`` stays the same. A cache that cannot be read
    or written only costs the build."""
    path = Path(cache_dir) / f"launch_server-help-{help_key()}.txt"
    try:
        return path.read_text()
    except OSError:
        pass
    text = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=path.name + ".")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # whole or absent: concurrent --help calls never read half
    except OSError:
        pass
    return text
