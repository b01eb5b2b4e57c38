"""Client diagnostics against hand values, naive per-pair loops and known Gaussian answers."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from beyond_averaging.strategies import FedAvg, diagnostics
from beyond_averaging.strategies.diagnostics import (
    ClientDiagnostics,
    cohort_coherence,
    cosine_matrix,
    gather_coordinates,
    gaussian_mutual_information,
    pairwise_gaussian_mutual_information,
    pairwise_statistics,
    round_diagnostics,
    sample_coordinates,
)
from tests.conftest import train_reply

Arrays = dict[str, np.ndarray[Any, Any]]


def random_clients(count: int, seed: int = 0) -> tuple[Arrays, list[Arrays]]:
    """A global model with a matrix, a vector and a 0-d tensor, and ``count`` trained clients."""
    rng = np.random.default_rng(seed)
    shapes = {"layer.weight": (4, 3), "layer.bias": (3,), "scale": ()}
    global_arrays = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    clients = [
        {
            k: (v + rng.normal(scale=0.1, size=v.shape)).astype(np.float32)
            for k, v in global_arrays.items()
        }
        for _ in range(count)
    ]
    return global_arrays, clients


def flat(arrays: Arrays, keys: list[str]) -> np.ndarray[Any, Any]:
    return np.concatenate([np.asarray(arrays[k], np.float64).reshape(-1) for k in keys])


def test_cosine_of_known_updates_matches_hand_values() -> None:
    # g = w - theta with w = 0, so theta = -g: g1 = (1, 0), g2 = (1, 1), g3 = (-1, 0).
    global_arrays = {"w": np.zeros(2)}
    clients = [{"w": -np.array(g, float)} for g in ([1, 0], [1, 1], [-1, 0])]
    cosine = cosine_matrix(pairwise_statistics(global_arrays, clients, ["w"]).gram)
    half_root = 1.0 / math.sqrt(2.0)
    expected = [[1, half_root, -1], [half_root, 1, -half_root], [-1, -half_root, 1]]
    np.testing.assert_allclose(cosine, expected, atol=1e-12)


def test_a_client_with_a_zero_update_has_zero_cosine_not_nan() -> None:
    global_arrays = {"w": np.array([1.0, 2.0])}
    clients = [{"w": np.array([1.0, 2.0])}, {"w": np.array([0.0, 2.0])}]
    cosine = cosine_matrix(pairwise_statistics(global_arrays, clients, ["w"]).gram)
    np.testing.assert_array_equal(cosine, [[0.0, 0.0], [0.0, 1.0]])


def test_distances_match_a_naive_loop_over_pairs_and_elements() -> None:
    global_arrays, clients = random_clients(5)
    keys = list(global_arrays)
    stats = pairwise_statistics(global_arrays, clients, keys)
    for i, j in itertools.product(range(5), repeat=2):
        a, b = flat(clients[i], keys), flat(clients[j], keys)
        euclidean = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
        manhattan = sum(abs(x - y) for x, y in zip(a, b, strict=True))
        chebyshev = max(abs(x - y) for x, y in zip(a, b, strict=True))
        assert stats.euclidean[i, j] == pytest.approx(euclidean, rel=1e-9, abs=1e-12)
        assert stats.manhattan[i, j] == pytest.approx(manhattan, rel=1e-9, abs=1e-12)
        assert stats.chebyshev[i, j] == pytest.approx(chebyshev, rel=1e-9, abs=1e-12)
        g_i, g_j = flat(global_arrays, keys) - a, flat(global_arrays, keys) - b
        assert stats.gram[i, j] == pytest.approx(float(sum(g_i * g_j)), rel=1e-9)


def test_chunked_processing_gives_the_same_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    global_arrays, clients = random_clients(4, seed=3)
    whole = pairwise_statistics(global_arrays, clients, list(global_arrays))
    monkeypatch.setattr(diagnostics, "CHUNK_ELEMENTS", 5)  # 12-element tensor -> 5 + 5 + 2
    chunked = pairwise_statistics(global_arrays, clients, list(global_arrays))
    for name in ("gram", "euclidean", "manhattan", "chebyshev"):
        np.testing.assert_allclose(getattr(chunked, name), getattr(whole, name), rtol=1e-12)


def test_only_the_named_keys_enter_the_statistics() -> None:
    global_arrays = {"w": np.zeros(2), "running_mean": np.zeros(1)}
    clients = [
        {"w": np.array([1.0, 0.0]), "running_mean": np.array([100.0])},
        {"w": np.array([0.0, 1.0]), "running_mean": np.array([-100.0])},
    ]
    stats = pairwise_statistics(global_arrays, clients, ["w"])
    assert stats.euclidean[0, 1] == pytest.approx(math.sqrt(2.0))


def test_cohort_coherence_matches_the_paper_sum_by_hand() -> None:
    cosine = np.array([[1.0, 0.5, -0.2], [0.5, 1.0, 0.1], [-0.2, 0.1, 1.0]])
    weights = np.array([0.5, 0.3, 0.2])
    expected = 0.0
    for i in range(3):
        for j in range(3):
            if i != j:
                expected += weights[i] * weights[j] * cosine[i, j]
    assert cohort_coherence(cosine, weights) == pytest.approx(expected / 3)
    # 2 * (0.15 * 0.5 + 0.10 * -0.2 + 0.06 * 0.1) / 3 = 2 * 0.061 / 3
    assert cohort_coherence(cosine, weights) == pytest.approx(0.122 / 3)


def test_gaussian_mutual_information_of_a_bivariate_normal_with_known_rho() -> None:
    rho = 0.6
    rng = np.random.default_rng(7)
    samples = rng.multivariate_normal([0.0, 0.0], [[1.0, rho], [rho, 1.0]], size=200_000)
    expected = -0.5 * math.log(1.0 - rho**2)  # 0.2231 nats
    assert gaussian_mutual_information(samples[:, 0], samples[:, 1]) == pytest.approx(
        expected, abs=0.01
    )
    pairwise = pairwise_gaussian_mutual_information(samples.T)
    assert pairwise[0, 1] == pytest.approx(expected, abs=0.01)
    assert pairwise[1, 0] == pairwise[0, 1]
    assert math.isnan(pairwise[0, 0])


def test_log_determinant_formula_for_multivariate_x_and_y() -> None:
    covariance = np.array(
        [
            [1.0, 0.3, 0.5, 0.1],
            [0.3, 2.0, 0.2, 0.4],
            [0.5, 0.2, 1.5, 0.0],
            [0.1, 0.4, 0.0, 1.0],
        ]
    )
    expected = 0.5 * math.log(
        np.linalg.det(covariance[:2, :2])
        * np.linalg.det(covariance[2:, 2:])
        / np.linalg.det(covariance)
    )
    samples = np.random.default_rng(11).multivariate_normal(np.zeros(4), covariance, size=200_000)
    estimate = gaussian_mutual_information(samples[:, :2], samples[:, 2:])
    assert estimate == pytest.approx(expected, abs=0.01)


def test_pairwise_mutual_information_equals_the_general_formula_per_pair() -> None:
    rows = np.random.default_rng(2).normal(size=(4, 50))
    rows[1] += 0.8 * rows[0]
    pairwise = pairwise_gaussian_mutual_information(rows)
    for i, j in itertools.permutations(range(4), 2):
        assert pairwise[i, j] == pytest.approx(gaussian_mutual_information(rows[i], rows[j]))


def test_identical_clients_give_a_large_finite_mutual_information() -> None:
    row = np.arange(10.0)
    pairwise = pairwise_gaussian_mutual_information(np.stack([row, row, -row]))
    ceiling = -0.5 * math.log(diagnostics.MIN_ONE_MINUS_RHO_SQUARED)
    assert pairwise[0, 1] == pytest.approx(ceiling)
    assert pairwise[0, 2] == pytest.approx(ceiling)  # rho = -1 is as informative as +1


def test_a_constant_client_has_undefined_mutual_information() -> None:
    pairwise = pairwise_gaussian_mutual_information(np.stack([np.ones(5), np.arange(5.0)]))
    assert math.isnan(pairwise[0, 1])


def test_coordinate_subset_is_fixed_by_the_seed_and_indexes_the_concatenation() -> None:
    sizes = {"a": 6, "b": 1, "c": 9}
    first = sample_coordinates(sizes, 8, seed=4)
    again = sample_coordinates(sizes, 8, seed=4)
    assert first.keys() == again.keys()
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
        assert np.all((first[key] >= 0) & (first[key] < sizes[key]))
    assert sum(len(v) for v in first.values()) == 8
    assert sample_coordinates(sizes, 100, seed=0).keys() == sizes.keys()  # capped at all 16

    global_arrays = {k: np.zeros(n) for k, n in sizes.items()}
    clients = [{k: np.arange(n) + 100.0 * c for k, n in sizes.items()} for c in range(2)]
    gathered = gather_coordinates(clients, first)
    for c in range(2):
        concatenated = flat(clients[c], list(sizes))
        offsets = {"a": 0, "b": 6, "c": 7}
        naive = [concatenated[offsets[k] + i] for k in first for i in first[k]]
        np.testing.assert_array_equal(gathered[c], naive)
    updates = gather_coordinates(clients, first, reference=global_arrays)
    np.testing.assert_array_equal(updates, -gathered)


def test_round_diagnostics_reports_pair_means_and_the_cohort_value() -> None:
    global_arrays, clients = random_clients(3, seed=5)
    keys = list(global_arrays)
    weights = np.array([0.2, 0.3, 0.5])
    coordinates = sample_coordinates({k: global_arrays[k].size for k in keys}, 10, seed=1)
    metrics = round_diagnostics(global_arrays, clients, weights, keys, coordinates)
    pairs = [(0, 1), (0, 2), (1, 2)]
    euclidean = [np.linalg.norm(flat(clients[i], keys) - flat(clients[j], keys)) for i, j in pairs]
    assert metrics["diag-euclidean-mean"] == pytest.approx(np.mean(euclidean))
    updates = [flat(global_arrays, keys) - flat(c, keys) for c in clients]
    cosines = {
        (i, j): updates[i] @ updates[j] / np.linalg.norm(updates[i]) / np.linalg.norm(updates[j])
        for i, j in pairs
    }
    assert metrics["diag-cosine-mean"] == pytest.approx(np.mean(list(cosines.values())))
    cohort = sum(2 * weights[i] * weights[j] * cosines[i, j] for i, j in pairs) / 3
    assert metrics["diag-coherence"] == pytest.approx(cohort)
    assert metrics["diag-clients"] == 3
    assert {"diag-mi-mean", "diag-update-mi-mean", "diag-manhattan-mean"} <= metrics.keys()


def test_a_single_client_round_reports_only_the_count() -> None:
    global_arrays, clients = random_clients(1)
    coordinates = sample_coordinates({"scale": 1, "layer.bias": 3}, 2, seed=0)
    metrics = round_diagnostics(
        global_arrays, clients, np.ones(1), list(global_arrays), coordinates
    )
    assert metrics == {"diag-clients": 1}


def test_observer_writes_diagnostics_into_the_strategy_round_metrics() -> None:
    global_arrays, clients = random_clients(3, seed=9)
    # Random updates share no direction: the direction check would drop one of the three.
    strategy = FedAvg(min_train_replies=2, direction_outlier_factor=0.0)
    observer = ClientDiagnostics(["layer.weight", "layer.bias"], mi_coordinates=6, seed=3)
    strategy.add_reply_observer(observer)
    strategy.global_arrays = global_arrays
    replies = [
        train_reply(c, num_examples=n, node_id=i)
        for i, (c, n) in enumerate(zip(clients, [1, 1, 2], strict=True))
    ]
    strategy.aggregate_train(1, replies)
    metrics = strategy.aggregation_metrics[1]
    keys = ["layer.weight", "layer.bias"]  # "scale" is no trainable parameter here
    expected = np.mean(
        [
            np.linalg.norm(flat(clients[i], keys) - flat(clients[j], keys))
            for i, j in [(0, 1), (0, 2), (1, 2)]
        ]
    )
    assert metrics["diag-euclidean-mean"] == pytest.approx(expected, rel=1e-6)
    assert metrics["diag-clients"] == 3
    assert float(metrics["diag-seconds"]) >= 0.0
    drawn = {k: v.copy() for k, v in (observer.coordinates or {}).items()}
    strategy.aggregate_train(2, replies)
    assert drawn.keys() == (observer.coordinates or {}).keys()
    for key, value in drawn.items():
        np.testing.assert_array_equal(value, (observer.coordinates or {})[key])


def test_observer_sees_only_valid_replies_and_their_normalised_weights() -> None:
    seen: list[tuple[int, list[int], list[float]]] = []

    def observer(server_round: int, _global: Any, replies: Any, weights: Any) -> dict[str, float]:
        seen.append((server_round, [r.node_id for r in replies], list(weights)))
        return {"observed": 1.0}

    strategy = FedAvg(min_train_replies=2)
    strategy.add_reply_observer(observer)
    strategy.global_arrays = {"w": np.zeros(2, np.float32)}
    good = [train_reply({"w": np.ones(2, np.float32)}, n, node_id=i) for i, n in ((1, 1), (2, 3))]
    bad = train_reply({"w": np.ones(3, np.float32)}, 5, node_id=9)  # wrong shape: dropped
    strategy.aggregate_train(4, [*good, bad])
    assert seen == [(4, [1, 2], [0.25, 0.75])]
    assert strategy.aggregation_metrics[4]["observed"] == 1.0
    strategy.aggregate_train(5, [good[0], bad])  # one valid reply < 2: no aggregation
    assert len(seen) == 1


def test_observer_rejects_keys_the_model_does_not_have() -> None:
    global_arrays, _clients = random_clients(2)
    observer = ClientDiagnostics(["missing.weight"])
    with pytest.raises(ValueError, match=r"missing\.weight"):
        observer(1, global_arrays, [], np.ones(2) / 2)
