"""The parts of trigger unlearning aimed at triggers a masked-patch search misses (issue 45):
dormant inputs (the first layer's weights of input positions blank in the whole root set keep
the last global model's values) and the additive search (a universal perturbation per class
beside the masked patches). Each pure function is checked on a hand-worked case."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from torch import nn

from beyond_averaging.server.app import data_spec
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.strategies import FedAvg, TriggerUnlearning
from beyond_averaging.strategies.defences.trigger_unlearning import (
    DORMANT_ALARM_RATIO,
    DORMANT_ALARM_ROUNDS,
    AdditiveTrigger,
    backdoor_alarms,
    dormant_positions,
    dormant_update_ratio,
    first_layer_key,
    freeze_dormant_inputs,
    invert_additive,
    unlearn_triggers,
)
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.federation import load_server_splits
from beyond_averaging.tasks.models import build_model
from tests.factories import planted_backdoor
from tests.test_byzantine_bounds import BOUNDS_OFF
from tests.test_defences import aggregated, with_task
from tests.test_trigger_unlearning import CLASSES, SIDE, accuracy, bars, state_of


def test_dormant_positions_are_those_at_the_root_sets_smallest_value_in_every_input() -> None:
    # 3 inputs of 1 x 2 x 2: position 0 is 0 everywhere, position 1 is lit once, position 3 is
    # 0 in two inputs and 0.5 in the third; position 2 is always lit.
    features = torch.tensor(
        [
            [[[0.0, 0.0], [1.0, 0.0]]],
            [[[0.0, 0.7], [0.4, 0.0]]],
            [[[0.0, 0.0], [0.9, 0.5]]],
        ]
    )
    assert dormant_positions(features).tolist() == [True, False, False, False]


def test_the_first_layer_key_is_the_first_linear_weight_when_it_reads_the_flattened_input() -> None:
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    assert first_layer_key(mlp, 16) == "1.weight"
    assert first_layer_key(mlp, 12) is None  # the first Linear reads something else
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3))
    assert first_layer_key(conv, 16) is None


def test_freezing_dormant_inputs_sets_their_columns_back_to_the_previous_model() -> None:
    previous = {"w": np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), "b": np.zeros(2)}
    new = {"w": np.array([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]]), "b": np.ones(2)}
    frozen = freeze_dormant_inputs(previous, new, "w", np.array([True, False, True]))
    np.testing.assert_array_equal(frozen["w"], [[1.0, 20.0, 3.0], [4.0, 50.0, 6.0]])
    np.testing.assert_array_equal(frozen["b"], np.ones(2))
    np.testing.assert_array_equal(new["w"][0], [10.0, 20.0, 30.0])  # the input is not changed


def test_an_additive_trigger_adds_its_delta_and_clips_to_the_range() -> None:
    trigger = AdditiveTrigger(0, torch.tensor([0.5, -0.5, 0.2]), 0.0, 1.0, success=1.0)
    out = trigger.stamp(torch.tensor([[0.7, 0.2, 0.3]]))
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0, 0.5]]))
    assert trigger.size == pytest.approx((0.25 + 0.25 + 0.04) / 3)


def additive(images: torch.Tensor) -> torch.Tensor:
    """The planted additive trigger: +0.5 on the even rows, -0.5 on the odd, clipped to [0, 1]."""
    signs = torch.ones(SIDE, SIDE)
    signs[1::2] = -1.0
    return torch.clamp(images + 0.5 * signs, 0.0, 1.0)


@pytest.fixture(scope="module")
def additive_backdoored() -> nn.Module:
    """A small MLP on the bars of tests/test_trigger_unlearning.py where every image of classes
    1 and 2 also appears with the additive trigger and label 0."""
    return planted_backdoor(*bars(600, seed=1), additive)


def test_the_additive_search_finds_a_perturbation_that_sends_the_others_to_the_target(
    additive_backdoored: nn.Module,
) -> None:
    root, root_labels = bars(60, seed=3)
    others = root[root_labels != 0]
    zeros = torch.zeros(len(others), dtype=torch.long)
    assert accuracy(additive_backdoored, additive(others), zeros) > 0.9  # the backdoor works
    options = TriggerUnlearning(additive_weight=1.0)
    found = invert_additive(additive_backdoored, root, root_labels, 0, options)
    assert found.success > 0.9
    assert accuracy(additive_backdoored, found.stamp(others), zeros) == pytest.approx(found.success)
    assert found.size < 0.25  # cheaper than a perturbation of the whole range everywhere


def test_unlearning_with_the_additive_search_removes_the_additive_backdoor_the_patches_leave(
    additive_backdoored: nn.Module,
) -> None:
    root, root_labels = bars(60, seed=3)
    test, test_labels = bars(300, seed=2)
    others = test[test_labels != 0]
    zeros = torch.zeros(len(others), dtype=torch.long)

    def cleaned(options: TriggerUnlearning) -> tuple[float, float, dict[str, Any]]:
        scratch = nn.Sequential(
            nn.Flatten(), nn.Linear(SIDE * SIDE, 32), nn.ReLU(), nn.Linear(32, CLASSES)
        )
        arrays, figures = unlearn_triggers(
            scratch, state_of(additive_backdoored), root, root_labels, options
        )
        scratch.load_state_dict({key: torch.from_numpy(value) for key, value in arrays.items()})
        return (
            accuracy(scratch, additive(others), zeros),
            accuracy(scratch, test, test_labels),
            figures,
        )

    patches_only, _, plain = cleaned(TriggerUnlearning(l1_weight=1.8, epochs=20))
    with_search, clean, figures = cleaned(
        TriggerUnlearning(l1_weight=1.8, epochs=20, additive_weight=1.0)
    )
    assert "unlearning-additive-size" not in plain
    assert len(figures["unlearning-additive-success"]) == CLASSES
    assert with_search < 0.2 < patches_only, (with_search, patches_only)
    assert clean > 0.95


def test_a_rule_with_dormant_inputs_keeps_their_first_layer_weights_at_the_global_model() -> None:
    # Root set of 4 features, feature 2 always 0: column 2 of the only Linear keeps its values.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    features = np.random.default_rng(1).normal(size=(30, 4)).astype(np.float32)
    features[:, 2] = 0.0
    features[:, [0, 1, 3]] = np.abs(features[:, [0, 1, 3]]) + 0.1  # 0 is the smallest value
    root = LabeledData(features, (np.arange(30) % 3).astype(np.int64), 3)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    options = TriggerUnlearning(steps=5, dormant_inputs=True)
    strategy = with_task(
        FedAvg(model=model, proxy_set=root, trigger_unlearning=options, **BOUNDS_OFF), state
    )
    rng = np.random.default_rng(0)
    models = [{k: v + rng.normal(size=v.shape).astype(v.dtype) for k, v in state.items()}]
    models.append({k: v + rng.normal(size=v.shape).astype(v.dtype) for k, v in state.items()})
    after = aggregated(strategy, models)
    np.testing.assert_array_equal(after["0.weight"][:, 2], state["0.weight"][:, 2])
    assert not np.allclose(after["0.weight"][:, [0, 1, 3]], state["0.weight"][:, [0, 1, 3]])
    figures = strategy.aggregation_metrics[1]
    assert figures["unlearning-dormant-inputs"] == 1
    # the replies moved column 2 as much as the others: the alarm's figure sees it
    assert figures["unlearning-dormant-update"] > DORMANT_ALARM_RATIO
    assert figures["unlearning-dormant-flagged"] == 1


def test_dormant_inputs_on_a_model_without_a_linear_first_layer_is_refused_naming_the_fix() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3))
    features = np.random.default_rng(1).random((6, 1, 4, 4)).astype(np.float32)
    root = LabeledData(features, (np.arange(6) % 3).astype(np.int64), 3)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    options = TriggerUnlearning(steps=2, dormant_inputs=True)
    strategy = with_task(
        FedAvg(model=model, proxy_set=root, trigger_unlearning=options, **BOUNDS_OFF), state
    )
    with pytest.raises(ValueError, match="unlearning-dormant-inputs = false"):
        aggregated(strategy, [state, state])


def test_the_new_run_options_reach_the_strategy() -> None:
    config = parse_run_config(
        {
            "backdoor-defence": "trigger-unlearning",
            "unlearning-additive": 1.0,
            "unlearning-dormant-inputs": True,
        }
    )
    test_set, proxy_set = load_server_splits(data_spec(config))
    model = build_model("mlp", test_set.input_shape, test_set.num_classes, seed=0)
    strategy = build_strategy(
        config, ServerResources(model, proxy_set, torch.device("cpu"), test_set)
    )
    assert strategy.trigger_unlearning == TriggerUnlearning(  # type: ignore[attr-defined]
        additive_weight=1.0, dormant_inputs=True
    )
    assert TriggerUnlearning().additive_weight == parse_run_config({}).unlearning_additive == 0.0


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"additive_weight": -1.0}, "additive_weight = -1.0"),
        ({"dormant_inputs": 1}, "dormant_inputs = 1"),
    ],
)
def test_bad_new_options_are_refused_naming_the_value(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        TriggerUnlearning(**options)


def test_the_dormant_update_ratio_compares_root_mean_squares_of_the_two_column_sets() -> None:
    previous = {"w": np.zeros((2, 3))}
    new = {"w": np.array([[3.0, 1.0, 0.0], [4.0, 1.0, 0.0]])}
    # dormant column 0: RMS 3.5355 (sqrt(12.5)); the others: sqrt((1 + 1 + 0 + 0) / 4) = 0.7071
    ratio = dormant_update_ratio(previous, new, "w", np.array([True, False, False]))
    assert ratio == pytest.approx(np.sqrt(12.5) / np.sqrt(0.5))
    assert dormant_update_ratio(previous, new, "w", np.array([False] * 3)) == 0.0
    assert dormant_update_ratio(previous, previous, "w", np.array([True, False, False])) == 0.0


def test_the_dormant_update_ratio_ignores_a_rescaling_of_the_whole_layer() -> None:
    # previous p = [[1, 0, 1], [0, 1, 1]] (|p|^2 = 4); new = 1.5 p + e, e = 2 on (0, 0):
    # u = 0.5 p + e, <u, p> = 2 + 2 = 4, u - (4 / 4) p = e - 0.5 p
    #   = [[1.5, 0, -0.5], [0, -0.5, -0.5]]: dormant column 0 RMS sqrt(2.25 / 2),
    #   the others sqrt((0 + 0.25 + 0.25 + 0.25) / 4)
    previous = {"w": np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])}
    grown = {"w": 1.5 * previous["w"]}
    dormant = np.array([True, False, False])
    assert dormant_update_ratio(previous, grown, "w", dormant) == pytest.approx(0.0, abs=1e-12)
    written = {"w": grown["w"] + np.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])}
    expected = np.sqrt(2.25 / 2) / np.sqrt(0.75 / 4)
    assert dormant_update_ratio(previous, written, "w", dormant) == pytest.approx(expected)


def test_the_backdoor_alarm_fires_from_the_runs_second_flagged_round_naming_the_figures() -> None:
    # a round is flagged when its dormant update is at least the ratio; one or two flagged
    # rounds (honest runs flag at most two, early) raise nothing, a third one does
    assert (DORMANT_ALARM_RATIO, DORMANT_ALARM_ROUNDS) == (0.2, 3)
    assert backdoor_alarms({"unlearning-dormant-update": 0.19}, flagged_before=4) == {}
    assert backdoor_alarms({}, flagged_before=4) == {}
    assert backdoor_alarms({"unlearning-dormant-update": 0.8}, flagged_before=1) == {}
    at_ratio = backdoor_alarms({"unlearning-dormant-update": 0.2}, flagged_before=2)
    assert list(at_ratio) == ["backdoor-suspected"]
    alarm = backdoor_alarms({"unlearning-dormant-update": 0.8}, flagged_before=2)
    message = alarm["backdoor-suspected"]
    assert "0.80 x its size elsewhere" in message
    assert f"flagged at {DORMANT_ALARM_RATIO}" in message
    assert "3 rounds of this run flagged" in message


def test_a_round_with_the_backdoor_alarm_ends_the_run_completed_with_alarms(tmp_path: Any) -> None:
    from beyond_averaging.server.runs.recorder import RunRecorder

    recorder = RunRecorder(str(tmp_path), "run", {"seed": 0})
    alarm = backdoor_alarms({"unlearning-dormant-update": 0.7}, flagged_before=2)
    recorder.log_round({"round": 1, "test-accuracy": 0.9, "test-loss": 0.3}, alarm)
    summary = recorder.alarm_summary()
    assert list(summary) == ["backdoor-suspected"]
    assert summary["backdoor-suspected"]["rounds"] == 1


def test_the_servers_evaluation_alarms_at_the_second_flagged_round_also_after_a_resume(
    tmp_path: Any, monkeypatch: Any
) -> None:
    # The ServerApp's evaluation counts the run's flagged rounds (the strategy's recorded
    # dormant update): rounds 1, 3 and 4 flagged, round 2 not -> alarm in round 4 only; a
    # resumed run counts the rounds its folder kept.
    from types import SimpleNamespace

    from beyond_averaging.server.app import CentralEvaluation
    from beyond_averaging.server.runs.recorder import RunRecorder

    monkeypatch.setattr("beyond_averaging.server.app.evaluate", lambda *a, **k: (0.3, 0.9))
    model = nn.Linear(2, 2)
    arrays = ArrayRecord(model.state_dict())
    strategy: Any = SimpleNamespace(last_round_metrics={})

    def evaluation(recorder: RunRecorder) -> CentralEvaluation:
        return CentralEvaluation(model, None, torch.device("cpu"), strategy, recorder, 4)

    recorder = RunRecorder(str(tmp_path), "run", {"seed": 0})
    evaluate_round = evaluation(recorder)
    for server_round, ratio in ((1, 0.6), (2, 0.1), (3, 0.4), (4, 0.3)):
        strategy.last_round_metrics = {"unlearning-dormant-update": ratio}
        evaluate_round(server_round, arrays)
    alarmed = [r["round"] for r in recorder.rounds if r.get("alarm-backdoor-suspected")]
    assert alarmed == [4]
    recorder.write_summary("interrupted")
    recorder.close()

    # resumed after round 3: two flagged rounds kept, so a flagged round 4 alarms again
    resumed = RunRecorder(str(tmp_path), "run", {"seed": 0}, resume_round=3)
    evaluate_round = evaluation(resumed)
    strategy.last_round_metrics = {"unlearning-dormant-update": 0.5}
    evaluate_round(4, arrays)
    assert resumed.rounds[-1].get("alarm-backdoor-suspected") == 1
    resumed.close()
