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
the same names (docs/development.md, "Layout").
"""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

#: The subpackages, each a folder at the repository's top (pyproject.toml maps the same four).
SUBPACKAGES = ("client", "server", "strategies", "tasks")

# Where the subpackages are: inside this folder in a built package (the wheel, where setuptools
# copied them by pyproject's package-dir), beside it in an unbuilt tree (a checkout, or a copy of
# its folders). One rule for both: the package's search path is this folder, then the folder that
# holds the four. (The FAB that `flwr run` ships carries no code: every node runs its installed
# release, pyproject.toml's `fab-include`.)
_BESIDE = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "tasks").is_dir() and all(
    (_BESIDE / name / "__init__.py").is_file() for name in SUBPACKAGES
):
    __path__.append(str(_BESIDE))
    #: The release: pyproject.toml's ``version`` (CHANGELOG.md says what each one holds).
    __version__: str = tomllib.loads((_BESIDE / "pyproject.toml").read_text("utf-8"))["project"][
        "version"
    ]
else:
    try:
        __version__ = version("beyond-averaging")
    except PackageNotFoundError:  # the files copied somewhere by hand, never installed
        __version__ = "0+unknown"

from .tasks.lazy_exports import lazy_exports  # noqa: E402 - needs the search path above

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
        track,
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
    "track": ".strategies",
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
    "__version__",
    "aggregate_elastic",
    "aggregate_fedavg",
    "aggregate_fedgma",
    "aggregate_fedlaw",
    "aggregate_metrics",
    "and_mask",
    "last_step_gradient",
    "learn_aggregation_weights",
    "sensitivity_record",
    "track",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _MODULE_OF_EXPORT)
