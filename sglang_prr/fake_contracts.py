"""How ``custom_ops`` defines an op so that its fake (meta / FakeTensor) implementation refuses
what the real ones refuse.

The reference and the SM90 kernels each run the op's contract (``contracts.check_<op>``) first.
A fake gives output shapes without running either, so without the same check a bad argument on
the meta device or under ``torch.compile`` passes silently, or fails deep inside the shape
arithmetic ("not enough values to unpack", "negative dimension") instead of with the contract's
``ValueError`` naming the argument. ``define`` makes the op and, for an op that only mutates its
inputs (returns None), a fake that runs the check; ``fake`` puts the check before an op's shape
function. The checks read shapes, dtypes and numbers, never a tensor value, so they are as valid
on fake tensors.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Dict

import torch
from torch.fx.experimental import symbolic_shapes

from . import contracts, contracts_infllm

# The value a SymInt was traced with (``hint_int`` before torch 2.11, deprecated there).
_hint = getattr(symbolic_shapes, "size_hint", None) or symbolic_shapes.hint_int

# A check's parameter -> the op's argument of the same meaning, where their names differ.
CHECK_ARG = {"sink": "sink_blocks", "local": "local_blocks", "page_size_": "page_size"}

# op -> its contract run on the op's arguments (``(args, kwargs)`` as the dispatcher passes them).
_CONTRACT: Dict[object, Callable] = {}


def find_check(name: str) -> Callable:
    """``check_<name>``, looked up at call time: the contracts may move between modules."""
    for module in (contracts, contracts_infllm):
        check = getattr(module, f"check_{name}", None)
        if check is not None:
            return check
    raise LookupError(f"no contract check_{name} in sglang_prr.contracts / contracts_infllm")


def check_args(check: Callable, given: dict) -> dict:
    """The keyword arguments of ``check`` taken by name from the op's ``given`` arguments; a
    parameter the op lacks (e.g. ``op``) keeps its default, an op argument the check does not
    read (``one_per_page``, ``out_dtype``) is left out. A parameter the check adds later under
    the op's own name (``sm_scale``) is passed without any change here."""
    params = inspect.signature(check).parameters
    return {p: given[CHECK_ARG.get(p, p)] for p in params if CHECK_ARG.get(p, p) in given}


def run_contract(name: str, sig: inspect.Signature, args: tuple, kwargs: dict) -> None:
    """Run op ``name``'s contract on the arguments of one call of it (defaults filled in: the
    dispatcher passes only those the caller gave).

    Under ``torch.compile`` an int argument may arrive as a ``SymInt`` (dynamic, after a
    recompile), which the contracts' ``isinstance(v, int)`` refuses; it is checked at the value
    it was traced with (its hint, no guard added), and the real op checks every value at run
    time. An int without a hint (data-dependent) leaves the whole check to the real op."""
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    given = dict(bound.arguments)
    for arg, v in given.items():
        if isinstance(v, torch.SymInt):
            if not symbolic_shapes.has_hint(v):
                return
            given[arg] = _hint(v)
    check = find_check(name)
    check(**check_args(check, given))


def define(namespace: str, name: str, mutates_args=()) -> Callable:
    """``torch.library.custom_op`` that also records the op's contract for its fake; an op that
    returns None (it only mutates) gets a fake that runs the contract and returns None."""
    def make(fn):
        op = torch.library.custom_op(f"{namespace}::{name}", mutates_args=mutates_args)(fn)
        _CONTRACT[op] = functools.partial(run_contract, name, inspect.signature(fn))
        if fn.__annotations__.get("return") in (None, "None"):
            op.register_fake(lambda *args, **kwargs: _CONTRACT[op](args, kwargs))
        return op
    return make


def fake(op) -> Callable:
    """Decorator: register ``shapes`` (the output shapes of ``op``, made by ``define``) as the
    op's fake, behind its contract."""
    def register(shapes):
        def checked(*args, **kwargs):
            _CONTRACT[op](args, kwargs)
            return shapes(*args, **kwargs)
        op.register_fake(checked)
        return shapes
    return register
