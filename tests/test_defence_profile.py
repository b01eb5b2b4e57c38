"""``defence-profile``: one name for the measured defence combination of a kind of federation
(server/config.py's DEFENCE_PROFILES, strategies/defences/profiles.py's defence_profile)."""

from __future__ import annotations

import pytest
import torch

from beyond_averaging.server.app import data_spec
from beyond_averaging.server.config import DEFENCE_PROFILES, ConfigError, parse_run_config
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.strategies import TriggerUnlearning, defence_profile
from beyond_averaging.tasks.federation import load_server_splits
from beyond_averaging.tasks.models import build_model


def test_label_skew_sets_the_documented_combination() -> None:
    config = parse_run_config({"defence-profile": "label-skew"})
    assert config.backdoor_defence == "trigger-unlearning"
    assert config.max_claim_factor == 1.0
    assert config.unlearning_epochs == 6
    assert config.unlearning_additive == 1.0
    assert config.unlearning_dormant_inputs is True
    assert config.unlearning_memory == 1
    assert config.unlearning_patched_share == 0.4
    assert config.robust_aggregation == "none"


def test_iid_sets_root_set_trust_and_trigger_unlearning() -> None:
    config = parse_run_config({"defence-profile": "iid"})
    assert config.robust_aggregation == "fltrust"
    assert config.backdoor_defence == "trigger-unlearning"
    assert config.max_claim_factor == 10.0  # the default: not part of the profile
    assert parse_run_config({"defence-profile": "none"}) == parse_run_config({})


def test_a_key_set_away_from_its_default_keeps_the_users_value() -> None:
    # Flower's run config holds every key at pyproject.toml's default: a key at its default is
    # one the user did not set, and the profile sets it.
    config = parse_run_config(
        {"defence-profile": "label-skew", "unlearning-epochs": 9, "max-claim-factor": 10.0}
    )
    assert config.unlearning_epochs == 9
    assert config.max_claim_factor == 1.0


def test_a_wrong_profile_is_refused_naming_the_closest_value() -> None:
    with pytest.raises(
        ConfigError, match=r"defence-profile.*closest allowed value is 'label-skew'"
    ):
        parse_run_config({"defence-profile": "label_skew"})


@pytest.mark.parametrize("name", list(DEFENCE_PROFILES))
def test_the_run_option_and_the_library_helper_build_the_same_strategy_options(name: str) -> None:
    config = parse_run_config({"defence-profile": name})
    test_set, proxy_set = load_server_splits(data_spec(config))
    model = build_model("mlp", test_set.input_shape, test_set.num_classes, seed=0)
    strategy = build_strategy(
        config, ServerResources(model, proxy_set, torch.device("cpu"), test_set)
    )
    options = defence_profile(name)
    assert strategy.trigger_unlearning == options.get("trigger_unlearning")  # type: ignore[attr-defined]
    assert strategy.robust_aggregation == options.get("robust_aggregation", "none")
    assert strategy.max_claim_factor == options.get("max_claim_factor", 10.0)


def test_the_library_helper_refuses_an_unknown_name_naming_the_closest() -> None:
    with pytest.raises(ValueError, match="the closest is 'label-skew'"):
        defence_profile("labelskew")
    assert defence_profile("label-skew")["trigger_unlearning"] == TriggerUnlearning(
        epochs=6, additive_weight=1.0, dormant_inputs=True, memory_rounds=1, patched_share=0.4
    )


def test_dormant_inputs_with_a_convolutional_model_is_refused_and_the_profile_leaves_it_off() -> (
    None
):
    with pytest.raises(ConfigError, match="unlearning-dormant-inputs = false"):
        parse_run_config({"unlearning-dormant-inputs": True, "model": "cnn"})
    config = parse_run_config({"defence-profile": "label-skew", "model": "cnn"})
    assert config.unlearning_dormant_inputs is False
    assert config.unlearning_input_bound == 0.0
    assert config.unlearning_additive == 1.0


def test_label_skew_fixes_fedlaws_shrink_factor_for_fedlaw_only() -> None:
    # FedLAW's learned gamma stayed above 1 in every round of the profile's runs and scaled up
    # what the unlearning left of a backdoor: the profile keeps it at 1 (learn = "clients").
    config = parse_run_config({"defence-profile": "label-skew", "strategy": "fedlaw"})
    assert config.fedlaw_learn == "clients"
    assert parse_run_config({"defence-profile": "iid", "strategy": "fedlaw"}).fedlaw_learn == "both"
    assert parse_run_config({"defence-profile": "label-skew"}).fedlaw_learn == "both"  # fedavg
    kept = parse_run_config(
        {"defence-profile": "label-skew", "strategy": "fedlaw", "fedlaw-learn": "shrink"}
    )
    assert kept.fedlaw_learn == "shrink"
    assert defence_profile("label-skew", fedlaw=True)["learn"] == "clients"
    assert "learn" not in defence_profile("label-skew")
    test_set, proxy_set = load_server_splits(data_spec(config))
    model = build_model("mlp", test_set.input_shape, test_set.num_classes, seed=0)
    strategy = build_strategy(
        config, ServerResources(model, proxy_set, torch.device("cpu"), test_set)
    )
    assert strategy.learn == "clients"  # type: ignore[attr-defined]


def test_label_skew_keeps_elastics_zeta_at_most_1_for_elastic_only() -> None:
    # zeta up to 1 + tau scaled up the update of the weights Elastic's clients are least
    # sensitive to, where the backdoors of the tables lived: the profile sets tau = 0.
    config = parse_run_config({"defence-profile": "label-skew", "strategy": "elastic"})
    assert config.elastic_tau == 0.0
    assert parse_run_config({"defence-profile": "label-skew"}).elastic_tau == 0.5  # fedavg
    assert parse_run_config({"defence-profile": "iid", "strategy": "elastic"}).elastic_tau == 0.5
    kept = parse_run_config(
        {"defence-profile": "label-skew", "strategy": "elastic", "elastic-tau": 0.2}
    )
    assert kept.elastic_tau == 0.2
    assert defence_profile("label-skew", elastic=True)["tau"] == 0.0
    assert "tau" not in defence_profile("label-skew")
    test_set, proxy_set = load_server_splits(data_spec(config))
    model = build_model("mlp", test_set.input_shape, test_set.num_classes, seed=0)
    strategy = build_strategy(
        config, ServerResources(model, proxy_set, torch.device("cpu"), test_set)
    )
    assert strategy.tau == 0.0  # type: ignore[attr-defined]
    assert strategy.trigger_unlearning.memory_rounds == 1  # type: ignore[attr-defined]


def test_a_profile_and_its_options_written_out_are_one_run_to_resume_and_to_the_sweep() -> None:
    # The name is a shorthand: what fixes a run's result are the options it sets, so a table
    # whose methods write out an earlier profile's options still matches the runs made with it.
    from beyond_averaging.server.runs.checkpoint import config_differences

    profile = parse_run_config({"defence-profile": "label-skew"}).to_run_config()
    options = DEFENCE_PROFILES["label-skew"].items()
    written = {k: v for k, v in options if not k.startswith(("fedlaw-", "elastic-"))}
    assert config_differences(profile, parse_run_config(written).to_run_config()) == []
    iid = parse_run_config({"defence-profile": "iid"}).to_run_config()
    assert "robust-aggregation: 'none' -> 'fltrust'" in "".join(config_differences(profile, iid))
