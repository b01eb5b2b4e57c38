"""One place that turns a data specification into client partitions and server splits.

Clients and the server build the same :class:`DataSpec` from the run configuration, so
they agree on the data without exchanging it: loading, partitioning and splitting are
deterministic functions of the spec. The spec-level work is cached per process, so a
process that hosts many clients (or many rounds) loads and partitions once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from .colored import COLORED_DATASET_NAMES, base_dataset, client_view, server_view
from .datasets import DATASET_NAMES, DatasetName, LabeledData, check_data_dir, load_dataset
from .partition import PARTITION_SCHEMES, PartitionScheme, partition_indices
from .partition_cache import load_partitions, partition_key, store_partitions
from .protocol import ClientTask
from .splits import split_server_data
from .synthetic import SERVER_DEVICES, device_data, server_heldout

# Stage tags for deriving independent seeds from DataSpec.seed, so that the held-out split,
# the partitioning and the proxy draw do not all consume the same random stream.
_PARTITION_STAGE = 1
_PROXY_STAGE = 2
_HOLDOUT_STAGE = 3
#: The test subset's seed is the run's seed plus this (the in-distribution test of the colored
#: tasks, drawn by the benchmarks' reporter, uses the next one).
TEST_SUBSET_OFFSET = 7
# Each cached entry holds a whole data set (up to ~200 MB for MNIST-sized data).
_CACHED_SPECS = 4
#: The data set whose clients are devices generated from their ids (tasks/synthetic.py): no
#: pool, no partitioner, any population size.
PER_DEVICE_DATASET = "synthetic"


@dataclass(frozen=True)
class DataSpec:
    """Everything that determines a federation's data; hashable, used as a cache key.

    Attributes
    ----------
    dataset : str
        One of ``tasks.datasets.DatasetName``.
    data_dir : str
        Folder of the IDX files; ``""`` selects ``DEFAULT_DATA_DIRS[dataset]``.
    partition : str
        One of ``tasks.partition.PartitionScheme``.
    dirichlet_alpha : float
        Concentration for ``partition="dirichlet"``.
    classes_per_partition : int
        Labels per client for ``partition="classes"``.
    num_partitions : int
        Number of clients.
    seed : int
        Seeds the held-out split and synthetic data directly, and (through derived seeds)
        the partitioning and the proxy draw.
    proxy_per_class : int
        Server proxy samples per class (0: no proxy).
    synthetic_alpha, synthetic_beta : float
        Synthetic(alpha, beta) parameters (``dataset="synthetic"`` only).
    client_holdout : float
        Share in [0, 1) of each client's partition held out (seeded) and not trained on: the
        FedLAW authors' clients keep 30 % for validation (``client_valid_ratio`` 0.3); 0 trains
        on the whole partition. See :func:`holdout_split`.
    test_size : int
        The server's test set cut to a seeded subset of this many samples (0: all of it), to
        cheapen the per-round evaluation; the server's alone, as ``proxy_per_class``. See
        :func:`seeded_subset`.
    """

    dataset: str
    data_dir: str
    partition: str
    dirichlet_alpha: float
    classes_per_partition: int
    num_partitions: int
    seed: int
    proxy_per_class: int
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    client_holdout: float = 0.0
    test_size: int = 0

    @classmethod
    def from_task(
        cls, task: ClientTask, num_partitions: int, proxy_per_class: int = 0, test_size: int = 0
    ) -> DataSpec:
        """The spec of the task the server sends: the client and the server build it here alike.

        ``num_partitions`` is the federation's size (the node's config on a SuperNode); the
        proxy split and the test subset are the server's alone, so clients leave
        ``proxy_per_class`` and ``test_size`` at 0.
        """
        return cls(
            dataset=task.dataset,
            data_dir=task.data_dir,
            partition=task.partition,
            dirichlet_alpha=task.dirichlet_alpha,
            classes_per_partition=task.classes_per_client,
            num_partitions=num_partitions,
            seed=task.seed,
            proxy_per_class=proxy_per_class,
            synthetic_alpha=task.synthetic_alpha,
            synthetic_beta=task.synthetic_beta,
            client_holdout=task.client_holdout,
            test_size=test_size,
        )

    def __post_init__(self) -> None:
        # Fail when the spec is made, not later inside a cached loader on some client.
        if self.dataset not in (*DATASET_NAMES, *COLORED_DATASET_NAMES):
            raise ValueError(
                f"dataset={self.dataset!r} is not allowed: choose one of "
                f"{', '.join((*DATASET_NAMES, *COLORED_DATASET_NAMES))}"
            )
        if self.partition not in PARTITION_SCHEMES:
            raise ValueError(
                f"partition={self.partition!r} is not allowed: choose one of "
                f"{', '.join(PARTITION_SCHEMES)}"
            )
        if not 0.0 <= self.client_holdout < 1.0:
            raise ValueError(
                f"client_holdout={self.client_holdout} is not allowed: it is the share of each "
                "partition held out from training, in [0, 1) (the FedLAW authors use 0.3)"
            )
        if self.test_size < 0:
            raise ValueError(
                f"test_size={self.test_size} is not allowed: it is the number of test samples "
                "the server evaluates on, 0 for all of them"
            )


def load_client_partition(spec: DataSpec, partition_id: int) -> LabeledData:
    """Return client ``partition_id``'s training data.

    Parameters
    ----------
    spec : DataSpec
        The federation's data specification.
    partition_id : int
        In ``[0, spec.num_partitions)``.

    Returns
    -------
    LabeledData
        A fresh (writable) copy of that client's training samples, in pool order: the whole
        partition, or without its held-out share when ``spec.client_holdout`` > 0. For
        ``synthetic`` the partition is device ``partition_id``'s own data, generated from its id
        (:func:`tasks.synthetic.device_data`; the partition settings do not apply).

    Raises
    ------
    ValueError
        ``partition_id`` out of range, or an invalid spec.
    """
    if not 0 <= partition_id < spec.num_partitions:
        raise ValueError(
            f"partition_id={partition_id} is out of range: it must lie in "
            f"[0, {spec.num_partitions - 1}] for num_partitions={spec.num_partitions}"
        )
    if spec.dataset == PER_DEVICE_DATASET:  # the partition is the device: built from its id
        train_pool = device_data(
            partition_id, alpha=spec.synthetic_alpha, beta=spec.synthetic_beta, seed=spec.seed
        )
        indices = np.arange(len(train_pool), dtype=np.int64)
    else:
        train_pool, _ = _spec_data(spec)
        indices = _partitions(spec)[partition_id]
    if spec.client_holdout > 0.0:
        seed = int(
            np.random.SeedSequence([spec.seed, _HOLDOUT_STAGE, partition_id]).generate_state(1)[0]
        )
        indices, _ = holdout_split(indices, spec.client_holdout, seed)
    grey = train_pool.subset(indices)
    # Colored data sets are partitioned grey on the digit, then colored per client (environment).
    return client_view(spec.dataset, grey, partition_id, spec.num_partitions, spec.seed)


def partition_label_counts(spec: DataSpec) -> np.ndarray:
    """Each client's training labels counted: shape ``(num_partitions, num_classes)``, int64.

    Counted on what :func:`load_client_partition` gives each client (its held-out share left
    out, colored views included), so the counts are those the clients train on.
    """
    rows = []
    for partition_id in range(spec.num_partitions):
        data = load_client_partition(spec, partition_id)
        rows.append(np.bincount(data.labels, minlength=data.num_classes))
    width = max((len(row) for row in rows), default=0)
    return np.array([np.pad(row, (0, width - len(row))) for row in rows], dtype=np.int64)


def holdout_split(indices: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split a partition's pool indices into (train, held out), as the FedLAW authors' clients do.

    Their ``Node.train_val_split`` shuffles the indices and holds out the first
    ``int(fraction * n)``; here the shuffle is seeded (``seed``) and both parts come back in
    pool order, so a run is reproducible and the training order does not depend on the split.

    Returns
    -------
    train, held_out : np.ndarray
        Disjoint, together ``indices``; ``held_out`` has ``int(fraction * len(indices))``
        entries, so ``train`` keeps at least one sample for ``fraction < 1``.
    """
    order = np.random.default_rng(seed).permutation(len(indices))
    held = np.sort(order[: int(fraction * len(indices))])
    kept = np.sort(order[int(fraction * len(indices)) :])
    return indices[kept], indices[held]


def seeded_subset(data: LabeledData, size: int, seed: int) -> LabeledData:
    """``size`` samples of ``data`` drawn without replacement, in their original order.

    The first ``size`` entries of ``default_rng(seed).permutation(len(data))``, sorted: the draw
    FedGMA's evidence script made (its ``--test-size``), so the tables it published are
    reproduced by a run with the same ``test-size``. ``size`` 0, or at least ``len(data)``,
    returns ``data`` itself.
    """
    if size <= 0 or size >= len(data):
        return data
    keep = np.sort(np.random.default_rng(seed).permutation(len(data))[:size])
    return data.subset(keep)


def load_server_splits(spec: DataSpec) -> tuple[LabeledData, LabeledData]:
    """Return the server's ``(test, proxy)`` data, see :func:`tasks.splits.split_server_data`.

    Parameters
    ----------
    spec : DataSpec
        The federation's data specification.

    Returns
    -------
    test : LabeledData
    proxy : LabeledData
        Both cached and shared within the process; their arrays are read-only.

    Raises
    ------
    ValueError
        More clients than training samples (:func:`check_federation_size`).
    """
    check_federation_size(spec)
    return _server_splits(spec)


def check_federation_size(spec: DataSpec) -> None:
    """Refuse a federation its data cannot be divided among, naming the limit and the fix.

    The ServerApp loads its splits before round 1, so this is one error there instead of one
    per ClientApp in round 1 (with ``num-clients = 5000`` on digits: 5,000 errors, then a run
    that "aggregated no round"). Beyond more clients than training samples, the partitioning
    itself is run here (and cached, for the clients): a Dirichlet draw that leaves a client
    without data fails once, before round 1, instead of in every ClientApp. ``synthetic`` has
    no pool and no partitioning (one device per client), so any population passes.
    """
    if spec.dataset == PER_DEVICE_DATASET:
        check_data_dir(spec.dataset, spec.data_dir)  # it reads no files: a data-dir is a mistake
        return
    train_pool, _ = _spec_data(spec)
    fix = (
        "or dataset = 'synthetic', whose clients are devices generated from their ids (up to "
        "1,000,000 of them)"
    )
    if spec.num_partitions > len(train_pool):
        raise ValueError(
            f"num-clients = {spec.num_partitions} exceeds the {len(train_pool)} training samples "
            f"of dataset {spec.dataset!r}: every client needs at least one sample. Set "
            f"num-clients <= {len(train_pool)}, use a larger data set, {fix}"
        )
    try:
        _partitions(spec)
    except ValueError as error:
        scheme = f"partition = {spec.partition!r}"
        if spec.partition == "dirichlet":
            scheme += f" (dirichlet-alpha = {spec.dirichlet_alpha}; a larger one skews less)"
        raise ValueError(
            f"num-clients = {spec.num_partitions} with {scheme} cannot divide the "
            f"{len(train_pool)} training samples of dataset {spec.dataset!r}: {error}. Use fewer "
            f"clients, another partition (partition = 'iid' gives every client a share), {fix}"
        ) from None


def _stage_seed(seed: int, stage: int) -> int:
    return int(np.random.SeedSequence([seed, stage]).generate_state(1)[0])


def _read_only(data: LabeledData) -> LabeledData:
    # Cached objects are shared by every caller in the process; a write through one of
    # them would silently change the data the others see.
    data.features.setflags(write=False)
    data.labels.setflags(write=False)
    return data


def _spec_data(spec: DataSpec) -> tuple[LabeledData, LabeledData]:
    return _loaded_data(base_dataset(spec.dataset), spec.data_dir, spec.seed)


# Keyed on the fields that decide the data only, so specs that differ in partitioning or
# proxy size share one loaded copy.
@functools.lru_cache(maxsize=_CACHED_SPECS)
def _loaded_data(dataset: str, data_dir: str, seed: int) -> tuple[LabeledData, LabeledData]:
    train_pool, heldout = load_dataset(
        cast(DatasetName, dataset), data_dir=Path(data_dir) if data_dir else None, seed=seed
    )
    return _read_only(train_pool), _read_only(heldout)


@functools.lru_cache(maxsize=_CACHED_SPECS)
def _partitions(spec: DataSpec) -> tuple[np.ndarray, ...]:
    train_pool, _ = _spec_data(spec)
    partition_seed = _stage_seed(spec.seed, _PARTITION_STAGE)
    settings = {
        "partition": spec.partition,
        "num-partitions": spec.num_partitions,
        "seed": partition_seed,
        # Only the parameter of the chosen scheme, so that e.g. IID ignores the alpha.
        **({"alpha": spec.dirichlet_alpha} if spec.partition == "dirichlet" else {}),
        **({"classes": spec.classes_per_partition} if spec.partition == "classes" else {}),
    }
    key = partition_key(settings, train_pool.labels)
    cached = load_partitions(key, spec.num_partitions, train_pool.labels.shape[0])
    if cached is None:
        cached = partition_indices(
            train_pool.labels,
            spec.num_partitions,
            cast(PartitionScheme, spec.partition),
            alpha=spec.dirichlet_alpha,
            classes_per_partition=spec.classes_per_partition,
            seed=partition_seed,
        )
        store_partitions(key, cached)
    partitions = tuple(cached)
    for indices in partitions:
        indices.setflags(write=False)
    return partitions


@functools.lru_cache(maxsize=_CACHED_SPECS)
def _server_splits(spec: DataSpec) -> tuple[LabeledData, LabeledData]:
    if spec.dataset != PER_DEVICE_DATASET:
        _, heldout = _spec_data(spec)
    else:  # held-out samples of a seeded set of the population's devices
        heldout = server_heldout(
            spec.num_partitions,
            alpha=spec.synthetic_alpha,
            beta=spec.synthetic_beta,
            seed=spec.seed,
        )
    try:
        test, proxy = split_server_data(
            heldout,
            proxy_per_class=spec.proxy_per_class,
            seed=_stage_seed(spec.seed, _PROXY_STAGE),
        )
    except ValueError as error:
        if spec.dataset != PER_DEVICE_DATASET:
            raise
        raise ValueError(
            f"{error}: the server's held-out samples of "
            f"{min(spec.num_partitions, SERVER_DEVICES)} synthetic devices (num-clients = "
            f"{spec.num_partitions}) lack that class, since each device labels most of its "
            "samples alike and a few devices may never label some classes. Use more clients (from "
            "50 on, every class was held in each of 30 seeds tried), another seed, or "
            "proxy-per-class = 0 (no proxy set; FedLAW needs one)"
        ) from None
    test, proxy = server_view(spec.dataset, test, proxy, spec.seed)
    # seed + 7: the stream FedGMA's evidence script drew its test subsets from (seeded_subset)
    test = seeded_subset(test, spec.test_size, spec.seed + TEST_SUBSET_OFFSET)
    return _read_only(test), _read_only(proxy)
