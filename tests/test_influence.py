"""Byzantine bounds and robust forms as pure functions, each against an independent computation.

References are written here the long way (explicit loops over clients and coordinates, Flower's
own Krum selection), never from the functions under test.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.serverapp.strategy.multikrum import select_multikrum

from beyond_averaging.strategies.aggregate import pseudo_gradient, scaled_mean, scaled_weights
from beyond_averaging.strategies.defences import robust
from beyond_averaging.strategies.defences.robust import (
    aggregate_robust,
    fltrust_scores,
    krum_scores,
    krum_selection,
    robust_update,
    update_gram,
)
from beyond_averaging.strategies.replies import influence
from beyond_averaging.strategies.replies.influence import (
    DIRECTION_FLOOR,
    bound_claims,
    clip_scales,
    direction_cosines,
    direction_outliers,
)

Model = dict[str, np.ndarray[Any, Any]]


def federation(count: int, seed: int = 0) -> tuple[Model, list[Model]]:
    """A global model (a matrix, a vector and an integer counter) and ``count`` client models."""
    rng = np.random.default_rng(seed)
    global_model = {
        "w": rng.normal(size=(5, 3)).astype(np.float32),
        "b": rng.normal(size=4).astype(np.float32),
        "n": np.array(7, np.int64),
    }
    clients = [
        {
            "w": (global_model["w"] + rng.normal(size=(5, 3))).astype(np.float32),
            "b": (global_model["b"] + rng.normal(size=4)).astype(np.float32),
            "n": np.array(int(rng.integers(0, 20)), np.int64),
        }
        for _ in range(count)
    ]
    return global_model, clients


def flat_update(global_model: Model, client: Model) -> np.ndarray[Any, Any]:
    return np.concatenate(
        [(client[k].astype(np.float64) - global_model[k]).ravel() for k in ("w", "b")]
    )


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of a few elements, so that every streaming function crosses block boundaries."""
    monkeypatch.setattr(robust, "ROBUST_BLOCK_ELEMENTS", 7)


def test_clip_scales_bring_every_norm_down_to_factor_times_the_median() -> None:
    norms = np.array([1.0, 2.0, 3.0, 30.0, 0.0])
    scales = clip_scales(norms, 1.5)  # median 2: bound 3
    np.testing.assert_allclose(scales, [1.0, 1.0, 1.0, 0.1, 1.0])
    np.testing.assert_allclose(np.minimum(norms, 3.0), norms * scales)
    assert np.all(clip_scales(norms, 0.0) == 1.0)  # 0: off
    assert np.all(clip_scales(np.zeros(3), 2.0) == 1.0)  # median 0: nothing to compare


def test_a_claim_counts_for_at_most_factor_times_the_median_claim() -> None:
    np.testing.assert_array_equal(bound_claims([10, 20, 30, 1e12], 2.0), [10, 20, 30, 50])
    np.testing.assert_array_equal(bound_claims([10, 20, 1e12], 0.0), [10, 20, 1e12])


def test_direction_cosines_are_each_update_against_the_clipped_mean_of_the_others() -> None:
    global_model, clients = federation(6)
    clients[5] = {**clients[5], "w": clients[5]["w"] * 40}  # a large update: clipped in the mean
    updates = [flat_update(global_model, c) for c in clients]
    norms = np.array([np.linalg.norm(u) for u in updates])
    median = float(np.median(norms))
    expected = []
    for k, own in enumerate(updates):
        others = [u * min(1.0, median / np.linalg.norm(u)) for j, u in enumerate(updates) if j != k]
        mean = np.mean(others, axis=0)
        expected.append(float(own @ mean / (np.linalg.norm(own) * np.linalg.norm(mean))))
    # float32 dot products: cosines to 1e-6, far finer than the 0.1 the check compares with
    np.testing.assert_allclose(direction_cosines(global_model, clients, norms), expected, atol=1e-6)


def test_a_sign_flipped_update_is_a_direction_outlier_and_honest_ones_are_not() -> None:
    rng = np.random.default_rng(3)
    direction = rng.normal(size=40)
    global_model = {"v": np.zeros(40)}
    honest = [{"v": direction + 0.5 * rng.normal(size=40)} for _ in range(3)]
    flipped = {"v": -5.0 * honest[0]["v"]}
    clients = [*honest, flipped]
    norms = np.array([np.linalg.norm(c["v"]) for c in clients])
    cosines = direction_cosines(global_model, clients, norms)
    assert cosines[3] < -0.8 < 0.5 < cosines[:3].min()
    np.testing.assert_array_equal(direction_outliers(cosines, 2.0), [False, False, False, True])
    assert not direction_outliers(cosines, 0.0).any()  # 0: off
    assert not direction_outliers(cosines[[0, 3]], 2.0).any()  # two replies: no majority


def test_a_model_larger_than_the_budget_is_compared_on_the_drawn_blocks_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(influence, "DIRECTION_STACK_BYTES", 4 * 4 * 100)  # blocks of 100 values
    rng = np.random.default_rng(5)
    global_model = {"w": rng.normal(size=(30, 20)), "b": rng.normal(size=350)}
    clients = [{k: v + rng.normal(size=v.shape) for k, v in global_model.items()} for _ in range(4)]
    norms = np.array([np.linalg.norm(flat_update(global_model, c)) for c in clients])
    segments = influence.direction_segments(global_model, clients, 300, (7, 3))

    def spans(seed: tuple[int, int]) -> list[tuple[int, int, int]]:
        drawn = influence.direction_segments(global_model, clients, 300, seed)
        return [(origin.size, start, stop) for _, origin, start, stop in drawn]

    assert len(set(spans((7, 3)))) == len(segments)  # distinct blocks
    assert 300 <= sum(stop - start for _, _, start, stop in segments) < 400
    assert spans((7, 3)) == spans((7, 3))  # seeded
    assert spans((7, 4)) != spans((7, 3))  # another round, other blocks
    every = influence.direction_segments(global_model, clients, 950, (7, 3))
    assert sum(stop - start for _, _, start, stop in every) == 950  # a model within the budget

    # Independent: the same cosines by hand on exactly the drawn coordinates, the clipping
    # scales from the full norms.
    def key_of(origin: np.ndarray) -> str:
        return next(k for k, v in global_model.items() if np.shares_memory(origin, v))

    def drawn(client: Model) -> np.ndarray:
        parts = []
        for _, origin, start, stop in segments:
            key = key_of(origin)
            parts.append((client[key] - global_model[key]).reshape(-1)[start:stop])
        return np.concatenate(parts)

    picked = [drawn(c) for c in clients]
    scales = np.minimum(1.0, np.median(norms) / norms)
    expected = []
    for k, own in enumerate(picked):
        mean = np.mean([scales[j] * u for j, u in enumerate(picked) if j != k], axis=0)
        expected.append(float(own @ mean / (np.linalg.norm(own) * np.linalg.norm(mean))))
    cosines = direction_cosines(global_model, clients, norms, coordinates=300, seed=(7, 3))
    np.testing.assert_allclose(cosines, expected, atol=1e-5)


def test_a_sign_flipped_update_is_found_on_a_sample_of_a_large_model() -> None:
    rng = np.random.default_rng(8)
    size = 400_000
    direction = rng.normal(size=size).astype(np.float32)
    global_model = {"v": np.zeros(size, dtype=np.float32)}
    honest = [{"v": direction + rng.normal(size=size).astype(np.float32)} for _ in range(5)]
    clients = [*honest, {"v": -5.0 * honest[0]["v"]}]
    norms = np.array([np.linalg.norm(c["v"]) for c in clients])
    exact = direction_cosines(global_model, clients, norms, coordinates=size)
    sampled = direction_cosines(global_model, clients, norms, coordinates=20_000, seed=(1, 2))
    np.testing.assert_allclose(sampled, exact, atol=0.02)  # about 1/sqrt(20,000) = 0.007
    assert not np.allclose(sampled, exact, atol=1e-6)  # a sample, not the whole model
    np.testing.assert_array_equal(direction_outliers(sampled, 2.0), [False] * 5 + [True])


def test_disagreement_within_a_wide_honest_spread_is_kept() -> None:
    # Under label skew honest cosines spread widely: -0.5 is within the round's own spread.
    cosines = np.array([-0.5, -0.2, 0.1, 0.3, 0.6, 0.8])
    assert not direction_outliers(cosines, 2.0).any()
    # and nothing above -DIRECTION_FLOOR is ever dropped, however tight the round
    tight = np.array([0.9, 0.9, 0.9, 0.9, -DIRECTION_FLOOR + 0.01])
    assert not direction_outliers(tight, 2.0).any()


def test_the_scaled_mean_is_the_mean_of_the_clipped_models() -> None:
    global_model, clients = federation(4)
    weights = np.array([0.1, 0.2, 0.3, 0.4])
    scales = np.array([1.0, 0.5, 0.25, 1.0])
    result = scaled_mean(global_model, clients, weights, scales)
    for key in ("w", "b"):
        expected = sum(
            p * (global_model[key].astype(np.float64) + s * (c[key] - global_model[key]))
            for p, s, c in zip(weights, scales, clients, strict=True)
        )
        np.testing.assert_allclose(result[key], expected, atol=1e-6)  # float32 result
    counters = sum(p * c["n"] for p, c in zip(weights, clients, strict=True))
    assert result["n"] == np.rint(counters)  # counters are averaged, never scaled
    # every scale 1: the plain weighted mean, bit for bit
    plain = scaled_mean(global_model, clients, weights, np.ones(4))
    unscaled = scaled_mean(global_model, clients, weights, None)
    for key in global_model:
        np.testing.assert_array_equal(plain[key], unscaled[key])


def test_the_clipped_mean_update_is_the_mean_of_the_scaled_updates() -> None:
    global_model, clients = federation(3)
    weights, scales = np.array([0.5, 0.3, 0.2]), np.array([0.2, 1.0, 0.7])
    update = pseudo_gradient(global_model, clients, scaled_weights(weights, scales), ["w", "b"])
    for key in ("w", "b"):
        expected = sum(
            p * s * (global_model[key].astype(np.float64) - c[key])
            for p, s, c in zip(weights, scales, clients, strict=True)
        )
        np.testing.assert_allclose(update[key], expected, rtol=1e-6)


@pytest.mark.parametrize("method", ["median", "trimmed-mean"])
def test_the_robust_update_is_the_per_coordinate_robust_mean_of_the_scaled_updates(
    method: str,
) -> None:
    global_model, clients = federation(5)
    scales = np.array([1.0, 0.5, 1.0, 0.1, 0.8])
    result = robust_update(global_model, clients, ["w", "b"], method, 0.2, scales)  # type: ignore[arg-type]
    for key in ("w", "b"):
        for index in np.ndindex(global_model[key].shape):
            values = sorted(
                s * (float(global_model[key][index]) - float(c[key][index]))
                for s, c in zip(scales, clients, strict=True)
            )
            expected = values[2] if method == "median" else math.fsum(values[1:4]) / 3
            assert result[key][index] == pytest.approx(expected, rel=1e-9)


def test_robust_fedavg_of_clipped_updates_steps_from_the_global_model() -> None:
    global_model, clients = federation(3)
    scales = np.array([1.0, 0.5, 1.0])
    result = aggregate_robust(global_model, clients, "median", scales=scales)
    for key in ("w", "b"):
        origin = global_model[key].astype(np.float64)
        updates = np.stack([s * (c[key] - origin) for s, c in zip(scales, clients, strict=True)])
        expected = origin + np.median(updates, axis=0)
        np.testing.assert_allclose(result[key], expected, atol=1e-6)  # float32 result
        assert result[key].dtype == global_model[key].dtype
    assert result["n"] == np.median([c["n"] for c in clients])


def test_the_gram_matrix_is_the_updates_inner_products() -> None:
    global_model, clients = federation(5)
    updates = np.stack([flat_update(global_model, c) for c in clients])
    np.testing.assert_allclose(update_gram(global_model, clients), updates @ updates.T)


@pytest.mark.parametrize(("count", "byzantine", "keep"), [(5, 1, 1), (6, 1, 5), (10, 2, 8)])
def test_krum_keeps_the_replies_flowers_multikrum_keeps(
    count: int, byzantine: int, keep: int
) -> None:
    global_model, clients = federation(count, seed=count)
    clients[0] = {**clients[0], "w": clients[0]["w"] * 50}  # one far away
    contents = [
        RecordDict(
            {"arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in c.items() if k != "n"})}
        )
        for c in clients
    ]
    flower = select_multikrum(contents, num_malicious_nodes=byzantine, num_nodes_to_select=keep)
    expected = sorted(contents.index(c) for c in flower)
    method = "krum" if keep == 1 else "multi-krum"
    trim = byzantine / count
    assert krum_selection(global_model, clients, method, trim) == expected
    assert 0 not in expected


def test_krum_scores_sum_the_nearest_squared_distances() -> None:
    points = np.array([[0.0], [1.0], [3.0], [10.0]])
    gram = points @ points.T
    # K = 4, f = 1: each client's 1 nearest other client
    np.testing.assert_allclose(krum_scores(gram, 1), [1.0, 1.0, 4.0, 49.0])


def test_fltrust_trusts_the_cosine_with_the_server_update_and_rescales_to_its_norm() -> None:
    global_model = {"v": np.zeros(3)}
    server_update = {"v": np.array([2.0, 0.0, 0.0])}
    clients = [
        {"v": np.array([4.0, 4.0, 0.0])},  # 45 degrees
        {"v": np.array([-1.0, 0.0, 0.0])},  # against the server
        {"v": np.array([0.0, 0.0, 0.0])},  # no update
    ]
    trust, scales = fltrust_scores(global_model, clients, server_update)
    np.testing.assert_allclose(trust, [math.sqrt(0.5), 0.0, 0.0])
    np.testing.assert_allclose(scales, [2.0 / math.sqrt(32.0), 2.0, 1.0])
