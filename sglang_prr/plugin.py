"""``from sglang_prr.plugin import enable`` and the ``sglang.srt.plugins`` entry point
(``sglang_prr.plugin:apply``), kept at this path; the plugin is ``sglang_prr.serving.plugin``."""

from .serving.plugin import apply, enable

__all__ = ["apply", "enable"]
