"""Delta policy: fixed budgets pass through; 'auto' picks the largest delta that fits the window."""

import json

import pytest

from sglang_prr.budget import FALLBACK_DELTA, BudgetPolicy, BudgetProfile
from sglang_prr.config import PRRConfig


def _profile(tmp_path, sel, spec):
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"selection_us": sel, "spec_attn_us": spec}))
    return str(p)


def test_fixed_budget_and_fallback():
    assert BudgetPolicy(PRRConfig(budget=2.0).validate()).delta(10**6) == 2.0
    auto = BudgetPolicy(PRRConfig(budget="auto", max_budget=4).validate())
    assert auto.delta(1000) == FALLBACK_DELTA


def test_auto_grows_with_the_selection_window(tmp_path):
    path = _profile(tmp_path, {"4096": 5.0, "131072": 12.0},
                    {"1.0": 4.0, "1.5": 6.0, "2.0": 8.0, "3.0": 11.0, "4.0": 14.0})
    pol = BudgetPolicy(PRRConfig(budget="auto", max_budget=4, profile=path, top_k=640,
                                 block_size=64).validate())
    assert pol.delta(4096) == 1.0          # window 5 us: only delta 1 fits
    assert pol.delta(131072) == 3.0        # window 12 us: delta 3 fits, 4 does not
    mid = pol.delta(23170)                 # ~halfway in log-context: window ~8.5 us
    assert mid == 2.0
    assert pol.predicted_blocks(131072) == 30 and pol.predicted_blocks(4096) == 10
    capped = BudgetPolicy(PRRConfig(budget="auto", max_budget=2, profile=path).validate())
    assert capped.delta(131072) == 2.0     # never above max_budget (the static width)


def test_bad_profile_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="selection_us"):
        BudgetProfile.load(_profile(tmp_path, {}, {"1.0": 1.0}))
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"selection_us": {"10": 1}, "spec_attn_us": {"0.5": 1}}))
    with pytest.raises(ValueError, match="deltas >= 1"):
        BudgetProfile.load(str(p))
