"""Split a training pool among clients with Flower Datasets' partitioners.

The labels are wrapped in an in-memory ``datasets.Dataset`` with an ``index`` column, a
Flower Datasets partitioner divides it, and each partition's ``index`` column gives back
positions into the original arrays. Nothing is downloaded.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Literal, get_args

import numpy as np

if TYPE_CHECKING:
    import datasets
    from flwr_datasets.partitioner.partitioner import Partitioner

# Hugging Face ``datasets`` and Flower Datasets are imported where a partition is computed, not
# here: together they take about 4 s to import, which every ClientApp process of a deployment
# would pay on every message although the partition usually comes from the disk cache
# (tasks/partition_cache.py).

PartitionScheme = Literal["iid", "dirichlet", "classes"]
PARTITION_SCHEMES: tuple[str, ...] = get_args(PartitionScheme)

# DirichletPartitioner redraws up to 11 times by itself when a partition is smaller than
# min_partition_size, then raises. On top of that we restart it with a few derived seeds
# (deterministically), so that an unlucky draw for a small pool (digits: ~1350 samples,
# 10 partitions, alpha 0.1) does not end the run, while an infeasible setting still fails
# fast instead of looping for ever.
_DIRICHLET_RESTARTS = 5
# DirichletPartitioner gives up after this many draws (its try counter runs 0..10).
_DRAWS_PER_DIRICHLET_PARTITIONER = 11
_DIRICHLET_RETRY_WARNING = r"The specified min_partition_size .* was not satisfied"
_PATHOLOGICAL_UNUSED_WARNING = r"Classes: .* will NOT be used"


def partition_indices(
    labels: np.ndarray,
    num_partitions: int,
    scheme: PartitionScheme,
    *,
    alpha: float = 0.5,
    classes_per_partition: int = 2,
    seed: int = 0,
    min_partition_size: int = 1,
) -> list[np.ndarray]:
    """Divide sample positions among ``num_partitions`` clients.

    Parameters
    ----------
    labels : np.ndarray
        Integer labels of the pool, shape ``(N,)``.
    num_partitions : int
        Number of partitions, in ``[1, N]``.
    scheme : {"iid", "dirichlet", "classes"}
        - ``iid``: a seeded shuffle, then ``IidPartitioner``'s contiguous shards (sizes
          differ by at most one).
        - ``dirichlet``: ``DirichletPartitioner`` (Hsu et al. 2019) without self-balancing;
          each class is split among the partitions by proportions drawn from
          ``Dir(alpha)``. Smaller ``alpha`` means more skewed label distributions.
        - ``classes``: ``PathologicalPartitioner`` in ``"first-deterministic"`` mode (the
          mode of Li et al. 2022, "Federated Learning on Non-IID Data Silos"): partition
          ``i`` gets class ``i mod C`` plus ``classes_per_partition - 1`` other classes
          drawn by ``seed``, and every class's samples are split evenly among the
          partitions holding it. Each partition has exactly ``classes_per_partition``
          distinct labels. When ``num_partitions < C`` some classes may belong to no
          partition and their samples are left out (Flower Datasets warns).
    alpha : float
        Dirichlet concentration (> 0); used by ``dirichlet`` only.
    classes_per_partition : int
        Labels per partition, in ``[1, C]`` where ``C`` is the number of distinct labels;
        used by ``classes`` only.
    seed : int
        The same seed gives the same partitions.
    min_partition_size : int
        Smallest partition the ``dirichlet`` scheme accepts (redrawing otherwise). The
        default 1 only asks that every client can train; a larger value (Flower's default
        is 10) makes redraws much likelier at small ``alpha`` on small pools. The other
        schemes never produce an empty partition for valid arguments and ignore it.

    Returns
    -------
    list of np.ndarray
        ``num_partitions`` sorted int64 arrays of positions into ``labels``; disjoint, and
        covering all positions for ``iid`` and ``dirichlet``. Sizes may differ.

    Raises
    ------
    ValueError
        An argument is out of range (the message names it, its value and what is allowed),
        or the Dirichlet draws keep missing ``min_partition_size``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"labels must be a 1-D integer array, got dtype {labels.dtype} and shape {labels.shape}"
        )
    num_samples = int(labels.shape[0])
    if not 1 <= num_partitions <= num_samples:
        raise ValueError(
            f"num_partitions={num_partitions} is not allowed: it must lie in [1, {num_samples}] "
            "(at least one partition, at most one per sample)"
        )
    if scheme == "iid":
        return _iid_partitions(labels, num_partitions, seed)
    if scheme == "dirichlet":
        if not alpha > 0:
            raise ValueError(f"alpha={alpha} is not allowed: the Dirichlet alpha must be > 0")
        if not 0 <= min_partition_size <= num_samples // num_partitions:
            raise ValueError(
                f"min_partition_size={min_partition_size} is not allowed: with {num_samples} "
                f"samples and {num_partitions} partitions it must lie in "
                f"[0, {num_samples // num_partitions}]"
            )
        return _dirichlet_partitions(labels, num_partitions, alpha, min_partition_size, seed)
    if scheme == "classes":
        num_classes = int(np.unique(labels).shape[0])
        if not 1 <= classes_per_partition <= num_classes:
            raise ValueError(
                f"classes_per_partition={classes_per_partition} is not allowed: it must lie "
                f"in [1, {num_classes}] (the number of distinct labels)"
            )
        from flwr_datasets.partitioner import PathologicalPartitioner

        partitioner = PathologicalPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_classes_per_partition=classes_per_partition,
            class_assignment_mode="first-deterministic",
            seed=seed,
        )
        with warnings.catch_warnings():
            # Flower Datasets' warning about unused classes suggests a parameter that does
            # not exist; the check below words it for this function instead.
            warnings.filterwarnings("ignore", message=_PATHOLOGICAL_UNUSED_WARNING)
            partitions = _run_partitioner(
                partitioner, _label_dataset(labels, np.arange(num_samples))
            )
        _warn_about_unassigned_classes(labels, partitions)
        return partitions
    raise ValueError(
        f"scheme={scheme!r} is not allowed: choose one of {', '.join(PARTITION_SCHEMES)}"
    )


def _label_dataset(labels: np.ndarray, positions: np.ndarray) -> datasets.Dataset:
    import datasets

    return datasets.Dataset.from_dict(
        {"label": labels[positions].astype(np.int64), "index": positions.astype(np.int64)}
    )


def _run_partitioner(partitioner: Partitioner, dataset: datasets.Dataset) -> list[np.ndarray]:
    partitioner.dataset = dataset
    # ``partition["index"]`` is a lazy Column that converts row by row; a numpy-formatted
    # slice reads the whole column at once.
    return [
        np.sort(
            np.asarray(
                partitioner.load_partition(partition_id).with_format("numpy")[:]["index"],
                dtype=np.int64,
            )
        )
        for partition_id in range(partitioner.num_partitions)
    ]


def _warn_about_unassigned_classes(labels: np.ndarray, partitions: list[np.ndarray]) -> None:
    assigned = np.unique(labels[np.concatenate(partitions)])
    unassigned = np.setdiff1d(np.unique(labels), assigned)
    if unassigned.size:
        left_out = int(np.isin(labels, unassigned).sum())
        warnings.warn(
            f"partition='classes': classes {unassigned.tolist()} were drawn for no partition, "
            f"so their {left_out} samples are left out; more partitions (>= the number of "
            "classes) or more classes_per_partition make every class used",
            UserWarning,
            stacklevel=3,
        )


def _iid_partitions(labels: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    # IidPartitioner cuts contiguous shards without shuffling, so shuffle first; otherwise
    # a pool sorted by class would give each client few classes.
    from flwr_datasets.partitioner import IidPartitioner

    shuffled = np.random.default_rng(seed).permutation(labels.shape[0])
    return _run_partitioner(IidPartitioner(num_partitions), _label_dataset(labels, shuffled))


def _dirichlet_partitions(
    labels: np.ndarray, num_partitions: int, alpha: float, min_partition_size: int, seed: int
) -> list[np.ndarray]:
    from flwr_datasets.partitioner import DirichletPartitioner

    dataset = _label_dataset(labels, np.arange(labels.shape[0]))
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
            # Each internal redraw warns; the outcome is reported below instead.
            warnings.filterwarnings("ignore", message=_DIRICHLET_RETRY_WARNING)
            try:
                return _run_partitioner(partitioner, dataset)
            except ValueError as error:
                if "max number of attempts" not in str(error):
                    raise
    raise ValueError(
        f"dirichlet partitioning with alpha={alpha}, num_partitions={num_partitions} and "
        f"min_partition_size={min_partition_size} left a partition too small in "
        f"{_DIRICHLET_RESTARTS * _DRAWS_PER_DIRICHLET_PARTITIONER} draws over "
        f"{labels.shape[0]} samples; raise alpha, lower min_partition_size or use fewer "
        "partitions"
    )
