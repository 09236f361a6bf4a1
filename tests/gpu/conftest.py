"""What the GPU tests share: the SM90 gate and the kernel library.

``sm90.require_sm90()`` (called at the top of a GPU test module) skips the module, with the reason,
without a CUDA SM90 device; the autouse ``kernel_library`` fixture builds or loads the SM90
kernel library once per module and fails the module's tests with the loader's message when it
cannot (``SGLANG_PRR_KERNEL_LIB`` names a prebuilt one). A module that loads a library of its
own (``OWN_KERNEL_LIBRARY = True``, e.g. the InfLLM-v2 tests with ``SGLANG_PRR_INFLLM_LIB``) or
needs none (``NEEDS_KERNEL_LIBRARY = False``, the server test, whose servers load it) opts out.
"""

from __future__ import annotations

import pytest

from sm90 import sm90_reason


@pytest.fixture(scope="module", autouse=True)
def kernel_library(request):
    """The SM90 kernel library, built or loaded once per module (see the module docstring)."""
    mod = request.module
    if (getattr(mod, "OWN_KERNEL_LIBRARY", False)
            or not getattr(mod, "NEEDS_KERNEL_LIBRARY", True) or sm90_reason()):
        yield None
        return
    from sglang_prr import kernels
    assert kernels.load(), f"kernel library failed to build/load: {kernels.load_error()}"
    yield kernels
