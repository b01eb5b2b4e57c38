"""client-holdout: a seeded share of each client's partition is held out and not trained on."""

from __future__ import annotations

import numpy as np
import pytest

from beyond_averaging.server.app import client_task, data_spec
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.tasks.federation import DataSpec, holdout_split, load_client_partition
from beyond_averaging.tasks.protocol import ClientTask


def spec(holdout: float) -> DataSpec:
    return DataSpec(
        dataset="digits",
        data_dir="",
        partition="dirichlet",
        dirichlet_alpha=0.5,
        classes_per_partition=2,
        num_partitions=4,
        seed=3,
        proxy_per_class=0,
        client_holdout=holdout,
    )


@pytest.mark.parametrize(("count", "fraction"), [(10, 0.3), (7, 0.3), (1, 0.3), (100, 0.5)])
def test_holdout_split_holds_out_int_fraction_n_and_keeps_the_rest(
    count: int, fraction: float
) -> None:
    indices = np.arange(1000, 1000 + count) * 3
    train, held = holdout_split(indices, fraction, seed=5)
    assert len(held) == int(fraction * count)  # the authors' int(valid_ratio * len(idxs))
    assert sorted([*train, *held]) == sorted(indices)
    assert not set(train) & set(held)
    assert list(train) == sorted(train)
    assert list(held) == sorted(held)
    again, _ = holdout_split(indices, fraction, seed=5)
    np.testing.assert_array_equal(train, again)


def test_holdout_depends_on_the_seed() -> None:
    indices = np.arange(200)
    first = {tuple(holdout_split(indices, 0.3, seed=s)[1]) for s in range(5)}
    assert len(first) == 5


def test_client_partition_trains_on_70_percent_of_the_full_partition() -> None:
    for partition_id in range(4):
        full = load_client_partition(spec(0.0), partition_id)
        kept = load_client_partition(spec(0.3), partition_id)
        assert len(kept) == len(full) - int(0.3 * len(full))
        # every kept sample is a sample of the full partition (rows of its features)
        rows = {row.tobytes() for row in full.features}
        assert all(row.tobytes() in rows for row in kept.features)
        again = load_client_partition(spec(0.3), partition_id)
        np.testing.assert_array_equal(kept.features, again.features)


def test_zero_holdout_is_the_whole_partition() -> None:
    default = DataSpec(**{**spec(0.0).__dict__})
    assert default.client_holdout == 0.0
    partition = load_client_partition(default, 1)
    np.testing.assert_array_equal(partition.labels, load_client_partition(spec(0.0), 1).labels)


def test_run_option_reaches_the_clients_data_spec_through_the_task() -> None:
    config = parse_run_config({"client-holdout": 0.3, "num-clients": 4})
    task = ClientTask.from_config(client_task(config).to_config())
    assert DataSpec.from_task(task, 4).client_holdout == 0.3
    assert data_spec(config).client_holdout == 0.3


@pytest.mark.parametrize("value", [1.0, -0.1])
def test_holdout_outside_0_1_is_a_clear_error(value: float) -> None:
    with pytest.raises(ValueError, match="client_holdout"):
        spec(value)
