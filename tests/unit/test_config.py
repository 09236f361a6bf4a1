"""PRRConfig: defaults are valid, derived values are right, bad values name value and range."""

import pytest

from sglang_prr.config import PRRConfig, PRRConfigError


def test_defaults_validate_and_derive():
    c = PRRConfig().validate()
    assert c.enabled and c.top_k_blocks == 2048 // 64
    assert c.predicted_blocks == int(1.5 * 32)
    assert len(c.theta_grid) == 80 and c.theta_grid[0] == (0.2, 0.1, 0.0)
    assert PRRConfig(top_k=100, block_size=16).validate().top_k_blocks == 7  # rounded up
    assert PRRConfig(top_k=5, top_k_unit="blocks").validate().top_k_blocks == 5
    auto = PRRConfig(budget="AUTO", max_budget=3).validate()
    assert auto.budget == "auto" and auto.delta == 3.0
    parsed = PRRConfig(dense_layers="0, 1,5", calib_gammas="0,0.5").validate()
    assert parsed.dense_layers == (0, 1, 5) and parsed.calib_gammas == (0.0, 0.5)
    assert PRRConfig(method="dense").validate().enabled is False
    assert PRRConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("field,value,needle", [
    ("method", "quset", "quest | infllm_v2 | dense"),
    ("block_size", 48, "16 | 32 | 64 | 128"),
    ("block_size", "abc", "an integer"),
    ("top_k", 0, ">= 1"),
    ("top_k", 8, ">= block_size (64)"),
    ("top_k", 2.5, "an integer"),
    ("budget", 0.5, ">= 1"),
    ("budget", "fast", "'auto'"),
    ("budget", float("inf"), ">= 1"),
    ("budget", 9, "max_budget"),
    ("mode", "approx", "exact | union"),
    ("top_k_unit", "pages", "tokens | blocks"),
    ("sink_blocks", -1, "[0, 64]"),
    ("local_blocks", 100, "[0, 64]"),
    ("dense_layers", "0,-2", "layer ids >= 0"),
    ("min_context", -5, ">= 0"),
    ("calib_alphas", "0,0.5", "(0.0, 1.0]"),
    ("calib_betas", "1.5", "(0.0, 1.0]"),
    ("calib_gammas", "-0.1", "[0.0, 1.0]"),
    ("calib_gammas", "", "non-empty"),
    ("calib_queries", 1, ">= 2"),
    ("default_theta", "0.5,0.5", "three numbers"),
    ("max_budget", 0.5, "[1, 64]"),
    ("max_context_blocks", 0, ">= 1"),
])
def test_bad_values_name_the_value_and_the_range(field, value, needle):
    with pytest.raises(PRRConfigError) as e:
        PRRConfig(**{field: value}).validate()
    msg = str(e.value)
    assert field.split(" ")[0] in msg or "layer" in msg
    # Scalars are shown as given; lists show the offending element (or the parsed list).
    if isinstance(value, str) and ("," in value or value == "" or field.startswith("calib")):
        assert f"{field}=" in msg
    else:
        assert repr(value) in msg, msg
    assert needle in msg, msg


@pytest.mark.parametrize("field,value,hint", [
    ("method", "serial", "use --prr-serial"),
    ("method", "union", "use --prr-mode union"),
    ("method", "prr", "leave --prr-method out"),
    ("method", "Quets", "did you mean quest?"),
    ("mode", "dense", "use --prr-method dense"),
    ("top_k_unit", "block", "did you mean blocks?"),
    ("budget", "off", "use --prr-serial"),
    ("budget", 0, "use --prr-serial"),
])
def test_common_mistakes_get_a_hint(field, value, hint):
    with pytest.raises(PRRConfigError) as e:
        PRRConfig(**{field: value}).validate()
    assert hint in str(e.value), str(e.value)


def test_no_hint_where_nothing_fits():
    """Negative control: a value like no choice gets the allowed range alone."""
    with pytest.raises(PRRConfigError) as e:
        PRRConfig(method="xyzzy").validate()
    assert str(e.value) == ("invalid PRR option method='xyzzy': allowed one of quest | "
                            "infllm_v2 | dense")


@pytest.mark.parametrize("name,hint", [("topk", "did you mean top_k?"),
                                       ("block", "did you mean block_size?"),
                                       ("xyzzy", "(the options: method, block_size, ")])
def test_an_unknown_option_is_named(name, hint):
    """``enable()``'s options (``from_options``) and a config's JSON (``from_dict``): a name that
    is no option is refused with the closest one (it was Python's TypeError, or dropped without
    a word from ``SGLANG_PRR_CONFIG``). Control: the same value under its right name passes."""
    for build in (lambda d: PRRConfig.from_options(**d), PRRConfig.from_dict):
        with pytest.raises(PRRConfigError) as e:
            build({name: 16, "method": "quest"})
        assert f"unknown PRR option {name!r}" in str(e.value) and hint in str(e.value), e.value
        assert build({"top_k": 16, "block_size": 16}).top_k_blocks == 1
    # to_dict's derived values go back through from_dict (recomputed, not refused)...
    d = PRRConfig(top_k=64, block_size=16).validate().to_dict()
    assert PRRConfig.from_dict({**d, "top_k_blocks": 999}).top_k_blocks == 4
    # ...but are no option of enable()
    with pytest.raises(PRRConfigError, match="unknown PRR option 'top_k_blocks'"):
        PRRConfig.from_options(top_k_blocks=4)


def test_a_misspelt_option_in_the_environment_is_an_error(monkeypatch):
    from sglang_prr.serving.server_args_patch import load_config

    monkeypatch.setenv("SGLANG_PRR_CONFIG", '{"topk": 4, "block_size": 16}')
    with pytest.raises(PRRConfigError, match="SGLANG_PRR_CONFIG.*'topk'; did you mean top_k"):
        load_config()
    monkeypatch.setenv("SGLANG_PRR_CONFIG", '{"top_k": 64, "block_size": 16}')
    assert load_config().top_k_blocks == 4
