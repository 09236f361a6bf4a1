"""SGLang plugin entry point (group ``sglang.srt.plugins``).

``apply()`` is idempotent and safe in every process.
"""

_applied = False


def apply() -> None:
    global _applied
    _applied = True
