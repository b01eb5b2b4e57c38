"""What many tests build, built in one place: a client's task (:func:`make_task`) and a sweep's
spec file (:func:`make_spec`), each a small default that a test changes by name, so that a test
shows only what it is about and a new field is added here once."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import tomli_w  # Flower's own dependency: it writes the run configuration's TOML too

from beyond_averaging.tasks.protocol import ClientTask

#: One epoch of the MLP on digits (IID), batch 10 at learning rate 0.1 on CPU; no momentum,
#: decay, weight decay or proximal term.
_TASK = ClientTask(
    dataset="digits",
    data_dir="",
    partition="iid",
    dirichlet_alpha=0.5,
    classes_per_client=2,
    seed=0,
    synthetic_alpha=1.0,
    synthetic_beta=1.0,
    model="mlp",
    device="cpu",
    local_epochs=1,
    batch_size=10,
    learning_rate=0.1,
    lr_decay=1.0,
    momentum=0.0,
    weight_decay=0.0,
    proximal_mu=0.0,
)


def make_task(**changes: Any) -> ClientTask:
    """The default task (:data:`_TASK`) with ``changes``, fields by name
    (``make_task(local_epochs=2)``)."""
    return replace(_TASK, **changes)


def make_spec(folder: Path, file: str = "exp.toml", **changes: Any) -> Path:
    """A spec file ``folder/file`` (docs/benchmarks.md, "The spec file"); its path.

    The default is a small comparison: title ``t``, runs under ``folder/runs``, 3 rounds,
    seeds 0-2, FedAvg then Elastic. ``changes`` replace the spec's top-level keys (``settings``,
    ``grid``, ``methods``, ``columns``, ``runs``, ...); None leaves a key out (``runs=None``: the
    runs go where the layout puts them)."""
    spec: dict[str, Any] = {
        "title": "t",
        "runs": str(folder / "runs"),
        "settings": {"num-server-rounds": 3},
        "grid": {"seed": [0, 1, 2]},
        "methods": {"fedavg": {}, "elastic": {}},
    }
    spec.update(changes)
    path = folder / file
    path.write_text(
        tomli_w.dumps({key: value for key, value in spec.items() if value is not None}),
        encoding="utf-8",
    )
    return path
