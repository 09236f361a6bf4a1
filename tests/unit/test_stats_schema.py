"""``GET /prr/stats`` has one schema: ``stats.empty_stats()``; the scheduler's snapshot fills
exactly its counters, the reader always answers with all of them, and the README's table
describes exactly those fields. (The servers' answers are compared in
tests/integration/test_server.py; the README's fields on the default server in
tests/integration/test_newcomer.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from readme import readme_text, table_column

from sglang_prr.serving import stats
from sglang_prr.config import PRRConfig
from sglang_prr.serving.server_args_patch import ENV_CONFIG, export_config

MARKER = "prr-stats-fields"


def missing_and_extra(documented, fields):
    return sorted(set(fields) - set(documented)), sorted(set(documented) - set(fields))


def test_readme_documents_every_field_and_no_other():
    documented = table_column(readme_text(), MARKER)
    assert len(documented) == len(set(documented)), documented
    assert missing_and_extra(documented, stats.STATS_FIELDS) == ([], [])
    assert documented == list(stats.STATS_FIELDS), "the README lists them in another order"


def test_a_field_left_out_of_the_readme_is_caught():
    """Negative control: the README's table with one row removed is told apart."""
    text = readme_text()
    row = next(l for l in text.splitlines() if l.startswith("| `calibrations` |"))
    documented = table_column(text.replace(row + "\n", ""), MARKER)
    assert missing_and_extra(documented, stats.STATS_FIELDS) == (["calibrations"], [])


def test_snapshot_fills_exactly_the_counters():
    cfg = PRRConfig(block_size=16).validate()
    snap = stats.Stats("cpu", cfg, SimpleNamespace(enable_metrics=False)).snapshot()
    assert list(snap) == [f for f in stats.STATS_FIELDS if f not in ("config", "enabled")]


@pytest.mark.parametrize("method", ["quest", "dense"])
def test_reader_answers_every_field_before_any_forward(method, tmp_path, monkeypatch):
    """A server whose scheduler never wrote the file (PRR off, or nothing served yet) answers
    with the whole schema; once the file is written, with the scheduler's values."""
    monkeypatch.setenv(stats.ENV_STATS, str(tmp_path / "stats.json"))
    monkeypatch.setenv(ENV_CONFIG, "")
    export_config(PRRConfig(method=method, block_size=16).validate())
    out = stats.read_stats()
    assert list(out) == list(stats.STATS_FIELDS)
    assert out["enabled"] is (method != "dense") and out["config"]["method"] == method
    assert {k: v for k, v in out.items() if k not in ("config", "enabled")} == {
        k: v for k, v in stats.empty_stats().items() if k not in ("config", "enabled")}
    written = dict(stats.empty_stats(), decode_batches=7, calibrations=30, time=1.5)
    del written["config"], written["enabled"]
    (tmp_path / "stats.json").write_text(json.dumps(written))
    out = stats.read_stats()
    assert list(out) == list(stats.STATS_FIELDS)
    assert (out["decode_batches"], out["calibrations"], out["time"]) == (7, 30, 1.5)
