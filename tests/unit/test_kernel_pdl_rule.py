"""The rule that makes programmatic dependent launch (PDL, ``SGLANG_PRR_PDL=1``) safe, checked on
the kernel sources: every ``__global__`` kernel calls ``pdl_begin()`` (``griddepcontrol.wait``)
as its first statement, before any global-memory access, and every launch goes through
``launch_kernel`` (the one place that sets the PDL attribute), none through ``<<<...>>>``. A
kernel launched with the attribute but without the wait could read its predecessor's output
before it is written. Each check has a negative control on an edited copy of a source."""

from __future__ import annotations

import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "sglang_prr" / "kernels"
SOURCES = sorted(KERNELS.glob("*.cu")) + sorted(KERNELS.glob("*.cuh"))


def kernels_without_wait(text: str):
    """Names of the ``__global__`` functions whose body does not open with ``pdl_begin();``."""
    bad = []
    for m in re.finditer(r"__global__\b", text):
        brace = text.index("{", m.end())
        name = re.findall(r"(\w+)\s*\(", text[m.end():brace])
        body = re.sub(r"//[^\n]*", "", text[brace + 1:brace + 400]).lstrip()
        if not body.startswith("pdl_begin();"):
            bad.append(name[-1] if name else "?")
    return bad


def chevron_launches(text: str):
    return re.findall(r"\w[\w:<>, ]*<<<", re.sub(r"//[^\n]*", "", text))


def test_every_kernel_waits_first_and_launches_through_launch_kernel():
    n_kernels = 0
    for src in SOURCES:
        text = src.read_text()
        n_kernels += len(re.findall(r"__global__\b", text))
        assert kernels_without_wait(text) == [], src.name
        assert chevron_launches(text) == [], src.name
    assert n_kernels >= 19  # every kernel of the library was seen


def test_the_checks_catch_a_kernel_without_the_wait_and_a_chevron_launch():
    src = KERNELS / "sets.cu"
    text = src.read_text()
    assert "pdl_begin();" in text and "launch_kernel(" in text
    no_wait = text.replace("pdl_begin();", "int unused_ = 0;", 1)
    assert len(kernels_without_wait(no_wait)) == 1
    chevron = text.replace("launch_kernel(set_difference_kernel, a.rows, kSetThreads, smem, s, a);",
                           "set_difference_kernel<<<a.rows, kSetThreads, smem, s>>>(a);")
    assert chevron != text and len(chevron_launches(chevron)) == 1


def test_the_attribute_is_set_in_one_place():
    """Only ``launch_kernel`` (common.cuh) names the PDL launch attribute."""
    owners = [s.name for s in SOURCES
              if "cudaLaunchAttributeProgrammaticStreamSerialization" in s.read_text()]
    assert owners == ["common.cuh"]
