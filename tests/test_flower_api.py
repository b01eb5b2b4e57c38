"""Every rule takes Flower's FedAvg arguments, defaults and meanings; Result: client metrics."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp import strategy as flower
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from beyond_averaging import (
    ContractStrategy,
    ElasticAggregation,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedGMA,
    FedGMASoft,
    FedLAW,
)
from beyond_averaging.strategies import StrategyOptions, aggregate_metrics
from beyond_averaging.tasks.datasets import LabeledData
from tests.conftest import reply_message, train_reply

GLOBAL = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
FLOWER_FEDAVG = inspect.signature(flower.FedAvg.__init__).parameters
FLOWER_ARGUMENTS = [name for name in FLOWER_FEDAVG if name != "self"]


RULES: dict[str, Any] = {
    "FedAvg": FedAvg,
    "FedAvgM": FedAvgM,
    "FedAdam": FedAdam,
    "ElasticAggregation": ElasticAggregation,
    "FedGMA": FedGMA,
    "FedGMASoft": FedGMASoft,
    "FedLAW": lambda **options: FedLAW(
        model=nn.Linear(3, 2), proxy_set=fedlaw_proxy(), epochs=1, batch_size=10, **options
    ),
}


def fedlaw_proxy() -> LabeledData:
    rng = np.random.default_rng(0)
    return LabeledData(rng.normal(size=(20, 3)).astype(np.float32), np.arange(20) % 2, 2)


def with_global(strategy: ContractStrategy) -> ContractStrategy:
    strategy.global_arrays = {key: value.copy() for key, value in GLOBAL.items()}
    return strategy


def filled(value: float) -> dict[str, np.ndarray[Any, Any]]:
    return {key: np.full_like(array, value) for key, array in GLOBAL.items()}


@pytest.fixture(autouse=True)
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Instruction Messages read the ServerApp's task identity, set here as a run would."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)


class NodeGrid:
    """A Grid that only lists nodes: enough for configure_train / configure_evaluate."""

    def __init__(self, count: int) -> None:
        self.count = count

    def get_node_ids(self) -> Iterable[int]:
        return list(range(1, self.count + 1))


# ----------------------------------------------------------------------------- constructor
def test_base_defaults_are_flower_fedavg_defaults() -> None:
    ours = inspect.signature(ContractStrategy.__init__).parameters
    for name in FLOWER_ARGUMENTS:
        assert name in ours, name
        assert ours[name].default == FLOWER_FEDAVG[name].default, name
    assert set(FLOWER_ARGUMENTS) <= set(StrategyOptions.__annotations__)


@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_accepts_flower_arguments_and_keeps_their_values(rule: str) -> None:
    def average(records: list[RecordDict], key: str) -> MetricRecord:
        return MetricRecord({"called": 1.0})

    given = {
        "fraction_train": 0.5,
        "fraction_evaluate": 0.25,
        "min_train_nodes": 3,
        "min_evaluate_nodes": 4,
        "min_available_nodes": 5,
        "weighted_by_key": "samples",
        "arrayrecord_key": "model",
        "configrecord_key": "settings",
        "train_metrics_aggr_fn": average,
        "evaluate_metrics_aggr_fn": average,
    }
    assert sorted(given) == sorted(FLOWER_ARGUMENTS)
    strategy = RULES[rule](**given)
    for name, value in given.items():
        assert getattr(strategy, name) == value, name


@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_evaluates_on_every_node_by_default_as_flower(rule: str) -> None:
    strategy = RULES[rule]()
    assert strategy.fraction_evaluate == 1.0
    messages = list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), NodeGrid(5)))
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 2, 3, 4, 5]


def test_flower_names_of_fedadam_and_fedavgm_have_flower_defaults() -> None:
    for ours, theirs in ((FedAdam, flower.FedAdam), (FedAvgM, flower.FedAvgM)):
        own = inspect.signature(ours.__init__).parameters
        extra = [n for n in inspect.signature(theirs.__init__).parameters if n not in FLOWER_FEDAVG]
        assert extra, theirs
        for name in extra:
            expected = inspect.signature(theirs.__init__).parameters[name].default
            assert own[name].default == expected, (ours.__name__, name)


def test_min_train_nodes_and_fraction_size_the_sample_as_flower() -> None:
    # Flower samples max(int(fraction * connected), min_nodes) nodes.
    strategy = FedAvg(fraction_train=0.2, min_train_nodes=3)
    sent = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), NodeGrid(10)))
    assert len(sent) == 3
    strategy = FedAvg(fraction_train=0.5, min_train_nodes=1)
    sent = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), NodeGrid(10)))
    assert len(sent) == 5
    assert strategy.min_train_replies == 1  # defaults to min_train_nodes


def test_zero_fractions_skip_the_phase_as_flower() -> None:
    strategy = FedAvg(fraction_train=0.0, fraction_evaluate=0.0)
    assert strategy.min_train_nodes == strategy.min_evaluate_nodes == 0
    assert list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), NodeGrid(3))) == []
    assert list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), NodeGrid(3))) == []
    assert strategy.aggregate_train(1, []) == (None, None)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("fraction_train", 1.5),
        ("fraction_evaluate", -0.1),
        ("min_train_nodes", -1),
        ("weighted_by_key", ""),
    ],
)
def test_bad_argument_is_rejected_by_name(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        FedAvg(**{name: value})


def test_record_keys_name_the_records_sent_and_read() -> None:
    strategy = FedAvg(
        arrayrecord_key="model",
        configrecord_key="settings",
        min_train_nodes=1,
        min_available_nodes=1,
    )
    arrays = ArrayRecord({key: Array(value) for key, value in GLOBAL.items()})
    sent = list(strategy.configure_train(1, arrays, ConfigRecord({"lr": 0.1}), NodeGrid(1)))
    assert set(sent[0].content.array_records) == {"model"}
    assert sent[0].content.config_records["settings"]["lr"] == 0.1
    content = RecordDict(
        {
            "model": ArrayRecord({k: Array(v) for k, v in filled(2.0).items()}),
            "metrics": MetricRecord({"num-examples": 4}),
        }
    )
    new, _ = strategy.aggregate_train(1, [reply_message(content)])
    assert new is not None
    np.testing.assert_array_equal(new["w"].numpy(), filled(2.0)["w"])


def test_weighted_by_key_weighs_the_model_average() -> None:
    strategy = with_global(FedAvg(weighted_by_key="samples", min_train_replies=2))
    replies = [
        train_reply(filled(1.0), 1, metrics={"samples": 3.0}, node_id=1),
        train_reply(filled(5.0), 3, metrics={"samples": 1.0}, node_id=2),
    ]
    new, metrics = strategy.aggregate_train(1, replies)
    assert new is not None
    np.testing.assert_allclose(new["w"].numpy(), np.full((2, 3), (3 * 1.0 + 1 * 5.0) / 4))
    assert metrics is not None
    assert metrics["num-examples"] == pytest.approx((3 * 1 + 1 * 3) / 4)  # now a plain metric


# ----------------------------------------------------------------------------- metrics
def contents(*entries: dict[str, Any]) -> list[RecordDict]:
    return [RecordDict({"metrics": MetricRecord(entry)}) for entry in entries]


def test_default_metric_aggregation_equals_flowers_when_replies_agree() -> None:
    records = contents(
        {"num-examples": 10, "loss": 0.5, "hits": 7, "per-class": [0.1, 0.9]},
        {"num-examples": 30, "loss": 1.5, "hits": 20, "per-class": [0.3, 0.5]},
    )
    ours, flowers = (
        aggregate_metrics(records, "num-examples"),
        aggregate_metricrecords(records, "num-examples"),
    )
    assert sorted(ours) == sorted(flowers)
    for key in flowers:
        assert ours[key] == pytest.approx(flowers[key])
    assert ours["loss"] == pytest.approx(1.25)  # (10 * 0.5 + 30 * 1.5) / 40, by hand
    assert type(ours["loss"]) is float


def test_metric_only_some_replies_carry_is_averaged_over_those() -> None:
    records = contents(
        {"num-examples": 10, "loss": 1.0, "extra": 4.0},
        {"num-examples": 30, "loss": 2.0},
        {"num-examples": 10, "loss": 3.0, "extra": 8.0},
    )
    result = aggregate_metrics(records, "num-examples")
    assert result["loss"] == pytest.approx((10 * 1 + 30 * 2 + 10 * 3) / 50)
    assert result["extra"] == pytest.approx(6.0)


def test_result_train_metrics_hold_only_client_metrics_as_plain_floats() -> None:
    strategy = with_global(FedAvg(min_train_replies=2))
    replies = [
        train_reply(filled(1.0), 10, metrics={"train_loss": 0.5}, node_id=1),
        train_reply(filled(2.0), 30, metrics={"train_loss": 1.5}, node_id=2),
        train_reply({"w": np.zeros(2, np.float32)}, 10, node_id=3),  # dropped: wrong keys
    ]
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics is not None
    assert dict(metrics) == {"train_loss": pytest.approx(1.25)}
    assert "np." not in repr(dict(metrics))
    figures = strategy.aggregation_metrics[1]
    assert figures["replies-received"] == 3
    assert figures["replies-dropped"] == 1
    assert figures["aggregated"] == 1
    assert strategy.last_round_metrics == {**dict(metrics), **figures}


def test_metric_aggregation_functions_are_called_as_flower_calls_them() -> None:
    calls: list[tuple[int, str]] = []

    def custom(records: list[RecordDict], key: str) -> MetricRecord:
        calls.append((len(records), key))
        return MetricRecord({"custom": 1.0})

    strategy = with_global(
        FedAvg(train_metrics_aggr_fn=custom, evaluate_metrics_aggr_fn=custom, min_train_replies=1)
    )
    _, train = strategy.aggregate_train(
        1, [train_reply(filled(1.0), 5), train_reply(filled(2.0), 5)]
    )
    evaluation = strategy.aggregate_evaluate(
        1, [reply_message(record) for record in contents({"num-examples": 3, "acc": 0.5})]
    )
    assert dict(train or {}) == dict(evaluation or {}) == {"custom": 1.0}
    assert calls == [(2, "num-examples"), (1, "num-examples")]


def test_evaluate_metrics_are_weighted_and_error_replies_skipped() -> None:
    strategy = FedAvg()
    replies = [
        reply_message(content)
        for content in contents({"num-examples": 1, "acc": 1.0}, {"num-examples": 3, "acc": 0.0})
    ]
    replies.append(reply_message(error="ClientApp crashed"))
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics is not None
    assert dict(metrics) == {"acc": pytest.approx(0.25)}


# ----------------------------------------------------------------------------- FedAvgM / FedAdam
def _assert_steps_as_flower(ours: Any, theirs: Any, shifts: list[tuple[float, float]]) -> None:
    """Three rounds of two clients (10 and 30 examples) shifted from the global model by
    ``shifts``: our strategy's new global model equals Flower's every round."""
    arrays = ArrayRecord({key: Array(value) for key, value in GLOBAL.items()})
    for server_round, (a, b) in enumerate(shifts, start=1):
        list(ours.configure_train(server_round, arrays, ConfigRecord(), NodeGrid(2)))
        # Flower's FedAvgM keeps an ArrayRecord of the global model, FedAdam a dict of arrays.
        current = {key: array.numpy() for key, array in arrays.items()}
        theirs.current_arrays = arrays if isinstance(theirs, flower.FedAvgM) else current
        replies = [
            train_reply({k: (v + a).astype(np.float32) for k, v in current.items()}, 10, node_id=1),
            train_reply({k: (v + b).astype(np.float32) for k, v in current.items()}, 30, node_id=2),
        ]
        new, _ = ours.aggregate_train(server_round, replies)
        expected, _ = theirs.aggregate_train(server_round, replies)
        assert new is not None
        assert expected is not None
        for key, value in expected.items():
            np.testing.assert_allclose(new[key].numpy(), value.numpy(), rtol=1e-5, atol=1e-6)
        arrays = new


def test_fedavgm_steps_exactly_as_flowers_fedavgm() -> None:
    _assert_steps_as_flower(
        FedAvgM(server_learning_rate=0.7, server_momentum=0.9, min_train_replies=2),
        flower.FedAvgM(server_learning_rate=0.7, server_momentum=0.9),
        [(1.0, 3.0), (-2.0, 4.0), (0.5, 0.0)],
    )


def test_fedadam_steps_exactly_as_flowers_fedadam() -> None:
    options = {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-2}
    _assert_steps_as_flower(
        FedAdam(**options, min_train_replies=2),
        flower.FedAdam(**options),
        [(1.0, 3.0), (-1.0, 2.0), (0.5, -4.0)],
    )


def test_fedavg_with_adam_is_reddi_algorithm_2_without_bias_correction() -> None:
    eta, beta_1, beta_2, tau = 0.1, 0.9, 0.99, 1e-3
    strategy = FedAvg(
        server_optimizer="adam",
        server_lr=eta,
        server_beta1=beta_1,
        server_beta2=beta_2,
        server_eps=tau,
        min_train_replies=2,
    )
    current = {key: value.astype(np.float64) for key, value in GLOBAL.items()}
    first = {key: np.zeros_like(value) for key, value in current.items()}
    second = {key: np.zeros_like(value) for key, value in current.items()}
    arrays = ArrayRecord({key: Array(value) for key, value in GLOBAL.items()})
    for server_round, (a, b) in enumerate([(1.0, 3.0), (-1.0, 2.0)], start=1):
        list(strategy.configure_train(server_round, arrays, ConfigRecord(), NodeGrid(2)))
        replies = [
            train_reply({k: (current[k] + a).astype(np.float32) for k in GLOBAL}, 10, node_id=1),
            train_reply({k: (current[k] + b).astype(np.float32) for k in GLOBAL}, 30, node_id=2),
        ]
        new, _ = strategy.aggregate_train(server_round, replies)
        assert new is not None
        for key in current:  # delta = average - w
            delta = (10 * a + 30 * b) / 40 * np.ones_like(current[key])
            first[key] = beta_1 * first[key] + (1 - beta_1) * delta
            second[key] = beta_2 * second[key] + (1 - beta_2) * delta**2
            current[key] = current[key] + eta * first[key] / (np.sqrt(second[key]) + tau)
            np.testing.assert_allclose(new[key].numpy(), current[key], rtol=1e-5)
        arrays = new
