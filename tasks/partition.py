"""Split a training pool among clients: Flower Datasets' partitioners, in NumPy alone.

The three schemes are Flower Datasets' (``flwr-datasets``): ``IidPartitioner`` after a seeded
shuffle, ``DirichletPartitioner`` without self-balancing, and ``PathologicalPartitioner`` in
``"first-deterministic"`` mode. Each is written here with NumPy only, making the same calls to
the same ``numpy.random.Generator`` in the same order as flwr-datasets 0.6.1, so the partitions
are bit-identical to that release's for the same arguments and seed
(``tests/test_partition_reference.py`` compares them on hypothesis-drawn cases). A run therefore
needs neither Flower Datasets nor what it brings (Hugging Face ``datasets``, pandas, pyarrow).
Measured: Fashion-MNIST's 60,000 training labels into 100 Dirichlet(0.1) partitions take 7.4 ms
here against 2.6 s through flwr-datasets 0.6.1, after its imports (best of 3 on a shared 2-core
machine; ``python -m tests.partition_reference``, table and command in docs/running.md).

Left out of flwr-datasets' code, changing no output: its partitioners shuffle every partition's
positions after the draws, and this module returns them sorted with no draw after that shuffle;
the ``datasets.Dataset`` that carried labels and positions is not built. Where flwr-datasets
raised its own error (a class needed by more partitions than it has samples), this module
raises a ``ValueError`` in its own arguments' terms.
"""

from __future__ import annotations

import warnings
from typing import Literal, get_args

import numpy as np

PartitionScheme = Literal["iid", "dirichlet", "classes"]
PARTITION_SCHEMES: tuple[str, ...] = get_args(PartitionScheme)

# DirichletPartitioner redraws up to 11 times by itself when a partition is smaller than
# min_partition_size, then raises (_dirichlet_draws does the same). On top of that we restart it
# with a few derived seeds (deterministically), so that an unlucky draw for a small pool
# (digits: ~1350 samples, 10 partitions, alpha 0.1) does not end the run, while an infeasible
# setting still fails fast instead of looping for ever.
_DIRICHLET_RESTARTS = 5
# DirichletPartitioner gives up after this many draws (its try counter runs 0..10).
_DRAWS_PER_DIRICHLET_PARTITIONER = 11


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
          partition and their samples are left out (a warning says how many).
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
        the Dirichlet draws keep missing ``min_partition_size``, or ``classes`` needs a
        class on more partitions than it has samples.
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
    # flwr-datasets read the labels from an int64 column.
    labels = labels.astype(np.int64, copy=False)
    if scheme == "iid":
        return _iid_partitions(num_samples, num_partitions, seed)
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
        partitions = _classes_partitions(labels, num_partitions, classes_per_partition, seed)
        _warn_about_unassigned_classes(labels, partitions)
        return partitions
    raise ValueError(
        f"scheme={scheme!r} is not allowed: choose one of {', '.join(PARTITION_SCHEMES)}"
    )


def _sorted_positions(pieces: list[np.ndarray]) -> np.ndarray:
    """One partition's positions, gathered from its pieces and sorted (int64)."""
    return np.sort(np.concatenate(pieces).astype(np.int64, copy=False))


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


def _iid_partitions(num_samples: int, num_partitions: int, seed: int) -> list[np.ndarray]:
    # IidPartitioner cuts contiguous shards without shuffling, so shuffle first; otherwise
    # a pool sorted by class would give each client few classes. Its shards are
    # datasets.Dataset.shard(contiguous=True): the first N mod P get one sample more, which is
    # np.array_split's cut.
    shuffled = np.random.default_rng(seed).permutation(num_samples)
    return [_sorted_positions([shard]) for shard in np.array_split(shuffled, num_partitions)]


def _dirichlet_partitions(
    labels: np.ndarray, num_partitions: int, alpha: float, min_partition_size: int, seed: int
) -> list[np.ndarray]:
    restart_seeds = [seed] + [
        int(np.random.SeedSequence([seed, restart]).generate_state(1)[0])
        for restart in range(1, _DIRICHLET_RESTARTS)
    ]
    for restart_seed in restart_seeds:
        partitions = _dirichlet_draws(
            labels, num_partitions, alpha, min_partition_size, restart_seed
        )
        if partitions is not None:
            return partitions
    raise ValueError(
        f"dirichlet partitioning with alpha={alpha}, num_partitions={num_partitions} and "
        f"min_partition_size={min_partition_size} left a partition too small in "
        f"{_DIRICHLET_RESTARTS * _DRAWS_PER_DIRICHLET_PARTITIONER} draws over "
        f"{labels.shape[0]} samples; raise alpha, lower min_partition_size or use fewer "
        "partitions"
    )


def _dirichlet_draws(
    labels: np.ndarray, num_partitions: int, alpha: float, min_partition_size: int, seed: int
) -> list[np.ndarray] | None:
    """One ``DirichletPartitioner(self_balancing=False, seed=seed)``: its up to 11 draws.

    None when every draw left a partition below ``min_partition_size`` (where flwr-datasets
    raises "The max number of attempts (10) was reached").
    """
    rng = np.random.default_rng(seed)
    # Its alpha vector: a float repeated once per partition.
    concentration = np.array([float(alpha)], dtype=float).repeat(num_partitions)
    class_positions = [np.nonzero(labels == label)[0] for label in np.unique(labels)]
    for _ in range(_DRAWS_PER_DIRICHLET_PARTITIONER):
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        for positions in class_positions:
            # One Dir(alpha) draw per class, in sorted class order; the class's positions are
            # cut where the cumulated shares times its size, truncated, fall.
            proportions = rng.dirichlet(concentration)
            cuts = (np.cumsum(proportions) * len(positions)).astype(int)[:-1]
            for partition_pieces, piece in zip(pieces, np.split(positions, cuts), strict=True):
                partition_pieces.append(piece)
        sizes = [sum(piece.size for piece in partition_pieces) for partition_pieces in pieces]
        if min(sizes) >= min_partition_size:
            return [_sorted_positions(partition_pieces) for partition_pieces in pieces]
    return None


def _classes_partitions(
    labels: np.ndarray, num_partitions: int, classes_per_partition: int, seed: int
) -> list[np.ndarray]:
    """``PathologicalPartitioner(class_assignment_mode="first-deterministic", seed=seed)``."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    num_classes = int(classes.shape[0])
    # Partition i holds class i mod C, then classes drawn with replacement (one choice call
    # per draw) until it holds classes_per_partition distinct ones.
    holders: dict[int, list[int]] = {int(label): [] for label in classes}
    for partition_id in range(num_partitions):
        chosen = [int(classes[partition_id % num_classes])]
        while len(chosen) < classes_per_partition:
            label = int(rng.choice(classes, size=1)[0])
            if label not in chosen:
                chosen.append(label)
        for label in chosen:
            holders[label].append(partition_id)
    counts = np.bincount(np.searchsorted(classes, labels), minlength=num_classes)
    for label, count in zip(classes.tolist(), counts.tolist(), strict=True):
        if len(holders[label]) > count:
            raise ValueError(
                f"partition='classes': label {label} is drawn for {len(holders[label])} "
                f"partitions but has only {count} sample{'' if count == 1 else 's'}; use fewer "
                "partitions or a smaller classes_per_partition"
            )
    # Each class's positions are split evenly (np.array_split) among its holders, in
    # partition order; a class that no partition holds is left out.
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
    for label, partition_ids in holders.items():
        if not partition_ids:
            continue
        positions = np.nonzero(labels == label)[0]
        for partition_id, piece in zip(
            partition_ids, np.array_split(positions, len(partition_ids)), strict=True
        ):
            pieces[partition_id].append(piece)
    return [_sorted_positions(partition_pieces) for partition_pieces in pieces]
