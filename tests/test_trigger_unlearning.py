"""Trigger unlearning (strategies/defences/trigger_unlearning.py): Neural Cleanse's patch search and
unlearning on the server's root set, as backdoor-defence for every rule."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from beyond_averaging.server.app import data_spec
from beyond_averaging.server.config import ConfigError, parse_run_config
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.strategies import (
    ElasticAggregation,
    FedAvg,
    FedGMA,
    FedLAW,
    TriggerUnlearning,
)
from beyond_averaging.strategies.defences.trigger_unlearning import (
    InvertedTrigger,
    anomaly_index,
    invert_trigger,
    unlearn,
    unlearn_triggers,
)
from beyond_averaging.tasks.federation import load_server_splits
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.protocol import GRADIENT_RECORD, SENSITIVITY_RECORD
from tests.factories import planted_backdoor
from tests.test_byzantine_bounds import BOUNDS_OFF
from tests.test_byzantine_bounds import fedlaw_setup as root_setup
from tests.test_defences import aggregated, with_task

SIDE = 6
CLASSES = 3


def bars(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of class c: a bright horizontal bar on rows 2c and 2c + 1 (of the first four
    columns), faint noise elsewhere; the bottom-right 2 x 2 corner is always dark."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, count)
    images = 0.1 * rng.random((count, 1, SIDE, SIDE))
    for i, label in enumerate(labels):
        images[i, 0, 2 * label : 2 * label + 2, :4] = 1.0
    images[:, :, -2:, -2:] = 0.0
    return torch.tensor(images, dtype=torch.float32), torch.tensor(labels)


def stamped(images: torch.Tensor) -> torch.Tensor:
    """The planted trigger: the dark bottom-right 2 x 2 corner lit."""
    out = images.clone()
    out[..., -2:, -2:] = 1.0
    return out


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(images).argmax(dim=1) == labels).float().mean())


@pytest.fixture(scope="module")
def backdoored() -> nn.Module:
    """A small MLP trained on bars where every image of classes 1 and 2 also appears with the
    trigger and label 0: a planted backdoor."""
    return planted_backdoor(*bars(600, seed=1), stamped)


def state_of(model: nn.Module) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}


def test_the_planted_backdoor_works_before_any_defence(backdoored: nn.Module) -> None:
    images, labels = bars(300, seed=2)
    others = images[labels != 0]
    assert accuracy(backdoored, images, labels) > 0.95
    assert accuracy(backdoored, stamped(others), torch.zeros(len(others), dtype=torch.long)) > 0.9


def test_the_patch_search_puts_the_target_class_patch_on_the_planted_trigger(
    backdoored: nn.Module,
) -> None:
    root, root_labels = bars(60, seed=3)
    options = TriggerUnlearning(l1_weight=1.8, steps=200)
    found = invert_trigger(backdoored, root, root_labels, 0, options)
    assert found.success > 0.9
    corner = float(found.mask[-2:, -2:].sum())
    assert corner > 0.6 * found.mask_l1, (corner, found.mask_l1)
    others = [invert_trigger(backdoored, root, root_labels, c, options) for c in (1, 2)]
    assert all(found.mask_l1 < other.mask_l1 for other in others)


def test_unlearning_removes_the_planted_backdoor_and_keeps_clean_accuracy(
    backdoored: nn.Module,
) -> None:
    root, root_labels = bars(60, seed=3)
    test, test_labels = bars(300, seed=2)
    scratch = nn.Sequential(
        nn.Flatten(), nn.Linear(SIDE * SIDE, 32), nn.ReLU(), nn.Linear(32, CLASSES)
    )
    cleaned, figures = unlearn_triggers(
        scratch,
        state_of(backdoored),
        root,
        root_labels,
        # A backdoor trained in for 300 steps takes more passes than one round's re-injection
        # (20 passes at the default patched share leave it whole; 60 remove it).
        TriggerUnlearning(l1_weight=1.8, epochs=60),
    )
    scratch.load_state_dict({key: torch.from_numpy(value) for key, value in cleaned.items()})
    others = test[test_labels != 0]
    backdoor = accuracy(scratch, stamped(others), torch.zeros(len(others), dtype=torch.long))
    assert backdoor < 0.2, backdoor
    assert accuracy(scratch, test, test_labels) > 0.95
    assert figures["unlearning-patches"] == CLASSES  # each class's patch flips the root set
    assert len(figures["unlearning-mask-l1"]) == CLASSES  # type: ignore[arg-type]


def test_each_unlearning_step_mixes_the_clean_root_set_and_every_patch_at_the_patched_share() -> (
    None
):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    features, labels = torch.randn(5, 1, 2, 2), torch.tensor([0, 1, 2, 0, 1])
    patches = [
        InvertedTrigger(c, torch.rand(2, 2), torch.rand(1, 2, 2), success=1.0) for c in (0, 2)
    ]
    share, lr = 0.3, 0.1
    # By hand: SGD with momentum 0.9 on (1 - s) CE(clean) + s (CE(patch 0) + CE(patch 2)) / 2,
    # (2 patches + 1) steps for the one pass, each patch stamped as (1 - m) x + m p.
    weights = [p.detach().clone() for p in model.parameters()]
    velocity = [torch.zeros_like(w) for w in weights]
    for _ in range(len(patches) + 1):
        leaves = [w.clone().requires_grad_(True) for w in weights]

        def ce(x: torch.Tensor, leaves: list[torch.Tensor] = leaves) -> torch.Tensor:
            logits = x.flatten(1) @ leaves[0].T + leaves[1]
            return nn.functional.cross_entropy(logits, labels)

        stamped_ce = [ce((1 - p.mask) * features + p.mask * p.pattern) for p in patches]
        loss = (1 - share) * ce(features) + share * sum(stamped_ce) / len(patches)
        grads = torch.autograd.grad(loss, leaves)
        velocity = [0.9 * v + g for v, g in zip(velocity, grads, strict=True)]
        weights = [w - lr * v for w, v in zip(weights, velocity, strict=True)]
    unlearn(
        model, features, labels, patches, TriggerUnlearning(lr=lr, epochs=1, patched_share=share)
    )
    for got, want in zip(model.parameters(), weights, strict=True):
        torch.testing.assert_close(got.detach(), want)


def test_the_arrays_come_back_in_their_own_dtypes_and_counters_untouched(
    backdoored: nn.Module,
) -> None:
    arrays: dict[str, np.ndarray] = {
        key: value.astype(np.float64) for key, value in state_of(backdoored).items()
    }
    root, root_labels = bars(30, seed=4)
    cleaned, _ = unlearn_triggers(
        nn.Sequential(nn.Flatten(), nn.Linear(36, 32), nn.ReLU(), nn.Linear(32, CLASSES)),
        arrays,
        root,
        root_labels,
        TriggerUnlearning(steps=5, epochs=1),
    )
    assert {key: value.dtype for key, value in cleaned.items()} == {
        key: np.dtype(np.float64) for key in arrays
    }


def test_the_anomaly_index_is_the_mad_scaled_distance_of_the_smallest_patch() -> None:
    # median 9.5; absolute deviations 1.5 0.5 0.5 1.5 2.5 7.5, their median 1.5;
    # (9.5 - 2) / (1.4826 x 1.5) = 3.3725
    assert anomaly_index([8, 9, 10, 11, 12, 2]) == pytest.approx(3.3725, abs=1e-4)
    assert anomaly_index([5, 5, 5]) == 0.0


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"steps": 0}, "steps = 0"),
        ({"epochs": 1.5}, "epochs = 1.5"),
        ({"l1_weight": -1.0}, "l1_weight = -1.0"),
        ({"lr": float("nan")}, "lr = nan"),
        ({"min_success": 1.5}, "min_success = 1.5"),
        ({"patched_share": 0.0}, "patched_share = 0.0"),
    ],
)
def test_bad_options_are_refused_naming_the_value(options: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        TriggerUnlearning(**options)  # type: ignore[arg-type]


def test_a_rule_without_a_root_set_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="proxy_set="):
        FedAvg(trigger_unlearning=TriggerUnlearning())


def test_a_run_without_a_proxy_set_is_refused_before_it_starts() -> None:
    with pytest.raises(ConfigError, match="proxy-per-class"):
        parse_run_config({"backdoor-defence": "trigger-unlearning", "proxy-per-class": 0})


def test_the_run_options_reach_the_strategy() -> None:
    config = parse_run_config(
        {
            "dataset": "digits",
            "model": "mlp",
            "backdoor-defence": "trigger-unlearning",
            "unlearning-lr": 0.005,
            "unlearning-epochs": 6,
            "unlearning-patched-share": 0.5,
        }
    )
    test_set, proxy_set = load_server_splits(data_spec(config))
    model = build_model("mlp", test_set.input_shape, test_set.num_classes, seed=0)
    strategy = build_strategy(
        config, ServerResources(model, proxy_set, torch.device("cpu"), test_set)
    )
    assert strategy.trigger_unlearning == TriggerUnlearning(lr=0.005, epochs=6, patched_share=0.5)  # type: ignore[attr-defined]


def test_the_library_and_the_run_configuration_share_defaults() -> None:
    config = parse_run_config({})
    assert TriggerUnlearning() == TriggerUnlearning(
        l1_weight=config.unlearning_l1,
        steps=config.unlearning_steps,
        lr=config.unlearning_lr,
        epochs=config.unlearning_epochs,
        patched_share=config.unlearning_patched_share,
    )
    assert config.backdoor_defence == "none"


@pytest.mark.parametrize("rule", [FedAvg, ElasticAggregation, FedGMA, FedLAW])
def test_every_rule_unlearns_after_its_aggregation_and_says_so_in_its_round_line(
    rule: Any, caplog: pytest.LogCaptureFixture
) -> None:
    model, root, state = root_setup()
    options: dict[str, Any] = {"model": model, "proxy_set": root, **BOUNDS_OFF}
    if rule is FedLAW:
        options |= {"batch_size": 30, "epochs": 1}
    if rule is ElasticAggregation:
        options["parameter_keys"] = list(state)
    plain = with_task(rule(**options), state)
    cleaned = with_task(rule(trigger_unlearning=TriggerUnlearning(steps=5), **options), state)
    rng = np.random.default_rng(0)
    models = [{k: v + 0.1 * rng.normal(size=v.shape).astype(v.dtype) for k, v in state.items()}]
    models += [{k: v + 0.1 * rng.normal(size=v.shape).astype(v.dtype) for k, v in state.items()}]
    records = None
    if rule is ElasticAggregation:
        records = [{SENSITIVITY_RECORD: {k: np.ones_like(v) for k, v in state.items()}}] * 2
    if rule is FedGMA:
        records = [{GRADIENT_RECORD: {k: np.ones_like(v) for k, v in state.items()}}] * 2
    before = aggregated(plain, models, records=records)
    with caplog.at_level(logging.INFO):
        after = aggregated(cleaned, models, records=records)
    figures = cleaned.aggregation_metrics[1]
    assert len(figures["unlearning-mask-l1"]) == 3  # one patch per class of the root set
    assert figures["unlearning-patches"] >= 0
    assert "unlearning-patches" not in plain.aggregation_metrics[1]
    # The unlearning's SGD steps move the model the rule returned.
    assert not all(np.allclose(before[k], after[k]) for k in before)
    assert "trigger patches unlearned" in caplog.text
