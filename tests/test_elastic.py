"""Elastic aggregation on the server: the zeta rule, buffers, server optimizers, reply contract."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from beyond_averaging.strategies import ElasticAggregation, MissingRecordError, aggregate_elastic
from beyond_averaging.strategies.elastic import elastic_zeta
from tests.conftest import train_reply

Arrays = dict[str, np.ndarray[Any, Any]]

GLOBAL: Arrays = {"w": np.zeros((2, 3), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}


def filled(value: float, template: Arrays = GLOBAL) -> Arrays:
    return {key: np.full_like(array, value) for key, array in template.items()}


def test_uniform_sensitivity_gives_zeta_tau_everywhere() -> None:
    # Clients 1.0 (10 examples) and 3.0 (30): mean 2.5, D = 0 - 2.5; zeta = tau = 0.5 everywhere,
    # so w_new = 0 - 1.0 * 0.5 * (-2.5) = 1.25 for every element.
    result = aggregate_elastic(
        GLOBAL, [filled(1.0), filled(3.0)], [filled(0.7), filled(0.7)], [10, 30], tau=0.5
    )
    for key in GLOBAL:
        np.testing.assert_allclose(result[key], np.full_like(GLOBAL[key], 1.25), rtol=1e-6)
        assert result[key].dtype == np.float32


def test_single_nonzero_sensitivity_gives_tau_there_and_one_plus_tau_elsewhere() -> None:
    sensitivity = filled(0.0)
    sensitivity["w"][1, 2] = 4.0
    result = aggregate_elastic(
        GLOBAL, [filled(2.0), filled(2.0)], [sensitivity, sensitivity], [1, 1], tau=0.3
    )
    # D = -2 everywhere: w_new = 2 * zeta, zeta = 0.3 at w[1, 2] and 1.3 elsewhere.
    expected_w = np.full((2, 3), 2.6, dtype=np.float32)
    expected_w[1, 2] = 0.6
    np.testing.assert_allclose(result["w"], expected_w, rtol=1e-6)
    # 'b' has an all-zero sensitivity: zeta = 1 + tau, never 0 / 0.
    np.testing.assert_allclose(result["b"], np.full(3, 2.6, dtype=np.float32), rtol=1e-6)


def test_the_max_is_taken_per_tensor_not_over_the_whole_model() -> None:
    # w holds the model's largest sensitivity (10); b's own max is 1. With a per-tensor max, b's
    # element of sensitivity 1 gets zeta = tau; with a global max it would get 1 + tau - 0.1.
    sensitivity = {"w": np.full((2, 3), 10.0), "b": np.array([1.0, 0.5, 0.0])}
    zeta_b = np.array([0.5, 1.0, 1.5])
    result = aggregate_elastic(GLOBAL, [filled(-1.0)], [sensitivity], [5], tau=0.5)
    np.testing.assert_allclose(result["b"], -zeta_b, rtol=1e-6)
    np.testing.assert_allclose(result["w"], np.full((2, 3), -0.5), rtol=1e-6)


def test_zeta_lies_between_tau_and_one_plus_tau() -> None:
    omega = np.random.default_rng(0).exponential(size=(50, 7))
    zeta = elastic_zeta(omega, tau=0.2)
    assert zeta.min() == pytest.approx(0.2, abs=1e-9)
    assert zeta.max() <= 1.2
    assert zeta.min() >= 0.2 - 1e-12


def test_aggregate_elastic_matches_a_naive_per_element_loop() -> None:
    rng = np.random.default_rng(1)
    global_arrays = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)}
    clients = [
        {k: v + rng.normal(size=v.shape) for k, v in global_arrays.items()} for _ in range(3)
    ]
    sensitivities = [
        {k: rng.exponential(size=v.shape) for k, v in global_arrays.items()} for _ in range(3)
    ]
    counts, tau, server_lr = [5.0, 7.0, 13.0], 0.4, 0.8
    result = aggregate_elastic(global_arrays, clients, sensitivities, counts, tau, server_lr)

    total = sum(counts)
    for key, w in global_arrays.items():
        omega = np.zeros(w.shape)
        for n, s in zip(counts, sensitivities, strict=True):
            for index in np.ndindex(w.shape):
                omega[index] += n / total * s[key][index]
        largest = max(omega[index] for index in np.ndindex(w.shape))
        for index in np.ndindex(w.shape):
            mean_update = sum(
                n / total * (w[index] - c[key][index]) for n, c in zip(counts, clients, strict=True)
            )
            zeta = 1 + tau - omega[index] / (largest + 1e-13)
            assert result[key][index] == pytest.approx(w[index] - server_lr * zeta * mean_update)


def test_tensors_without_sensitivity_are_the_weighted_average() -> None:
    global_arrays = {
        "w": np.zeros(2, dtype=np.float32),
        "bn.running_mean": np.zeros(2, dtype=np.float32),
        "bn.num_batches_tracked": np.array(0, dtype=np.int64),
    }
    clients = [
        {"w": np.ones(2), "bn.running_mean": np.array([1.0, 2.0]), "bn.num_batches_tracked": 4},
        {"w": np.ones(2), "bn.running_mean": np.array([5.0, 6.0]), "bn.num_batches_tracked": 8},
    ]
    clients_np = [{k: np.asarray(v) for k, v in c.items()} for c in clients]
    sensitivities = [{"w": np.ones(2)}, {"w": np.ones(2)}]
    result = aggregate_elastic(global_arrays, clients_np, sensitivities, [1, 3], tau=0.5)
    # (1 * [1, 2] + 3 * [5, 6]) / 4 and (1 * 4 + 3 * 8) / 4 = 7, unscaled by zeta.
    np.testing.assert_allclose(result["bn.running_mean"], [4.0, 5.0])
    assert result["bn.num_batches_tracked"] == 7
    assert result["bn.num_batches_tracked"].dtype == np.int64
    np.testing.assert_allclose(result["w"], [0.5, 0.5])  # zeta = tau on the parameter


def test_float16_and_torch_inputs_give_the_float32_result() -> None:
    rng = np.random.default_rng(2)
    sensitivity = {
        k: np.asarray(rng.exponential(size=v.shape), dtype=np.float32) for k, v in GLOBAL.items()
    }
    clients = [filled(1.0), filled(-2.0)]
    reference = aggregate_elastic(GLOBAL, clients, [sensitivity] * 2, [1, 2])
    half = {k: v.astype(np.float16) for k, v in sensitivity.items()}
    as_torch = [{k: torch.from_numpy(v) for k, v in c.items()} for c in clients]
    result = aggregate_elastic(GLOBAL, as_torch, [half] * 2, [1, 2])
    for key in GLOBAL:
        np.testing.assert_allclose(result[key], reference[key], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("tau", [-0.1, 1.5, float("nan")])
def test_tau_outside_zero_one_is_a_clear_error(tau: float) -> None:
    with pytest.raises(ValueError, match=r"tau = .*allowed is \[0, 1\]"):
        aggregate_elastic(GLOBAL, [filled(1.0)], [filled(1.0)], [1], tau=tau)
    with pytest.raises(ValueError, match=r"tau = .*allowed is \[0, 1\]"):
        ElasticAggregation(tau=tau)


def test_clients_with_different_sensitivity_keys_are_an_error() -> None:
    with pytest.raises(ValueError, match="same tensors"):
        aggregate_elastic(GLOBAL, [filled(1.0)] * 2, [filled(1.0), {"w": np.ones((2, 3))}], [1, 1])


# ---------------------------------------------------------------------- the Flower strategy


def elastic(**options: Any) -> ElasticAggregation:
    strategy = ElasticAggregation(parameter_keys=["w", "b"], **options)
    strategy.global_arrays = {k: v.copy() for k, v in GLOBAL.items()}  # done by configure_train
    return strategy


def reply(value: float, count: int, sensitivity: Arrays | None, node_id: int = 1) -> Any:
    extra = {} if sensitivity is None else {"sensitivity": sensitivity}
    return train_reply(filled(value), count, node_id=node_id, extra=extra)


def run_round(strategy: ElasticAggregation, replies: list[Any], rnd: int = 1) -> tuple[Arrays, Any]:
    record, metrics = strategy.aggregate_train(rnd, replies)
    assert record is not None
    assert metrics is not None
    return {k: v.numpy() for k, v in record.items()}, strategy.aggregation_metrics[rnd]


def test_strategy_sends_decay_and_dtype_and_asks_for_sensitivity() -> None:
    strategy = elastic(sensitivity_decay=0.8, sensitivity_dtype="float16")
    assert strategy.train_config_entries() == {
        "sensitivity-decay": 0.8,
        "sensitivity-dtype": "float16",
    }
    assert set(strategy.required_records) == {"sensitivity"}


def test_strategy_with_sgd_applies_the_pure_rule_and_reports_zeta() -> None:
    sensitivity = filled(1.0)
    sensitivity["w"][0, 0] = 3.0
    strategy = elastic(tau=0.5, server_lr=0.5)
    arrays, metrics = run_round(
        strategy, [reply(1.0, 10, sensitivity, 1), reply(3.0, 30, sensitivity, 2)]
    )
    expected = aggregate_elastic(
        GLOBAL, [filled(1.0), filled(3.0)], [sensitivity] * 2, [10, 30], 0.5, 0.5
    )
    for key in GLOBAL:
        np.testing.assert_allclose(arrays[key], expected[key], rtol=1e-6)
    # zeta: w[0,0] 0.5, the other 5 w elements 1.5 - 1/3, b uniform 0.5: mean over 9 elements.
    assert metrics["elastic-zeta-mean"] == pytest.approx((0.5 + 5 * (1.5 - 1 / 3) + 3 * 0.5) / 9)
    assert metrics["elastic-zeta-min"] == pytest.approx(0.5)


def test_strategy_feeds_the_zeta_scaled_update_to_adam() -> None:
    # One client at 2.0, uniform sensitivity: zeta = tau = 0.5, D = -2, zeta D = -1.
    # FedAdam's first step: m = 0.1 * -1, v = 0.01 * 1, w = 0 - lr * m / (sqrt(v) + eps).
    strategy = elastic(tau=0.5, server_optimizer="adam", server_lr=0.1, server_eps=1e-3)
    arrays, _ = run_round(strategy, [reply(2.0, 5, filled(1.0)), reply(2.0, 5, filled(1.0), 2)])
    expected = -0.1 * (-0.1) / (0.1 + 1e-3)
    np.testing.assert_allclose(arrays["w"], np.full((2, 3), expected), rtol=1e-6)


def test_strategy_feeds_the_zeta_scaled_update_to_momentum_across_rounds() -> None:
    strategy = elastic(tau=1.0, server_optimizer="momentum", server_lr=1.0, server_momentum=0.9)
    replies = [reply(2.0, 5, filled(1.0)), reply(2.0, 5, filled(1.0), 2)]
    first, _ = run_round(strategy, replies)
    # Round 1: zeta = 1, D = -2, v = -2, w = 2. Round 2 from w = 2 with clients at 2: D = 0,
    # v = 0.9 * -2 + 0 = -1.8, w = 2 + 1.8 = 3.8.
    np.testing.assert_allclose(first["w"], np.full((2, 3), 2.0))
    strategy.global_arrays = {k: v.copy() for k, v in first.items()}
    second, _ = run_round(strategy, replies, rnd=2)
    np.testing.assert_allclose(second["w"], np.full((2, 3), 3.8), rtol=1e-6)


def bad_sensitivity(case: str) -> Arrays:
    sensitivity = filled(1.0)
    if case == "nan":
        sensitivity["w"][0, 1] = np.nan
    elif case == "wrong-shape":
        sensitivity["w"] = np.ones((3, 2))
    elif case == "missing-key":
        del sensitivity["b"]
    elif case == "negative":
        sensitivity["b"][0] = -1.0
    return sensitivity


@pytest.mark.parametrize("case", ["nan", "wrong-shape", "missing-key", "negative"])
def test_reply_with_bad_sensitivity_is_dropped_and_the_round_goes_on(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = elastic()
    good = [reply(1.0, 10, filled(1.0), 1), reply(3.0, 30, filled(1.0), 2)]
    with caplog.at_level(logging.WARNING):
        arrays, metrics = run_round(strategy, [*good, reply(100.0, 10, bad_sensitivity(case), 3)])
    assert metrics["replies-dropped"] == 1
    assert metrics["dropped-bad-sensitivity"] == 1
    assert "sensitivity" in caplog.text
    # Only the two good clients count: uniform sensitivity, zeta = 0.5, mean 2.5, w_new = 1.25.
    np.testing.assert_allclose(arrays["w"], np.full((2, 3), 1.25), rtol=1e-6)


def test_reply_without_sensitivity_is_dropped_with_how_to_add_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = elastic()
    good = [reply(1.0, 10, filled(1.0), 1), reply(3.0, 30, filled(1.0), 2)]
    with caplog.at_level(logging.WARNING):
        _, metrics = run_round(strategy, [*good, reply(1.0, 10, None, 3)])
    assert metrics["dropped-missing-sensitivity"] == 1
    assert "no ArrayRecord named 'sensitivity'" in caplog.text


def test_round_where_no_reply_has_sensitivity_stops_with_the_recipe() -> None:
    strategy = elastic()
    with pytest.raises(MissingRecordError, match=r"ElasticAggregation needs.*sensitivity_record"):
        strategy.aggregate_train(1, [reply(1.0, 10, None, 1), reply(2.0, 10, None, 2)])


def test_without_parameter_keys_only_keys_every_reply_carries_are_scaled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = ElasticAggregation(tau=0.5)
    strategy.global_arrays = {k: v.copy() for k, v in GLOBAL.items()}
    with caplog.at_level(logging.WARNING):
        arrays, _ = run_round(
            strategy, [reply(2.0, 1, filled(1.0), 1), reply(2.0, 1, {"w": np.ones((2, 3))}, 2)]
        )
    np.testing.assert_allclose(arrays["w"], np.full((2, 3), 1.0))  # zeta 0.5 * 2
    np.testing.assert_allclose(arrays["b"], np.full(3, 2.0))  # plain average
    assert "averaged without elastic scaling" in caplog.text
