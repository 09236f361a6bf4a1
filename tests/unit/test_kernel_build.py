"""CI compile check of the SM90 kernels (no GPU needed): nvcc builds the whole library for sm_90a,
it loads into torch, and every CUDA op has the same argument list as the ``sglang_prr`` op it
implements. Skipped only when nvcc is absent. Takes about 1.5-2 minutes on 2 cores.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from sglang_prr import kernels, ops  # noqa: F401  (ops defines torch.ops.sglang_prr.*)
from sglang_prr.kernels import build
from test_structure import KERNEL_SUFFIXES


def _nvcc():
    try:
        return build.nvcc_path()
    except RuntimeError:
        return None


pytestmark = pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (CUDA toolkit absent)")


@pytest.fixture(scope="module")
def built_lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("prr_kernels")
    t0 = time.time()
    path = build.build(out)
    print(f"built {path} in {time.time() - t0:.0f} s")
    return path


def test_build_targets_sm90a(built_lib):
    assert built_lib.exists() and built_lib.stat().st_size > 0
    cmds = build.build_commands(built_lib.parent)
    cu = [c for c in cmds if any(a.endswith(".cu") for a in c)]
    assert cu and all("arch=compute_90a,code=sm_90a" in c for c in cu)
    cuobjdump = shutil.which("cuobjdump") or str(build.cuda_home() / "bin" / "cuobjdump")
    if os.path.exists(cuobjdump):
        out = subprocess.run([cuobjdump, "--list-elf", str(built_lib)], capture_output=True,
                             text=True).stdout
        assert "sm_90a" in out, out[:500]


def test_library_registers_every_op_with_matching_schema(built_lib):
    torch.ops.load_library(str(built_lib))
    for name in kernels.IMPLS:
        mine = getattr(torch.ops.sglang_prr_cuda, name).default._schema
        theirs = getattr(torch.ops.sglang_prr, name).default._schema
        assert [a.name for a in mine.arguments] == [a.name for a in theirs.arguments], name
        assert len(mine.returns) == len(theirs.returns), name
    # negative control: a name the library does not define is not found
    with pytest.raises((AttributeError, RuntimeError)):
        torch.ops.sglang_prr_cuda.no_such_op.default


def test_the_built_library_matches_the_declarations_the_loader_checks(built_lib):
    """The loader's schema check passes for a build of these sources and names every op it
    compares (a library built from other declarations: tests/unit/test_kernel_schemas.py)."""
    from sglang_prr.kernels import loader
    torch.ops.load_library(str(built_lib))
    declared = loader.declared_schemas()
    registered = loader.registered_schemas(declared)
    assert registered == declared
    loader.check_schemas(built_lib)
    registered["quest_scores"] = None  # negative control: an op the library would lack
    assert loader.schema_mismatches(declared, registered)[0].startswith("quest_scores")


def test_pdl_follows_the_environment(built_lib):
    """``SGLANG_PRR_PDL=1`` (exactly) turns programmatic dependent launch on, read once per
    process; unset, ``0`` or another spelling leave it off (the negative controls)."""
    code = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
            "print(torch.ops.sglang_prr_cuda.launches_with_pdl())")
    seen = {}
    for value in ("1", "0", "yes", None):
        env = {k: v for k, v in os.environ.items() if k != "SGLANG_PRR_PDL"}
        if value is not None:
            env["SGLANG_PRR_PDL"] = value
        out = subprocess.run([sys.executable, "-c", code, str(built_lib)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        seen[value] = out.stdout.strip().splitlines()[-1]
    assert seen == {"1": "True", "0": "False", "yes": "False", None: "False"}


def test_cache_key_changes_with_sources(monkeypatch):
    h1 = build.source_hash()
    monkeypatch.setattr(build, "NVCC_FLAGS", build.NVCC_FLAGS + ["-DPRR_TEST_FLAG"])
    assert build.source_hash() != h1


def test_the_probe_build_is_another_library(monkeypatch, tmp_path):
    """SGLANG_PRR_PROBES=1 compiles the timing probes into the CUDA sources (the host sources do
    not read them) and keys another cache entry, so a probe build is never loaded as the
    default one; control: without it no command carries the define."""
    monkeypatch.delenv("SGLANG_PRR_PROBES", raising=False)
    h0 = build.source_hash()
    plain = build.build_commands(tmp_path)
    assert not any("-DSGLANG_PRR_PROBES" in c for c in plain)
    monkeypatch.setenv("SGLANG_PRR_PROBES", "1")
    probed = build.build_commands(tmp_path)
    n_cuda = len(build.CUDA_SOURCES)
    assert all("-DSGLANG_PRR_PROBES" in c for c in probed[:n_cuda])
    assert not any("-DSGLANG_PRR_PROBES" in c for c in probed[n_cuda:])
    assert build.source_hash() != h0


def unlisted_sources(folder, listed) -> list:
    """The kernel sources (``KERNEL_SUFFIXES``) in ``folder`` that ``listed`` does not name."""
    return sorted(f.name for f in folder.iterdir()
                  if f.suffix in KERNEL_SUFFIXES and f.name not in listed)


def test_the_build_hashes_every_kernel_source(tmp_path):
    """Every source and header in the kernels folder is compiled or hashed, so an edit of any of
    them gives another source hash, hence a rebuild (a header the build does not list would leave
    a stale library current). Control: a header dropped into a copy of the folder is found."""
    listed = build.CUDA_SOURCES + build.HOST_SOURCES + build.HEADERS
    assert unlisted_sources(build.HERE, listed) == []
    copy = tmp_path / "kernels"
    shutil.copytree(build.HERE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "extra_tile.cuh").write_text("#pragma once\n")
    assert unlisted_sources(copy, listed) == ["extra_tile.cuh"]


def test_prebuilt_library_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_PRR_KERNEL_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(RuntimeError, match="SGLANG_PRR_KERNEL_LIB"):
        build.library_path()


def test_named_output_folder_rebuilds_a_library_of_other_sources(monkeypatch, tmp_path):
    """``python -m sglang_prr.kernels.build DIR`` after a source change must rebuild: a library
    in DIR built from other sources (another hash, or none recorded) is not returned as current."""
    built = []

    def fake_commands(out_dir):
        return [["compile"], ["link", str(out_dir / build.LIB_NAME)]]

    def fake_run(cmd):
        if cmd[0] == "link":
            built.append(cmd[1])
            open(cmd[1], "w").write("new")

    monkeypatch.setattr(build, "build_commands", fake_commands)
    monkeypatch.setattr(build, "_run", fake_run)
    out = tmp_path / "kb"
    out.mkdir()
    (out / build.LIB_NAME).write_text("stale")
    # No hash recorded beside it (an older build): rebuilt.
    assert build.build(out).read_text() == "new" and len(built) == 1
    assert (out / build.STAMP_NAME).read_text() == build.source_hash()
    # Same sources: returned as is (control: no second build).
    build.build(out)
    assert len(built) == 1
    # Other sources: rebuilt.
    (out / build.STAMP_NAME).write_text("0" * 16)
    (out / build.LIB_NAME).write_text("stale")
    assert build.build(out).read_text() == "new" and len(built) == 2


def test_the_cutlass_headers_are_found_without_reading_the_command_line(monkeypatch):
    """The nvidia-cutlass wheel's package parses ``sys.argv`` when imported (``--help`` there
    prints its usage and exits): the build locates its headers without importing it, whatever
    the building program's command line holds. Negative control: without the package, None."""
    if importlib.util.find_spec("cutlass_library") is None:
        pytest.skip("the nvidia-cutlass wheel is not installed")
    monkeypatch.delenv("CUTLASS_INCLUDE_DIR", raising=False)
    monkeypatch.setattr(sys, "argv", ["server", "--help"])
    monkeypatch.delitem(sys.modules, "cutlass_library", raising=False)
    inc = build.cutlass_include()
    assert inc is not None and os.path.isfile(os.path.join(inc, "cute", "tensor.hpp"))
    assert "cutlass_library" not in sys.modules
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert build.cutlass_include() is None


def test_the_build_command_line(monkeypatch, tmp_path, capsys):
    """``python -m sglang_prr.kernels.build --help`` prints the usage and builds nothing (it
    once built into a folder named ``--help``); a second folder is an error; a folder builds
    there and prints the library's path."""
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(build, "build", lambda out, verbose=False: calls.append(out) or "lib.so")
    with pytest.raises(SystemExit) as e:
        build.main(["--help"])
    assert e.value.code == 0 and "out_dir" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        build.main(["a", "b"])
    assert e.value.code == 2 and "unrecognized arguments: b" in capsys.readouterr().err
    assert calls == [] and list(tmp_path.iterdir()) == []
    build.main(["kb"])
    assert calls == [build.Path("kb")] and capsys.readouterr().out.strip() == "lib.so"
    build.main([])
    assert calls[-1] is None
