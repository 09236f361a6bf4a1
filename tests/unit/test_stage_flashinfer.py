"""benchmarks/stage_flashinfer.py: FlashInfer's compiled modules packed into capped parts on one
machine and installed as AOT modules on another, bit for bit; parts of another FlashInfer
version or architecture, missing or damaged parts and entries outside ``<module>/<module>.so``
refused with nothing written; a module already installed kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import stage_flashinfer as sf  # noqa: E402
import stage_model  # noqa: E402

VERSION, ARCH = "0.6.15.post1", "90a"


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A JIT directory with three compiled modules of fresh random bytes and one whose build
    failed (no .so), an empty AOT directory, FlashInfer's version and architecture."""
    here = {"version": VERSION, "arch": ARCH, "jit": tmp_path / "jit", "aot": tmp_path / "aot"}
    monkeypatch.setattr(sf, "dirs", lambda: dict(here))
    mods = {}
    for i, n in enumerate((3000, 70_000, 1)):
        name = f"batch_prefill_with_kv_cache_head_dim_{64 << i}"
        (here["jit"] / name).mkdir(parents=True)
        mods[name] = os.urandom(n)
        (here["jit"] / name / f"{name}.so").write_bytes(mods[name])
        (here["jit"] / name / "build.ninja").write_text("not carried")
    (here["jit"] / "failed_module").mkdir()
    return here, mods


def installed(here):
    return {so.parent.name: so.read_bytes() for so in sf.compiled_modules(here["aot"])}


def test_harvest_and_install_round_trip(machine, tmp_path):
    here, mods = machine
    parts = tmp_path / "parts"
    man = sf.harvest(parts, 0.01)  # ~10 KB parts: the random bytes do not compress
    assert len(man["parts"]) >= 3 and man["flashinfer"] == VERSION and man["arch"] == ARCH
    assert sorted(man["modules"]) == sorted(mods)  # not the failed build
    assert installed(here) == {}  # control: nothing there before install
    assert sorted(sf.install(parts)) == sorted(mods)
    assert installed(here) == mods
    assert not list(here["aot"].rglob("*.part"))
    assert sf.install(parts) == []  # installed already: kept
    assert "3 modules of FlashInfer 0.6.15.post1 (90a)" in sf.status(parts)
    # The next harvest packs the installed modules with the ones compiled since.
    extra = here["jit"] / "late_module"
    extra.mkdir()
    (extra / "late_module.so").write_bytes(b"late")
    for name in mods:
        (here["jit"] / name / f"{name}.so").unlink()
    again = sf.harvest(tmp_path / "again", 14)
    assert sorted(again["modules"]) == sorted([*mods, "late_module"])


def test_a_module_already_installed_is_kept(machine, tmp_path):
    here, mods = machine
    sf.harvest(tmp_path / "parts", 14)
    name = sorted(mods)[0]
    mine = here["aot"] / name / f"{name}.so"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"built here")
    assert name not in sf.install(tmp_path / "parts")
    assert mine.read_bytes() == b"built here" and len(installed(here)) == 3


@pytest.mark.parametrize("key, other", [("version", "0.6.14"), ("arch", "100a")])
def test_parts_of_another_flashinfer_or_architecture_are_refused(machine, tmp_path, key, other,
                                                                  monkeypatch):
    here, _ = machine
    sf.harvest(tmp_path / "parts", 14)
    monkeypatch.setattr(sf, "dirs", lambda: {**here, key: other})
    with pytest.raises(ValueError, match=other):
        sf.install(tmp_path / "parts")
    assert installed(here) == {}


def test_a_missing_or_damaged_part_is_named(machine, tmp_path):
    here, _ = machine
    parts = tmp_path / "parts"
    sf.harvest(parts, 0.01)
    p1 = parts / "part-01"
    data = bytearray(p1.read_bytes())
    data[len(data) // 2] ^= 1
    p1.write_bytes(bytes(data))
    (parts / "part-02").unlink()
    with pytest.raises(ValueError) as e:
        sf.install(parts)
    assert "part-01 is damaged" in str(e.value) and "part-02 missing" in str(e.value)
    assert installed(here) == {}
    assert sf.main(["install", "--dir", str(parts)]) == 1


@pytest.mark.parametrize("entry", ["../evil.so", "mod/other.so", "mod/sub/mod.so"])
def test_an_entry_outside_module_so_is_refused(machine, tmp_path, entry):
    here, _ = machine
    src = tmp_path / "src.so"
    src.write_bytes(b"x")
    archive = tmp_path / sf.ARCHIVE
    with tarfile.open(archive, "w:gz") as tar:  # a valid module first: not written either
        tar.add(src, arcname="mod/mod.so")
        tar.add(src, arcname=entry)
    stage_model.split(archive, tmp_path / "parts", 1 << 20,
                      {"flashinfer": VERSION, "arch": ARCH, "modules": ["mod"]})
    with pytest.raises(ValueError, match="unexpected entry"):
        sf.install(tmp_path / "parts")
    assert not (tmp_path / "evil.so").exists() and installed(here) == {}


def test_nothing_to_harvest_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(sf, "dirs", lambda: {"version": VERSION, "arch": ARCH,
                                             "jit": tmp_path / "none", "aot": tmp_path / "a"})
    with pytest.raises(ValueError, match="run a server first"):
        sf.harvest(tmp_path / "parts", 14)
    assert json.loads(json.dumps(sf.compiled_modules(tmp_path / "none"))) == []


def test_build_env_links_only_curand_and_stubs_the_driver(tmp_path):
    """The build's environment: sm_90a, an include folder holding curand's headers alone (links),
    a stub libcuda whose soname is the driver's, the runtime's folder on the link path."""
    inc = tmp_path / "wheel_include"
    inc.mkdir()
    for h in ("curand.h", "curand_kernel.h", "cuda_runtime.h"):
        (inc / h).write_text(f"/* {h} */")
    env = sf.build_env(tmp_path / "cudalib", inc, tmp_path / "stub")
    assert env["FLASHINFER_CUDA_ARCH_LIST"] == "9.0a"
    linked = tmp_path / "stub" / "include"
    assert env["FLASHINFER_EXTRA_CUDAFLAGS"] == f"-I{linked}"
    assert sorted(p.name for p in linked.iterdir()) == ["curand.h", "curand_kernel.h"]
    assert (linked / "curand.h").resolve() == (inc / "curand.h").resolve()
    assert env["FLASHINFER_EXTRA_LDFLAGS"].split() == [f"-L{tmp_path / 'cudalib'}",
                                                       f"-L{tmp_path / 'stub'}"]
    stub = (tmp_path / "stub" / "libcuda.so").read_bytes()
    assert stub[:4] == b"\x7fELF" and b"libcuda.so.1" in stub
    assert sf.build_env(tmp_path / "cudalib", inc, tmp_path / "stub") == env  # again: the same


def _spec_names(head_dims):
    """``specs(head_dims)``'s names from a fresh process whose FlashInfer is imported for sm_90a
    (as ``main`` imports it for ``build``: FlashInfer fixes its architectures at import)."""
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import stage_flashinfer as sf; "
            f"print(json.dumps([s.name for s in sf.specs({list(head_dims)})]))")
    env = {**os.environ, "FLASHINFER_CUDA_ARCH_LIST": sf.ARCH_LIST}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_modules_built_are_sglangs_names():
    """Per head dimension: FlashInfer's fa2 and fa3 (sm90) batch prefill and its batch decode,
    bf16 with int32 indices, nothing else on; another head dimension gives other names."""
    pytest.importorskip("flashinfer")
    both = _spec_names([64, 128])
    names = both[:3]
    tail = ("dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_64_head_dim_vo_64"
            "_posenc_0_use_swa_False_use_logits_cap_False")
    assert names == [f"batch_prefill_with_kv_cache_{tail}_f16qk_False",
                     f"batch_prefill_with_kv_cache_{tail}_f16qk_False_sm90",
                     f"batch_decode_with_kv_cache_{tail}"]
    assert len(both) == 6 and not set(names) & set(both[3:])


def test_build_compiles_each_spec_and_refuses_other_head_dims(monkeypatch, capsys):
    built = []
    fake = [type("Spec", (), {"name": f"m{i}", "is_compiled": i == 1,
                              "build": lambda self, verbose: built.append(self.name)})()
            for i in range(3)]
    monkeypatch.setattr(sf, "specs", lambda dims: fake)
    assert sf.build([64]) == ["m0", "m2"] and built == ["m0", "m2"]  # m1 compiled already
    with pytest.raises(SystemExit) as e:
        sf.main(["build", "--head-dims", "96"])
    assert e.value.code == 2 and "96" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["build", "harvest"])
def test_a_part_size_of_zero_is_refused_before_any_work(action, monkeypatch, capsys):
    monkeypatch.setattr(sf, "build", lambda dims: pytest.fail("compiled before the check"))
    with pytest.raises(SystemExit) as e:
        sf.main([action, "--part-mib", "0"])
    assert e.value.code == 2 and "--part-mib 0" in capsys.readouterr().err
    sf.main(["status"])  # control: another action does not read --part-mib


def test_the_cuda_runtime_is_found_beside_a_wrapper_nvcc(tmp_path, monkeypatch):
    """An ``nvcc`` on the PATH that is a wrapper script outside the toolkit (no runtime beside
    its ``bin``) falls back to ``$CUDA_HOME``'s ``lib`` or ``lib64``; the folder beside a real
    nvcc's ``bin`` is taken first. Negative control: ``$CUDA_HOME`` without a runtime gives
    another folder."""
    wrapper = tmp_path / "usr" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text("#!/bin/sh\n")
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "lib").mkdir(parents=True)
    (toolkit / "lib" / "libcudart.so").write_bytes(b"")
    monkeypatch.setattr(sf.shutil, "which", lambda name: str(wrapper))
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    assert sf.default_cuda_lib() == toolkit / "lib"
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    assert sf.default_cuda_lib() != toolkit / "lib"
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    (tmp_path / "usr" / "lib64").mkdir()
    (tmp_path / "usr" / "lib64" / "libcudart.so").write_bytes(b"")
    assert sf.default_cuda_lib() == tmp_path / "usr" / "lib64"
