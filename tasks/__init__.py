"""Data sets, partitioning, server splits, models and evaluation for the federated runs.

The public names below are re-exported lazily (PEP 562): ``from tasks import build_model``
works as usual, but ``import tasks.protocol`` (which the strategies need) does not pull in
torch, scikit-learn and Flower Datasets, which take seconds to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.datasets import (
        DEFAULT_DATA_DIRS,
        DatasetName,
        DatasetNotFoundError,
        LabeledData,
        load_dataset,
        make_synthetic,
    )
    from tasks.evaluation import DeviceRequest, evaluate, make_loader, resolve_device
    from tasks.federation import DataSpec, load_client_partition, load_server_splits
    from tasks.models import ModelName, build_model
    from tasks.partition import PartitionScheme, partition_indices
    from tasks.splits import split_server_data

_MODULE_OF_EXPORT = {
    "DEFAULT_DATA_DIRS": "tasks.datasets",
    "DatasetName": "tasks.datasets",
    "DatasetNotFoundError": "tasks.datasets",
    "LabeledData": "tasks.datasets",
    "load_dataset": "tasks.datasets",
    "make_synthetic": "tasks.datasets",
    "DeviceRequest": "tasks.evaluation",
    "evaluate": "tasks.evaluation",
    "make_loader": "tasks.evaluation",
    "resolve_device": "tasks.evaluation",
    "DataSpec": "tasks.federation",
    "load_client_partition": "tasks.federation",
    "load_server_splits": "tasks.federation",
    "ModelName": "tasks.models",
    "build_model": "tasks.models",
    "PartitionScheme": "tasks.partition",
    "partition_indices": "tasks.partition",
    "split_server_data": "tasks.splits",
}

__all__ = [
    "DEFAULT_DATA_DIRS",
    "DataSpec",
    "DatasetName",
    "DatasetNotFoundError",
    "DeviceRequest",
    "LabeledData",
    "ModelName",
    "PartitionScheme",
    "build_model",
    "evaluate",
    "load_client_partition",
    "load_dataset",
    "load_server_splits",
    "make_loader",
    "make_synthetic",
    "partition_indices",
    "resolve_device",
    "split_server_data",
]


def __getattr__(name: str) -> object:
    module_name = _MODULE_OF_EXPORT.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tasks' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
