"""PRR statistics: where the scheduler writes them and how ``GET /prr/stats`` reads them back.

The scheduler process (the backend) writes a JSON snapshot of its counters to one file per
server; the HTTP process (the plugin's route) reads it. The file's path is fixed in the
launching process before the schedulers are spawned, so every process inherits the same one.
"""

from __future__ import annotations

import json
import os
import tempfile

from .server_args_patch import load_config

ENV_STATS = "SGLANG_PRR_STATS_FILE"


def stats_path() -> str:
    """Where the scheduler writes PRR statistics for ``GET /prr/stats`` (one file per server)."""
    path = os.environ.get(ENV_STATS)
    if not path:
        path = os.path.join(tempfile.gettempdir(), f"sglang_prr_stats_{os.getpid()}.json")
        os.environ[ENV_STATS] = path
    return path


def read_stats() -> dict:
    """The latest statistics written by the scheduler, with the active configuration."""
    cfg = load_config()
    out = {"config": cfg.to_dict() if cfg else None, "enabled": bool(cfg and cfg.enabled)}
    try:
        with open(stats_path()) as f:
            out.update(json.load(f))
    except (OSError, ValueError):
        out.setdefault("decode_steps", 0)
    return out
