"""Pre-aggregation under heterogeneity (strategies/defences/preaggregation.py) against the papers'
equations written out with loops: nearest-neighbour mixing (Allouah et al., AISTATS 2023,
Algorithm 1), bucketing (Karimireddy, He and Jaggi, ICLR 2022, Algorithm 1) and centered
clipping (Karimireddy, He and Jaggi, ICML 2021)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from beyond_averaging.strategies import FedAvg
from beyond_averaging.strategies.defences import robust
from beyond_averaging.strategies.defences.preaggregation import (
    bucket_mixing,
    centered_clipping,
    mix,
    mixed_models,
    mixing_matrix,
    nnm_mixing,
)
from beyond_averaging.strategies.defences.robust import update_gram
from beyond_averaging.strategies.replies.wire import ClientReply
from tests.test_byzantine_bounds import BOUNDS_OFF
from tests.test_defences import aggregated

Vector = np.ndarray[Any, Any]


def updates(count: int, size: int = 7, seed: int = 0) -> list[Vector]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=size) * (1 + k) for k in range(count)]


def gram_of(vectors: list[Vector]) -> Vector:
    return np.array([[float(a @ b) for b in vectors] for a in vectors])


def test_nnm_averages_each_update_with_its_nearest_k_minus_f() -> None:
    vectors = updates(6)
    byzantine = 2
    mixing = nnm_mixing(gram_of(vectors), byzantine)
    for k, u in enumerate(vectors):
        distances = [float(np.linalg.norm(u - v)) for v in vectors]
        nearest = sorted(range(6), key=lambda j: (distances[j], j))[: 6 - byzantine]
        expected = sum(vectors[j] for j in nearest) / len(nearest)
        np.testing.assert_allclose(mixing[k] @ np.array(vectors), expected, atol=1e-12)
        assert k in nearest
    # f = 0: every row is the mean
    np.testing.assert_allclose(nnm_mixing(gram_of(vectors), 0), np.full((6, 6), 1 / 6))


def test_nnm_keeps_one_far_update_out_of_every_honest_mix() -> None:
    honest = [np.array([1.0, 0.0]) + 0.1 * k for k in range(4)]
    attacker = np.array([-50.0, 30.0])
    vectors = [*honest, attacker]
    mixed = nnm_mixing(gram_of(vectors), 1) @ np.array(vectors)
    for row in mixed[:4]:
        assert np.linalg.norm(row - np.mean(honest, axis=0)) < 0.2


def test_buckets_are_the_means_of_a_seeded_permutation_cut_in_size_s() -> None:
    mixing = bucket_mixing(7, 3, (4, 2))
    order = np.random.default_rng([4, 2]).permutation(7)
    buckets = [order[0:3], order[3:6], order[6:7]]
    assert mixing.shape == (3, 7)
    for row, members in zip(mixing, buckets, strict=True):
        expected = np.zeros(7)
        expected[members] = 1.0 / len(members)
        np.testing.assert_allclose(row, expected)
    assert not np.array_equal(mixing, bucket_mixing(7, 3, (4, 3)))  # another round, other buckets
    with pytest.raises(ValueError, match="bucket_size"):
        bucket_mixing(7, 0, (0,))


def loop_centered_clipping(vectors: list[Vector], iterations: int) -> list[Vector]:
    """v_{l+1} = v_l + mean_k (u_k - v_l) min(1, tau_l / ||u_k - v_l||), tau_l the median
    distance, from v_0 = 0; then each u_k clipped around v_L."""
    centre = np.zeros_like(vectors[0])

    def clipped(centre: Vector) -> list[Vector]:
        distances = [float(np.linalg.norm(u - centre)) for u in vectors]
        tau = float(np.median(distances))
        return [
            (u - centre) * min(1.0, tau / d) if d > 0 else u - centre
            for u, d in zip(vectors, distances, strict=True)
        ]

    for _ in range(iterations):
        centre = centre + sum(clipped(centre)) / len(vectors)
    return [centre + offset for offset in clipped(centre)]


@pytest.mark.parametrize("iterations", [1, 3])
def test_centered_clipping_follows_its_iteration_written_out(iterations: int) -> None:
    vectors = updates(5, seed=3)
    vectors.append(np.full(7, 40.0))  # far away: clipped to the median radius
    mixing = centered_clipping(gram_of(vectors), iterations=iterations)
    expected = loop_centered_clipping(vectors, iterations)
    np.testing.assert_allclose(mixing @ np.array(vectors), np.array(expected), atol=1e-9)


def test_mixed_models_apply_the_matrix_to_the_clipped_updates_block_by_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(robust, "ROBUST_BLOCK_ELEMENTS", 8)  # several blocks per tensor
    rng = np.random.default_rng(1)
    global_arrays = {"w": rng.normal(size=(3, 4)), "n": np.array(5, np.int64)}
    models = [
        {"w": rng.normal(size=(3, 4)).astype(np.float32), "n": np.array(k, np.int64)}
        for k in range(4)
    ]
    scales = [1.0, 0.5, 1.0, 0.25]
    gram = update_gram(global_arrays, models)
    mixing = mixing_matrix(gram, "nnm", trim_fraction=0.25, bucket_size=2, seed=(0,))
    got = mixed_models(global_arrays, models, mixing, ["w"], scales)
    for row, result in zip(mixing, got, strict=True):
        expected = global_arrays["w"] + sum(
            weight * scale * (model["w"] - global_arrays["w"])
            for weight, scale, model in zip(row, scales, models, strict=True)
        )
        np.testing.assert_allclose(result["w"], expected, rtol=1e-6, atol=1e-6)
        assert result["n"] == int(np.argmax(row))  # integer buffers are not mixed


# ----------------------------------------------------------------------------- inside a rule
def test_every_rule_runs_its_robust_form_on_the_mixed_replies() -> None:
    # FedAvg's coordinate-wise median of the NNM-mixed models, against the median of the
    # mixtures written out with loops (bounds off: no clipping, every reply valid).
    rng = np.random.default_rng(2)
    global_model = {"w": np.zeros(9, np.float32)}
    vectors = [rng.normal(size=9) + 1.0 for _ in range(4)] + [np.full(9, -30.0)]
    models = [{"w": v.astype(np.float32)} for v in vectors]
    strategy = FedAvg(
        robust_aggregation="median", pre_aggregation="nnm", trim_fraction=0.2, **BOUNDS_OFF
    )
    strategy.global_arrays, strategy.reply_byte_limit = dict(global_model), 1 << 20
    result = aggregated(strategy, models)["w"]
    as_float = [m["w"].astype(np.float64) for m in models]
    mixes = []
    for u in as_float:
        nearest = sorted(range(5), key=lambda j: (float(np.linalg.norm(u - as_float[j])), j))[:4]
        mixes.append(sum(as_float[j] for j in nearest) / 4)
    np.testing.assert_allclose(result, np.median(mixes, axis=0), rtol=1e-5, atol=1e-5)
    assert strategy.aggregation_metrics[1]["pre-aggregation-rows"] == 5


def test_buckets_weigh_the_sum_of_their_members_claims() -> None:
    global_arrays = {"w": np.zeros(3)}
    replies = [
        ClientReply(
            node_id=k, arrays={"w": np.full(3, float(k))}, num_examples=10.0 * (k + 1), metrics={}
        )
        for k in range(5)
    ]
    mixed = mix(global_arrays, replies, "bucketing", trim_fraction=0.1, bucket_size=2, seed=(1,))
    order = np.random.default_rng([1]).permutation(5)
    buckets = [order[0:2], order[2:4], order[4:5]]
    assert [r.num_examples for r in mixed] == [sum(10.0 * (k + 1) for k in b) for b in buckets]
    for reply, members in zip(mixed, buckets, strict=True):
        np.testing.assert_allclose(reply.arrays["w"], np.full(3, float(np.mean(members))))
