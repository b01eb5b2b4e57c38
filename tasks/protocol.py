"""The wire contract between this project's ServerApp and ClientApp.

The server sends, in the ``config`` ConfigRecord of every train/evaluate message, what a client
needs to load its data, build the model and train it (:class:`ClientTask`), plus the names of
the extra ArrayRecords the strategy wants back (``request-records``). Replies carry:

- ``arrays`` (ArrayRecord): the trained model, keyed like the global model;
- ``metrics`` (MetricRecord): ``num-examples`` (> 0) and ``train-loss``;
- optionally the requested extra ArrayRecords (``sensitivity``, ``gradient``), keyed
  like ``arrays``;
- ``client`` (ConfigRecord): who answered, ``partition-id``; the server's per-client record
  (``clients.jsonl``) reads it, the aggregation never does.

Both sides import this module so that the record names and keys are written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # flwr stays out of this light module's import at run time
    from flwr.app import ConfigRecordValues as ConfigValue

ARRAYS_RECORD = "arrays"
METRICS_RECORD = "metrics"
CONFIG_RECORD = "config"
NUM_EXAMPLES_KEY = "num-examples"
TRAIN_LOSS_KEY = "train-loss"
SERVER_ROUND_KEY = "server-round"
REQUEST_RECORDS_KEY = "request-records"
SENSITIVITY_RECORD = "sensitivity"
GRADIENT_RECORD = "gradient"
SENSITIVITY_DECAY_KEY = "sensitivity-decay"
SENSITIVITY_DTYPE_KEY = "sensitivity-dtype"
#: The beyond-averaging release of the ServerApp that sent a message. The FAB carries no code
#: (pyproject.toml, ``fab-include``): every node runs its installed library, and a ClientApp of
#: another release refuses the message rather than train under a contract it may not share.
LIBRARY_VERSION_KEY = "library-version"
#: A reply's ConfigRecord naming the client that sent it (``partition-id``): metadata, not a
#: metric, so that no client-metric aggregation averages it.
CLIENT_RECORD = "client"
PARTITION_ID_KEY = "partition-id"


@dataclass(frozen=True)
class ClientTask:
    """What the server asks a client to do in a round (data, model, local optimiser).

    ``learning_rate`` is the base rate; the client applies ``lr_decay ** (server_round - 1)``.
    """

    dataset: str
    data_dir: str
    partition: str
    dirichlet_alpha: float
    classes_per_client: int
    seed: int
    synthetic_alpha: float
    synthetic_beta: float
    model: str
    device: str
    local_epochs: int
    batch_size: int
    learning_rate: float
    lr_decay: float
    momentum: float
    weight_decay: float
    proximal_mu: float
    client_holdout: float = 0.0

    def to_config(self) -> dict[str, ConfigValue]:
        """Flat kebab-case entries for a Flower ConfigRecord."""
        return {key.replace("_", "-"): value for key, value in asdict(self).items()}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ClientTask:
        """Read the task back from a received ConfigRecord.

        Raises
        ------
        KeyError
            When the server sent no value for a field: the message names the missing keys, which
            happens when a ServerApp other than this project's drives the ClientApp.
        """
        wanted = {f.name: f.name.replace("_", "-") for f in fields(cls)}
        missing = sorted(key for key in wanted.values() if key not in config)
        if missing:
            raise KeyError(
                f"train config lacks {missing}: this ClientApp expects the ServerApp of "
                "beyond-averaging (beyond_averaging.server.app:app), which sends them every round"
            )
        return cls(**{name: config[key] for name, key in wanted.items()})

    def round_learning_rate(self, server_round: int) -> float:
        """The client learning rate of a round: decayed once per round, as FedLAW's setup does."""
        return self.learning_rate * self.lr_decay ** max(server_round - 1, 0)


class LibraryVersionError(RuntimeError):
    """A message from a ServerApp of another beyond-averaging release than this node's."""


def check_library_version(config: Mapping[str, Any], installed: str) -> None:
    """Refuse a message sent by a ServerApp of another release than ``installed``.

    A message without :data:`LIBRARY_VERSION_KEY` (a ServerApp other than this project's, e.g. a
    user's app with these strategies) is accepted.

    Raises
    ------
    LibraryVersionError
        Naming both releases and the fix; the reply becomes an error reply, which the server
        drops with this text as its reason.
    """
    sent = config.get(LIBRARY_VERSION_KEY)
    if sent is not None and str(sent) != installed:
        raise LibraryVersionError(
            f"the ServerApp runs beyond-averaging {sent} and this SuperNode {installed}: "
            f"install beyond-averaging=={sent} on this node (or rebuild its image from the "
            "checkout the run was started from)"
        )


def requested_records(config: Mapping[str, Any]) -> frozenset[str]:
    """Names of the extra ArrayRecords that the strategy asked the client to send back."""
    raw = config.get(REQUEST_RECORDS_KEY, "")
    return frozenset(name.strip() for name in str(raw).split(",") if name.strip())
