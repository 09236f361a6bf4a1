"""The kernels' measuring knobs that the benchmark rows name: which settings this environment
forces (the servers a benchmark starts inherit it), as the labels of the rows' launch columns."""

from __future__ import annotations

import os
import re
from typing import List


def attn_launch() -> str:
    """The attention launch's forced settings: ``grid-heads`` / ``grid-entries``
    (``SGLANG_PRR_ATTN_GRID``), ``merge-split`` / ``merge-fused`` / ``merge-ticket``
    (``SGLANG_PRR_ATTN_MERGE``), ``spread-row`` (``SGLANG_PRR_ATTN_SPREAD=row``: a spread merge
    shared by every CTA of the row), ``merge-splits-<n>`` (``SGLANG_PRR_ATTN_MERGE_SPLITS=<n>``:
    the merge kernel's CTAs a group, n instead of its shape rule), ``pages-packed``
    (``SGLANG_PRR_ATTN_PACK=1``: pages of 16 or 32 tokens, 64 / page list entries a CTA, on every
    grid) / ``pages-one`` (``=0``: one entry a CTA, instead of the packing's shape rule), joined
    by ``+``, else ``""`` (the launch's shape rules).
    Other values force nothing, as in the launcher."""
    parts = []
    grid = os.environ.get("SGLANG_PRR_ATTN_GRID", "")
    if grid in ("heads", "entries"):
        parts.append(f"grid-{grid}")
    merge = os.environ.get("SGLANG_PRR_ATTN_MERGE", "")
    if merge in ("split", "fused", "ticket"):
        parts.append(f"merge-{merge}")
    if os.environ.get("SGLANG_PRR_ATTN_SPREAD", "") == "row":
        parts.append("spread-row")
    splits = os.environ.get("SGLANG_PRR_ATTN_MERGE_SPLITS", "")
    if re.fullmatch(r"\s*\+?[0-9]+", splits) and int(splits) > 0:  # what strtol takes
        parts.append(f"merge-splits-{int(splits)}")
    pack = os.environ.get("SGLANG_PRR_ATTN_PACK", "")
    if pack in ("0", "1"):
        parts.append("pages-packed" if pack == "1" else "pages-one")
    return "+".join(parts)


def selection_forms() -> List[str]:
    """The selection kernels' forced forms, in this order: ``scores-warp``
    (``SGLANG_PRR_SCORES_KERNEL=warp``: the warp-per-block scores) and ``topk-scan``
    (``SGLANG_PRR_TOPK=scan``: the rows' lists by CTA scans, not warp walks)."""
    parts = []
    if os.environ.get("SGLANG_PRR_SCORES_KERNEL") == "warp":
        parts.append("scores-warp")
    if os.environ.get("SGLANG_PRR_TOPK") == "scan":
        parts.append("topk-scan")
    return parts


def select_kernel() -> str:
    """The selection path this environment forces (``SGLANG_PRR_SELECT_KERNEL``, else ``auto``),
    with ``+grid-<v>`` where ``SGLANG_PRR_SELECT_GRID`` caps the selection grids,
    ``+scores-warp`` where ``SGLANG_PRR_SCORES_KERNEL=warp`` asks for the warp-per-block scores
    and ``+topk-scan`` where ``SGLANG_PRR_TOPK=scan`` writes the rows' lists by CTA scans (the
    default: warp walks)."""
    grid = os.environ.get("SGLANG_PRR_SELECT_GRID", "")
    return (os.environ.get("SGLANG_PRR_SELECT_KERNEL", "auto") + (f"+grid-{grid}" if grid else "")
            + "".join("+" + p for p in selection_forms()))
