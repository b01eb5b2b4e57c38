"""Data sets, partitioning, server splits, models and evaluation for the federated runs.

The public names below are re-exported lazily (PEP 562): ``from beyond_averaging.tasks import
build_model`` works as usual, but ``import beyond_averaging.tasks.protocol`` (which the strategies
need) does not pull in torch, scikit-learn and Flower Datasets, which take seconds to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .datasets import (
        DEFAULT_DATA_DIRS,
        DatasetName,
        DatasetNotFoundError,
        LabeledData,
        load_dataset,
    )
    from .evaluation import DeviceData, DeviceRequest, evaluate, resolve_device
    from .federation import DataSpec, load_client_partition, load_server_splits
    from .models import ModelName, build_model
    from .partition import PartitionScheme, partition_indices
    from .splits import split_server_data

_MODULE_OF_EXPORT = {
    "DEFAULT_DATA_DIRS": ".datasets",
    "DatasetName": ".datasets",
    "DatasetNotFoundError": ".datasets",
    "LabeledData": ".datasets",
    "load_dataset": ".datasets",
    "DeviceData": ".evaluation",
    "DeviceRequest": ".evaluation",
    "evaluate": ".evaluation",
    "resolve_device": ".evaluation",
    "DataSpec": ".federation",
    "load_client_partition": ".federation",
    "load_server_splits": ".federation",
    "ModelName": ".models",
    "build_model": ".models",
    "PartitionScheme": ".partition",
    "partition_indices": ".partition",
    "split_server_data": ".splits",
}

__all__ = [
    "DEFAULT_DATA_DIRS",
    "DataSpec",
    "DatasetName",
    "DatasetNotFoundError",
    "DeviceData",
    "DeviceRequest",
    "LabeledData",
    "ModelName",
    "PartitionScheme",
    "build_model",
    "evaluate",
    "load_client_partition",
    "load_dataset",
    "load_server_splits",
    "partition_indices",
    "resolve_device",
    "split_server_data",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _MODULE_OF_EXPORT)
