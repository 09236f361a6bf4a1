"""sglang-prr: Predict, Reuse, Repair for dynamic sparse attention decoding in SGLang.

Layers, as folders: the core here (``config``, ``ops``, ``step``, ..., ``methods/``,
``reference/``, ``kernels/``) imports torch only; ``tools/`` (models, budget profiler, traces)
builds on it; ``serving/`` (launcher, plugin, backend, harness) is the only part that imports
SGLang, and only when imported. ``launch_server``, ``plugin``, ``profile_budget`` and ``models``
are the public paths of serving and tool modules, kept here. docs/ARCHITECTURE.md has the map.
"""

from .config import PRRConfig, PRRConfigError

__version__ = "0.1.0"
__all__ = ["PRRConfig", "PRRConfigError", "__version__"]
