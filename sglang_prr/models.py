"""``python -m sglang_prr.models`` (fetch and convert the default model), kept at this path; the
code is ``sglang_prr.tools.models``."""

from .tools.models import main

if __name__ == "__main__":
    main()
