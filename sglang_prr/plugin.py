"""``from sglang_prr.plugin import enable, read_stats`` and the ``sglang.srt.plugins`` entry
point (``sglang_prr.plugin:apply``), kept at this path; the plugin is ``sglang_prr.serving.plugin``
(``read_stats``: what ``GET /prr/stats`` answers, for the engines this process started)."""

from .serving.plugin import apply, enable, read_stats

__all__ = ["apply", "enable", "read_stats"]
