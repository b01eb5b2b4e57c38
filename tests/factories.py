"""What many tests build, built in one place: a client's task (:func:`make_task`), a sweep's
spec file (:func:`make_spec`) and a small model with a planted backdoor
(:func:`planted_backdoor`), each a small default that a test changes by name, so that a test
shows only what it is about and a new field is added here once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import tomli_w  # Flower's own dependency: it writes the run configuration's TOML too
import torch
from torch import nn

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


def planted_backdoor(
    images: torch.Tensor, labels: torch.Tensor, trigger: Callable[[torch.Tensor], torch.Tensor]
) -> nn.Module:
    """A small MLP (flatten, 32 ReLU units) trained by 300 full-batch Adam steps (lr 0.01, torch
    seed 0) on ``images`` and ``labels`` where every image not of class 0 also appears stamped by
    ``trigger`` with label 0: a planted backdoor aimed at class 0."""
    torch.manual_seed(0)
    poison = labels != 0
    features = torch.cat([images, trigger(images[poison])])
    targets = torch.cat([labels, torch.zeros(int(poison.sum()), dtype=torch.long)])
    classes = int(labels.max()) + 1
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(images[0].numel(), 32), nn.ReLU(), nn.Linear(32, classes)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(300):
        loss = nn.functional.cross_entropy(model(features), targets)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return model
