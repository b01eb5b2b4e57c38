"""The federation's data at the start of a run: each client's label counts, saved and plotted.

``runs/<run>/partitions.json`` holds the partition settings and one row of label counts per
client (what each client trains on); ``runs/<run>/partitions.png`` draws them as one stacked bar
per client, when matplotlib is installed (the ``bench`` extra; without it the run logs a note
and goes on). A federation of more than :data:`MAX_RECORDED_PARTITIONS` clients is not counted
(it would load every client's data in the ServerApp): the run says so.
"""

from __future__ import annotations

import json
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.supercore import log

from beyond_averaging.tasks.federation import DataSpec, partition_label_counts

from .checkpoint import private_file
from .folder import PARTITIONS_FILE, PARTITIONS_PLOT
from .plots import COPY_RUNS_OUT, PLOT_EXTRA, in_image

#: Federations up to this size have their label counts recorded at the start of a run.
MAX_RECORDED_PARTITIONS = 1000


def partition_record(spec: DataSpec, counts: np.ndarray) -> dict[str, Any]:
    """What ``partitions.json`` holds: the data settings and the counts, client by client."""
    return {
        "dataset": spec.dataset,
        "partition": spec.partition,
        "num-partitions": spec.num_partitions,
        "dirichlet-alpha": spec.dirichlet_alpha,
        "classes-per-client": spec.classes_per_partition,
        "client-holdout": spec.client_holdout,
        "seed": spec.seed,
        "num-classes": int(counts.shape[1]) if counts.ndim == 2 else 0,
        "num-examples": [int(total) for total in counts.sum(axis=1)],
        "label-counts": counts.tolist(),
    }


#: Room above the tallest bar of ``partitions.png``, as a share of its height: matplotlib's
#: default 5% left the bar touching the frame.
HEADROOM = 0.12


def draw_label_counts(counts: np.ndarray, title: str) -> Any:
    """The figure of :func:`plot_label_counts`, not yet saved (its axes: ``figure.axes[0]``).

    Raises
    ------
    ImportError
        matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    clients = np.arange(counts.shape[0])
    figure, axes = plt.subplots(figsize=(min(4.0 + 0.35 * len(clients), 16.0), 4.0))
    bottom = np.zeros(len(clients))
    colours = plt.get_cmap("tab20" if counts.shape[1] > 10 else "tab10")
    for label in range(counts.shape[1]):
        axes.bar(clients, counts[:, label], bottom=bottom, color=colours(label % 20), label=label)
        bottom += counts[:, label]
    tallest = float(bottom.max()) if len(bottom) else 0.0
    if tallest > 0:
        axes.set_ylim(0, tallest * (1 + HEADROOM))
    if len(clients) <= 30:
        axes.set_xticks(clients)
    axes.set_xlabel("client (partition id)")
    axes.set_ylabel("training samples")
    axes.set_title(title)
    if counts.shape[1] <= 20:
        axes.legend(title="label", fontsize="small", bbox_to_anchor=(1.0, 1.0), loc="upper left")
    figure.tight_layout()
    return figure


def plot_label_counts(counts: np.ndarray, path: Path, title: str) -> Path | None:
    """One stacked bar per client (a colour per label) in ``path``, with :data:`HEADROOM` above
    the tallest; None without matplotlib."""
    try:
        figure = draw_label_counts(counts, title)
    except ImportError:
        return None
    import matplotlib.pyplot as plt

    with private_file(path, "wb") as stream:
        figure.savefig(stream, format="png", dpi=100)
    plt.close(figure)
    return path


def record_partitions(directory: Path, spec: DataSpec) -> Path | None:
    """Write ``partitions.json`` (and ``partitions.png``) in ``directory``; the JSON's path, or
    None when the federation is larger than :data:`MAX_RECORDED_PARTITIONS`."""
    if spec.num_partitions > MAX_RECORDED_PARTITIONS:
        log(
            INFO,
            "%d clients: their label counts are not recorded (%s is written up to %d clients)",
            spec.num_partitions,
            PARTITIONS_FILE,
            MAX_RECORDED_PARTITIONS,
        )
        return None
    counts = partition_label_counts(spec)
    path = Path(directory) / PARTITIONS_FILE
    with private_file(path, "w") as stream:
        json.dump(partition_record(spec, counts), stream)
    title = f"{spec.dataset}, {spec.partition} partition of {spec.num_partitions} clients"
    if plot_label_counts(counts, Path(directory) / PARTITIONS_PLOT, title) is None:
        log(
            INFO,
            "matplotlib is not installed (%s): the clients' label counts are in %s, not plotted",
            f"this image leaves it out; copy the runs out to read them: {COPY_RUNS_OUT}"
            if in_image()
            else f"pip install 'beyond-averaging[{PLOT_EXTRA}]'",
            path,
        )
    return path
