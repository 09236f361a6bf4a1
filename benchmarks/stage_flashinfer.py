"""Carry FlashInfer's compiled kernels from one GPU machine to the next, so that a fresh machine's
first SGLang server does not compile them again.

flashinfer-python 0.6.15.post1 compiles its attention kernels on first use (its JIT: about 2.5
minutes of a fresh machine's first server start, against ~1 minute for the servers after it) into
``FLASHINFER_JIT_DIR/<module>/<module>.so``. A module found as
``FLASHINFER_AOT_DIR/<module>/<module>.so`` instead is loaded as it is, without a build. On a
machine that has compiled them (after a server ran; the module names carry every parameter of the
kernel, the GPU architecture is in the JIT directory's name):

    python benchmarks/stage_flashinfer.py harvest --dir /tmp/fi   # manifest.json + part-00, ...

packs every compiled (or installed) module into parts small enough to come back from the machine (at most
``--part-mib``, 14 MiB by default), with the FlashInfer version and the architecture in the
manifest. Keep them under ``.xfer/flashinfer`` of the repository (git-ignored). On a later fresh
machine, carrying ``.xfer/flashinfer`` (after FlashInfer is staged):

    python benchmarks/stage_flashinfer.py install    # checks the parts, writes the AOT modules

``install`` refuses parts of another FlashInfer version or architecture (their modules would not
be the ones this FlashInfer asks for) and names a missing or damaged part; it keeps a module that
is already there. ``status`` lists the parts and the modules each directory holds.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import tempfile
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
    ap = stage_model.parts_parser(__doc__, ["harvest", "status", "install"], XFER, PART_MIB)
    a = ap.parse_args(argv)
    try:
        if a.action == "harvest":
            if a.part_mib <= 0:
                ap.error(f"--part-mib {a.part_mib}: allowed > 0")
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
