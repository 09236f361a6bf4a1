"""sglang-prr: Predict, Reuse, Repair for dynamic sparse attention decoding in SGLang.

The algorithm core (``config``, ``reference``, ``ops``) imports torch only; the SGLang shell
(``plugin``, ``backend``, ``launch_server``) is imported on demand.
"""

from .config import PRRConfig, PRRConfigError

__version__ = "0.1.0"
__all__ = ["PRRConfig", "PRRConfigError", "__version__"]
