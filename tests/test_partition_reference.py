"""tasks/partition.py gives flwr-datasets 0.6.1's partitions, bit for bit.

The NumPy partitioners are compared with Flower Datasets' own (tests/partition_reference.py, the
code tasks/partition.py ran before) on hypothesis-drawn label pools, partition counts, alphas,
classes per partition, minimum sizes and seeds: equal int64 positions per partition, or a
ValueError from both. The pools are small so that the Dirichlet redraws, the restarts with
derived seeds, giving up, the classes drawn for no partition and a class needed by more
partitions than it has samples all come up often; fixed cases pin each of those paths.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from beyond_averaging.tasks.partition import partition_indices

pytest.importorskip(
    "flwr_datasets",
    reason="flwr-datasets (the dev extra) is the reference these tests compare with",
)
pytest.importorskip("datasets", reason="flwr-datasets' partitioners need Hugging Face datasets")

from tests.partition_reference import (
    FLWR_DATASETS_VERSION,
    reference_partitions,
    run_partitioner,
)

PROPERTY_SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)


@st.composite
def label_pools(draw: st.DrawFn, max_samples: int = 60) -> np.ndarray:
    """1-8 classes with arbitrary (not necessarily contiguous) values, in one integer dtype."""
    dtype = draw(st.sampled_from([np.uint8, np.int16, np.int32, np.int64]))
    smallest = 0 if dtype == np.uint8 else -50
    values = draw(st.lists(st.integers(smallest, 200), min_size=1, max_size=8, unique=True))
    labels = draw(st.lists(st.sampled_from(values), min_size=1, max_size=max_samples))
    return np.asarray(labels, dtype=dtype)


def outcome(partitioner: Callable[..., list[np.ndarray]], *args: Any, **kwargs: Any) -> Any:
    """The partitions, or ``ValueError`` when the partitioner refused (warnings recorded)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            partitions = partitioner(*args, **kwargs)
        except ValueError:
            return ValueError, caught
    return partitions, caught


def assert_same_partitions(
    labels: np.ndarray, num_partitions: int, scheme: str, **kwargs: Any
) -> Any:
    """Compare with flwr-datasets; returns the reference partitions and this module's warnings."""
    expected, _ = outcome(reference_partitions, labels, num_partitions, scheme, **kwargs)
    got, caught = outcome(partition_indices, labels, num_partitions, scheme, **kwargs)
    if expected is ValueError or got is ValueError:
        assert got is expected, f"flwr-datasets gave {expected!r}, this module {got!r}"
        return expected, caught
    assert len(got) == len(expected) == num_partitions
    for partition_id, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert mine.dtype == np.int64
        assert mine.tobytes() == theirs.tobytes(), f"partition {partition_id} differs"
    return expected, caught


def test_the_reference_is_the_release_the_partitions_match() -> None:
    assert importlib.metadata.version("flwr-datasets") == FLWR_DATASETS_VERSION


@st.composite
def pools_and_counts(
    draw: st.DrawFn, max_samples: int, max_partitions: int
) -> tuple[np.ndarray, int]:
    """A label pool and a partition count it allows."""
    labels = draw(label_pools(max_samples))
    return labels, draw(st.integers(1, min(labels.size, max_partitions)))


@PROPERTY_SETTINGS
@given(case=pools_and_counts(max_samples=400, max_partitions=40), seed=st.integers(0, 2**32 - 1))
def test_iid_partitions_equal_flwr_datasets(case: tuple[np.ndarray, int], seed: int) -> None:
    labels, num_partitions = case
    assert_same_partitions(labels, num_partitions, "iid", seed=seed)


@st.composite
def dirichlet_cases(draw: st.DrawFn) -> tuple[np.ndarray, int, int]:
    """A pool, a partition count, and a min_partition_size up to an equal share (at the top
    of that range the partitioner's redraws, the restarts and giving up are common)."""
    labels, num_partitions = draw(pools_and_counts(max_samples=60, max_partitions=8))
    return labels, num_partitions, draw(st.integers(0, labels.size // num_partitions))


#: 4 classes of 10, 4 partitions of at least 8 samples: flwr-datasets' partitioner seeded 0
#: gives up after its 11 draws (test_a_restart_after_flwr_datasets_gives_up_matches_it).
RESTART_CASE = (np.repeat(np.arange(4, dtype=np.int64), 10), 4, 8)


@PROPERTY_SETTINGS
@given(case=dirichlet_cases(), alpha=st.floats(0.02, 20.0), seed=st.integers(0, 2**32 - 1))
@example(case=RESTART_CASE, alpha=0.3, seed=0)
@example(case=RESTART_CASE, alpha=0.3, seed=40)  # the fifth and last restart succeeds
@example(case=(RESTART_CASE[0], 4, 7), alpha=0.3, seed=30)  # the partitioner's 11th draw does
@example(case=(RESTART_CASE[0], 4, 10), alpha=0.3, seed=0)  # every restart gives up
def test_dirichlet_partitions_equal_flwr_datasets(
    case: tuple[np.ndarray, int, int], alpha: float, seed: int
) -> None:
    labels, num_partitions, min_partition_size = case
    assert_same_partitions(
        labels,
        num_partitions,
        "dirichlet",
        alpha=alpha,
        seed=seed,
        min_partition_size=min_partition_size,
    )


def test_a_restart_after_flwr_datasets_gives_up_matches_it() -> None:
    from flwr_datasets.partitioner import DirichletPartitioner

    labels, num_partitions, min_partition_size = RESTART_CASE
    first = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        alpha=0.3,
        min_partition_size=min_partition_size,
        self_balancing=False,
        seed=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the partitioner warns at each redraw
        with pytest.raises(ValueError, match="max number of attempts"):
            run_partitioner(first, labels, np.arange(labels.size))
    assert_same_partitions(
        labels, num_partitions, "dirichlet", alpha=0.3, seed=0, min_partition_size=8
    )


@st.composite
def classes_cases(draw: st.DrawFn) -> tuple[np.ndarray, int, int]:
    """A pool, a partition count, and classes per partition up to the number of classes."""
    labels, num_partitions = draw(pools_and_counts(max_samples=60, max_partitions=12))
    return labels, num_partitions, draw(st.integers(1, np.unique(labels).size))


@PROPERTY_SETTINGS
@given(case=classes_cases(), seed=st.integers(0, 2**32 - 1))
# 3 partitions, 10 classes: at least 4 classes are drawn for no partition.
@example(case=(np.repeat(np.arange(10, dtype=np.int64), 5), 3, 2), seed=0)
# Class 7 has 1 sample; with 6 partitions of all 3 classes it is needed 6 times.
@example(case=(np.array([0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 3, 7]), 6, 3), seed=0)
def test_classes_partitions_and_their_warning_equal_flwr_datasets(
    case: tuple[np.ndarray, int, int], seed: int
) -> None:
    labels, num_partitions, classes_per_partition = case
    expected, caught = assert_same_partitions(
        labels, num_partitions, "classes", classes_per_partition=classes_per_partition, seed=seed
    )
    if expected is ValueError:
        return
    # Partitions are disjoint, so what flwr-datasets left out is the pool minus their sizes.
    left_out = labels.size - sum(indices.size for indices in expected)
    warned = [str(w.message) for w in caught if "left out" in str(w.message)]
    if left_out:
        assert len(warned) == 1
        assert f"their {left_out} samples are left out" in warned[0]
    else:
        assert not warned
