"""The kernels' size limits, read from ``kernel_limits.h`` (where the kernels take them from),
so each is defined once: ``LIMITS["kMaxGroup"]`` and the names below.

The header ships with the package (its package data), so this works without the compiled
library: the dispatch uses the limits to send a shape past them to the reference. Each constant
is a line ``constexpr int kName = <integer expression>;`` (integers, ``+ - * /``, parentheses;
``/`` is C++'s integer division); anything else in such a line is an error at import.
"""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path
from typing import Dict

HEADER = Path(__file__).resolve().parent / "kernel_limits.h"
_LINE = re.compile(r"^\s*constexpr\s+int\s+(k\w+)\s*=\s*([^;]+);")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.floordiv, ast.FloorDiv: operator.floordiv}


def _int_expr(text: str) -> int:
    """An integer expression of the header, evaluated as C++ would for non-negative ints."""
    def ev(n):
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError(f"not an integer expression: {text!r}")
    return ev(ast.parse(text.strip(), mode="eval").body)


def read_limits(path: Path = HEADER) -> Dict[str, int]:
    """``{name: value}`` of every ``constexpr int`` in the header; ``ValueError`` naming the
    line when one cannot be read."""
    out: Dict[str, int] = {}
    for no, line in enumerate(Path(path).read_text().splitlines(), 1):
        code = line.split("//")[0]
        if "constexpr" not in code:
            continue
        m = _LINE.match(code)
        if m is None:
            raise ValueError(f"{path}:{no}: not a 'constexpr int kName = <int>;' line: {line!r}")
        try:
            out[m.group(1)] = _int_expr(m.group(2))
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"{path}:{no}: {e}") from None
    return out


LIMITS = read_limits()
# Largest GQA group of the attention and Quest selection kernels, and of infllm_scores.
ATTN_MAX_GROUP = LIMITS["kMaxGroup"]
INFLLM_MAX_GROUP = LIMITS["kInfllmMaxGroup"]
# Blocks per row of the top-K, the predictor and the fused selection (shared memory).
TOPK_MAX_BLOCKS = LIMITS["kTopkMaxBlocks"]
# Blocks per row of calib_grid_terms.
CALIB_MAX_BLOCKS = LIMITS["kCalibMaxBlocks"]
