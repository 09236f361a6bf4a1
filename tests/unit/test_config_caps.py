"""PRRConfig caps: K and |P| never exceed the context's blocks; 'auto' needs a profile."""

import json
import logging

import pytest

from sglang_prr.budget import check_profile
from sglang_prr.config import PRRConfig, PRRConfigError


def test_huge_top_k_is_capped_at_the_context_blocks():
    c = PRRConfig(top_k=1_000_000, top_k_unit="tokens", block_size=16).validate()
    assert c.top_k_blocks == 62_500 and c.predicted_blocks == 93_750  # no context known: as given
    c.cap_to_context(1024)
    assert c.max_context_blocks == 64
    assert c.top_k_blocks == 64 and c.predicted_blocks == 64
    assert c.requested_top_k_blocks == 62_500
    c2 = PRRConfig(top_k=1_000_000, block_size=16).validate().cap_to_context(1000)
    assert c2.max_context_blocks == 63  # ceil(1000 / 16)


def test_cap_only_bounds_and_keeps_the_smaller_cap():
    c = PRRConfig(top_k=32, top_k_unit="blocks", block_size=16).validate().cap_to_context(1024)
    assert (c.top_k_blocks, c.predicted_blocks) == (32, 48)  # fits: unchanged
    c = PRRConfig(top_k=50, top_k_unit="blocks", block_size=16).validate().cap_to_context(1024)
    assert (c.top_k_blocks, c.predicted_blocks) == (50, 64)  # only |P| (75) hits the cap
    c = PRRConfig(top_k=40, top_k_unit="blocks", block_size=16, max_context_blocks=20).validate()
    c.cap_to_context(1024)
    assert c.max_context_blocks == 20 and c.predicted_blocks == 20  # a smaller given cap wins
    c = PRRConfig(top_k=40, top_k_unit="blocks", block_size=16).validate().cap_to_context(None)
    assert c.max_context_blocks is None and c.predicted_blocks == 60  # unknown: no cap


def test_cap_travels_through_the_environment_json():
    c = PRRConfig(top_k=1_000_000, block_size=16).validate().cap_to_context(1024)
    back = PRRConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c and back.top_k_blocks == 64 and back.predicted_blocks == 64
    assert c.to_dict()["top_k_blocks"] == 64


def test_state_bytes_follow_the_cap():
    from sglang_prr.state import state_bytes

    huge = PRRConfig(top_k=1_000_000, block_size=16).validate()
    capped = PRRConfig(top_k=1_000_000, block_size=16).validate().cap_to_context(1024)
    full = PRRConfig(top_k=64, top_k_unit="blocks", block_size=16, budget=1.0).validate()
    args = (2, 2, 33, 1024)
    assert state_bytes(capped, *args) == state_bytes(full, *args) < state_bytes(huge, *args)


@pytest.mark.parametrize("method,rows,ctx", [("quest", 5, 1000), ("infllm_v2", 3, 517)])
def test_state_bytes_are_what_the_state_allocates(method, rows, ctx):
    """The memory the server reserves for the predictor state (``state_bytes``) is what
    ``PRRState`` allocates per request slot, to the byte (the per-layer shared theta* aside: a
    few bytes a layer, not a slot). Control: one row more is told apart."""
    import torch

    from sglang_prr.state import PRRState, state_bytes

    class Pool:  # SGLang's ReqToTokenPool as the state reads it (weakly referenced)
        req_to_token = torch.zeros(rows, ctx, dtype=torch.int32)

    cfg = PRRConfig(method=method, top_k=3, top_k_unit="blocks", block_size=16).validate()
    L, hk = 3, 2
    pool = Pool()
    st = PRRState(cfg, L, hk, pool, "cpu")
    shared = st.shared_theta.numel() * st.shared_theta.element_size()
    assert st.nbytes - shared == state_bytes(cfg, L, hk, rows, ctx)
    assert st.nbytes - shared != state_bytes(cfg, L, hk, rows + 1, ctx)


def test_cap_is_logged_once_and_only_when_it_lowers(caplog):
    with caplog.at_level(logging.INFO, logger="sglang_prr"):
        PRRConfig(top_k=8, top_k_unit="blocks", block_size=16).validate().cap_to_context(4096)
        assert not [r for r in caplog.records if "capped" in r.getMessage()]
        c = PRRConfig(top_k=1_000_000, block_size=16).validate().cap_to_context(1024)
        c.top_k_blocks, c.predicted_blocks  # reading the values logs nothing
    msgs = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert len(msgs) == 1 and "62500 to 64" in msgs[0], msgs


@pytest.mark.parametrize("value", [0, -3, "x"])
def test_bad_max_context_blocks(value):
    with pytest.raises(PRRConfigError, match="max_context_blocks"):
        PRRConfig(max_context_blocks=value).validate()


def test_bad_context_len():
    with pytest.raises(PRRConfigError, match="context_len"):
        PRRConfig().validate().cap_to_context(0)


def test_budget_auto_needs_a_profile(tmp_path):
    with pytest.raises(PRRConfigError) as e:
        check_profile(PRRConfig(budget="auto").validate())
    msg = str(e.value)
    assert "--prr-budget auto" in msg and "--prr-profile" in msg and "profile_budget" in msg
    with pytest.raises(PRRConfigError, match="nope.json"):
        check_profile(PRRConfig(budget="auto", profile=str(tmp_path / "nope.json")).validate())
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(PRRConfigError, match="version"):
        check_profile(PRRConfig(budget="auto", profile=str(bad)).validate())
    good = tmp_path / "good.json"
    shape = dict(method="quest", num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=64,
                 top_k_tokens=2048)
    good.write_text(json.dumps({"version": 2, "shape": shape, "layer_us": [
        {"batch": 1, "context": 32768, "delta": 0, "us": 40.0},
        {"batch": 1, "context": 32768, "delta": 1.5, "us": 38.0}]}))
    check_profile(PRRConfig(budget="auto", profile=str(good)).validate())
    # Fixed budgets and PRR off need no profile.
    check_profile(PRRConfig(budget=2.0).validate())
    check_profile(PRRConfig(budget="auto", method="dense").validate())
    # validate() alone accepts 'auto' without a profile (a config may come before its profile);
    # the server (launcher and backend) refuses it.
    assert PRRConfig(budget="auto").validate().budget == "auto"
