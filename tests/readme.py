"""What the tests read from the README: the blocks and tables it marks for them.

A marker is an HTML comment line (invisible on the rendered page) right above the block or table,
``<!-- NAME: ... -->``; the tests fail with the marker's name when it is missing, so a README
edit cannot silently detach a documented example from the test that runs it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import List, Optional

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_text() -> str:
    return README.read_text()


def _after_marker(text: str, name: str) -> List[str]:
    """The lines after the ``<!-- name: ... -->`` marker."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.fullmatch(rf"<!--\s*{re.escape(name)}\b.*-->", line.strip()):
            return lines[i + 1:]
    raise AssertionError(f"README.md has no <!-- {name}: ... --> marker")


def table_column(text: str, name: str) -> List[str]:
    """The backticked names in the first column of the table under the marker ``name``."""
    rows = []
    for line in _after_marker(text, name):
        if not line.startswith("|"):
            break
        rows.append(line)
    assert len(rows) > 2, f"the marker {name} is not followed by a table"
    out = []
    for row in rows[2:]:  # header and separator
        first = row.split("|")[1]
        out += re.findall(r"`([^`]+)`", first)
    return out


def fenced_block(text: str, name: str) -> str:
    """The body of the fenced code block right under the marker ``name``."""
    lines = _after_marker(text, name)
    assert lines and lines[0].startswith("```"), f"the marker {name} is not followed by a ``` block"
    body = []
    for line in lines[1:]:
        if line.startswith("```"):
            return "\n".join(body) + "\n"
        body.append(line)
    raise AssertionError(f"the block under {name} is not closed")


def shell_commands(block: str) -> List[str]:
    """The commands of a shell block, one per command (backslash continuations joined; blank
    lines and comment lines dropped)."""
    out: List[str] = []
    current: Optional[str] = None
    for line in block.splitlines():
        if current is None and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current = line if current is None else current + "\n" + line
        if not line.endswith("\\"):
            shlex.split(current)  # a quoting error fails here, naming the command
            out.append(current)
            current = None
    assert current is None, f"unfinished command: {current}"
    return out
