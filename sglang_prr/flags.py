"""The ``--prr-*`` flags, generated from ``PRRConfig``: one flag per dataclass field, with the
field's help text, so a new option needs no edit here. ``python -m sglang_prr.flags`` prints
them as the README's table.

Flags default to ``None`` in argparse so that "not given" is visible (the launcher derives the
page size from the block size only when the user chose none); the values then go through
``PRRConfig.validate()``, whose errors name the value and the allowed range. Used by the
launcher (``serving.launch_server``) and by the budget profiler (``tools.profile_budget``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Dict

from .config import PRRConfig

FLAG_PREFIX = "--prr-"
DEST_PREFIX = "prr_"


def flag_name(field_name: str) -> str:
    return FLAG_PREFIX + field_name.replace("_", "-")


def _str2bool(v: str) -> bool:
    low = str(v).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {v!r}: expected true | false")


def _argparse_type(f: dataclasses.Field) -> Any:
    """argparse ``type`` for a field: ints and floats parse early; everything else (tuples,
    'auto'-or-number, optional paths) stays a string for ``PRRConfig.validate()``."""
    hint = typing.get_type_hints(PRRConfig)[f.name]
    if hint is int:
        return int
    if hint is float:
        return float
    return str


def add_prr_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--prr-*`` flag per ``PRRConfig`` field, in a group of its own."""
    group = parser.add_argument_group("PRR (Predict, Reuse, Repair) sparse decoding")
    hints = typing.get_type_hints(PRRConfig)
    for f in dataclasses.fields(PRRConfig):
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, tuple):
            shown = ",".join(str(x) for x in default) if default else "(none)"
        else:
            shown = default
        help_text = f"{meta.get('help', '')} (default: {shown})"
        if "choices" in meta:
            help_text += " [choices: " + " | ".join(str(c) for c in meta["choices"]) + "]"
        help_text = help_text.replace("%", "%%")
        if hints[f.name] is bool:
            group.add_argument(flag_name(f.name), dest=DEST_PREFIX + f.name, type=_str2bool,
                               nargs="?", const=True, default=None, help=help_text)
        else:
            group.add_argument(flag_name(f.name), dest=DEST_PREFIX + f.name,
                               type=_argparse_type(f), default=None, help=help_text)


def pop_prr_args(ns: argparse.Namespace) -> Dict[str, Any]:
    """Remove the ``prr_*`` attributes from the namespace; return those the user gave."""
    given = {}
    for f in dataclasses.fields(PRRConfig):
        dest = DEST_PREFIX + f.name
        if hasattr(ns, dest):
            v = getattr(ns, dest)
            delattr(ns, dest)
            if v is not None:
                given[f.name] = v
    return given


def flags_markdown() -> str:
    """The ``--prr-*`` flags as a Markdown table (for the README), from the dataclass."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(PRRConfig):
        d = f.default
        shown = ",".join(str(x) for x in d) if isinstance(d, tuple) else d
        help_text = f.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `{flag_name(f.name)}` | `{shown}` | {help_text} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(flags_markdown())
