"""Flower Datasets' partitioners as tasks/partition.py called them before it reimplemented them.

The reference for ``tests/test_partition_reference.py`` (bit-identical partitions); run as
``python -m tests.partition_reference`` it times both (docs/running.md quotes it). The labels
are wrapped in an in-memory ``datasets.Dataset`` with an ``index`` column, a flwr-datasets
partitioner divides it, and each partition's ``index`` column gives positions into the labels,
sorted. The Dirichlet scheme restarts the partitioner with the same derived seeds, and the
classes scheme reports classes left out, as tasks/partition.py does. Needs ``flwr-datasets`` and
``datasets`` (the ``dev`` extra); argument checking is tasks/partition.py's and is not repeated.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any, cast, get_args

import numpy as np

from benchmarks.harness import Stopwatch
from beyond_averaging.server.runs.provenance import hardware_line
from beyond_averaging.tasks.datasets import DATASET_NAMES, DatasetName, load_dataset
from beyond_averaging.tasks.partition import PartitionScheme, partition_indices

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


def main(argv: Sequence[str] | None = None) -> int:
    """Time both partitioners per scheme, best of ``--repeats`` in this process after their
    imports (the import of ``datasets`` and Flower Datasets apart, in a fresh interpreter);
    exit 1 if any partition differs."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--dataset", choices=DATASET_NAMES, default="fashion-mnist")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--classes-per-client", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schemes", nargs="+", choices=get_args(PartitionScheme))
    args = parser.parse_args(argv)
    labels = load_dataset(cast(DatasetName, args.dataset))[0].labels
    probe = "import time; t = time.perf_counter(); import datasets, flwr_datasets.partitioner; "
    probe += "print(time.perf_counter() - t)"
    imported = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    import datasets  # noqa: F401  (imported before timing, as a warm process has them)
    import flwr_datasets.partitioner  # noqa: F401

    print(
        f"{hardware_line()}; load average {os.getloadavg()[0]:.1f} at {time.asctime(time.gmtime())}"
    )
    print(
        f"{args.dataset}: {labels.size} labels, {args.clients} partitions, alpha {args.alpha}, "
        f"{args.classes_per_client} classes per client, seed {args.seed}, best "
        f"of {args.repeats}; importing datasets and Flower Datasets {FLWR_DATASETS_VERSION} in a "
        f"fresh interpreter: {float(imported.stdout):.2f} s"
    )
    print("| scheme | NumPy (tasks/partition.py) | flwr-datasets | ratio | bit-identical |")
    print("|---|---:|---:|---:|---|")
    settings = {"alpha": args.alpha, "classes_per_partition": args.classes_per_client}
    identical_everywhere = True
    for scheme in args.schemes or ["dirichlet"]:
        best, parts = [], []
        for partitioner in (partition_indices, reference_partitions):
            clocks = []
            for _ in range(args.repeats):
                with Stopwatch() as clock:
                    found = partitioner(labels, args.clients, scheme, seed=args.seed, **settings)
                clocks.append(clock.wall)
            best.append(min(clocks))
            parts.append([(a.dtype, a.tobytes()) for a in found])
        identical = parts[0] == parts[1]
        identical_everywhere &= identical
        print(
            f"| {scheme} | {best[0] * 1000:.1f} ms | {best[1] * 1000:.1f} ms | "
            f"{best[1] / best[0]:.0f}x | {'yes' if identical else 'NO'} |"
        )
    return 0 if identical_everywhere else 1


if __name__ == "__main__":
    raise SystemExit(main())
