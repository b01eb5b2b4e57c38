"""RunConfig: defaults agree with pyproject.toml, and every kind of bad input is named."""

from __future__ import annotations

import tomllib

import pytest

from beyond_averaging.server.config import ConfigError, RunConfig, parse_run_config
from tests.conftest import REPO


def pyproject_config() -> dict[str, object]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(data["tool"]["flwr"]["app"]["config"])


def test_pyproject_holds_every_option_with_the_runconfig_default() -> None:
    assert pyproject_config() == RunConfig().to_run_config()


def test_pyproject_defaults_validate() -> None:
    assert parse_run_config(pyproject_config()) == RunConfig()


def test_override_with_an_int_for_a_float_option_is_accepted() -> None:
    assert parse_run_config({"server-lr": 1}).server_lr == 1.0


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("local-epochs", -1, "allowed is >= 1"),
        ("fraction-train", 0.0, "allowed is > 0.0"),
        ("dataset", "cifar10", "'digits', 'fashion-mnist'"),
        ("elastic-tau", 1.5, "allowed is <= 1.0"),
        ("gma-threshold", -0.1, "allowed is >= 0.0"),
        ("fedlaw-learn", "gamma", "'both', 'shrink' or 'clients'"),
        ("device", "tpu", "'auto', 'cpu' or 'cuda'"),
        ("batch-size", 1.5, "valid integer"),
        ("diagnostics", 1, "valid boolean"),
        ("learning-rate", "fast", "valid number"),
    ],
)
def test_bad_value_error_names_key_value_and_what_is_allowed(
    key: str, value: object, allowed: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_run_config({key: value})
    message = str(caught.value)
    assert f"'{key}'" in message
    assert repr(value) in message
    assert allowed in message


@pytest.mark.parametrize(
    ("key", "value", "closest"),
    [
        ("tracker", "tensorbord", "the closest allowed value is 'tensorboard'"),
        ("partition", "dirchlet", "the closest allowed value is 'dirichlet'"),
        ("num-server-rounds", 0, "the closest allowed value is 1"),
        ("dirichlet-alpha", 0.0, "the closest allowed value is a value just > 0.0"),
        ("local-epochs", "3", "the closest allowed value is 3 (without quotes)"),
        ("server-lr", "aut", "the closest allowed value is 'auto'"),
        ("server-lr", -1.0, "the closest allowed value is 0.0"),
    ],
)
def test_a_bad_value_is_one_line_ending_with_the_closest_allowed_value(
    key: str, value: object, closest: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_run_config({key: value})
    (line,) = caught.value.problems  # one line for the key, a union's alternatives included
    assert line.startswith(f"key '{key}' = {value!r} is not allowed: allowed is ")
    assert line.endswith(closest)


def test_unknown_key_is_named_with_the_list_of_known_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'num-round'") as caught:
        parse_run_config({"num-round": 3})
    assert "num-server-rounds" in str(caught.value)


def test_all_problems_are_reported_in_one_message() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_run_config({"local-epochs": 0, "batch-size": 0})
    assert "'local-epochs'" in str(caught.value)
    assert "'batch-size'" in str(caught.value)


def test_min_train_replies_above_num_clients_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"min-train-replies = 11 exceeds num-clients = 10"):
        parse_run_config({"min-train-replies": 11, "num-clients": 10})


def test_fedlaw_without_any_proxy_set_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"proxy-per-class = 0"):
        parse_run_config({"strategy": "fedlaw", "proxy-per-class": 0})


def test_configuration_page_documents_every_option() -> None:
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    undocumented = [key for key in RunConfig().to_run_config() if f"`{key}`" not in page]
    assert undocumented == []
