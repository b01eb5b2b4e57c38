"""The disk cache of client partitions: hits across processes, keys, bad files, cache off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from beyond_averaging.tasks import federation
from beyond_averaging.tasks.federation import load_client_partition
from beyond_averaging.tasks.partition_cache import CACHE_ENV, partition_key
from tests.test_tasks_datasets import digits_spec


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    federation._partitions.cache_clear()  # the in-process cache would hide the disk
    yield tmp_path
    federation._partitions.cache_clear()


def partition_not_allowed(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("partitioned again although the partitions were cached")


def test_a_new_process_reads_the_partitions_from_disk_instead_of_partitioning(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = [load_client_partition(digits_spec(), client).labels for client in range(5)]
    assert len(list(cache.glob("*.npz"))) == 1
    federation._partitions.cache_clear()  # as in a fresh ClientApp process
    monkeypatch.setattr(federation, "partition_indices", partition_not_allowed)
    again = [load_client_partition(digits_spec(), client).labels for client in range(5)]
    for before, after in zip(first, again, strict=True):
        np.testing.assert_array_equal(before, after)


def test_another_partitioning_setting_is_another_cache_entry(cache: Path) -> None:
    load_client_partition(digits_spec(), 0)
    load_client_partition(digits_spec(dirichlet_alpha=0.1), 0)
    load_client_partition(digits_spec(seed=4), 0)
    assert len(list(cache.glob("*.npz"))) == 3


def test_the_key_changes_with_the_labels_and_ignores_nothing_it_is_given() -> None:
    labels = np.array([0, 1, 1, 2])
    settings = {"partition": "iid", "num-partitions": 2, "seed": 1}
    key = partition_key(settings, labels)
    assert partition_key(settings, labels.copy()) == key
    assert partition_key(settings, np.array([0, 1, 2, 2])) != key
    assert partition_key({**settings, "seed": 2}, labels) != key


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.write_bytes(b"not an npz file"),
        lambda path: np.savez(path, np.array([10**6])),  # positions beyond the data set
        lambda path: np.savez(path, np.zeros(3)),  # one partition, of floats
    ],
)
def test_a_bad_cache_file_is_ignored_with_a_warning_and_replaced(cache: Path, damage: Any) -> None:
    expected = load_client_partition(digits_spec(), 2).labels
    (path,) = cache.glob("*.npz")
    damage(path)
    federation._partitions.cache_clear()
    with pytest.warns(RuntimeWarning, match="partitioning again"):
        np.testing.assert_array_equal(load_client_partition(digits_spec(), 2).labels, expected)
    federation._partitions.cache_clear()
    np.testing.assert_array_equal(load_client_partition(digits_spec(), 2).labels, expected)


def test_cache_off_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    federation._partitions.cache_clear()
    load_client_partition(digits_spec(seed=11), 0)
    federation._partitions.cache_clear()
    assert not list(tmp_path.rglob("*.npz"))


def test_an_unwritable_cache_warns_how_to_fix_it_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # a folder under a file: cannot exist
    federation._partitions.cache_clear()
    with pytest.warns(RuntimeWarning, match=f"set {CACHE_ENV} to a writable folder"):
        assert len(load_client_partition(digits_spec(seed=12), 0)) > 0
    federation._partitions.cache_clear()
