"""The kernel library's op declarations against these sources': the loader refuses a library
built from other declarations (a ``SGLANG_PRR_KERNEL_LIB`` from another checkout) with an error
that names the op, instead of an argument-count failure at the op's first call; the serving
benchmark checks the library before its first server. No GPU or nvcc needed."""

from __future__ import annotations

import pytest
import torch

from sglang_prr import kernels, ops  # noqa: F401  (ops defines torch.ops.sglang_prr.*)
from sglang_prr.kernels import loader
from sglang_prr.serving import harness


def test_declared_schemas_cover_every_op_with_its_arguments():
    declared = loader.declared_schemas()
    assert set(kernels.IMPLS) <= set(declared), set(kernels.IMPLS) - set(declared)
    assert {"prepare", "launches_with_pdl", "infllm_scores"} <= set(declared)
    for name in kernels.IMPLS:  # the declaration has the Python op's arguments, in order
        mine = torch._C.parse_schema(declared[name])
        theirs = getattr(torch.ops.sglang_prr, name).default._schema
        assert [a.name for a in mine.arguments] == [a.name for a in theirs.arguments], name


def test_declarations_are_joined_across_lines(tmp_path):
    """A schema split over adjacent C++ literals is one schema (the multi-line m.def calls)."""
    for name in loader.BINDINGS:
        (tmp_path / name).write_text("")
    (tmp_path / loader.BINDINGS[0]).write_text(
        'TORCH_LIBRARY(sglang_prr_cuda, m) {\n'
        '  m.def("f(Tensor a, "\n        "int b=2) -> Tensor");\n'
        '  m.def("g() -> bool", &g);\n}\n')
    got = loader.declared_schemas(tmp_path)
    assert got == {"f": "sglang_prr_cuda::f(Tensor a, int b=2) -> Tensor",
                   "g": "sglang_prr_cuda::g() -> bool"}


def test_mismatches_name_the_op_and_both_schemas():
    declared = loader.declared_schemas()
    assert loader.schema_mismatches(declared, dict(declared)) == []  # control: same library
    name = "sparse_attn_merge"
    other = dict(declared)
    other[name] = declared[name].replace(") -> (Tensor, Tensor)",
                                         ", bool skip_in_p=False) -> (Tensor, Tensor)")
    assert other[name] != declared[name]
    bad = loader.schema_mismatches(declared, other)
    assert len(bad) == 1 and bad[0].startswith(name) and "skip_in_p" in bad[0]
    missing = dict(declared)
    missing["quest_scores"] = None
    bad = loader.schema_mismatches(declared, missing)
    assert bad == [f"quest_scores: not in the library (these sources declare "
                   f"{declared['quest_scores']})"]


def test_check_schemas_raises_for_another_library(monkeypatch):
    declared = loader.declared_schemas()
    monkeypatch.setattr(loader, "registered_schemas", lambda names: dict(declared))
    loader.check_schemas("/x/lib.so")  # control: every declaration matches
    changed = dict(declared)
    changed["holt_update"] = None
    monkeypatch.setattr(loader, "registered_schemas", lambda names: changed)
    with pytest.raises(RuntimeError, match=r"/x/lib\.so .*1 of \d+ ops differ.*holt_update"):
        loader.check_schemas("/x/lib.so")


def test_kernel_library_error_reports_the_child_s_reason(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the library may load")
    err = harness.kernel_library_error()
    assert err and "no CUDA device" in err, err
    monkeypatch.setattr(harness, "KERNEL_CHECK", "import sys; sys.exit(0)")
    assert harness.kernel_library_error() is None  # control: a child that loads

