"""Flower Datasets' partitioners as tasks/partition.py called them before it reimplemented them.

The reference for ``tests/test_partition_reference.py`` (bit-identical partitions) and for
``benchmarks/partition_speed.py`` (the speed-up): the labels are wrapped in an in-memory
``datasets.Dataset`` with an ``index`` column, a flwr-datasets partitioner divides it, and each
partition's ``index`` column gives positions into the labels, sorted. The Dirichlet scheme
restarts the partitioner with the same derived seeds, and the classes scheme reports classes
left out, as tasks/partition.py does. Needs ``flwr-datasets`` and ``datasets`` (the ``dev``
extra); argument checking is tasks/partition.py's and is not repeated here.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

#: The release whose partitions tasks/partition.py reproduces.
FLWR_DATASETS_VERSION = "0.6.1"

_DIRICHLET_RESTARTS = 5
_DIRICHLET_RETRY_WARNING = r"The specified min_partition_size .* was not satisfied"
_PATHOLOGICAL_UNUSED_WARNING = r"Classes: .* will NOT be used"


class ReferenceGaveUpError(ValueError):
    """Every Dirichlet restart hit flwr-datasets' "max number of attempts"."""


def reference_partitions(
    labels: np.ndarray,
    num_partitions: int,
    scheme: str,
    *,
    alpha: float = 0.5,
    classes_per_partition: int = 2,
    seed: int = 0,
    min_partition_size: int = 1,
) -> list[np.ndarray]:
    """flwr-datasets' partitions of ``labels`` (sorted int64 positions per partition).

    Raises
    ------
    ReferenceGaveUpError
        ``dirichlet``: every restart exhausted the partitioner's draws.
    ValueError
        flwr-datasets' own errors (e.g. a class needed by more partitions than it has
        samples).
    """
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
    )

    labels = np.asarray(labels)
    if scheme == "iid":
        shuffled = np.random.default_rng(seed).permutation(labels.shape[0])
        return run_partitioner(IidPartitioner(num_partitions), labels, shuffled)
    positions = np.arange(labels.shape[0])
    if scheme == "classes":
        partitioner: Any = PathologicalPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_classes_per_partition=classes_per_partition,
            class_assignment_mode="first-deterministic",
            seed=seed,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PATHOLOGICAL_UNUSED_WARNING)
            return run_partitioner(partitioner, labels, positions)
    restart_seeds = [seed] + [
        int(np.random.SeedSequence([seed, restart]).generate_state(1)[0])
        for restart in range(1, _DIRICHLET_RESTARTS)
    ]
    for restart_seed in restart_seeds:
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=alpha,
            min_partition_size=min_partition_size,
            self_balancing=False,
            seed=restart_seed,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DIRICHLET_RETRY_WARNING)
            try:
                return run_partitioner(partitioner, labels, positions)
            except ValueError as error:
                if "max number of attempts" not in str(error):
                    raise
    raise ReferenceGaveUpError(f"every one of the {_DIRICHLET_RESTARTS} restarts gave up")


def run_partitioner(
    partitioner: Any, labels: np.ndarray, positions: np.ndarray
) -> list[np.ndarray]:
    """Give ``partitioner`` the labels at ``positions`` and read back each partition's positions."""
    import datasets

    partitioner.dataset = datasets.Dataset.from_dict(
        {"label": labels[positions].astype(np.int64), "index": positions.astype(np.int64)}
    )
    return [
        np.sort(
            np.asarray(
                partitioner.load_partition(partition_id).with_format("numpy")[:]["index"],
                dtype=np.int64,
            )
        )
        for partition_id in range(partitioner.num_partitions)
    ]
