"""Influence bounds as pure functions: weight cap, norm outliers, robust means, model rejection."""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np
import pytest

from beyond_averaging.strategies.defences.robust import (
    aggregate_robust,
    check_robust,
    coordinate_median,
    trimmed_mean,
)
from beyond_averaging.strategies.replies.influence import (
    NORM_BLOCK,
    cap_weights,
    max_over_median,
    norm_outliers,
    record_norms,
    update_norms,
)
from beyond_averaging.strategies.replies.validation import REPLY_VALUE_LIMIT, model_rejection
from beyond_averaging.strategies.server_optimizer import ServerOptimizer


def iterative_cap(weights: list[float], cap: float) -> list[float]:
    """Reference: cap the weights above the cap, spread the excess over the rest, repeat."""
    shares = [w / sum(weights) for w in weights]
    cap = max(cap, 1 / len(shares))
    fixed: set[int] = set()
    while True:
        free = [i for i in range(len(shares)) if i not in fixed]
        over = [i for i in free if shares[i] > cap + 1e-15]
        if not over:
            return shares
        fixed.update(over)
        for i in over:
            shares[i] = cap
        rest = 1 - cap * len(fixed)
        free = [i for i in range(len(shares)) if i not in fixed]
        free_total = sum(shares[i] for i in free)
        for i in free:
            shares[i] = shares[i] * rest / free_total


@pytest.mark.parametrize(
    ("weights", "cap"),
    [
        ([1e12, 10, 20, 30], 0.25),
        ([50, 40, 5, 3, 2], 0.3),
        ([1, 1, 1, 97], 0.5),
        ([5, 5, 5, 5], 0.1),  # a cap below 1/K gives equal weights
        ([7, 3, 2, 9, 100, 1, 1, 40], 0.2),
    ],
)
def test_capped_weights_match_the_iterative_redistribution(
    weights: list[float], cap: float
) -> None:
    result = cap_weights(weights, cap)
    np.testing.assert_allclose(result, iterative_cap(weights, cap), rtol=1e-12)
    assert math.isclose(result.sum(), 1.0)
    assert result.max() <= max(cap, 1 / len(weights)) + 1e-12


def test_weights_under_the_cap_are_the_data_size_shares_unchanged() -> None:
    np.testing.assert_array_equal(cap_weights([10, 30, 60], 0.6), [0.1, 0.3, 0.6])
    np.testing.assert_array_equal(cap_weights([10, 30, 60], 1.0), [0.1, 0.3, 0.6])


def test_capping_keeps_the_order_and_ratios_of_the_uncapped_clients() -> None:
    result = cap_weights([1e12, 10, 30], 0.5)
    assert result[0] == 0.5
    assert math.isclose(result[2] / result[1], 3.0)


@pytest.mark.parametrize("bad", [[1.0, np.inf], [1.0, 0.0], [1.0, -2.0], []])
def test_cap_refuses_weights_that_are_not_positive_and_finite(bad: list[float]) -> None:
    with pytest.raises(ValueError, match="weights"):
        cap_weights(bad, 0.5)


def test_norm_outliers_are_those_above_factor_times_the_median() -> None:
    norms = np.array([1.0, 2.0, 3.0, 6.1, 100.0])
    np.testing.assert_array_equal(norm_outliers(norms, 2.0), [False, False, False, True, True])
    assert not norm_outliers(norms, 0.0).any()  # 0 turns it off
    assert not norm_outliers(np.array([0.0, 0.0, 5.0]), 3.0).any()  # median 0: nothing to compare


def test_max_over_median_is_the_ratio_the_norm_filter_compares() -> None:
    norms = [1.0, 2.0, 3.0, 6.1, 100.0]
    assert max_over_median(norms) == pytest.approx(100.0 / statistics.median(norms))
    assert max_over_median([0.0, 0.0, 5.0]) is None  # median 0: no ratio
    assert max_over_median([]) is None


def test_update_and_record_norms_are_the_l2_norms_over_floating_tensors() -> None:
    global_arrays = {
        "w": np.array([1.0, 2.0], np.float32),
        "count": np.array(5, np.int64),
    }
    clients = [
        {"w": np.array([4.0, 6.0], np.float16), "count": np.array(9, np.int64)},
        {"w": np.array([1.0, 2.0], np.float32), "count": np.array(0, np.int64)},
    ]
    np.testing.assert_allclose(update_norms(global_arrays, clients), [5.0, 0.0])
    records = [{"a": np.array([3.0]), "b": np.array([[4.0]])}, {"a": np.array([-1.0])}]
    np.testing.assert_allclose(record_norms(records), [5.0, 1.0])


def test_update_norms_over_tensors_of_many_blocks_and_mixed_dtypes_match_float64() -> None:
    # Tensors of several norm blocks and a partial last one, smaller tensors before and after,
    # and replies in float16, float32 and float64: each norm as NumPy computes it in float64.
    rng = np.random.default_rng(4)
    shapes = {"b0": (7,), "w": (3, NORM_BLOCK + 123), "b1": (NORM_BLOCK // 2 + 5,)}
    global_arrays = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    clients = [
        {k: (v + rng.normal(size=v.shape)).astype(dtype) for k, v in global_arrays.items()}
        for dtype in (np.float16, np.float32, np.float64)
    ]
    expected = [
        np.sqrt(sum(np.sum((c[k].astype(np.float64) - v) ** 2) for k, v in global_arrays.items()))
        for c in clients
    ]
    np.testing.assert_allclose(update_norms(global_arrays, clients), expected, rtol=1e-5)
    # A float16 model: the difference is taken in float32, where float16 would overflow to inf.
    half = {"w": np.full(4, 60000, np.float16)}
    assert update_norms(half, [{"w": np.full(4, -60000, np.float16)}])[0] == 240000.0


def test_record_norms_of_float16_records_over_many_blocks_are_squared_in_float32() -> None:
    # 300^2 = 90,000 is beyond float16 (65,504): each block is squared in float32; several blocks
    # and a partial last one, beside a float32 tensor and an empty one.
    rng = np.random.default_rng(5)
    record = {
        "w": rng.uniform(250, 300, size=2 * NORM_BLOCK + 77).astype(np.float16),
        "b": rng.normal(size=11).astype(np.float32),
        "e": np.zeros(0, np.float16),
    }
    expected = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in record.values()))
    np.testing.assert_allclose(record_norms([record]), [expected], rtol=1e-6)
    swapped = {key: value.astype(value.dtype.newbyteorder(">")) for key, value in record.items()}
    np.testing.assert_allclose(record_norms([swapped]), [expected], rtol=1e-6)  # either order


def reference_robust(
    values: np.ndarray[Any, Any], method: str, trim: float
) -> np.ndarray[Any, Any]:
    """Per coordinate with Python's sorted() and statistics.median: an independent computation."""
    count = values.shape[0]
    flat = values.reshape(count, -1)
    out = []
    for column in flat.T:
        ordered = sorted(float(v) for v in column)
        if method == "median":
            out.append(statistics.median(ordered))
        else:
            cut = math.floor(trim * count)
            kept = ordered[cut : count - cut]
            out.append(math.fsum(kept) / len(kept))
    return np.array(out).reshape(values.shape[1:])


@pytest.mark.parametrize("count", [1, 2, 5, 8])
@pytest.mark.parametrize("trim", [0.0, 0.1, 0.25, 0.4])
def test_trimmed_mean_matches_the_per_coordinate_reference(count: int, trim: float) -> None:
    values = np.random.default_rng(count).normal(size=(count, 3, 4)).astype(np.float32)
    values[0, 0, 0] = 1e9  # one wild value: trimmed away whenever a client is trimmed
    np.testing.assert_allclose(
        trimmed_mean(values, trim), reference_robust(values, "trimmed", trim), rtol=1e-12
    )


@pytest.mark.parametrize("count", [1, 2, 5, 8])
def test_median_matches_the_per_coordinate_reference(count: int) -> None:
    values = np.random.default_rng(10 + count).normal(size=(count, 7))
    np.testing.assert_allclose(coordinate_median(values), reference_robust(values, "median", 0))


def test_robust_fedavg_ignores_one_wild_client_and_claimed_sizes() -> None:
    global_arrays = {"w": np.zeros(3, np.float32), "n": np.array(4, np.int64)}
    honest = [
        {"w": np.full(3, v, np.float32), "n": np.array(c, np.int64)}
        for v, c in [(1.0, 6), (2.0, 6), (3.0, 8)]
    ]
    wild = {"w": np.full(3, 1e12, np.float32), "n": np.array(100, np.int64)}
    result = aggregate_robust(global_arrays, [*honest, wild], "median")
    np.testing.assert_array_equal(result["w"], np.full(3, 2.5, np.float32))
    assert result["w"].dtype == np.float32
    assert result["n"] == 7
    assert result["n"].dtype == np.int64
    trimmed = aggregate_robust(global_arrays, [*honest, wild], "trimmed-mean", 0.25)
    np.testing.assert_allclose(trimmed["w"], np.full(3, 2.5))


def test_robust_fedavg_feeds_the_robust_update_to_the_server_optimizer() -> None:
    global_arrays = {"w": np.array([10.0, 10.0])}
    clients = [{"w": np.array([v, 2 * v])} for v in (1.0, 2.0, 3.0)]
    result = aggregate_robust(
        global_arrays, clients, "median", optimizer=ServerOptimizer("sgd", lr=0.5)
    )
    # median theta = (2, 4); w - 0.5 (w - median) = (6, 7)
    np.testing.assert_allclose(result["w"], [6.0, 7.0])


@pytest.mark.parametrize(("method", "trim"), [("mean", 0.1), ("median", 0.5), ("median", -0.1)])
def test_robust_options_outside_their_range_are_clear_errors(method: str, trim: float) -> None:
    with pytest.raises(ValueError, match=r"robust_aggregation|trim_fraction"):
        check_robust(method, trim)


def test_a_finite_model_near_the_previous_one_is_committed() -> None:
    previous = {"w": np.ones(100, np.float32), "n": np.array(3, np.int64)}
    new = {"w": np.full(100, 3.0, np.float32), "n": 4}
    assert model_rejection(new, previous, median_update=20.0) is None


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (np.nan, "NaN or Inf"),
        (np.inf, "NaN or Inf"),
        (REPLY_VALUE_LIMIT * 10, "magnitude"),
        (1e6, "norm"),  # in range, but 1e4 x the previous model plus the median update
    ],
)
def test_a_broken_or_exploding_model_is_rejected_with_the_reason(value: float, why: str) -> None:
    previous = {"w": np.ones(100, np.float64)}
    new = np.ones(100, np.float64)
    new[7] = value
    reason = model_rejection({"w": new}, previous, median_update=1.0)
    assert reason is not None
    assert why in reason
