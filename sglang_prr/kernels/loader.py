"""Build, load and device checks of the SM90 kernel library (sources beside this file).

``load()`` builds (or finds in the cache, or takes from ``SGLANG_PRR_KERNEL_LIB``) the library
once and loads it; ``active(device)`` says whether tensors on ``device`` run the kernels (an SM90
GPU and the library loaded). Everything here is host-side and decided from device properties
only, so the choice between kernel and reference is static within a CUDA graph.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Dict, List, Optional

import torch

logger = logging.getLogger("sglang_prr")

# The dtypes the kernels are instantiated for (inputs in other dtypes run the reference).
FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)

_lock = threading.Lock()
_lib_state: Optional[bool] = None  # None: not tried; True: loaded; False: failed
_lib_error: Optional[str] = None
_device_ok: Dict[int, bool] = {}


def load() -> bool:
    """Build (or fetch from cache) and load the kernel library once; True when it is usable.

    Host-side and idempotent (``# host-ok``: runs once, outside decode)."""
    global _lib_state, _lib_error
    if _lib_state is not None:
        return _lib_state
    with _lock:
        if _lib_state is not None:
            return _lib_state
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            from . import build
            path = build.library_path()
            torch.ops.load_library(str(path))
            check_schemas(path)
            _prepare_current()
            _lib_state = True
            logger.info("sglang_prr: SM90 kernels loaded from %s", path)
        except Exception as e:  # noqa: BLE001 - any failure keeps the reference path
            _lib_state = False
            _lib_error = f"{type(e).__name__}: {e}"
            logger.warning("sglang_prr: SM90 kernels unavailable, using the torch reference "
                           "(%s)", _lib_error.splitlines()[0][:500])
    return _lib_state


NAMESPACE = "sglang_prr_cuda"
BINDINGS = ("binding.cpp", "infllm_binding.cpp")  # the sources that declare the ops
_DEF = re.compile(r'm\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)')


def declared_schemas(folder: Optional[Path] = None) -> Dict[str, str]:
    """The op schemas these sources declare (the ``m.def`` strings of BINDINGS, adjacent
    literals joined), by op name, as torch's schema parser prints them."""
    folder = Path(__file__).resolve().parent if folder is None else Path(folder)
    out: Dict[str, str] = {}
    for name in BINDINGS:
        for m in _DEF.finditer((folder / name).read_text()):
            text = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))
            schema = torch._C.parse_schema(f"{NAMESPACE}::{text}")
            out[schema.name.split("::", 1)[1]] = str(schema)
    return out


def registered_schemas(names) -> Dict[str, Optional[str]]:
    """The schemas the loaded library registers for ``names`` (None for an op it lacks)."""
    ns = getattr(torch.ops, NAMESPACE)
    out: Dict[str, Optional[str]] = {}
    for n in names:
        try:
            out[n] = str(getattr(ns, n).default._schema)
        except (AttributeError, RuntimeError):
            out[n] = None
    return out


def schema_mismatches(declared: Dict[str, str], registered: Dict[str, Optional[str]]
                      ) -> List[str]:
    """One line per op whose registered schema is missing or differs from the declared one."""
    bad = []
    for n, want in sorted(declared.items()):
        have = registered.get(n)
        if have is None:
            bad.append(f"{n}: not in the library (these sources declare {want})")
        elif have != want:
            bad.append(f"{n}: the library has {have}, these sources declare {want}")
    return bad


def check_schemas(path) -> None:
    """Raise when the library at ``path`` (loaded) was built from other op declarations than
    these sources: calls through the Python side would fail later, op by op, with an argument
    count error (e.g. a ``SGLANG_PRR_KERNEL_LIB`` built from another checkout)."""
    declared = declared_schemas()
    bad = schema_mismatches(declared, registered_schemas(declared))
    if bad:
        raise RuntimeError(
            f"the kernel library {path} does not match these sources' op declarations "
            f"({len(bad)} of {len(declared)} ops differ; first: {bad[0]}); rebuild it with "
            f"`python -m sglang_prr.kernels.build` or point SGLANG_PRR_KERNEL_LIB at a build of "
            f"these sources")


def _prepare_current() -> None:
    """Allocate the fused kernels' counters on the current device (host-ok: once, at load)."""
    if torch.cuda.is_available() and is_sm90(torch.device("cuda")):
        prepare(torch.device("cuda", torch.cuda.current_device()))


def prepare(device: torch.device) -> None:
    """Allocate the fused kernels' zeroed counters on ``device`` (idempotent). Must happen outside
    CUDA-graph capture; ``load()`` does it for the current device, and any eager call of a fused
    op (e.g. SGLang's warm-up before capture) does it for its device."""
    torch.ops.sglang_prr_cuda.prepare(torch.empty(0, device=device))


def launches_with_pdl() -> bool:
    """Whether the loaded library launches its kernels with programmatic dependent launch
    (``SGLANG_PRR_PDL=1`` in the environment when the first kernel launches or this is asked;
    read once per process). False when the library is not loaded."""
    return bool(load() and torch.ops.sglang_prr_cuda.launches_with_pdl())


def attn_spread_launches() -> int:
    """How many attention launches of this process spread their fused merge over the groups'
    CTAs (one-wave grids; counted on the host at launch or graph capture): what a test reads to
    know that form ran. 0 when the library is not loaded."""
    return int(torch.ops.sglang_prr_cuda.attn_spread_launches()) if load() else 0


def scores_stream_launches() -> int:
    """How many Quest scores launches of this process took the streamed kernel (the split
    selection's first launch; counted on the host at launch or graph capture): what a test reads
    to know which scores kernel ran. 0 when the library is not loaded."""
    return int(torch.ops.sglang_prr_cuda.scores_stream_launches()) if load() else 0


def load_error() -> Optional[str]:
    """Why ``load()`` failed (None when it succeeded or was not tried)."""
    return _lib_error


def is_sm90(device: torch.device) -> bool:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _device_ok.get(idx)
    if ok is None:
        ok = torch.cuda.get_device_capability(idx) == (9, 0)  # host-ok: device property
        _device_ok[idx] = ok
    return ok


def active(device: torch.device) -> bool:
    """Are the kernels used for tensors on ``device``? (SM90 and the library loaded.)"""
    return device.type == "cuda" and is_sm90(device) and load()


def aligned(*ts: torch.Tensor) -> bool:
    """16-byte aligned data pointers: what the kernels' vector loads need."""
    return all(t.data_ptr() % 16 == 0 for t in ts)
