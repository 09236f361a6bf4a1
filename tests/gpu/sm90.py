"""The SM90 gate of the GPU tests (see ``conftest.py``): ``require_sm90()`` at the top of a
module skips it, with the reason, without a CUDA SM90 device."""

from __future__ import annotations

import pytest
import torch


def sm90_reason() -> str:
    """Why the SM90 kernels cannot run here ('' when they can)."""
    if not torch.cuda.is_available():
        return "needs a CUDA device (SM90 kernels)"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"needs an SM90 GPU, found sm_{''.join(map(str, cap))}"
    return ""


def require_sm90() -> None:
    """Skip the calling test module without an SM90 device (call at module level)."""
    why = sm90_reason()
    if why:
        pytest.skip(why, allow_module_level=True)
