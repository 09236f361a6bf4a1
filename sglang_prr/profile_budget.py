"""``python -m sglang_prr.profile_budget``, kept at this path; the profiler is
``sglang_prr.tools.profile_budget``."""

import sys

from .tools.profile_budget import main

if __name__ == "__main__":
    sys.exit(main())
