"""The package's shape: no import cycle between its modules (imports inside functions count),
no source file beyond the size at which it stops holding one concept (and no list of exemptions),
the reference a leaf of single ops (whole steps stated on it are the tests' oracle), no branch on
a method's name outside ``methods/``, one definition of the decode counters.

A cycle hidden in a lazy import still couples two modules both ways: neither can be read,
tested or changed alone, and which one finishes importing first depends on who is imported
first. The checker reads the sources (``ast``), so it sees every import, executed or not.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

PKG = Path(__file__).resolve().parents[2] / "sglang_prr"

# Past these sizes a file has, so far every time, held more than one concept.
MAX_MODULE_LINES = 450
MAX_KERNEL_LINES = 800
KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")


def _modules(pkg_dir: Path) -> Dict[str, Path]:
    """Dotted module name -> source file of every module under ``pkg_dir`` (a package)."""
    out = {}
    for f in sorted(pkg_dir.rglob("*.py")):
        parts = f.relative_to(pkg_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(pkg_dir: Path) -> Dict[str, Set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its source.

    ``from X import n`` counts as importing ``X.n`` when that is a module, else ``X``. Parent
    packages imported implicitly by Python are not edges: a package's ``__init__`` importing
    its own submodules is the normal layout, not a cycle."""
    mods = _modules(pkg_dir)
    graph: Dict[str, Set[str]] = {}
    for name, f in mods.items():
        # Relative imports start from the module's package (the module itself for __init__).
        here = name if f.name == "__init__.py" else name.rpartition(".")[0]
        targets: List[str] = []
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1]
                                    + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                            for a in node.names]
        deps = set()
        for t in targets:
            while t and t not in mods:  # `import pkg.mod.attr`-style names: the module part
                t = t.rpartition(".")[0]
            if t and t != name:
                deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected groups of more than one module (each one or more cycles)."""
    reach = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        reach[start] = seen
    groups = {frozenset([n] + [m for m in reach[n] if n in reach[m]]) for n in graph}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def test_no_import_cycle():
    graph = import_graph(PKG)
    # The walker sees imports inside functions (backend imports traces only when tracing).
    assert "sglang_prr.tools.traces" in graph["sglang_prr.serving.backend"]
    assert "sglang_prr.kernels" in graph["sglang_prr.custom_ops"]
    found = cycles(graph)
    assert not found, "import cycles between modules of sglang_prr: " + "; ".join(
        " <-> ".join(g) for g in found)


def test_reference_is_a_leaf():
    """The reference (the CPU path and the oracle of the kernels) imports nothing of the package
    but ``config``: never the ops, the methods or the kernels, so it cannot run product code.
    Control: the walker does see the reference's own imports."""
    graph = import_graph(PKG)
    ref_mods = {m for m in graph if m == "sglang_prr.reference"
                or m.startswith("sglang_prr.reference.")}
    assert "sglang_prr.reference.paging" in graph["sglang_prr.reference.quest"]
    outside = {(m, d) for m in ref_mods for d in graph[m]
               if d not in ref_mods and d != "sglang_prr.config"}
    assert not outside, f"the reference imports outside itself: {sorted(outside)}"


def _in(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_no_branch_on_a_method_name_outside_methods():
    """What differs between DSA methods lives in ``methods/`` (one module each, behind one
    interface): no other module compares anything with a method's name (control: a synthetic
    ``method == "quest"`` is found)."""
    from sglang_prr import methods

    def branches(tree) -> List[int]:
        return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
                and any(isinstance(c, ast.Constant) and c.value in methods.BUILTIN
                        for c in [n.left, *n.comparators])]

    found = {name: branches(ast.parse(f.read_text())) for name, f in _modules(PKG).items()
             if not _in(name, ("sglang_prr.methods",))}
    assert not {k: v for k, v in found.items() if v}
    assert branches(ast.parse('if method == "quest":\n    pass\n')) == [1]


def _write(root: Path, files: Dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("files, expect", [
    # Two modules, one of the imports lazy (inside a function).
    ({"pkg/__init__.py": "", "pkg/a.py": "def f():\n    from . import b\n",
      "pkg/b.py": "from .a import f as g\n"}, [["pkg.a", "pkg.b"]]),
    # A package's __init__ and its submodule importing a name back from the package.
    ({"pkg/__init__.py": "", "pkg/sub/__init__.py": "from .c import X\nY = 1\n",
      "pkg/sub/c.py": "X = 0\ndef g():\n    from . import Y\n"}, [["pkg.sub", "pkg.sub.c"]]),
    # Absolute imports count as well; a one-way chain is no cycle.
    ({"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "from pkg import c\n",
      "pkg/c.py": "import os\n"}, []),
])
def test_cycle_checker_negative_control(tmp_path, files, expect):
    """The checker does find cycles: synthetic packages with a known answer."""
    assert cycles(import_graph(_write(tmp_path, files))) == expect


def _lines(f: Path) -> int:
    return len(f.read_text().splitlines())


def _limit(f: Path):
    """The line limit of a source file of the package; None for other files."""
    return (MAX_MODULE_LINES if f.suffix == ".py" else
            MAX_KERNEL_LINES if f.suffix in KERNEL_SUFFIXES else None)


def oversized(pkg_dir: Path) -> List[str]:
    return [f"{f.relative_to(pkg_dir).as_posix()}: {_lines(f)} > {_limit(f)}"
            for f in sorted(pkg_dir.rglob("*")) if _limit(f) and _lines(f) > _limit(f)]


def _size_cases():
    """One case per source file; there is no list of exemptions to add a file to."""
    return [pytest.param(f, _limit(f), id=f.relative_to(PKG).as_posix())
            for f in sorted(PKG.rglob("*")) if _limit(f)]


@pytest.mark.parametrize("path, limit", _size_cases())
def test_file_size(path, limit):
    n = _lines(path)
    assert n <= limit, f"{path.relative_to(PKG)}: {n} lines, the limit is {limit}"


def test_size_check_negative_control(tmp_path):
    pkg = _write(tmp_path, {"pkg/__init__.py": "", "pkg/ok.py": "x = 1\n" * MAX_MODULE_LINES,
                            "pkg/big.py": "x = 1\n" * (MAX_MODULE_LINES + 1),
                            "pkg/k.cu": "//\n" * (MAX_KERNEL_LINES + 1),
                            "pkg/notes.txt": "x\n" * 999})
    assert oversized(pkg) == [f"big.py: {MAX_MODULE_LINES + 1} > {MAX_MODULE_LINES}",
                              f"k.cu: {MAX_KERNEL_LINES + 1} > {MAX_KERNEL_LINES}"]


def test_size_cases_cover_the_package():
    """Control: the size check sees the modules and kernel sources it is meant to see."""
    ids = {c.id for c in _size_cases()}
    assert {"serving/backend.py", "tools/traces.py", "kernels/__init__.py",
            "kernels/attention.cu", "kernels/common.cuh", "kernels/binding.cpp",
            "reference/__init__.py", "reference/calibration.py", "methods/base.py",
            "launch_server.py"} <= ids


# A whole decode step is a selection followed by attention over what it selected. The product
# composes it of dispatching ops (ops.dsa_decode / prr_decode, step.DecodeStep); stated on the
# reference alone it is an oracle of the tests (tests/unit/ref_steps.py), never the reference's.
SELECTIONS = {"select_topk", "select_lists", "select_from_scores", "quest_select",
              "quest_select_predict", "select_lists_predict", "select_fused", "select",
              "select_predict"}
ATTENTIONS = {"attend_set", "sparse_attn_merge", "sparse_attn_partials", "dense_attention"}


def step_compositions(files) -> List[str]:
    """Functions that call both a selection and an attention op."""
    out = []
    for f in files:
        for fn in ast.walk(ast.parse(Path(f).read_text())):
            if isinstance(fn, ast.FunctionDef):
                called = {c.func.attr if isinstance(c.func, ast.Attribute) else
                          getattr(c.func, "id", None) for c in ast.walk(fn)
                          if isinstance(c, ast.Call)}
                if called & SELECTIONS and called & ATTENTIONS:
                    out.append(f"{Path(f).name}:{fn.name}")
    return out


def test_step_oracle_lives_in_the_tests():
    """The reference holds single ops only (control: the checker finds the steps the tests
    state in ref_steps.py, and ops' compositions)."""
    assert not step_compositions(sorted((PKG / "reference").glob("*.py")))
    here = Path(__file__).resolve().parent
    assert step_compositions([here / "ref_steps.py"]) == ["ref_steps.py:dsa_decode",
                                                          "ref_steps.py:prr_decode"]
    product = step_compositions([PKG / "ops.py", PKG / "step.py"])
    assert {"ops.py:dsa_decode", "ops.py:prr_decode", "step.py:run"} <= set(product), product


def test_counter_layout_is_one_definition():
    """The decode counters' slots: contracts.STATS_SLOTS and the kernels' StatSlot enum name the
    same slots in the same order (control: a reordered copy of the header does not match)."""
    import re

    from sglang_prr import contracts

    header = (PKG / "kernels" / "prr_kernels.h").read_text()

    def slots(text):
        body = re.search(r"enum StatSlot : int \{(.*?)\};", text, re.S).group(1)
        pairs = re.findall(r"kStat(\w+) = (\d+)", body)
        named = sorted((int(v), n.lower()) for n, v in pairs)
        n = int(re.search(r"kNumStatSlots = (\d+)", body).group(1))
        return [name for _, name in named], n

    names, n = slots(header)
    assert names == list(contracts.STATS_SLOTS) and n == len(contracts.STATS_SLOTS)
    swapped = header.replace("kStatSelected = 0", "kStatSelected = 9")
    assert slots(swapped)[0] != list(contracts.STATS_SLOTS)
