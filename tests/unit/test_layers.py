"""The package's layers, as folders: the core at the top (``config``, ``ops``, ``step``, ...,
with ``methods/``, ``reference/``, ``kernels/``), ``tools/`` above it, ``serving/`` (the SGLang
layer) on top, imports going one way only (the AST walker of ``test_structure`` sees lazy imports
too); and the public paths users type, kept at the top as entry points."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from typing import Dict, List, Set

from test_structure import PKG, _write, import_graph

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
