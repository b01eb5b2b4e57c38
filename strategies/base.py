"""The base class of this project's strategies: sampling, a written reply contract, and metrics.

Payload contract of a train reply (see :mod:`tasks.protocol`):

- ``arrays`` (ArrayRecord, named by ``arrayrecord_key``): required; same keys and shapes as the
  global model; finite values.
- a MetricRecord (the one named ``metrics``, or the reply's only one, as Flower reads it):
  required; its entry ``weighted_by_key`` (``num-examples``) a number > 0, the reply's weight.
- each record a strategy declares in ``required_records`` (``sensitivity``, ``gradient``):
  an ArrayRecord whose keys are a non-empty subset of the global model's, same shapes, finite.

A reply that breaks it is dropped with a logged reason and counted in the strategy's aggregation
metrics (``replies-dropped`` and ``dropped-<reason>``). The round aggregates the rest when at least
``min_train_replies`` remain; otherwise the global model is kept and the log says why. If no reply
of a round carries a required record at all, the run stops with :class:`MissingRecordError`, whose
message says how to add that record: a strategy never silently falls back to FedAvg.

Constructor arguments are those of Flower's ``flwr.serverapp.strategy.FedAvg``, in its order
and with its defaults and meanings (:class:`~strategies.arguments.FlowerOptions`), then,
keyword-only, this project's extras (:class:`~strategies.arguments.ProjectOptions`:
``min_train_replies``, ``seed`` and the reply bounds).
Results follow Flower's split: ``aggregate_train`` / ``aggregate_evaluate`` return only
the clients' metrics, aggregated as Flower does (:mod:`strategies.replies.metrics`), so
``Result.train_metrics_clientapp`` holds client metrics only; the strategy's own figures of each
round go to :attr:`ContractStrategy.aggregation_metrics`.

Subclasses implement :meth:`ContractStrategy.aggregate`, a call into their pure math function.
"""

from __future__ import annotations

import math
import random
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any, ClassVar, NamedTuple

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
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy import Strategy

from beyond_averaging.strategies.defences.robust import (
    GENERIC_METHODS,
    RobustAggregation,
    check_robust,
    selection_rule,
)
from beyond_averaging.strategies.replies.bounds import (
    BOUNDS_STATE_KEY,
    DEFAULT_DIRECTION_OUTLIER_FACTOR,
    DEFAULT_MAX_CLAIM_FACTOR,
    DEFAULT_UPDATE_CLIP_FACTOR,
    DEFAULT_UPDATE_NORM_FACTOR,
    BoundedReplies,
    BoundsOptions,
    InfluenceBounds,
)
from beyond_averaging.strategies.replies.metrics import (
    MetricsAggregationFn,
    aggregate_metrics,
    plain_metrics,
    reply_metric_record,
    reply_weight,
)
from beyond_averaging.strategies.replies.reporting import (
    RoundLogFields,
    node_label,
    partition_of,
    reply_node,
    reply_records,
    round_line,
)
from beyond_averaging.strategies.replies.validation import (
    REPLY_OVERSIZED_ERROR_CODE,
    check_reply_size,
    check_reply_weight,
    default_reply_byte_limit,
)
from beyond_averaging.strategies.replies.wire import (
    ClientReply,
    ReplyObserver,
    ReplyRejected,
    decode_record,
    npy_header,
    record_arrays,
)
from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    NUM_EXAMPLES_KEY,
    REQUEST_RECORDS_KEY,
)

from .aggregate import NDArrayDict, normalise_weights
from .arguments import NamedArgumentErrors
from .privacy import check_wrapper


class _RoundReplies(NamedTuple):
    """A round's replies as the contract left them (refused, accepted), as the bounds left them,
    and as aggregated (capped): what the per-client records are made of."""

    refused: list[tuple[Message, ReplyRejected]]
    accepted: list[tuple[ClientReply, RecordDict]]
    bounded: BoundedReplies
    valid: list[ClientReply]


class MissingRecordError(RuntimeError):
    """No reply of a round carried a record that the strategy cannot work without."""


class ContractStrategy(NamedArgumentErrors, Strategy):
    """Base of this project's strategies (Flower Message API).

    The arguments up to ``evaluate_metrics_aggr_fn`` are Flower's ``FedAvg``'s: same order (so
    ``FedAvg(0.5)`` samples half the nodes, as in Flower), defaults, meanings and attribute
    names (:class:`~strategies.arguments.FlowerOptions`). This project's extras and each rule's
    own arguments are keyword-only after them (:class:`~strategies.arguments.ProjectOptions`).
    Per-round settings for the clients go where Flower puts them:
    ``start(train_config=ConfigRecord(...))``.

    Parameters
    ----------
    fraction_train : float
        Share of connected nodes sampled for training each round, at least ``min_train_nodes``;
        0 skips training.
    fraction_evaluate : float
        Share of connected nodes sampled for federated evaluation, at least
        ``min_evaluate_nodes``; 0 skips it.
    min_train_nodes, min_evaluate_nodes : int
        Fewest nodes sampled for training / evaluation.
    min_available_nodes : int
        Nodes that must be connected before a round samples (at least the sample size).
    weighted_by_key : str
        The entry of each reply's MetricRecord that weighs the reply, for its model and its
        metrics alike.
    arrayrecord_key, configrecord_key : str
        Names of the ArrayRecord (model) and ConfigRecord in the messages sent; a train reply
        carries its model under ``arrayrecord_key`` too.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable, optional
        ``fn(reply_contents, weighted_by_key) -> MetricRecord``, as in Flower; default
        :func:`strategies.replies.metrics.aggregate_metrics` (a weighted mean, as Flower's default).
    min_train_replies : int, optional
        This project's extra: valid replies needed to aggregate; with fewer the global model is
        kept. Default ``max(min_train_nodes, 1)``.
    seed : int
        This project's extra: seeds node sampling, so that two strategies of one seed see the
        same cohorts.
    max_client_weight : float
        Largest weight share one reply may get, in (0, 1]; the excess goes to the others in
        proportion to their weights (:func:`strategies.replies.validation.cap_weights`). 1 is no
        cap.
    update_norm_factor : float
        A reply whose update norm ||theta_k - w|| exceeds this factor times the round's median
        is dropped (``norm-outlier``), and one whose required record's norm exceeds
        ``RECORD_NORM_FACTOR_SCALE`` times the factor times that record's median
        (``norm-outlier-<record>``); 0 turns both off.
    update_clip_factor : float
        Each update is scaled down, its direction kept, to at most this factor times the
        round's median update norm (and each required record to this factor times its median
        norm) before the rule aggregates it; 0 turns clipping off.
    direction_outlier_factor : float
        A reply whose update points against the other replies' mean (cosine below -0.1 and more
        than this many robust standard deviations below the round's median cosine) is dropped
        (``direction-outlier``); 0 turns the check off
        (:func:`strategies.replies.influence.direction_outliers`).
    max_claim_factor : float
        No reply's weight (``weighted_by_key``) counts for more than this factor times the
        round's median weight; 0 turns the bound off.
    robust_aggregation : {"none", "trimmed-mean", "median", "krum", "multi-krum", "flame"}
        A Byzantine-robust aggregation in the rule's own terms (each rule's docs say what it
        is): the coordinate-wise trimmed mean or median of the updates in place of their
        weighted mean, or Krum / Multi-Krum / FLAME's selection of the replies the rule
        aggregates (:mod:`strategies.defences.robust`); ``"fltrust"`` (:mod:`strategies.defended`).
    trim_fraction : float
        Share of clients left out at each end of every coordinate by ``trimmed-mean``, and the
        share Krum and Multi-Krum assume Byzantine (f = floor(trim_fraction x K)).
    max_reply_bytes : int
        A reply holding more bytes is dropped before decoding (``oversized``); 0: four times
        the model's bytes per record sent back, plus 1 MiB.
    log_rounds : bool
        Log one line per round about what the rule did (Flower's logger, INFO): the rule's own
        figures (:attr:`round_log_fields`) and the replies kept, clipped and dropped
        (:func:`strategies.replies.reporting.round_line`). False silences it; the figures stay in
        :attr:`aggregation_metrics`.
    """

    #: The ``robust_aggregation`` values this rule has a robust form for.
    robust_methods: ClassVar[tuple[str, ...]] = GENERIC_METHODS

    #: Extra ArrayRecords every reply must carry, with the hint shown when they are missing.
    required_records: ClassVar[Mapping[str, str]] = {}
    #: Smallest value allowed in a required record (e.g. 0 for a sensitivity); checked in the
    #: same pass as finiteness, a reply breaking it is dropped as ``bad-<record>``.
    record_minimums: ClassVar[Mapping[str, float]] = {}
    #: The rule's figures in its per-round log line: metric key of :attr:`aggregation_metrics`
    #: -> (label, format spec); the reply checks' and defences' figures follow them.
    round_log_fields: ClassVar[RoundLogFields] = {}

    def __init__(
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = NUM_EXAMPLES_KEY,
        arrayrecord_key: str = ARRAYS_RECORD,
        configrecord_key: str = CONFIG_RECORD,
        train_metrics_aggr_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregationFn | None = None,
        *,
        min_train_replies: int | None = None,
        seed: int = 0,
        max_client_weight: float = 1.0,
        update_norm_factor: float = DEFAULT_UPDATE_NORM_FACTOR,
        update_clip_factor: float = DEFAULT_UPDATE_CLIP_FACTOR,
        direction_outlier_factor: float = DEFAULT_DIRECTION_OUTLIER_FACTOR,
        max_claim_factor: float = DEFAULT_MAX_CLAIM_FACTOR,
        robust_aggregation: RobustAggregation = "none",
        trim_fraction: float = 0.1,
        max_reply_bytes: int = 0,
        log_rounds: bool = True,
    ) -> None:
        if isinstance(max_reply_bytes, bool) or not isinstance(max_reply_bytes, int):
            raise ValueError(f"max_reply_bytes = {max_reply_bytes!r}: allowed is an integer >= 0")
        if max_reply_bytes < 0:
            raise ValueError(f"max_reply_bytes = {max_reply_bytes!r}: allowed is an integer >= 0")
        check_robust(robust_aggregation, trim_fraction)
        if robust_aggregation not in self.robust_methods:
            raise ValueError(
                f"robust_aggregation = {robust_aggregation!r} has no robust form in "
                f"{type(self).__name__}: use one of {self.robust_methods}"
            )
        self.robust_aggregation: RobustAggregation = robust_aggregation
        self.trim_fraction = trim_fraction
        self.max_reply_bytes = max_reply_bytes
        self.reply_byte_limit = max_reply_bytes
        #: The reply bounds (stage 3 of a reply's path, :mod:`strategies.replies.bounds`), with
        #: Krum / Multi-Krum / FLAME's selection as their selection step.
        self.bounds = InfluenceBounds(
            self._effective_bounds(
                BoundsOptions(
                    max_client_weight=max_client_weight,
                    update_norm_factor=update_norm_factor,
                    update_clip_factor=update_clip_factor,
                    direction_outlier_factor=direction_outlier_factor,
                    max_claim_factor=max_claim_factor,
                )
            ),
            tuple(self.required_records),
            selection_rule(robust_aggregation, trim_fraction),
        )
        # The bounds in force, under the arguments' names (read-only: the bounds read
        # ``self.bounds.options``).
        options = self.bounds.options
        self.max_client_weight = options.max_client_weight
        self.update_norm_factor = options.update_norm_factor
        self.update_clip_factor = options.update_clip_factor
        self.direction_outlier_factor = options.direction_outlier_factor
        self.max_claim_factor = options.max_claim_factor
        for name, fraction in (
            ("fraction_train", fraction_train),
            ("fraction_evaluate", fraction_evaluate),
        ):
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(f"{name} = {fraction}: allowed is [0, 1]")
        for name, count in (
            ("min_train_nodes", min_train_nodes),
            ("min_evaluate_nodes", min_evaluate_nodes),
            ("min_available_nodes", min_available_nodes),
        ):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{name} = {count!r}: allowed is an integer >= 0")
        if min_train_replies is None:
            min_train_replies = max(min_train_nodes, 1)
        if min_train_replies < 1:
            raise ValueError(f"min_train_replies = {min_train_replies}: allowed is >= 1")
        for name, key in (
            ("weighted_by_key", weighted_by_key),
            ("arrayrecord_key", arrayrecord_key),
            ("configrecord_key", configrecord_key),
        ):
            if not isinstance(key, str) or not key:
                raise ValueError(f"{name} = {key!r}: allowed is a non-empty string")
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        # As Flower: a phase that is off needs no nodes.
        self.min_train_nodes = min_train_nodes if fraction_train > 0.0 else 0
        self.min_evaluate_nodes = min_evaluate_nodes if fraction_evaluate > 0.0 else 0
        self.min_available_nodes = min_available_nodes
        self.weighted_by_key = weighted_by_key
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.train_metrics_aggr_fn = train_metrics_aggr_fn or aggregate_metrics
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn or aggregate_metrics
        self.min_train_replies = min_train_replies
        self.seed = seed
        for phase, fraction in (("training", fraction_train), ("evaluation", fraction_evaluate)):
            if fraction == 0.0:
                log(INFO, "fraction of nodes for %s is 0.0: federated %s is skipped", phase, phase)
        self.global_arrays: NDArrayDict = {}
        # Without a global model: what replies are decoded against (the first reply's tensors)
        # and whether the log has said so (once); see _decode_reference.
        self._reply_reference: NDArrayDict = {}
        self._told_no_global_model = False
        #: Per round, the strategy's own figures: replies received / valid / dropped (and why),
        #: ``aggregated``, ``aggregation-seconds`` and the rule's parameters (e.g. ``fedlaw-*``).
        #: Kept out of ``Result.train_metrics_clientapp``, which holds the clients' metrics only.
        self.aggregation_metrics: dict[int, dict[str, Any]] = {}
        #: The last round's client train metrics and aggregation metrics in one dict, for a run
        #: recorder (this project's ServerApp logs it with the round's test accuracy).
        self.last_round_metrics: dict[str, Any] = {}
        self.last_aggregation_seconds = 0.0
        self.reply_observers: list[ReplyObserver] = []
        self.log_rounds = bool(log_rounds)
        #: One record per train reply of the last round
        #: (:func:`strategies.replies.reporting.reply_record`:
        #: node, partition, weight, train loss, update norm, direction cosine, trust, and kept,
        #: clipped or dropped with the reason), for a run recorder (``clients.jsonl``).
        self.last_client_records: list[dict[str, Any]] = []
        #: Node id -> the partition id its last train reply named (``client`` record): the
        #: partition of an error reply from that node, which carries none. One entry per node
        #: that replied since this strategy was built.
        self.node_partitions: dict[int, int] = {}
        #: What the reply bounds made of the round being aggregated (the kept replies, the
        #: median update, the Byzantine suspects, the figures): what the stages after them read.
        self.round_bounds = BoundedReplies.unbounded()

    # ------------------------------------------------------------------ what subclasses provide
    @abstractmethod
    def aggregate(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        """New global arrays from the valid replies (same keys, shapes and dtypes)."""

    def _needs_global_model(self) -> str | None:
        """Why :meth:`aggregate` needs the global model, or None where the rule's aggregate is
        defined without it (plain FedAvg: the weighted mean, as Flower's FedAvg computes it).

        Asked only when ``aggregate_train`` runs without one (see :meth:`_decode_reference`).
        """
        return f"{type(self).__name__} aggregates the updates theta_k - w, which need w"

    def _effective_bounds(self, requested: BoundsOptions) -> BoundsOptions:
        """The reply bounds this strategy runs with, from the ones its arguments ask for: as
        asked; a defence that replaces a bound says so here (:class:`strategies.defended
        .DefendedStrategy`), before the bounds are built."""
        return requested

    def add_reply_observer(self, observer: ReplyObserver) -> None:
        """Call ``observer`` after every aggregation; its metrics join the round's metrics."""
        self.reply_observers.append(observer)

    def train_config_entries(self) -> dict[str, int | float | str | bool]:
        """Extra config a strategy sends with every train message (e.g. sensitivity options)."""
        return {}

    def privacy_noise_gap(self) -> str | None:
        """Why Flower's DP noise does not cover this rule's aggregate; None when it does.

        Flower's central-DP wrappers add noise of ``noise_multiplier * clipping_norm /
        num_sampled_clients``, calibrated for an aggregate that one client's clipped update moves
        by at most ``clipping_norm / num_sampled_clients`` (:mod:`strategies.privacy`). The text
        completes "the noise is calibrated for a plain mean of the clipped updates, and ...".
        """
        return (
            f"{type(self).__name__} changes that mean with values computed from the replies, so "
            "one client's clipped update can move its model by more than "
            "clipping_norm / num_sampled_clients"
        )

    def round_metrics(self) -> dict[str, float | int | list[float]]:
        """Strategy-specific metrics of the last aggregation (e.g. FedLAW's gamma)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What the strategy carries from one round to the next, for a run's checkpoint.

        NumPy arrays, numbers, strings and nested dicts/lists of them. A rule whose aggregation
        depends on earlier rounds (server-optimizer moments, buffers) returns that state, so that
        a resumed run continues bit for bit (``tests/test_resume.py``); node sampling needs none,
        it is seeded by the round. The base carries the reply bounds' and defences' state
        (:meth:`_carried_state`); a rule adds its own.
        """
        return self._carried_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of the same strategy and configuration."""
        state = self._load_carried_state(state)
        if state:
            raise ValueError(
                f"{type(self).__name__} carries no state between rounds, but the checkpoint "
                f"holds {sorted(state)}: it was written by another strategy"
            )

    def summary(self) -> None:
        """Log the strategy's configuration.

        ``Strategy.start`` calls it first, before any evaluation or message: inside a Flower DP
        wrapper that the rule cannot run in, the run stops here
        (:func:`strategies.privacy.check_wrapper`).
        """
        check_wrapper(self)
        log(INFO, "\t├──> %s", self.__class__.__name__)
        log(
            INFO,
            "\t│\t├── fraction train / evaluate: %s / %s, min nodes %d / %d, a round waits "
            "for at least %d connected nodes (min_available_nodes)",
            self.fraction_train,
            self.fraction_evaluate,
            self.min_train_nodes,
            self.min_evaluate_nodes,
            self.min_available_nodes,
        )
        log(
            INFO,
            "\t│\t├── weighted by '%s', records '%s' / '%s'",
            self.weighted_by_key,
            self.arrayrecord_key,
            self.configrecord_key,
        )
        log(INFO, "\t│\t├── min train replies: %s", self.min_train_replies)
        log(INFO, "\t│\t├── required records: %s", ["arrays", "metrics", *self.required_records])
        log(
            INFO,
            "\t│\t└── reply bounds: max client weight %s, update norm factor %s, robust %s "
            "(trim %s), max reply bytes %s",
            self.max_client_weight,
            self.update_norm_factor,
            self.robust_aggregation,
            self.trim_fraction,
            self.max_reply_bytes or "auto",
        )

    # ------------------------------------------------------------------ Flower Strategy API
    def _sample(self, grid: Grid, fraction: float, min_nodes: int, server_round: int) -> list[int]:
        """Flower's sampling: max(fraction * connected, min_nodes) nodes, seeded by the round."""
        wanted = max(self.min_available_nodes, min_nodes, 1)
        while True:
            ids = grid.get_node_ids()
            # An ascending range (the in-process Grid's million nodes) draws as its sorted list.
            nodes = ids if isinstance(ids, range) and ids.step > 0 else sorted(ids)
            if len(nodes) >= wanted:
                break
            log(INFO, "Waiting for nodes: %d connected, %d needed", len(nodes), wanted)
            time.sleep(1.0)
        size = min(len(nodes), max(int(len(nodes) * fraction), min_nodes, 1))
        # A round-seeded generator: reproducible cohorts, identical across strategies.
        return random.Random(self.seed * 100_003 + server_round).sample(nodes, size)

    def _messages(
        self,
        grid: Grid,
        record: RecordDict,
        message_type: str,
        fraction: float,
        min_nodes: int,
        rnd: int,
    ) -> list[Message]:
        node_ids = self._sample(grid, fraction, min_nodes, rnd)
        log(INFO, "%s: sampled %d nodes", message_type, len(node_ids))
        return [Message(content=record, message_type=message_type, dst_node_id=n) for n in node_ids]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global model, the run's client task and the records the strategy needs.

        Inside one of Flower's DP wrappers, a rule that cannot run there stops here at the
        latest, before the first message (:func:`strategies.privacy.check_wrapper`).
        """
        check_wrapper(self)
        if self.fraction_train == 0.0:
            return []
        self.global_arrays = record_arrays(arrays)
        self.reply_byte_limit = self.max_reply_bytes or default_reply_byte_limit(
            self.global_arrays, len(self.required_records)
        )
        config["server-round"] = server_round
        config[REQUEST_RECORDS_KEY] = ",".join(self.required_records)
        for key, value in self.train_config_entries().items():
            config[key] = value
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._messages(
            grid,
            record,
            MessageType.TRAIN,
            self.fraction_train,
            self.min_train_nodes,
            server_round,
        )

    def validate_reply(self, message: Message) -> ClientReply:
        """Unpack a reply or raise :class:`ReplyRejected` with the contract clause it breaks.

        Its size is checked before anything is decoded, every requested record is decoded only
        through :func:`strategies.replies.wire.decode_record`, and records the strategy did not
        request are never read. Keys, shapes and dtypes are the global model's, or without one
        the round's first reply's (:meth:`_decode_reference`).
        """
        model = self.global_arrays or self._reply_reference
        if message.has_error():
            if message.error.code == REPLY_OVERSIZED_ERROR_CODE:  # dropped while it was pulled
                raise ReplyRejected("oversized", str(message.error.reason)[:300])
            raise ReplyRejected("error-reply", f"error reply: {message.error.reason}"[:300])
        content = message.content
        check_reply_size(content, self.reply_byte_limit)
        arrays_record = content.array_records.get(self.arrayrecord_key)
        if arrays_record is None:
            raise ReplyRejected("missing-arrays", f"no ArrayRecord named '{self.arrayrecord_key}'")
        metrics_record = reply_metric_record(content)
        if metrics_record is None or self.weighted_by_key not in metrics_record:
            raise ReplyRejected(
                "missing-metrics",
                f"no MetricRecord (named 'metrics', or the reply's only one) with the weight "
                f"'{self.weighted_by_key}'",
            )
        num_examples = check_reply_weight(
            metrics_record[self.weighted_by_key],
            self.weighted_by_key,
            whole=self.weighted_by_key == NUM_EXAMPLES_KEY,
        )
        arrays = decode_record(ARRAYS_RECORD, arrays_record, model, subset=False)
        records: dict[str, NDArrayDict] = {}
        norms: dict[str, float] = {}
        for name in self.required_records:
            extra = content.array_records.get(name)
            if extra is None:
                raise ReplyRejected(f"missing-{name}", f"no ArrayRecord named '{name}'")
            decoded = decode_record(
                name,
                extra,
                model,
                subset=True,
                minimum=self.record_minimums.get(name, -math.inf),
            )
            records[name] = decoded.arrays
            if decoded.norm is not None:
                norms[name] = decoded.norm
        metrics = {  # finite numbers only: a NaN or a list never reaches an observer
            key: float(value)
            for key, value in metrics_record.items()
            if key != self.weighted_by_key
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        }
        return ClientReply(
            node_id=message.metadata.src_node_id,
            arrays=arrays.arrays,
            num_examples=num_examples,
            metrics=metrics,
            records=records,
            record_norms=norms,
        )

    def _carried_state(self) -> dict[str, Any]:
        """What every rule carries, for :meth:`state_dict`: the reply bounds' state (nothing
        before it is made); the defences add theirs (``DefendedStrategy``)."""
        bounds = self.bounds.state_dict()
        return {BOUNDS_STATE_KEY: bounds} if bounds else {}

    def _load_carried_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Restore :meth:`_carried_state` from ``state``; the rest of ``state``, for the rule."""
        self.bounds.load_state_dict(state.get(BOUNDS_STATE_KEY) or {})
        return {key: value for key, value in state.items() if key != BOUNDS_STATE_KEY}

    def _client_metrics(
        self, server_round: int, contents: list[RecordDict], aggregate: MetricsAggregationFn
    ) -> MetricRecord | None:
        """The clients' metrics by ``aggregate``; None without replies or if they cannot average.

        Metrics are the clients' claims, not checked by the contract: one client's inf beside
        another's -inf makes a weighted mean raise, which must not end the round.
        """
        if not contents:
            return None
        try:
            return aggregate(contents, self.weighted_by_key)
        except (ArithmeticError, ValueError, TypeError) as error:
            log(
                WARNING,
                "round %d: the clients' metrics cannot be aggregated (%s): no client metrics "
                "this round",
                server_round,
                error,
            )
            return None

    def _decode_reference(self, server_round: int, replies: Sequence[Message]) -> NDArrayDict:
        """The model the round's replies are decoded against: the global model, or where none was
        given (``aggregate_train`` without ``configure_train`` or ``current_arrays`` before it,
        as Flower's tests and hand-written server loops call it) the first readable reply's keys,
        shapes and dtypes, as Flower's FedAvg takes the first reply's keys.

        Without the global model the reply bounds, which measure an update against it, do not
        run (said once, in the log).

        Raises
        ------
        AggregationError
            Without the global model, where :meth:`_needs_global_model` says why the rule needs it.
        """
        if self.global_arrays:
            return self.global_arrays
        how = "call configure_train(server_round, arrays, config, grid) before aggregate_train" + (
            ", or set current_arrays" if hasattr(type(self), "current_arrays") else ""
        )
        need = self._needs_global_model()
        if need is not None:
            raise AggregationError(f"round {server_round}: no global model: {need}; {how}")
        if not self._told_no_global_model:
            self._told_no_global_model = True
            log(
                WARNING,
                "%s.aggregate_train has no global model: the replies are checked against the "
                "first reply's tensors, and the reply bounds that measure an update against the "
                "global model (norm filter, direction check, Krum/FLAME selection, claim bound, "
                "clipping, model guard) do not run; they need the global model first: %s",
                type(self).__name__,
                how,
            )
        for message in replies:
            record = (
                None
                if message.has_error()
                else message.content.array_records.get(self.arrayrecord_key)
            )
            try:  # headers only; every tensor, this reply's too, is checked by decode_record
                headers = {key: npy_header(array.data) for key, array in (record or {}).items()}
            except (ValueError, TypeError):
                continue
            if headers:  # zero-strided: a reference of any shape takes no memory
                self._reply_reference = {
                    k: np.broadcast_to(np.zeros((), h.dtype), h.shape) for k, h in headers.items()
                }
                return self._reply_reference
        self._reply_reference = {}
        return self._reply_reference

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies by the contract, then aggregate the valid ones.

        Returns the new global arrays (None when the round keeps the old ones) and the clients'
        train metrics aggregated by ``train_metrics_aggr_fn`` (None without a valid reply); the
        strategy's own figures go to :attr:`aggregation_metrics`.
        """
        if self.fraction_train == 0.0:
            return None, None
        replies = list(replies)
        known = bool(self.global_arrays)
        reference = self._decode_reference(server_round, replies)
        accepted: list[tuple[ClientReply, RecordDict]] = []
        refused: list[tuple[Message, ReplyRejected]] = []
        dropped: Counter[str] = Counter()
        self._learn_partitions(replies)
        for message in replies:
            try:
                accepted.append((self.validate_reply(message), message.content))
            except ReplyRejected as rejection:
                refused.append((message, rejection))
                dropped[rejection.reason] += 1
                log(
                    WARNING,
                    "round %d: dropped reply from %s: %s",
                    server_round,
                    self._reply_label(message),
                    rejection.detail,
                )
        self._stop_if_record_absent(replies, dropped)
        bounded = (
            self.bounds.bound(server_round, self.global_arrays, accepted)
            if known
            else BoundedReplies.unbounded(accepted)
        )
        for bound_out in bounded.rejected.values():
            dropped[bound_out.reason] += 1
        self.round_bounds = bounded
        valid = self.bounds.capped([reply for reply, _ in bounded.kept])
        valid_contents = [content for _, content in bounded.kept]
        metrics: dict[str, Any] = {
            "replies-received": len(replies),
            "replies-valid": len(valid),
            "replies-dropped": sum(dropped.values()),
            **{f"dropped-{reason}": count for reason, count in sorted(dropped.items())},
            **bounded.figures,
        }
        round_replies = _RoundReplies(refused, accepted, bounded, valid)
        client_metrics = self._client_metrics(
            server_round, valid_contents, self.train_metrics_aggr_fn
        )
        # Krum's selection keeps fewer replies than were valid on purpose (one, for Krum): the
        # quorum counts the replies it chose from.
        chosen_from = len(valid) + bounded.unselected
        if chosen_from < self.min_train_replies:
            log(
                WARNING,
                "round %d: %d valid replies < min-train-replies = %d: keeping the "
                "global model of the previous round",
                server_round,
                chosen_from,
                self.min_train_replies,
            )
            metrics["aggregated"] = 0
            self._record_round(server_round, client_metrics, metrics, round_replies)
            return None, client_metrics
        weights = normalise_weights([reply.num_examples for reply in valid])
        started = time.perf_counter()
        new_arrays = self.aggregate(server_round, reference, valid)
        self.last_aggregation_seconds = time.perf_counter() - started
        refusal = (
            self.bounds.model_rejection(new_arrays, self.global_arrays, bounded) if known else None
        )
        if refusal is not None:
            log(
                WARNING,
                "round %d: the aggregated global model is not committed, %s: keeping the "
                "global model of the previous round",
                server_round,
                refusal,
            )
            metrics["aggregated"] = 0
            metrics["model-rejected"] = 1
            self._record_round(server_round, client_metrics, metrics, round_replies)
            return None, client_metrics
        metrics["aggregated"] = 1
        metrics["aggregation-seconds"] = self.last_aggregation_seconds
        metrics.update(self.round_metrics())
        # After the timing, so that observers never inflate it; they compare with the global model.
        for observer in self.reply_observers if known else ():
            metrics.update(observer(server_round, self.global_arrays, valid, weights))
        self._record_round(server_round, client_metrics, metrics, round_replies)
        record = ArrayRecord(
            # asarray(order='C'), not ascontiguousarray: the latter turns 0-d tensors
            # (BatchNorm's num_batches_tracked) into shape (1,), which round 2 then rejects.
            {key: Array(np.asarray(value, order="C")) for key, value in new_arrays.items()}
        )
        return record, client_metrics

    def _record_round(
        self,
        server_round: int,
        client_metrics: MetricRecord | None,
        figures: dict[str, Any],
        replies: _RoundReplies,
    ) -> None:
        """Keep the round's aggregation figures apart from the clients' metrics, record each
        reply (:attr:`last_client_records`) and log the round's line (``log_rounds``)."""
        self.aggregation_metrics[server_round] = plain_metrics(figures)
        self.last_round_metrics = {
            **plain_metrics(client_metrics or {}),
            **self.aggregation_metrics[server_round],
        }
        self.last_client_records = reply_records(
            server_round,
            replies.refused,
            replies.accepted,
            replies.bounded.view,
            replies.valid,
            self.aggregation_metrics[server_round],
            self.weighted_by_key,
            self.node_partitions,
        )
        if self.log_rounds:
            log(
                INFO,
                "%s",
                round_line(
                    type(self).__name__,
                    server_round,
                    self.aggregation_metrics[server_round],
                    self.round_log_fields,
                ),
            )

    def _learn_partitions(self, replies: Sequence[Message]) -> None:
        """Remember the partition each reply with content names, for the node's error replies."""
        for message in replies:
            if not message.has_error():
                partition = partition_of(message.content)
                if partition is not None:
                    self.node_partitions[message.metadata.src_node_id] = partition

    def _reply_label(self, message: Message) -> str:
        """``node N (partition P)`` of a reply for a log line, unknown parts said as such."""
        node = reply_node(message)
        partition = None if message.has_error() else partition_of(message.content)
        if partition is None and node is not None:
            partition = self.node_partitions.get(node)
        return node_label(node, partition)

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
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._messages(
            grid,
            record,
            MessageType.EVALUATE,
            self.fraction_evaluate,
            self.min_evaluate_nodes,
            server_round,
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The clients' evaluation metrics aggregated by ``evaluate_metrics_aggr_fn``.

        Error replies and replies without a positive weight (``weighted_by_key``) are skipped
        with a logged reason; None when none is left.
        """
        contents: list[RecordDict] = []
        for message in replies:
            if message.has_error():
                reason = f"error reply: {message.error.reason}"
            elif reply_weight(reply_metric_record(message.content), self.weighted_by_key) is None:
                reason = f"no MetricRecord with a weight '{self.weighted_by_key}' > 0"
            else:
                contents.append(message.content)
                continue
            log(
                WARNING,
                "round %d: skipped evaluate reply from %s: %s",
                server_round,
                self._reply_label(message),
                reason,
            )
        return self._client_metrics(server_round, contents, self.evaluate_metrics_aggr_fn)
