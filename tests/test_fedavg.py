"""FedAvg and the server optimizers against hand computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from beyond_averaging.strategies import FedAvg, ServerOptimizer, aggregate_fedavg
from tests.conftest import train_reply


def test_fedavg_is_the_data_size_weighted_mean_computed_by_hand() -> None:
    global_arrays = {"w": np.array([0.0, 0.0], np.float32)}
    clients = [{"w": np.array([1.0, 2.0], np.float32)}, {"w": np.array([4.0, -2.0], np.float32)}]
    # n = (1, 3): p = (0.25, 0.75) -> [0.25*1 + 0.75*4, 0.25*2 + 0.75*(-2)] = [3.25, -1.0]
    result = aggregate_fedavg(global_arrays, clients, [1, 3])
    np.testing.assert_allclose(result["w"], [3.25, -1.0])
    assert result["w"].dtype == np.float32


def test_fedavg_accepts_torch_tensors() -> None:
    clients = [{"w": torch.tensor([2.0])}, {"w": torch.tensor([4.0])}]
    result = aggregate_fedavg({"w": torch.tensor([0.0])}, clients, [1, 1])
    np.testing.assert_allclose(result["w"], [3.0])


def test_integer_buffers_are_averaged_and_stay_integers() -> None:
    clients = [{"count": np.array(3, np.int64)}, {"count": np.array(6, np.int64)}]
    result = aggregate_fedavg({"count": np.array(0, np.int64)}, clients, [1, 2])
    assert result["count"].dtype == np.int64
    assert int(result["count"]) == 5  # (1*3 + 2*6) / 3


def test_server_learning_rate_scales_the_mean_update() -> None:
    # w = 1, client mean = 3 -> D = w - mean = -2 ; server_lr 0.5 -> w_new = 1 - 0.5 * (-2) = 2
    result = aggregate_fedavg(
        {"w": np.array([1.0])},
        [{"w": np.array([2.0])}, {"w": np.array([4.0])}],
        [1, 1],
        ServerOptimizer("sgd", lr=0.5),
    )
    np.testing.assert_allclose(result["w"], [2.0])


def test_momentum_accumulates_the_update_across_rounds() -> None:
    optimizer = ServerOptimizer("momentum", lr=1.0, momentum=0.5)
    w = {"w": np.array([0.0])}
    d = {"w": np.array([1.0])}
    first = optimizer.step(w, d)  # v = 1 -> w = -1
    second = optimizer.step(first, d)  # v = 0.5 * 1 + 1 = 1.5 -> w = -1 - 1.5 = -2.5
    np.testing.assert_allclose(first["w"], [-1.0])
    np.testing.assert_allclose(second["w"], [-2.5])


def test_adam_follows_fedadam_without_bias_correction() -> None:
    optimizer = ServerOptimizer("adam", lr=0.1, beta1=0.9, beta2=0.99, eps=1e-3)
    d = np.array([2.0])
    m = 0.1 * 2.0  # (1 - b1) * d
    v = 0.01 * 4.0  # (1 - b2) * d^2
    expected = 0.0 - 0.1 * m / (np.sqrt(v) + 1e-3)
    np.testing.assert_allclose(optimizer.step({"w": np.array([0.0])}, {"w": d})["w"], [expected])


def test_adam_keeps_its_moments_across_rounds_and_leaves_the_update_untouched() -> None:
    optimizer = ServerOptimizer("adam", lr=0.1, beta1=0.9, beta2=0.99, eps=1e-3)
    updates = [np.array([2.0, -1.0]), np.array([-0.5, 4.0])]
    given = [u.copy() for u in updates]
    w, m, v = np.zeros(2), np.zeros(2), np.zeros(2)
    current = {"w": w.copy()}
    for update in updates:
        m = 0.9 * m + 0.1 * update  # FedAdam's moments by hand
        v = 0.99 * v + 0.01 * update**2
        w = w - 0.1 * m / (np.sqrt(v) + 1e-3)
        current = optimizer.step(current, {"w": update})
        np.testing.assert_allclose(current["w"], w, rtol=1e-12)
    for update, original in zip(updates, given, strict=True):
        np.testing.assert_array_equal(update, original)


def test_momentum_does_not_alias_the_first_update_it_stores() -> None:
    optimizer = ServerOptimizer("momentum", lr=1.0, momentum=0.5)
    first_update = np.array([1.0])
    optimizer.step({"w": np.array([0.0])}, {"w": first_update})
    optimizer.step({"w": np.array([0.0])}, {"w": np.array([1.0])})
    assert first_update[0] == 1.0  # the velocity grew in its own buffer


def test_unknown_server_optimizer_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"'rmsprop' is unknown: use 'sgd', 'momentum' or 'adam'"):
        ServerOptimizer("rmsprop")  # type: ignore[arg-type]


def test_fedavg_strategy_aggregates_replies_like_the_pure_function() -> None:
    strategy = FedAvg(min_train_replies=1)
    strategy.global_arrays = {"w": np.zeros(2, np.float32)}
    replies = [
        train_reply({"w": np.array([1.0, 2.0], np.float32)}, 1),
        train_reply({"w": np.array([4.0, -2.0], np.float32)}, 3),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    np.testing.assert_allclose(arrays["w"].numpy(), [3.25, -1.0])
