"""The base class of this project's strategies: sampling, a written reply contract, and metrics.

Payload contract of a train reply (see :mod:`tasks.protocol`):

- ``arrays`` (ArrayRecord): required; same keys and shapes as the global model; finite values.
- ``metrics`` (MetricRecord): required; ``num-examples`` > 0; other entries are averaged.
- each record a strategy declares in ``required_records`` (``sensitivity``, ``gradient``):
  an ArrayRecord whose keys are a non-empty subset of the global model's, same shapes, finite.

A reply that breaks it is dropped with a logged reason and counted in the round's metrics
(``replies-dropped`` and ``dropped-<reason>``). The round aggregates the rest when at least
``min_train_replies`` remain; otherwise the global model is kept and the log says why. If no reply
of a round carries a required record at all, the run stops with :class:`MissingRecordError`, whose
message says how to add that record: a strategy never silently falls back to FedAvg.

Subclasses implement :meth:`ContractStrategy.aggregate`, a call into their pure math function.
"""

from __future__ import annotations

import random
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from ..tasks.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
    REQUEST_RECORDS_KEY,
)
from .aggregate import NDArrayDict, normalise_weights, npy_view, value_range


class MissingRecordError(RuntimeError):
    """No reply of a round carried a record that the strategy cannot work without."""


@dataclass(frozen=True)
class ClientReply:
    """A reply that passed the contract, unpacked to numpy."""

    node_id: int
    arrays: NDArrayDict
    num_examples: int
    metrics: dict[str, float]
    records: dict[str, NDArrayDict] = field(default_factory=dict)


#: ``fn(server_round, global_arrays, valid_replies, weights) -> metrics``: called after each
#: aggregation with the round's valid replies and their normalised data-size weights; the metrics it
#: returns are merged into the round's metrics (e.g. strategies.diagnostics.ClientDiagnostics).
ReplyObserver = Callable[
    [int, NDArrayDict, Sequence[ClientReply], np.ndarray[Any, np.dtype[np.float64]]],
    Mapping[str, float | int | list[float]],
]


class ReplyRejected(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Internal: why a reply is dropped (``reason`` is the metrics key suffix)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _check_values(
    name: str, arrays: Mapping[str, np.ndarray[Any, Any]], minimum: float = -np.inf
) -> None:
    """Reject NaN, Inf and values below ``minimum``: one pass over each floating tensor."""
    for key, value in arrays.items():
        if np.issubdtype(value.dtype, np.floating):
            low, high = value_range(value)
            finite = bool(np.isfinite(low) and np.isfinite(high))
        elif np.issubdtype(value.dtype, np.complexfloating):  # unordered: finiteness only
            low, finite = minimum, bool(np.all(np.isfinite(value)))
        else:  # integer counters are finite; their minimum matters only under a bound
            finite = True
            low = float(value.min()) if value.size and np.isfinite(minimum) else minimum
        if not finite:
            raise ReplyRejected(
                "non-finite" if name == ARRAYS_RECORD else f"bad-{name}",
                f"record '{name}' tensor '{key}' holds NaN or Inf",
            )
        if low < minimum:
            raise ReplyRejected(
                f"bad-{name}",
                f"record '{name}' tensor '{key}' has values below {minimum} (smallest {low})",
            )


def _check_like_global(
    name: str,
    arrays: NDArrayDict,
    global_arrays: NDArrayDict,
    subset: bool,
    minimum: float = -np.inf,
) -> None:
    keys, expected = set(arrays), set(global_arrays)
    if (subset and (not keys or not keys <= expected)) or (not subset and keys != expected):
        unknown, missing = sorted(keys - expected), sorted(expected - keys)
        raise ReplyRejected(
            "key-mismatch" if name == ARRAYS_RECORD else f"bad-{name}",
            f"record '{name}' keys differ from the global model "
            f"(unknown: {unknown[:5]}, missing: {[] if subset else missing[:5]})",
        )
    for key, value in arrays.items():
        if value.shape != global_arrays[key].shape:
            raise ReplyRejected(
                "shape-mismatch" if name == ARRAYS_RECORD else f"bad-{name}",
                f"record '{name}' tensor '{key}' has shape {value.shape}, "
                f"global model has {global_arrays[key].shape}",
            )
    _check_values(name, arrays, minimum)


def _to_numpy(record: ArrayRecord) -> NDArrayDict:
    # Read-only views of the received bytes: a copy per tensor (Array.numpy) would hold one more
    # model-sized buffer per client and record during aggregation (benchmarks/systems.py).
    return {key: npy_view(array.data) for key, array in record.items()}


class ContractStrategy(Strategy):
    """Base of this project's strategies (Flower Message API).

    Parameters
    ----------
    fraction_train : float
        Share of connected nodes sampled for training each round.
    min_train_replies : int
        Valid replies needed to aggregate; with fewer the global model is kept.
    fraction_evaluate : float
        Share of nodes sampled for federated evaluation (0 disables it).
    min_available_nodes : int
        Nodes that must be connected before a round starts.
    seed : int
        Seeds node sampling, so that two strategies of one seed see the same cohorts.
    train_config : Mapping, optional
        Entries added to every train message's config (after the strategy's own).
    """

    #: Extra ArrayRecords every reply must carry, with the hint shown when they are missing.
    required_records: ClassVar[Mapping[str, str]] = {}
    #: Smallest value allowed in a required record (e.g. 0 for a sensitivity); checked in the
    #: same pass as finiteness, a reply breaking it is dropped as ``bad-<record>``.
    record_minimums: ClassVar[Mapping[str, float]] = {}

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        min_train_replies: int = 2,
        fraction_evaluate: float = 0.0,
        min_available_nodes: int = 2,
        seed: int = 0,
    ) -> None:
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train = {fraction_train}: allowed is (0, 1]")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate = {fraction_evaluate}: allowed is [0, 1]")
        if min_train_replies < 1:
            raise ValueError(f"min_train_replies = {min_train_replies}: allowed is >= 1")
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_train_replies = min_train_replies
        self.min_available_nodes = max(min_available_nodes, 1)
        self.seed = seed
        self.global_arrays: NDArrayDict = {}
        self.last_round_metrics: dict[str, Any] = {}
        self.last_aggregation_seconds = 0.0
        self.reply_observers: list[ReplyObserver] = []

    # ------------------------------------------------------------------ what subclasses provide
    @abstractmethod
    def aggregate(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        """New global arrays from the valid replies (same keys, shapes and dtypes)."""

    def add_reply_observer(self, observer: ReplyObserver) -> None:
        """Call ``observer`` after every aggregation; its metrics join the round's metrics."""
        self.reply_observers.append(observer)

    def train_config_entries(self) -> dict[str, int | float | str | bool]:
        """Extra config a strategy sends with every train message (e.g. sensitivity options)."""
        return {}

    def round_metrics(self) -> dict[str, float | int | list[float]]:
        """Strategy-specific metrics of the last aggregation (e.g. FedLAW's gamma)."""
        return {}

    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "\t├──> %s", self.__class__.__name__)
        log(
            INFO,
            "\t│\t├── fraction train / evaluate: %s / %s",
            self.fraction_train,
            self.fraction_evaluate,
        )
        log(INFO, "\t│\t├── min train replies: %s", self.min_train_replies)
        log(INFO, "\t│\t└── required records: %s", ["arrays", "metrics", *self.required_records])

    # ------------------------------------------------------------------ Flower Strategy API
    def _sample(self, grid: Grid, fraction: float, server_round: int) -> list[int]:
        wanted = self.min_available_nodes
        while len(nodes := sorted(grid.get_node_ids())) < wanted:
            log(INFO, "Waiting for nodes: %d connected, %d needed", len(nodes), wanted)
            time.sleep(1.0)
        size = min(len(nodes), max(int(len(nodes) * fraction), self.min_train_replies, 1))
        # A round-seeded generator: reproducible cohorts, identical across strategies.
        return random.Random(self.seed * 100_003 + server_round).sample(nodes, size)

    def _messages(
        self, grid: Grid, record: RecordDict, message_type: str, fraction: float, rnd: int
    ) -> list[Message]:
        node_ids = self._sample(grid, fraction, rnd)
        log(INFO, "%s: sampled %d nodes", message_type, len(node_ids))
        return [Message(content=record, message_type=message_type, dst_node_id=n) for n in node_ids]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global model, the run's client task and the records the strategy needs."""
        self.global_arrays = _to_numpy(arrays)
        config["server-round"] = server_round
        config[REQUEST_RECORDS_KEY] = ",".join(self.required_records)
        for key, value in self.train_config_entries().items():
            config[key] = value
        record = RecordDict({ARRAYS_RECORD: arrays, CONFIG_RECORD: config})
        return self._messages(grid, record, MessageType.TRAIN, self.fraction_train, server_round)

    def validate_reply(self, message: Message) -> ClientReply:
        """Unpack a reply or raise :class:`ReplyRejected` with the contract clause it breaks."""
        if message.has_error():
            raise ReplyRejected("error-reply", f"error reply: {message.error.reason}")
        content = message.content
        arrays_record = content.array_records.get(ARRAYS_RECORD)
        if arrays_record is None:
            raise ReplyRejected("missing-arrays", "no ArrayRecord named 'arrays'")
        metrics_record = content.metric_records.get(METRICS_RECORD)
        if metrics_record is None or NUM_EXAMPLES_KEY not in metrics_record:
            raise ReplyRejected("missing-metrics", "no MetricRecord 'metrics' with 'num-examples'")
        num_examples = metrics_record[NUM_EXAMPLES_KEY]
        if isinstance(num_examples, list) or not num_examples > 0:
            raise ReplyRejected(
                "bad-num-examples", f"num-examples = {num_examples!r}, must be a number > 0"
            )
        arrays = _to_numpy(arrays_record)
        _check_like_global(ARRAYS_RECORD, arrays, self.global_arrays, subset=False)
        records: dict[str, NDArrayDict] = {}
        for name in self.required_records:
            extra = content.array_records.get(name)
            if extra is None:
                raise ReplyRejected(f"missing-{name}", f"no ArrayRecord named '{name}'")
            records[name] = _to_numpy(extra)
            _check_like_global(
                name,
                records[name],
                self.global_arrays,
                subset=True,
                minimum=self.record_minimums.get(name, -np.inf),
            )
        metrics = {
            key: float(value)
            for key, value in metrics_record.items()
            if key != NUM_EXAMPLES_KEY and isinstance(value, int | float)
        }
        return ClientReply(
            node_id=message.metadata.src_node_id,
            arrays=arrays,
            num_examples=int(num_examples),
            metrics=metrics,
            records=records,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies by the contract, then aggregate the valid ones."""
        replies = list(replies)
        valid: list[ClientReply] = []
        dropped: Counter[str] = Counter()
        for message in replies:
            try:
                valid.append(self.validate_reply(message))
            except ReplyRejected as rejection:
                dropped[rejection.reason] += 1
                log(
                    WARNING,
                    "round %d: dropped reply from node %s: %s",
                    server_round,
                    message.metadata.src_node_id,
                    rejection.detail,
                )
        self._stop_if_record_absent(replies, dropped)
        metrics: dict[str, Any] = {
            "replies-received": len(replies),
            "replies-valid": len(valid),
            "replies-dropped": sum(dropped.values()),
            **{f"dropped-{reason}": count for reason, count in sorted(dropped.items())},
        }
        if valid:
            weights = normalise_weights([reply.num_examples for reply in valid])
            for key in sorted({k for reply in valid for k in reply.metrics}):
                present = [
                    (w, r.metrics[key])
                    for w, r in zip(weights, valid, strict=True)
                    if key in r.metrics
                ]
                total = sum(w for w, _ in present)
                metrics[key] = sum(w * v for w, v in present) / total
        if len(valid) < self.min_train_replies:
            log(
                WARNING,
                "round %d: %d valid replies < min-train-replies = %d: keeping the "
                "global model of the previous round",
                server_round,
                len(valid),
                self.min_train_replies,
            )
            metrics["aggregated"] = 0
            self.last_round_metrics = metrics
            return None, MetricRecord(metrics)
        started = time.perf_counter()
        new_arrays = self.aggregate(server_round, self.global_arrays, valid)
        self.last_aggregation_seconds = time.perf_counter() - started
        metrics["aggregated"] = 1
        metrics["aggregation-seconds"] = self.last_aggregation_seconds
        metrics.update(self.round_metrics())
        for observer in self.reply_observers:  # after the timing: observers never inflate it
            metrics.update(observer(server_round, self.global_arrays, valid, weights))
        self.last_round_metrics = metrics
        record = ArrayRecord(
            # asarray(order='C'), not ascontiguousarray: the latter turns 0-d tensors
            # (BatchNorm's num_batches_tracked) into shape (1,), which round 2 then rejects.
            {key: Array(np.asarray(value, order="C")) for key, value in new_arrays.items()}
        )
        return record, MetricRecord(metrics)

    def _stop_if_record_absent(self, replies: Sequence[Message], dropped: Counter[str]) -> None:
        answered = sum(not message.has_error() for message in replies)
        for name, hint in self.required_records.items():
            if answered and dropped[f"missing-{name}"] == answered:
                raise MissingRecordError(
                    f"{self.__class__.__name__} needs the ArrayRecord '{name}' in every train "
                    f"reply, and none of the {answered} replies of this round had it. {hint}"
                )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation on a sample of nodes (none when fraction_evaluate is 0)."""
        if self.fraction_evaluate == 0.0:
            return []
        config["server-round"] = server_round
        record = RecordDict({ARRAYS_RECORD: arrays, CONFIG_RECORD: config})
        return self._messages(
            grid, record, MessageType.EVALUATE, self.fraction_evaluate, server_round
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Example-weighted mean of the clients' evaluation metrics."""
        results: list[tuple[float, dict[str, float]]] = []
        for message in replies:
            if message.has_error():
                log(
                    WARNING,
                    "round %d: evaluate error from node %s: %s",
                    server_round,
                    message.metadata.src_node_id,
                    message.error.reason,
                )
                continue
            record = message.content.metric_records.get(METRICS_RECORD)
            if record is None or not isinstance(record.get(NUM_EXAMPLES_KEY), int | float):
                continue
            count = float(record[NUM_EXAMPLES_KEY])  # type: ignore[arg-type]
            if count > 0:
                results.append(
                    (
                        count,
                        {
                            k: float(v)
                            for k, v in record.items()
                            if isinstance(v, int | float) and k != NUM_EXAMPLES_KEY
                        },
                    )
                )
        if not results:
            return None
        total = sum(count for count, _ in results)
        keys = set.intersection(*(set(values) for _, values in results))
        return MetricRecord(
            {key: sum(c * v[key] for c, v in results) / total for key in sorted(keys)}
        )
