"""beyond-averaging: Flower strategies for aggregation rules beyond plain averaging.

The public API a Flower app needs::

    from beyond_averaging import FedAvg, ElasticAggregation, FedLAW, FedGMA, FedGMASoft
    from beyond_averaging import FedAdam, FedAvgM  # Flower's names and arguments
    from beyond_averaging import sensitivity_record  # the client side of Elastic aggregation
    from beyond_averaging import last_step_gradient  # the client side of hard FedGMA
    from beyond_averaging import SecureAggregation, SecAggOptions, BOUNDS_OFF  # SecAgg+
    from beyond_averaging import secure_aggregation_mod  # its client side, a ClientApp mod

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
    from .client.gradient import last_step_gradient as last_step_gradient
    from .client.secure import secure_aggregation_mod as secure_aggregation_mod
    from .client.sensitivity import sensitivity_record as sensitivity_record
    from .strategies import ClientReply as ClientReply
    from .strategies import ContractStrategy as ContractStrategy
    from .strategies import ElasticAggregation as ElasticAggregation
    from .strategies import FedAdam as FedAdam
    from .strategies import FedAvg as FedAvg
    from .strategies import FedAvgM as FedAvgM
    from .strategies import FedGMA as FedGMA
    from .strategies import FedGMASoft as FedGMASoft
    from .strategies import FedLAW as FedLAW
    from .strategies import MissingRecordError as MissingRecordError
    from .strategies import ProxySetError as ProxySetError
    from .strategies import ServerOptimizer as ServerOptimizer
    from .strategies import aggregate_elastic as aggregate_elastic
    from .strategies import aggregate_fedavg as aggregate_fedavg
    from .strategies import aggregate_fedgma as aggregate_fedgma
    from .strategies import aggregate_fedlaw as aggregate_fedlaw
    from .strategies import aggregate_metrics as aggregate_metrics
    from .strategies import and_mask as and_mask
    from .strategies import learn_aggregation_weights as learn_aggregation_weights
    from .strategies import track as track
    from .strategies.secure import BOUNDS_OFF as BOUNDS_OFF
    from .strategies.secure import SecAggOptions as SecAggOptions
    from .strategies.secure import SecureAggregation as SecureAggregation

# Exports resolve on first use (PEP 562): `import beyond_averaging.tasks.protocol` must not pull
# in torch, and a ServerApp that only needs a strategy does not import the client helpers.
_MODULE_OF_EXPORT = {
    "BOUNDS_OFF": ".strategies.secure",
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
    "SecAggOptions": ".strategies.secure",
    "SecureAggregation": ".strategies.secure",
    "ServerOptimizer": ".strategies",
    "aggregate_elastic": ".strategies",
    "aggregate_fedavg": ".strategies",
    "aggregate_fedgma": ".strategies",
    "aggregate_fedlaw": ".strategies",
    "aggregate_metrics": ".strategies",
    "and_mask": ".strategies",
    "last_step_gradient": ".client.gradient",
    "learn_aggregation_weights": ".strategies",
    "secure_aggregation_mod": ".client.secure",
    "sensitivity_record": ".client.sensitivity",
    "track": ".strategies",
}

#: The public names: the export map's and the release. Listed once, in the map above; the
#: TYPE_CHECKING imports name them again only for type checkers (``X as X``: an explicit
#: re-export, which mypy's strict mode needs since __all__ is not a literal).
__all__ = sorted([*_MODULE_OF_EXPORT, "__version__"])


__getattr__, __dir__ = lazy_exports(__name__, globals(), _MODULE_OF_EXPORT)
