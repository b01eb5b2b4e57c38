"""ContractStrategy: each bad reply is dropped, counted and logged; the round goes on or not."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from beyond_averaging.strategies import ClientReply, ContractStrategy, FedAvg, MissingRecordError
from beyond_averaging.strategies.aggregate import NDArrayDict
from tests.conftest import reply_message, train_reply

GLOBAL = {"w": np.zeros((2, 3), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}


def client(value: float) -> dict[str, np.ndarray[Any, Any]]:
    return {key: np.full_like(array, value) for key, array in GLOBAL.items()}


def strategy_with_global(strategy: ContractStrategy) -> ContractStrategy:
    # configure_train stores the global model; set it directly as no Grid is involved here.
    strategy.global_arrays = {k: v.copy() for k, v in GLOBAL.items()}
    return strategy


def aggregate(strategy: ContractStrategy, replies: list[Any]) -> tuple[Any, dict[str, Any]]:
    """The new arrays, and the clients' train metrics merged with the strategy's own figures."""
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics is not None
    return arrays, {**dict(metrics), **strategy.aggregation_metrics[1]}


def good_replies() -> list[Any]:
    return [train_reply(client(1.0), 10, node_id=1), train_reply(client(3.0), 30, node_id=2)]


def bad_reply(case: str) -> Any:
    if case == "error-reply":
        return reply_message(error="ClientApp raised")
    if case == "missing-arrays":
        return reply_message(RecordDict({"metrics": MetricRecord({"num-examples": 5})}))
    if case == "missing-metrics":
        return reply_message(
            RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in client(1.0).items()})})
        )
    if case == "bad-num-examples":
        return train_reply(client(1.0), 0)
    if case == "key-mismatch":
        return train_reply({"w": client(1.0)["w"], "other": np.zeros(3, np.float32)}, 5)
    if case == "shape-mismatch":
        return train_reply({"w": np.zeros((3, 2), np.float32), "b": client(1.0)["b"]}, 5)
    if case == "non-finite":
        arrays = client(1.0)
        arrays["b"][1] = np.nan
        return train_reply(arrays, 5)
    raise AssertionError(case)


BAD_CASES = [
    "error-reply",
    "missing-arrays",
    "missing-metrics",
    "bad-num-examples",
    "key-mismatch",
    "shape-mismatch",
    "non-finite",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_reply_is_dropped_counted_and_logged_and_the_round_goes_on(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = strategy_with_global(FedAvg(min_train_replies=2))
    with caplog.at_level(logging.WARNING):
        arrays, metrics = aggregate(strategy, [*good_replies(), bad_reply(case)])
    assert metrics["replies-received"] == 3
    assert metrics["replies-valid"] == 2
    assert metrics["replies-dropped"] == 1
    assert metrics[f"dropped-{case}"] == 1
    assert "dropped reply" in caplog.text
    # The two good clients (10 and 30 examples, values 1 and 3) average to 2.5 exactly.
    np.testing.assert_array_equal(arrays["w"].numpy(), np.full((2, 3), 2.5, np.float32))


def test_too_few_valid_replies_keep_the_global_model_and_say_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = strategy_with_global(FedAvg(min_train_replies=2))
    with caplog.at_level(logging.WARNING):
        arrays, metrics = aggregate(
            strategy, [train_reply(client(1.0), 10), bad_reply("non-finite")]
        )
    assert arrays is None  # Flower's Strategy.start keeps the previous global model
    assert metrics["aggregated"] == 0
    assert metrics["replies-valid"] == 1
    assert "keeping the global model" in caplog.text


def test_train_metrics_are_example_weighted() -> None:
    strategy = strategy_with_global(FedAvg())
    replies = [
        train_reply(client(1.0), 10, metrics={"train-loss": 1.0}),
        train_reply(client(1.0), 30, metrics={"train-loss": 2.0}),
    ]
    _, metrics = aggregate(strategy, replies)
    assert metrics["train-loss"] == pytest.approx((10 * 1.0 + 30 * 2.0) / 40)


class NeedsSensitivity(ContractStrategy):
    """A minimal strategy that declares an extra record (what Elastic aggregation does)."""

    required_records: ClassVar[dict[str, str]] = {"sensitivity": "Add it with the recipe."}

    def aggregate(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        return dict(replies[0].arrays)


def test_reply_without_a_required_record_is_dropped_with_the_record_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = strategy_with_global(NeedsSensitivity(min_train_replies=1))
    with_record = train_reply(client(1.0), 10, extra={"sensitivity": {"w": client(1.0)["w"]}})
    with caplog.at_level(logging.WARNING):
        _, metrics = aggregate(strategy, [with_record, train_reply(client(2.0), 10)])
    assert metrics["dropped-missing-sensitivity"] == 1
    assert "no ArrayRecord named 'sensitivity'" in caplog.text


def test_extra_record_with_a_wrong_shape_is_dropped() -> None:
    strategy = strategy_with_global(NeedsSensitivity(min_train_replies=1))
    good = train_reply(client(1.0), 10, extra={"sensitivity": {"w": client(1.0)["w"]}})
    wrong = train_reply(client(1.0), 10, extra={"sensitivity": {"w": np.ones(6, np.float32)}})
    _, metrics = aggregate(strategy, [good, wrong])
    assert metrics["dropped-bad-sensitivity"] == 1


def test_no_reply_with_a_required_record_stops_the_run_with_the_hint() -> None:
    strategy = strategy_with_global(NeedsSensitivity(min_train_replies=1))
    with pytest.raises(MissingRecordError, match=r"'sensitivity'.*Add it with the recipe"):
        strategy.aggregate_train(1, [train_reply(client(1.0), 10), train_reply(client(2.0), 5)])
