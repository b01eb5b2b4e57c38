"""The bound on first-layer changes of seldom-exercised inputs (``TriggerUnlearning(
input_bound=k)``, run option ``unlearning-input-bound``; docs/reliability.md, "A defence aimed at
why they pass"): each round's change of a first-layer weight column may be at most k x the
column's exercise in the root set x the round's median change per unit of exercise. Checked on
hand-worked cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from beyond_averaging.server.config import ConfigError, parse_run_config
from beyond_averaging.strategies import FedAvg, TriggerUnlearning
from beyond_averaging.strategies.defences.trigger_unlearning import (
    bound_rare_inputs,
    input_exercise,
)
from beyond_averaging.tasks.datasets import LabeledData
from tests.test_byzantine_bounds import BOUNDS_OFF
from tests.test_defences import aggregated, with_task


def test_the_exercise_is_the_root_mean_square_height_above_the_smallest_value_over_the_range() -> (
    None
):
    # range [0, 4]; feature 0 heights 0, 0, 0.5 -> sqrt(0.25 / 3); feature 1: 1, 0, 1 -> sqrt(2 / 3)
    features = torch.tensor([[0.0, 4.0], [0.0, 0.0], [2.0, 4.0]])
    torch.testing.assert_close(
        input_exercise(features),
        torch.tensor([np.sqrt(0.25 / 3), np.sqrt(2 / 3)], dtype=torch.float64),
    )
    # image batches are flattened: a blank position has exercise 0
    images = torch.zeros(2, 1, 2, 2)
    images[0, 0, 0, 1] = 1.0
    torch.testing.assert_close(
        input_exercise(images), torch.tensor([0.0, np.sqrt(0.5), 0.0, 0.0], dtype=torch.float64)
    )


def test_a_column_moving_more_than_its_exercise_supports_is_scaled_down_to_the_bound() -> None:
    previous = {"w": np.ones((2, 3), dtype=np.float32), "b": np.zeros(2, dtype=np.float32)}
    change = np.array([[3.0, 1.0, 0.0], [4.0, 0.0, 2.0]], dtype=np.float32)
    new = {"w": previous["w"] + change, "b": np.ones(2, dtype=np.float32)}
    exercise = np.array([0.5, 1.0, 0.0])
    # column norms 5, 1, 2; per unit of exercise 10 and 1 (column 2 is not exercised): median
    # 5.5, so with k = 1 the caps are 2.75, 5.5 and 0; column 0 is scaled by 2.75 / 5 = 0.55,
    # column 1 stays, column 2 (no root input lights it) keeps its old values
    bounded, count = bound_rare_inputs(previous, new, "w", exercise, 1.0)
    np.testing.assert_allclose(bounded["w"] - previous["w"], [[1.65, 1.0, 0.0], [2.2, 0.0, 0.0]])
    assert count == 2
    assert bounded["w"].dtype == np.float32
    np.testing.assert_array_equal(bounded["b"], new["b"])  # other tensors as they came
    # a looser bound (k = 2: caps 5.5, 11, 0) leaves column 0 whole
    looser, looser_count = bound_rare_inputs(previous, new, "w", exercise, 2.0)
    np.testing.assert_allclose(looser["w"] - previous["w"], [[3.0, 1.0, 0.0], [4.0, 0.0, 0.0]])
    assert looser_count == 1


def test_no_exercised_column_leaves_the_model_as_it_came() -> None:
    previous = {"w": np.zeros((2, 2))}
    new = {"w": np.ones((2, 2))}
    bounded, count = bound_rare_inputs(previous, new, "w", np.zeros(2), 1.0)
    np.testing.assert_array_equal(bounded["w"], new["w"])
    assert count == 0


def test_a_rule_with_the_bound_holds_back_the_column_the_root_set_barely_lights() -> None:
    # Root set of 4 features; feature 2 is lit in one root input of 30: its column may move
    # far less than the others, which the replies move as much.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    rng = np.random.default_rng(1)
    features = (np.abs(rng.normal(size=(30, 4))) + 0.1).astype(np.float32)
    features[:, 2] = 0.0
    features[0, 2] = 1.0
    root = LabeledData(features, (np.arange(30) % 3).astype(np.int64), 3)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    models = [
        {k: v + rng.normal(size=v.shape).astype(v.dtype) for k, v in state.items()}
        for _ in range(2)
    ]
    moved = {}
    for bound in (0.0, 1.0):
        options = TriggerUnlearning(steps=5, input_bound=bound)
        strategy = with_task(
            FedAvg(model=model, proxy_set=root, trigger_unlearning=options, **BOUNDS_OFF), state
        )
        after = aggregated(strategy, models)
        moved[bound] = np.linalg.norm(after["0.weight"] - state["0.weight"], axis=0)
    # exercise of feature 2: sqrt(1 / 30) = 0.18 of the range's share, the others' about 1 / 0.18
    # times more; unbounded, the replies move column 2 as much as the others
    assert moved[0.0][2] > 0.5 * moved[0.0][[0, 1, 3]].min(), moved
    assert moved[1.0][2] < 0.3 * moved[0.0][2], moved
    assert strategy.aggregation_metrics[1]["unlearning-inputs-bounded"] >= 1


def test_a_negative_bound_is_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"input_bound = -1\.0"):
        TriggerUnlearning(input_bound=-1.0)
    with pytest.raises(ConfigError, match="unlearning-input-bound"):
        parse_run_config({"unlearning-input-bound": -1.0})


def test_the_bound_with_a_convolutional_model_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match="unlearning-input-bound = 0"):
        parse_run_config({"unlearning-input-bound": 2.0, "model": "cnn"})
    assert parse_run_config({"unlearning-input-bound": 2.0}).unlearning_input_bound == 2.0
    assert parse_run_config({}).unlearning_input_bound == TriggerUnlearning().input_bound == 0.0
