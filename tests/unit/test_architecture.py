"""docs/ARCHITECTURE.md names every module of the package and every kernel source, so that the
map stays the map: a new file without its room in the doc fails here.

A file ``F/name.ext`` of folder ``F`` is named by a line of the doc that holds ```F/name.ext```,
or that holds a token ```F/...``` of its folder and ```name.ext``` or ```name```; a file at the
top by ```name.ext``` on a line that names no folder of the package.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

from test_structure import KERNEL_SUFFIXES, PKG, _write

DOC = PKG.parent / "docs" / "ARCHITECTURE.md"


def sources(pkg_dir: Path) -> List[Path]:
    return sorted(f for f in pkg_dir.rglob("*")
                  if f.suffix == ".py" or f.suffix in KERNEL_SUFFIXES)


def unnamed(pkg_dir: Path, doc: str) -> List[str]:
    folders = {p.relative_to(pkg_dir).as_posix() for p in pkg_dir.rglob("*") if p.is_dir()
               and p.name != "__pycache__"}
    lines = [set(re.findall(r"`([^`]+)`", ln)) for ln in doc.splitlines()]
    out = []
    for f in sources(pkg_dir):
        rel = f.relative_to(pkg_dir)
        folder = rel.parent.as_posix()
        ok = False
        for toks in lines:
            named = f.name in toks or f.stem in toks
            in_folder = {t.split("/")[0] for t in toks if "/" in t}
            if folder != "." and rel.as_posix() in toks:
                ok = True
            elif folder != "." and folder in in_folder and named:
                ok = True
            elif folder == "." and named and not in_folder & folders:
                ok = True
            if ok:
                break
        if not ok:
            out.append(rel.as_posix())
    return out


def test_architecture_names_every_module():
    assert not unnamed(PKG, DOC.read_text())


def test_architecture_check_negative_control(tmp_path):
    """A module the doc does not name is found: a row taken out of the real doc, and a new
    module of a synthetic package (its namesake in another folder's row does not count)."""
    doc = DOC.read_text()
    without = "\n".join(ln for ln in doc.splitlines() if "`serving/harness.py`" not in ln)
    assert unnamed(PKG, without) == ["serving/harness.py"]
    pkg = _write(tmp_path, {"pkg/__init__.py": "", "pkg/step.py": "", "pkg/sub/__init__.py": "",
                            "pkg/sub/step.py": "", "pkg/sub/new.py": "", "pkg/k.cu": ""})
    doc = ("| the top | `__init__.py`, `step.py`, `k.cu` |\n"
           "| the sub | `sub/` (`__init__.py`, `step`) |\n")
    assert unnamed(pkg, doc) == ["sub/new.py"]
    assert unnamed(pkg, "| rows | `sub/` (`__init__.py`, `step.py`, `new`) |\n") == [
        "__init__.py", "k.cu", "step.py"]
