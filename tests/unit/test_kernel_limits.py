"""The kernels' size limits are defined once, in ``kernels/kernel_limits.h``: the kernels
include it, no other source defines them again, and the Python dispatch reads its values from
it (``kernels/limits.py``). Each check has a control that makes it fail."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from sglang_prr.kernels import build, dispatch, infllm, limits

KERNELS = Path(limits.__file__).resolve().parent
SOURCES = build.CUDA_SOURCES + build.HOST_SOURCES + build.HEADERS


def redefined(folder: Path, names) -> list:
    """``(file, name)`` for every kernel source in ``folder`` but kernel_limits.h that defines
    one of ``names`` as a constant of its own."""
    out = []
    for src in SOURCES:
        if src == "kernel_limits.h":
            continue
        text = (folder / src).read_text()
        out += [(src, n) for n in names
                if re.search(rf"\bconstexpr\s+\w+\s+{n}\s*=", text)]
    return out


def test_python_reads_the_header():
    got = limits.read_limits()
    assert got == limits.LIMITS and set(got) == {"kMaxGroup", "kInfllmMaxGroup",
                                                 "kTopkMaxBlocks", "kCalibMaxBlocks"}
    assert dispatch.ATTN_MAX_GROUP == got["kMaxGroup"] == 8
    assert infllm.INFLLM_MAX_GROUP == got["kInfllmMaxGroup"]
    assert dispatch.TOPK_MAX_BLOCKS == got["kTopkMaxBlocks"] == 48 * 1024
    assert dispatch.CALIB_MAX_BLOCKS == got["kCalibMaxBlocks"] == 200 * 1024 // 12


def test_a_changed_header_changes_what_python_reads(tmp_path):
    """Control of the above: the values come from the file, not from Python."""
    h = tmp_path / "kernel_limits.h"
    h.write_text(limits.HEADER.read_text().replace("kMaxGroup = 8;", "kMaxGroup = 4 * 3;"))
    assert limits.read_limits(h)["kMaxGroup"] == 12
    h.write_text("// a comment that says constexpr int kX = 1; is not a constant\n"
                 "constexpr int kA = 7 / 2 + (1 - 1);\n")
    assert limits.read_limits(h) == {"kA": 3}  # C++'s integer division


@pytest.mark.parametrize("line", ["constexpr int kA = 8.5;", "constexpr int kA = sizeof(float);",
                                  "constexpr size_t kA = 8;", "constexpr int kA = 2 ** 3;"])
def test_an_unreadable_constant_names_its_line(tmp_path, line):
    h = tmp_path / "kernel_limits.h"
    h.write_text("#pragma once\n" + line + "\n")
    with pytest.raises(ValueError, match=r"limits\.h:2"):
        limits.read_limits(h)


def test_no_kernel_source_defines_a_limit_again(tmp_path):
    names = list(limits.LIMITS)
    assert redefined(KERNELS, names) == []
    # Control: a copy of the sources where one kernel defines its own group limit.
    for src in SOURCES:
        shutil.copy(KERNELS / src, tmp_path / src)
    p = tmp_path / "attention.cu"
    p.write_text(p.read_text() + "\nconstexpr int kMaxGroup = 16;\n")
    assert redefined(tmp_path, names) == [("attention.cu", "kMaxGroup")]


def test_the_kernels_include_the_header_and_the_build_hashes_it():
    assert "kernel_limits.h" in build.HEADERS  # a changed limit rebuilds the library
    for header in ("prr_kernels.h", "infllm_kernels.h", "topk.cuh"):
        assert '#include "kernel_limits.h"' in (KERNELS / header).read_text(), header
    uses = {n: [s for s in SOURCES if s != "kernel_limits.h" and re.search(rf"\b{n}\b",
                                                                    (KERNELS / s).read_text())]
            for n in limits.LIMITS}
    assert all(uses.values()), uses  # every limit is one the kernels use
