"""Partitioning time of tasks/partition.py's NumPy partitioners against flwr-datasets 0.6.1.

The same pool, settings and seed through both (tests/partition_reference.py drives Flower
Datasets as tasks/partition.py did before it was rewritten); each is timed best of ``--repeats``
in this process, after its imports, and the partitions are checked bit-identical. The import of
Hugging Face ``datasets`` and Flower Datasets, which every ClientApp process that partitioned
used to pay, is timed apart in a fresh interpreter. docs/running.md quotes::

    .venv/bin/python -m benchmarks.partition_speed --dataset fashion-mnist --clients 100 \\
        --alpha 0.1 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, cast, get_args

import numpy as np

from benchmarks.harness import Stopwatch, hardware
from beyond_averaging.tasks.datasets import DATASET_NAMES, DatasetName, load_dataset
from beyond_averaging.tasks.partition import PartitionScheme, partition_indices
from tests.partition_reference import FLWR_DATASETS_VERSION, reference_partitions

_IMPORT_PROBE = (
    "import time; start = time.perf_counter(); import datasets, flwr_datasets.partitioner; "
    "print(time.perf_counter() - start)"
)


def best_wall(
    partitioner: Callable[..., list[np.ndarray]],
    labels: np.ndarray,
    clients: int,
    scheme: str,
    settings: dict[str, Any],
    repeats: int,
) -> tuple[float, list[np.ndarray]]:
    """The shortest wall time of ``repeats`` calls, and the last call's partitions."""
    times = []
    for _ in range(repeats):
        with Stopwatch() as clock:
            partitions = partitioner(labels, clients, scheme, **settings)
        times.append(clock.wall)
    return min(times), partitions


def main(argv: Sequence[str] | None = None) -> int:
    """Time both partitioners per scheme; exit 1 if any partition differs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=DATASET_NAMES, default="fashion-mnist")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--classes-per-client", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--schemes", nargs="+", choices=get_args(PartitionScheme), default=["dirichlet"]
    )
    args = parser.parse_args(argv)
    labels = load_dataset(cast(DatasetName, args.dataset))[0].labels
    imported = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, check=True
    )
    import datasets  # noqa: F401  (imported before timing, as a warm process has them)
    import flwr_datasets.partitioner  # noqa: F401

    print(hardware())
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"load average {os.getloadavg()[0]:.1f} at {when}")
    print(
        f"{args.dataset}: {labels.size} training labels, {args.clients} partitions, seed "
        f"{args.seed}, best of {args.repeats}; importing datasets and Flower Datasets "
        f"{FLWR_DATASETS_VERSION} in a fresh interpreter: {float(imported.stdout):.2f} s"
    )
    print("| scheme | NumPy (tasks/partition.py) | flwr-datasets | ratio | bit-identical |")
    print("|---|---:|---:|---:|---|")
    identical_everywhere = True
    for scheme in args.schemes:
        settings: dict[str, Any] = {
            "alpha": args.alpha,
            "classes_per_partition": args.classes_per_client,
            "seed": args.seed,
        }
        ours, mine = best_wall(
            partition_indices, labels, args.clients, scheme, settings, args.repeats
        )
        reference, theirs = best_wall(
            reference_partitions, labels, args.clients, scheme, settings, args.repeats
        )
        identical = len(mine) == len(theirs) and all(
            a.dtype == b.dtype and a.tobytes() == b.tobytes()
            for a, b in zip(mine, theirs, strict=True)
        )
        identical_everywhere &= identical
        verdict = "yes" if identical else "NO"
        shown = {"dirichlet": f" (alpha {args.alpha})", "classes": f" ({args.classes_per_client})"}
        print(
            f"| {scheme}{shown.get(scheme, '')} | {ours * 1000:.1f} ms | "
            f"{reference * 1000:.1f} ms | {reference / ours:.0f}x | {verdict} |"
        )
    return 0 if identical_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
