"""Loading a script of ``benchmarks/`` as a module (the folder is not a package), for the tests
that dry-run it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str, register: bool = False) -> ModuleType:
    """``benchmarks/<name>.py`` executed as module ``name``; ``register``: put it in
    ``sys.modules`` first (a script whose dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
