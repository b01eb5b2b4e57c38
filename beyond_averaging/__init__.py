"""beyond-averaging: Flower strategies for aggregation rules beyond plain averaging.

The public API a Flower app needs::

    from beyond_averaging import FedAvg, ElasticAggregation, FedLAW, FedGMA, FedGMASoft
    from beyond_averaging import FedAdam, FedAvgM  # Flower's names and arguments
    from beyond_averaging import sensitivity_record  # the client side of Elastic aggregation
    from beyond_averaging import last_step_gradient  # the client side of hard FedGMA

The library's parts are subpackages: ``beyond_averaging.strategies`` (the aggregation rules),
``beyond_averaging.client`` (client-side helpers and this project's ClientApp),
``beyond_averaging.tasks`` (data, models, record names) and ``beyond_averaging.server`` (this
project's ServerApp and run configuration). In the repository they are the top-level folders of
the same names; ``beyond_averaging/`` links to them so that one import name serves the source tree,
a Flower app bundle (FAB) and an installed wheel alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

# Flower does not follow links when it packs an app into a FAB, so an unpacked FAB holds this file
# but not the linked folders. There the subpackages are found in the FAB's root, beside this
# folder: a run executes the code it was started with, not whatever copy is installed.
_SOURCE_ROOT = Path(__file__).resolve().parent.parent
if not Path(__file__).with_name("strategies").is_dir() and (_SOURCE_ROOT / "strategies").is_dir():
    __path__.append(str(_SOURCE_ROOT))

from .tasks.lazy_exports import lazy_exports  # noqa: E402 - in a FAB it needs the path above

if TYPE_CHECKING:
    from .client.gradient import last_step_gradient
    from .client.sensitivity import sensitivity_record
    from .strategies import (
        ClientReply,
        ContractStrategy,
        ElasticAggregation,
        FedAdam,
        FedAvg,
        FedAvgM,
        FedGMA,
        FedGMASoft,
        FedLAW,
        MissingRecordError,
        ProxySetError,
        ServerOptimizer,
        aggregate_elastic,
        aggregate_fedavg,
        aggregate_fedgma,
        aggregate_fedlaw,
        aggregate_metrics,
        and_mask,
        learn_aggregation_weights,
    )

# Exports resolve on first use (PEP 562): `import beyond_averaging.tasks.protocol` must not pull
# in torch, and a ServerApp that only needs a strategy does not import the client helpers.
_MODULE_OF_EXPORT = {
    "ClientReply": ".strategies",
    "ContractStrategy": ".strategies",
    "ElasticAggregation": ".strategies",
    "FedAdam": ".strategies",
    "FedAvg": ".strategies",
    "FedAvgM": ".strategies",
    "FedGMA": ".strategies",
    "FedGMASoft": ".strategies",
    "FedLAW": ".strategies",
    "MissingRecordError": ".strategies",
    "ProxySetError": ".strategies",
    "ServerOptimizer": ".strategies",
    "aggregate_elastic": ".strategies",
    "aggregate_fedavg": ".strategies",
    "aggregate_fedgma": ".strategies",
    "aggregate_fedlaw": ".strategies",
    "aggregate_metrics": ".strategies",
    "and_mask": ".strategies",
    "last_step_gradient": ".client.gradient",
    "learn_aggregation_weights": ".strategies",
    "sensitivity_record": ".client.sensitivity",
}

__all__ = [
    "ClientReply",
    "ContractStrategy",
    "ElasticAggregation",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedGMA",
    "FedGMASoft",
    "FedLAW",
    "MissingRecordError",
    "ProxySetError",
    "ServerOptimizer",
    "aggregate_elastic",
    "aggregate_fedavg",
    "aggregate_fedgma",
    "aggregate_fedlaw",
    "aggregate_metrics",
    "and_mask",
    "last_step_gradient",
    "learn_aggregation_weights",
    "sensitivity_record",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _MODULE_OF_EXPORT)
