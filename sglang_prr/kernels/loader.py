"""Build, load and device checks of the SM90 kernel library (sources beside this file).

``load()`` builds (or finds in the cache, or takes from ``SGLANG_PRR_KERNEL_LIB``) the library
once and loads it; ``active(device)`` says whether tensors on ``device`` run the kernels (an SM90
GPU and the library loaded). Everything here is host-side and decided from device properties
only, so the choice between kernel and reference is static within a CUDA graph.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Optional

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
            _prepare_current()
            _lib_state = True
            logger.info("sglang_prr: SM90 kernels loaded from %s", path)
        except Exception as e:  # noqa: BLE001 - any failure keeps the reference path
            _lib_state = False
            _lib_error = f"{type(e).__name__}: {e}"
            logger.warning("sglang_prr: SM90 kernels unavailable, using the torch reference "
                           "(%s)", _lib_error.splitlines()[0][:500])
    return _lib_state


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
