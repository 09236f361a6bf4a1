"""The DSA methods, one module each behind one interface (``base.DSAMethod``), and their
registry keyed by ``--prr-method``.

A new method: a module here with a ``DSAMethod`` subclass (and its ops and kernels, if it has
any), registered below, its name among ``config.METHODS``. ``tests/unit/test_methods_conformance``
then runs it through the checks every method passes (``tests/gpu/test_methods_conformance``: its
kernels against its reference). A method outside the package (e.g. a test's) registers itself
with ``register``.
"""

from __future__ import annotations

from typing import Dict, Tuple

from .base import (DSAMethod, NewKeys, Selected, SelectSpec, SummaryTensor,
                   select_from_scores)
from .infllm_v2 import InfLLMv2
from .quest import Quest

__all__ = ["DSAMethod", "NewKeys", "Selected", "SelectSpec", "SummaryTensor", "select_from_scores",
           "BUILTIN", "register", "unregister", "get", "names"]

_REGISTRY: Dict[str, DSAMethod] = {}


def register(method: DSAMethod) -> DSAMethod:
    """Add ``method`` under ``method.name``. Registering a second object under a taken name is
    an error unless it is of the same class (a module imported twice)."""
    if not isinstance(method, DSAMethod) or not method.name:
        raise ValueError(f"register: {method!r} is not a named DSAMethod")
    old = _REGISTRY.get(method.name)
    if old is not None and type(old) is not type(method):
        raise ValueError(f"register: DSA method {method.name!r} is already {old!r}")
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method added with ``register`` (the built-in ones stay)."""
    if name in BUILTIN:
        raise ValueError(f"unregister: {name!r} is a built-in DSA method")
    _REGISTRY.pop(name, None)


def get(name: str) -> DSAMethod:
    """The method registered as ``name`` (a ``--prr-method`` value)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown DSA method {name!r}: expected one of {names()}") from None


def names() -> Tuple[str, ...]:
    """Every registered method's name, the built-in ones first."""
    return tuple(_REGISTRY)


BUILTIN: Tuple[str, ...] = tuple(register(m).name for m in (Quest(), InfLLMv2()))
