"""Partitioning of a label pool among clients (tasks.partition)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from beyond_averaging.tasks.datasets import load_dataset
from beyond_averaging.tasks.partition import PartitionScheme, partition_indices

NUM_CLASSES = 10


@pytest.fixture(scope="module")
def class_sorted_labels() -> np.ndarray:
    """1000 labels, 100 per class, sorted by class (as many raw data sets are)."""
    return np.repeat(np.arange(NUM_CLASSES, dtype=np.int64), 100)


@pytest.fixture(scope="module")
def digits_pool_labels() -> np.ndarray:
    train_pool, _ = load_dataset("digits", seed=0)
    return train_pool.labels


def label_entropy(labels: np.ndarray) -> float:
    """Shannon entropy (nats) of the empirical label distribution."""
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    shares = counts[counts > 0] / counts.sum()
    return float(-(shares * np.log(shares)).sum())


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_iid_and_dirichlet_partitions_are_disjoint_and_cover_every_sample(
    class_sorted_labels: np.ndarray, scheme: PartitionScheme
) -> None:
    partitions = partition_indices(class_sorted_labels, 7, scheme, alpha=0.5, seed=3)
    assert len(partitions) == 7
    every_index = np.concatenate(partitions)
    np.testing.assert_array_equal(np.sort(every_index), np.arange(class_sorted_labels.size))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "classes"])
def test_partitions_are_sorted_int64_position_arrays(
    class_sorted_labels: np.ndarray, scheme: PartitionScheme
) -> None:
    partitions = partition_indices(class_sorted_labels, 10, scheme, seed=0)
    for indices in partitions:
        assert indices.dtype == np.int64
        assert indices.ndim == 1
        assert np.all(np.diff(indices) > 0)


@pytest.mark.parametrize("classes_per_partition", [1, 2, 3])
def test_classes_scheme_gives_each_partition_exactly_k_labels_without_overlap(
    class_sorted_labels: np.ndarray, classes_per_partition: int
) -> None:
    partitions = partition_indices(
        class_sorted_labels, 10, "classes", classes_per_partition=classes_per_partition, seed=1
    )
    every_index = np.concatenate(partitions)
    assert np.unique(every_index).size == every_index.size
    for indices in partitions:
        assert np.unique(class_sorted_labels[indices]).size == classes_per_partition


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "classes"])
def test_same_seed_gives_identical_partitions(
    class_sorted_labels: np.ndarray, scheme: PartitionScheme
) -> None:
    first = partition_indices(class_sorted_labels, 10, scheme, seed=11)
    second = partition_indices(class_sorted_labels, 10, scheme, seed=11)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "classes"])
def test_different_seeds_give_different_partitions(
    class_sorted_labels: np.ndarray, scheme: PartitionScheme
) -> None:
    first = partition_indices(class_sorted_labels, 10, scheme, seed=0)
    second = partition_indices(class_sorted_labels, 10, scheme, seed=1)
    assert any(
        a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(first, second, strict=True)
    )


def test_classes_scheme_with_fewer_partitions_than_classes_warns_how_much_is_left_out(
    class_sorted_labels: np.ndarray,
) -> None:
    # 3 partitions x 2 classes can hold at most 6 of the 10 classes.
    with pytest.warns(UserWarning, match=r"their \d+ samples are left out") as caught:
        partitions = partition_indices(class_sorted_labels, 3, "classes", seed=0)
    covered = np.concatenate(partitions)
    expected_left_out = class_sorted_labels.size - covered.size
    assert expected_left_out >= 400
    assert f"their {expected_left_out} samples" in str(caught[0].message)


def test_iid_partitions_mix_all_classes_even_when_the_pool_is_sorted_by_class(
    class_sorted_labels: np.ndarray,
) -> None:
    partitions = partition_indices(class_sorted_labels, 10, "iid", seed=0)
    sizes = [indices.size for indices in partitions]
    assert max(sizes) - min(sizes) <= 1
    # Contiguous shards of the sorted pool would hold a single class each.
    for indices in partitions:
        assert np.unique(class_sorted_labels[indices]).size == NUM_CLASSES


def test_small_dirichlet_alpha_skews_labels_more_than_iid(class_sorted_labels: np.ndarray) -> None:
    iid = partition_indices(class_sorted_labels, 10, "iid", seed=0)
    skewed = partition_indices(class_sorted_labels, 10, "dirichlet", alpha=0.1, seed=0)
    iid_entropy = np.mean([label_entropy(class_sorted_labels[p]) for p in iid])
    skewed_entropy = np.mean([label_entropy(class_sorted_labels[p]) for p in skewed])
    # IID partitions of a balanced pool are close to the uniform entropy log(10) ~ 2.30.
    assert iid_entropy > 2.0
    assert skewed_entropy < iid_entropy - 0.5


@pytest.mark.parametrize("seed", range(5))
def test_dirichlet_on_the_small_digits_pool_gives_every_client_data(
    digits_pool_labels: np.ndarray, seed: int
) -> None:
    partitions = partition_indices(digits_pool_labels, 10, "dirichlet", alpha=0.1, seed=seed)
    assert min(indices.size for indices in partitions) >= 1
    assert sum(indices.size for indices in partitions) == digits_pool_labels.size


def test_dirichlet_partitions_meet_min_partition_size(class_sorted_labels: np.ndarray) -> None:
    partitions = partition_indices(
        class_sorted_labels, 10, "dirichlet", alpha=0.3, seed=2, min_partition_size=20
    )
    assert min(indices.size for indices in partitions) >= 20


def test_unreachable_min_partition_size_fails_with_advice_instead_of_hanging(
    digits_pool_labels: np.ndarray,
) -> None:
    # 10 partitions of >= 130 samples out of ~1350 need near-equal shares, which Dir(0.1)
    # practically never draws.
    with pytest.raises(ValueError, match=r"alpha=0\.1.*min_partition_size=130.*raise alpha"):
        partition_indices(
            digits_pool_labels, 10, "dirichlet", alpha=0.1, seed=0, min_partition_size=130
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_partitions": 0}, r"num_partitions=0 .*\[1, 1000\]"),
        ({"num_partitions": 1001}, r"num_partitions=1001 .*\[1, 1000\]"),
        ({"scheme": "dirichlet", "alpha": 0.0}, r"alpha=0\.0 .*> 0"),
        ({"scheme": "dirichlet", "alpha": -1.0}, r"alpha=-1\.0 .*> 0"),
        ({"scheme": "classes", "classes_per_partition": 0}, r"classes_per_partition=0 .*\[1, 10\]"),
        (
            {"scheme": "classes", "classes_per_partition": 11},
            r"classes_per_partition=11 .*\[1, 10\]",
        ),
        ({"scheme": "shards"}, r"scheme='shards' .*iid, dirichlet, classes"),
        (
            {"scheme": "dirichlet", "min_partition_size": 101},
            r"min_partition_size=101 .*\[0, 100\]",
        ),
    ],
)
def test_invalid_arguments_raise_value_error_naming_argument_value_and_range(
    class_sorted_labels: np.ndarray, kwargs: dict[str, Any], message: str
) -> None:
    arguments: dict[str, Any] = {"num_partitions": 10, "scheme": "iid", **kwargs}
    with pytest.raises(ValueError, match=message):
        partition_indices(class_sorted_labels, **arguments)


def test_classes_needing_a_class_on_more_partitions_than_it_has_samples_names_it() -> None:
    # Every one of the 6 partitions holds all 3 classes, but class 7 has a single sample.
    labels = np.array([0] * 6 + [3] * 6 + [7])
    with pytest.raises(
        ValueError, match=r"label 7 is drawn for 6 partitions but has only 1 sample; use fewer"
    ):
        partition_indices(labels, 6, "classes", classes_per_partition=3)
