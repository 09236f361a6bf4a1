"""Carry FlashInfer's compiled kernels from one GPU machine to the next, so that a fresh machine's
first SGLang server does not compile them again.

flashinfer-python 0.6.15.post1 compiles its attention kernels on first use (its JIT: about 2.5
minutes of a fresh machine's first server start, against ~1 minute for the servers after it) into
``FLASHINFER_JIT_DIR/<module>/<module>.so``. A module found as
``FLASHINFER_AOT_DIR/<module>/<module>.so`` instead is loaded as it is, without a build. On a
machine that has compiled them (after a server ran; the module names carry every parameter of the
kernel, the GPU architecture is in the JIT directory's name):

    python benchmarks/stage_flashinfer.py harvest --dir /tmp/fi   # manifest.json + part-00, ...

packs every compiled (or installed) module into parts small enough to come back from the
machine (at most ``--part-mib``, 14 MiB by default), with the FlashInfer version and the
architecture in the manifest. Keep them under ``.xfer/flashinfer`` of the repository
(git-ignored). On a later fresh machine, carrying ``.xfer/flashinfer`` (after FlashInfer is
staged):

    python benchmarks/stage_flashinfer.py install    # checks the parts, writes the AOT modules

A machine without a GPU can compile them too (nvcc and FlashInfer's sources, for sm_90a):

    python benchmarks/stage_flashinfer.py build --head-dims 64 128   # and packs them, as harvest

builds the modules SGLang 0.5.17's FlashInfer backend asks for on an H100 or H200 with bf16 KV,
by our reading of its code (``BUILT``: paged prefill and tensor-core decode "fa2", ragged prefill
"auto", which is fa3 on sm90, CUDA-core decode below GQA 4), per head dimension. A module the
server asks for and the parts lack is compiled there as before.

``install`` refuses parts of another FlashInfer version or architecture (their modules would not
be the ones this FlashInfer asks for) and names a missing or damaged part; it keeps a module that
is already there. ``status`` lists the parts and the modules each directory holds.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import stage_model  # noqa: E402  (the parts, their manifest and checks)

XFER = ROOT / ".xfer" / "flashinfer"
PART_MIB = 14  # long.sh returns a file's last 16,000,000 bytes: a part must fit whole
ARCHIVE = "flashinfer-modules.tar.gz"


def dirs() -> Dict[str, object]:
    """FlashInfer's version, its JIT and AOT module directories, and the architecture the JIT
    directory is named for (``90a`` on an H100 or H200)."""
    import flashinfer
    from flashinfer.jit import env
    from flashinfer.compilation_context import CompilationContext

    # The JIT directory's own naming (``env._get_workspace_dir_name``); "" without a GPU or an
    # architecture list (FLASHINFER_CUDA_ARCH_LIST).
    arch = "_".join(f"{a}{b}" for a, b in sorted(CompilationContext().TARGET_CUDA_ARCHS))
    return {"version": flashinfer.__version__, "jit": Path(env.FLASHINFER_JIT_DIR),
            "aot": Path(env.FLASHINFER_AOT_DIR), "arch": arch}


def compiled_modules(folder: Path) -> List[Path]:
    """Every ``<module>/<module>.so`` under ``folder`` (a module whose build failed has none)."""
    if not folder.is_dir():
        return []
    return sorted(d / f"{d.name}.so" for d in folder.iterdir() if (d / f"{d.name}.so").is_file())


# (kind, backend) of each module ``build`` compiles per head dimension.
BUILT = (("prefill", "fa2"), ("prefill", "fa3"), ("decode", None))
ARCH_LIST = "9.0a"


def build_env(cuda_lib: Path, curand_include: Path, stub_dir: Path) -> Dict[str, str]:
    """The environment FlashInfer's JIT needs to compile and link for sm_90a on a machine
    without a GPU or a driver: the architecture list, curand's headers (CUTLASS's utilities
    include them; only those headers, not the wheel's whole include folder, whose runtime
    headers clash with nvcc's), the CUDA runtime's folder and a stub ``libcuda`` (the modules
    load the driver's at run time)."""
    stub_dir.mkdir(parents=True, exist_ok=True)
    inc = stub_dir / "include"
    inc.mkdir(exist_ok=True)
    for h in curand_include.glob("curand*.h"):
        link = inc / h.name
        if link.is_symlink() or link.exists():  # an earlier run's, perhaps broken: made anew
            link.unlink()
        link.symlink_to(h)
    stub = stub_dir / "libcuda.so"
    if not stub.exists():
        src = stub_dir / "stub.c"
        src.write_text("/* libcuda stub for linking only */\n")
        subprocess.run(["cc", "-shared", "-o", str(stub), "-Wl,-soname,libcuda.so.1", str(src)],
                       check=True)
    return {"FLASHINFER_CUDA_ARCH_LIST": ARCH_LIST,
            "FLASHINFER_EXTRA_CUDAFLAGS": f"-I{inc}",
            "FLASHINFER_EXTRA_LDFLAGS": f"-L{cuda_lib} -L{stub_dir}"}


def specs(head_dims: List[int]):
    """The JIT specs ``build`` compiles (``BUILT`` for each head dimension; bf16 q, KV and
    output, int32 indices, no positional encoding, sliding window, soft cap or fp16 QK
    reduction, as SGLang plans them for Llama-like models)."""
    import torch
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module

    bf, i32 = torch.bfloat16, torch.int32
    out = []
    for hd in head_dims:
        for kind, backend in BUILT:
            if kind == "prefill":
                out.append(gen_batch_prefill_module(backend, bf, bf, bf, i32, hd, hd, 0, False,
                                                    False, False))
            else:
                out.append(gen_batch_decode_module(bf, bf, bf, i32, hd, hd, 0, False, False))
    return out


def build(head_dims: List[int]) -> List[str]:
    """Compile ``specs(head_dims)`` into FlashInfer's JIT directory; the names compiled. A
    module already compiled there is kept (ninja would rebuild it for another flag). Set
    ``build_env``'s variables before FlashInfer is imported (``main`` does)."""
    done = []
    for spec in specs(head_dims):
        if spec.is_compiled:
            print(f"   kept    {spec.name}", flush=True)
            continue
        t0 = time.time()
        spec.build(verbose=False)
        print(f"{time.time() - t0:7.1f} s  {spec.name}", flush=True)
        done.append(spec.name)
    return done


def default_cuda_lib() -> Path:
    """The folder of nvcc's ``libcudart.so``: ``lib64`` or ``lib`` beside nvcc's ``bin``, else
    under ``$CUDA_HOME`` or ``/usr/local/cuda`` (an ``nvcc`` on the PATH may be a wrapper script
    outside the toolkit)."""
    nvcc = shutil.which("nvcc")
    homes = [Path(nvcc).resolve().parents[1]] if nvcc else []
    homes += [Path(p) for p in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if p]
    found = [h / d for h in homes for d in ("lib64", "lib") if (h / d / "libcudart.so").exists()]
    return found[0] if found else homes[0] / "lib64"


def default_curand_include() -> Path:
    """curand's headers from the pip CUDA wheels torch brings (``nvidia/cu*/include``)."""
    import nvidia

    for root in map(Path, nvidia.__path__):
        for h in sorted(root.glob("cu*/include/curand_kernel.h")) + sorted(
                root.glob("curand/include/curand_kernel.h")):
            return h.parent
    raise ValueError("no curand_kernel.h in the nvidia wheels: pass --curand-include")


def harvest(out: Path, part_mib: float) -> dict:
    """Pack every module this machine holds (compiled by its JIT, or installed: the next machine
    needs both) into parts under ``out`` (``stage_model.split``: SHA-256 of each part and of the
    whole). A module in both directories is taken from the JIT's."""
    d = dirs()
    by_name = {so.parent.name: so for key in ("aot", "jit") for so in compiled_modules(d[key])}
    mods = [by_name[n] for n in sorted(by_name)]
    if not mods:
        raise ValueError(f"no compiled FlashInfer module under {d['jit']} or {d['aot']}: run a "
                         "server first")
    with tempfile.TemporaryDirectory(prefix="fi-") as tmp:
        archive = Path(tmp) / ARCHIVE
        with tarfile.open(archive, "w:gz") as tar:
            for so in mods:
                tar.add(so, arcname=f"{so.parent.name}/{so.name}")
        meta = {"flashinfer": d["version"], "arch": d["arch"],
                "modules": [so.parent.name for so in mods]}
        return stage_model.split(archive, out, int(part_mib * (1 << 20)), meta)


def install(folder: Path) -> List[str]:
    """Write the parts' modules into FlashInfer's AOT directory; the names of those written (a
    module already there is kept). Raises ``ValueError`` for parts of another FlashInfer version
    or architecture, or missing or damaged ones."""
    problems = stage_model.check_parts(folder)
    if problems:
        raise ValueError(f"cannot install the modules in {folder}: " + "; ".join(problems))
    man = json.loads((folder / stage_model.MANIFEST).read_text())
    d = dirs()
    for key, here in (("flashinfer", d["version"]), ("arch", d["arch"])):
        if man.get(key) != here:
            raise ValueError(f"the parts in {folder} hold modules of {key} {man.get(key)!r}; "
                             f"this machine's is {here!r}: not installed")
    written = []
    with tempfile.TemporaryDirectory(prefix="fi-") as tmp:
        archive = stage_model.join(folder, Path(tmp))
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            # Only <module>/<module>.so, as harvest writes them (no path leaves the folder),
            # checked before anything is written.
            for member in members:
                name = Path(member.name)
                if (not member.isfile() or len(name.parts) != 2
                        or name.name != f"{name.parts[0]}.so"):
                    raise ValueError(f"{archive.name}: unexpected entry {member.name!r}")
            for member in members:
                name = Path(member.name)
                dest = d["aot"] / name
                if dest.exists():
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                data = tar.extractfile(member).read()
                tmp_dest = dest.with_suffix(".so.part")
                tmp_dest.write_bytes(data)
                tmp_dest.replace(dest)  # a reader sees the whole module or none
                written.append(name.parts[0])
    return written


def status(folder: Path) -> str:
    out = io.StringIO()
    man_path = folder / stage_model.MANIFEST
    if man_path.exists():
        man = json.loads(man_path.read_text())
        here = [p["name"] for p in man["parts"] if (folder / p["name"]).exists()]
        print(f"{len(man.get('modules', []))} modules of FlashInfer {man.get('flashinfer')} "
              f"({man.get('arch')}) in {len(here)}/{len(man['parts'])} parts under {folder}",
              file=out)
    for p in stage_model.check_parts(folder):
        print(f"  {p}", file=out)
    try:
        d = dirs()
    except ImportError as e:
        print(f"FlashInfer not importable here: {e}", file=out)
        return out.getvalue()
    for key in ("jit", "aot"):
        print(f"{key}: {len(compiled_modules(d[key]))} modules in {d[key]}", file=out)
    return out.getvalue()


def main(argv=None) -> int:
    ap = stage_model.parts_parser(__doc__, ["harvest", "status", "install", "build"], XFER,
                                  PART_MIB)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128],
                    help="head dimensions to compile (build)")
    ap.add_argument("--cuda-lib", type=Path, default=None,
                    help="the CUDA runtime's folder (build; default: beside nvcc)")
    ap.add_argument("--curand-include", type=Path, default=None,
                    help="curand's headers (build; default: the pip CUDA wheel's)")
    a = ap.parse_args(argv)
    if a.action in ("build", "harvest") and a.part_mib <= 0:  # build packs too, after compiling
        ap.error(f"--part-mib {a.part_mib}: allowed > 0")
    try:
        if a.action == "build":
            bad = [h for h in a.head_dims if h not in (64, 128, 256)]
            if bad:
                ap.error(f"--head-dims {bad}: allowed 64, 128, 256")
            env = build_env(a.cuda_lib or default_cuda_lib(),
                            a.curand_include or default_curand_include(),
                            Path(tempfile.gettempdir()) / "stage_flashinfer")
            os.environ.update(env)  # before FlashInfer is imported (its JIT reads them then)
            print(f"compiled {len(build(a.head_dims))} modules for sm_90a into {dirs()['jit']}")
            man = harvest(a.dir, a.part_mib)  # in this process: FlashInfer imported for sm_90a
            print(f"{len(man['modules'])} modules in {len(man['parts'])} parts under {a.dir}")
        elif a.action == "harvest":
            man = harvest(a.dir, a.part_mib)
            print(f"{len(man['modules'])} modules of FlashInfer {man['flashinfer']} "
                  f"({man['arch']}): {man['bytes']} bytes in {len(man['parts'])} parts under "
                  f"{a.dir}")
        elif a.action == "install":
            written = install(a.dir)
            print(f"installed {len(written)} modules into {dirs()['aot']}")
        else:
            print(status(a.dir), end="")
    except ValueError as e:
        print(f"stage_flashinfer: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
