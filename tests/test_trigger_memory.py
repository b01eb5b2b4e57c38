"""Remembering what the search found (``TriggerUnlearning(memory_rounds=k)``, run option
``unlearning-memory``; docs/reliability.md, "Remembering what was found"): the triggers unlearned
in each of the last k rounds are unlearned again every round, whether or not the round's own
search finds them, and a resumed run recalls them from its checkpoint."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from beyond_averaging.server.config import ConfigError, parse_run_config
from beyond_averaging.strategies import FedAvg, TriggerUnlearning
from beyond_averaging.strategies.defences.trigger_unlearning import (
    AdditiveTrigger,
    InvertedTrigger,
    TriggerMemory,
    unlearn_triggers,
)
from tests.factories import planted_backdoor
from tests.test_byzantine_bounds import BOUNDS_OFF
from tests.test_byzantine_bounds import fedlaw_setup as root_setup
from tests.test_defences import aggregated, with_task
from tests.test_trigger_unlearning import CLASSES, SIDE, accuracy, bars, stamped, state_of


def corner_patch(target: int = 0) -> InvertedTrigger:
    """The planted trigger of tests.test_trigger_unlearning as a patch: the bottom-right 2 x 2
    corner at 1."""
    mask = torch.zeros(SIDE, SIDE)
    mask[-2:, -2:] = 1.0
    return InvertedTrigger(target, mask, torch.ones(1, SIDE, SIDE), success=1.0)


def shift(target: int, value: float) -> AdditiveTrigger:
    return AdditiveTrigger(target, torch.full((1, SIDE, SIDE), value), 0.0, 1.0, success=0.5)


def test_the_memory_recalls_the_triggers_of_the_last_k_rounds_oldest_first() -> None:
    memory = TriggerMemory(2)
    for round_triggers in ([shift(0, 0.1)], [shift(1, 0.2), shift(2, 0.3)], [shift(0, 0.4)]):
        memory.remember(round_triggers)
    recalled = memory.recall(torch.device("cpu"))
    # the first round's trigger is forgotten
    assert [t.target for t in recalled] == [1, 2, 0]
    assert [float(t.delta[0, 0, 0]) for t in recalled] == pytest.approx([0.2, 0.3, 0.4])
    nothing = TriggerMemory(0)
    nothing.remember([shift(0, 0.1)])
    assert nothing.recall(torch.device("cpu")) == []


def test_the_memory_survives_its_state_dict() -> None:
    memory = TriggerMemory(3)
    memory.remember([corner_patch(1), shift(2, -0.25)])
    memory.remember([])
    restored = TriggerMemory(3)
    restored.load_state_dict(memory.state_dict())
    assert [len(r) for r in restored.state_dict()] == [2, 0]
    patch, additive = restored.recall(torch.device("cpu"))
    assert isinstance(patch, InvertedTrigger)
    assert isinstance(additive, AdditiveTrigger)
    assert (patch.target, patch.success, additive.target, additive.low, additive.high) == (
        1,
        1.0,
        2,
        0.0,
        1.0,
    )
    images = bars(4, seed=0)[0]
    torch.testing.assert_close(patch.stamp(images), stamped(images))
    torch.testing.assert_close(additive.stamp(images), torch.clamp(images - 0.25, 0.0, 1.0))


@pytest.fixture(scope="module")
def backdoored() -> nn.Module:
    return planted_backdoor(*bars(600, seed=1), stamped)


def cleaned_backdoor(backdoored: nn.Module, memory: TriggerMemory | None) -> tuple[float, Any]:
    """The planted backdoor's success on held-out images after one unlearning whose own search
    finds nothing that works (one search step, and every patch must flip the whole root set)."""
    root, root_labels = bars(60, seed=3)
    test, test_labels = bars(300, seed=2)
    scratch = nn.Sequential(
        nn.Flatten(), nn.Linear(SIDE * SIDE, 32), nn.ReLU(), nn.Linear(32, CLASSES)
    )
    options = TriggerUnlearning(steps=1, epochs=60, min_success=1.0, memory_rounds=1)
    cleaned, figures = unlearn_triggers(
        scratch, state_of(backdoored), root, root_labels, options, memory
    )
    scratch.load_state_dict({key: torch.from_numpy(value) for key, value in cleaned.items()})
    others = test[test_labels != 0]
    assert accuracy(scratch, test, test_labels) > 0.95
    return accuracy(scratch, stamped(others), torch.zeros(len(others), dtype=torch.long)), figures


def test_a_remembered_trigger_is_unlearned_in_a_round_whose_search_misses_it(
    backdoored: nn.Module,
) -> None:
    missed, figures = cleaned_backdoor(backdoored, None)
    assert missed > 0.9  # the round's own search found nothing: the backdoor stays
    assert figures["unlearning-patches"] == 0
    assert "unlearning-remembered" not in figures
    memory = TriggerMemory(1)
    memory.remember([corner_patch()])
    removed, figures = cleaned_backdoor(backdoored, memory)
    assert removed < 0.2, removed
    assert figures["unlearning-patches"] == 0
    assert figures["unlearning-remembered"] == 1
    # what is remembered now is this round's own finds (none): k = 1 keeps one round
    assert memory.recall(torch.device("cpu")) == []


def test_the_run_option_reaches_the_strategy_and_bad_values_are_refused() -> None:
    config = parse_run_config({"backdoor-defence": "trigger-unlearning", "unlearning-memory": 2})
    assert config.unlearning_memory == 2
    assert parse_run_config({}).unlearning_memory == TriggerUnlearning().memory_rounds == 0
    with pytest.raises(ConfigError, match="unlearning-memory"):
        parse_run_config({"unlearning-memory": -1})
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="memory_rounds"):
            TriggerUnlearning(memory_rounds=bad)  # type: ignore[arg-type]


def test_a_strategy_checkpoints_its_memory_and_a_resumed_one_recalls_it() -> None:
    model, root, state = root_setup()
    options: dict[str, Any] = {"model": model, "proxy_set": root, **BOUNDS_OFF}
    unlearning = TriggerUnlearning(steps=5, min_success=0.01, memory_rounds=2)
    strategy = with_task(FedAvg(trigger_unlearning=unlearning, **options), state)
    rng = np.random.default_rng(0)
    models = [
        {k: v + 0.1 * rng.normal(size=v.shape).astype(v.dtype) for k, v in state.items()}
        for _ in range(2)
    ]
    aggregated(strategy, models)
    found = strategy.aggregation_metrics[1]["unlearning-patches"]
    assert found > 0  # every patch that flips 1 % of the root set is unlearned, and kept
    checkpoint = strategy.state_dict()
    assert len(checkpoint["trigger-memory"]) == 1
    assert len(checkpoint["trigger-memory"][0]) == found
    resumed = FedAvg(trigger_unlearning=unlearning, **options)
    resumed.load_state_dict(checkpoint)
    before = strategy.trigger_memory.recall(torch.device("cpu"))
    after = resumed.trigger_memory.recall(torch.device("cpu"))
    assert [t.target for t in after] == [t.target for t in before]
    images = torch.from_numpy(root.features[:5])
    for old, new in zip(before, after, strict=True):
        torch.testing.assert_close(new.stamp(images), old.stamp(images))
    # without a memory the checkpoint is what it was
    plain = FedAvg(trigger_unlearning=TriggerUnlearning(steps=5), **options)
    assert "trigger-memory" not in plain.state_dict()
