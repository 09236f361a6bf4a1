"""The package's layers, as folders: the core at the top (``config``, ``ops``, ``step``, ...,
with ``methods/``, ``reference/``, ``kernels/``), ``tools/`` above it, ``serving/`` (the SGLang
layer) on top, imports going one way only (the AST walker of ``test_structure`` sees lazy imports
too); the public paths users type, kept at the top as entry points; and SGLang nowhere outside
the serving layer, in the sources or when imported."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import tomllib
from typing import Dict, List, Set

from test_structure import PKG, _modules, _write, import_graph

# Public commands and imports kept at their paths: entry point -> the module it stands for.
ENTRY_POINTS = {
    "sglang_prr.launch_server": "sglang_prr.serving.launch_server",  # python -m
    "sglang_prr.plugin": "sglang_prr.serving.plugin",  # enable(), SGLang's plugin entry point
    "sglang_prr.profile_budget": "sglang_prr.tools.profile_budget",  # python -m
    "sglang_prr.models": "sglang_prr.tools.models",  # python -m
    "sglang_prr.__main__": None,  # python -m sglang_prr: the ops on a synthetic cache
}
LAYERS = ("serving", "tools")  # above the core, in this order: serving may import tools


def layer(mod: str, pkg: str = "sglang_prr") -> str:
    """``serving``, ``tools``, ``entry`` or ``core``."""
    if mod in ENTRY_POINTS or mod.replace(pkg, "sglang_prr", 1) in ENTRY_POINTS:
        return "entry"
    for name in LAYERS:
        if mod == f"{pkg}.{name}" or mod.startswith(f"{pkg}.{name}."):
            return name
    return "core"


# Which layers each layer may import.
ALLOWED = {"core": {"core"}, "tools": {"core", "tools"},
           "serving": {"core", "tools", "serving"}, "entry": {"core", "tools", "serving"}}


def layer_violations(graph: Dict[str, Set[str]], pkg: str = "sglang_prr") -> List[str]:
    return sorted(f"{m} ({layer(m, pkg)}) -> {d} ({layer(d, pkg)})"
                  for m, deps in graph.items() for d in deps
                  if layer(d, pkg) not in ALLOWED[layer(m, pkg)])


def test_imports_go_one_way_between_layers():
    graph = import_graph(PKG)
    assert not layer_violations(graph)
    # Control: the layers are really there, and the walker sees them meet.
    assert {layer(m) for m in graph} == {"core", "tools", "serving", "entry"}
    assert "sglang_prr.tools.traces" in graph["sglang_prr.serving.backend"]


def test_layer_check_negative_control(tmp_path):
    """A core module that imports the serving layer, lazily, and a tool that does: both caught."""
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/step.py": "def f():\n    from .serving import backend\n",
        "pkg/serving/__init__.py": "", "pkg/serving/backend.py": "from .. import step\n",
        "pkg/tools/__init__.py": "", "pkg/tools/replay.py": "from ..serving import backend\n"})
    bad = layer_violations(import_graph(pkg), pkg="pkg")
    assert bad == ["pkg.step (core) -> pkg.serving.backend (serving)",
                   "pkg.tools.replay (tools) -> pkg.serving.backend (serving)"]


def test_entry_points_are_only_entry_points():
    """Each kept path stands for one module (the same objects), and holds nothing else."""
    graph = import_graph(PKG)
    for shim, target in ENTRY_POINTS.items():
        if target is None:
            continue
        assert graph[shim] == {target}, (shim, graph[shim])
        src = PKG.parent.joinpath(*shim.split(".")).with_suffix(".py").read_text()
        assert len(src.splitlines()) <= 12, shim
    from sglang_prr import launch_server, models, plugin, profile_budget
    from sglang_prr.serving import launch_server as ls, plugin as pl
    from sglang_prr.tools import models as md, profile_budget as pb

    assert launch_server.main is ls.main and models.main is md.main
    assert plugin.apply is pl.apply and plugin.enable is pl.enable
    assert plugin.read_stats is pl.read_stats is pl.stats.read_stats
    assert profile_budget.main is pb.main


def test_the_plugin_entry_point_resolves():
    """SGLang loads ``prr`` from group ``sglang.srt.plugins``: the declared target imports."""
    meta = tomllib.loads((PKG.parent / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["sglang.srt.plugins"]["prr"]
    mod, _, attr = target.partition(":")
    assert mod in ENTRY_POINTS  # a public path, stable across moves inside the package
    from sglang_prr.serving import plugin

    assert getattr(importlib.import_module(mod), attr) is plugin.apply
    listed = set(meta["tool"]["setuptools"]["packages"])
    subpackages = {".".join(p.relative_to(PKG.parent).parts[:-1])
                   for p in PKG.rglob("__init__.py")}
    assert listed == subpackages  # every folder ships


def test_public_command_runs_from_its_kept_path():
    out = subprocess.run([sys.executable, "-m", "sglang_prr.profile_budget", "--help"],
                         capture_output=True, text=True, timeout=300, cwd=str(PKG.parent))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--prr-top-k" in out.stdout and "python -m sglang_prr.profile_budget" in out.stdout


# ------------------------------------------------------------------ the core never imports SGLang
# Everything but the serving layer (the core, the tools, the entry points that stand for them)
# runs on torch alone: testable and benchmarkable without SGLang, and unaffected by its upgrades.
def not_serving(mod: str, pkg: str = "sglang_prr") -> bool:
    target = ENTRY_POINTS.get(mod.replace(pkg, "sglang_prr", 1))
    return layer(mod, pkg) != "serving" and not (target and layer(target) == "serving")


def sglang_importers(pkg_dir) -> Set[str]:
    """Modules of the package that import SGLang (``sglang`` or a submodule), anywhere."""
    out = set()
    for name, f in _modules(pkg_dir).items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            if any(n == "sglang" or n.startswith("sglang.") for n in names):
                out.add(name)
    return out


def sglang_reach(pkg_dir, pkg: str = "sglang_prr") -> List[str]:
    """Modules outside the serving layer that reach SGLang: themselves, or through any module
    they import (lazily included)."""
    graph, sg = import_graph(pkg_dir), sglang_importers(pkg_dir)
    bad = []
    for start in (m for m in graph if not_serving(m, pkg)):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        bad += [f"{start} -> {m}" for m in sorted(seen & sg)]
    return bad


def test_core_never_imports_sglang_in_its_source():
    assert not sglang_reach(PKG)
    # Control: the serving layer does import SGLang, and it is the serving layer that does.
    sg = sglang_importers(PKG)
    assert "sglang_prr.serving.backend" in sg and all(layer(m) == "serving" for m in sg)


def test_sglang_check_negative_control(tmp_path):
    """A core module importing SGLang inside a function, and one reaching it through a tool
    that imports the serving layer: both found; the serving layer itself is allowed to."""
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/ops.py": "def f():\n    import sglang.srt\n",
        "pkg/step.py": "from .tools import replay\n",
        "pkg/tools/__init__.py": "", "pkg/tools/replay.py": "from ..serving import backend\n",
        "pkg/serving/__init__.py": "",
        "pkg/serving/backend.py": "from sglang.srt.layers import radix_attention\n"})
    assert sglang_reach(pkg, pkg="pkg") == [
        "pkg.ops -> pkg.ops", "pkg.step -> pkg.serving.backend",
        "pkg.tools.replay -> pkg.serving.backend"]


# Imports the named modules with every import of ``sglang`` refused, then runs ``THEN`` (code of
# the caller's); prints how many modules it imported and exits 0 only if SGLang is nowhere in
# ``sys.modules`` afterwards.
NO_SGLANG = """
import importlib, importlib.abc, os, sys

class NoSGLang(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError(f"sglang refused: {name!r} imported")
        return None

sys.meta_path.insert(0, NoSGLang())
mods = [importlib.import_module(m) for m in sys.argv[1:]]
exec(os.environ["THEN"])
leaked = sorted(n for n in sys.modules if n == "sglang" or n.startswith("sglang."))
assert not leaked, leaked
print("imported", len(mods))
"""


def _import_without_sglang(mods, then: str = ""):
    return subprocess.run([sys.executable, "-c", NO_SGLANG, *mods], capture_output=True,
                          text=True, timeout=600, cwd=str(PKG.parent),
                          env={**os.environ, "THEN": then})


def test_core_imports_without_sglang_at_run_time():
    """Every module outside the serving layer imports in a process where SGLang cannot be
    imported (what the source check cannot see: an import by a third-party package, or by name
    through importlib); and the step runs there. Control: the serving layer, which imports
    SGLang only where it needs it, fails there once it does (the launcher's parser)."""
    mods = sorted(m for m in import_graph(PKG) if not_serving(m))
    assert {"sglang_prr.ops", "sglang_prr.tools.profile_budget", "sglang_prr.kernels.build",
            "sglang_prr.profile_budget", "sglang_prr.__main__"} <= set(mods)
    out = _import_without_sglang(mods, then=(  # serial DSA and PRR on a synthetic cache
        "sys.modules['sglang_prr.__main__'].main(['--steps', '2', '--batch', '1', '--context',"
        " '256', '--block-size', '16', '--top-k', '64', '--device', 'cpu'])"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "max|PRR-DSA|" in out.stdout, out.stdout[-2000:]
    assert out.stdout.strip().endswith(f"imported {len(mods)}"), out.stdout[-2000:]
    ctl = _import_without_sglang(["sglang_prr.serving.launch_server"],
                                 then="mods[0].build_parser()")
    assert ctl.returncode != 0 and "sglang refused" in ctl.stderr, ctl.stderr[-2000:]
