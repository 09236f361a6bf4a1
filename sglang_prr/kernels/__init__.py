"""SM90 CUDA kernels for the PRR ops (sources beside this file, JIT-built on first use).

``loader``: build, load and device checks (``load()``, ``active(device)``); ``dispatch``: the
per-op guards that pick the kernel or the torch reference, and ``register()``, which
``sglang_prr.custom_ops`` calls at import; ``infllm``: the guards of the InfLLM-v2 ops;
``build``: the JIT build spec. Call ``load()`` at server start to keep the build out of the
first decode step / graph capture. This module only re-exports the names callers use.
"""

from .dispatch import (ATTN_HEAD_DIMS, ATTN_MAX_GROUP, CALIB_MAX_BLOCKS, IMPLS,  # noqa: F401
                       MAX_GROUPS, TOPK_MAX_BLOCKS, register)
from .loader import (FLOAT_TYPES, active, aligned, attn_spread_launches,  # noqa: F401
                     is_sm90, launches_with_pdl, load, load_error, prepare,
                     scores_stream_launches)
