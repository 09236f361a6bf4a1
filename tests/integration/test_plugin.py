"""The plugin: entry point declared, ``apply()`` idempotent, patches visible after one call."""

from __future__ import annotations

import importlib.metadata as md

import pytest

pytest.importorskip("sglang")


def test_entry_point_declared():
    eps = [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "prr"]
    if not eps:
        pytest.skip("sglang-prr is not pip-installed here (entry points need an install)")
    assert eps[0].value == "sglang_prr.plugin:apply"


def test_apply_is_idempotent(monkeypatch):
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.layers.attention import attention_registry as reg
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator as A

    from sglang_prr.config import PRRConfig
    from sglang_prr.serving import plugin
    from sglang_prr.serving.server_args_patch import export_config

    monkeypatch.setenv("SGLANG_PRR_CONFIG", "")
    export_config(PRRConfig(block_size=16).validate())
    monkeypatch.setattr(plugin, "_applied", False)
    plugin.apply()
    first = dict(reg.ATTENTION_BACKENDS)
    alloc = A.alloc_extend
    assert getattr(first["torch_native"], "_prr_wrapped", False)
    assert Engine.run_scheduler_process_func is plugin.run_scheduler_process
    monkeypatch.setattr(plugin, "_applied", False)  # even a forced second run patches nothing
    plugin.apply()
    plugin.apply()
    assert dict(reg.ATTENTION_BACKENDS) == first  # not wrapped twice
    assert A.alloc_extend is alloc


def test_enable_takes_a_config_or_options_not_both(monkeypatch):
    """Options beside a PRRConfig were ignored without a word; now refused before anything is
    exported or patched. Control: either alone is taken."""
    from sglang_prr.config import PRRConfig, PRRConfigError
    from sglang_prr.serving import plugin

    monkeypatch.setenv("SGLANG_PRR_CONFIG", "")
    monkeypatch.setattr(plugin, "apply", lambda: None)  # patching SGLang is not under test
    monkeypatch.setattr(plugin, "_applied", plugin._applied)  # enable() resets it: restored
    with pytest.raises(PRRConfigError, match="not both: top_k given beside"):
        plugin.enable(PRRConfig(block_size=16), top_k=4)
    assert plugin.load_config() is None  # nothing exported
    with pytest.raises(PRRConfigError, match="did you mean top_k"):
        plugin.enable(topk=64)
    assert plugin.enable(PRRConfig(block_size=16)).block_size == 16
    assert plugin.enable(top_k=4, top_k_unit="blocks", block_size=16).top_k_blocks == 4
    assert plugin.load_config().top_k_blocks == 4
