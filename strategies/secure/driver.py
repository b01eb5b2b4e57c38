"""SecAgg+ on Flower's Message API: a strategy wrapper that drives the four stages per round.

``SecureAggregation(rule, options)`` is a Flower ``Strategy``: a round of ``Strategy.start`` (or
this project's round loop) calls it as any strategy, and it runs, with the Grid it is given in
``configure_train``,

1. ``setup``: every sampled node makes fresh key pairs and sends their public halves;
2. ``share-keys``: each node gets its neighbours' public keys (:func:`tasks.secure_aggregation
   .neighbours`) and returns its secrets' Shamir shares, each sealed for one neighbour;
3. ``collect``: the rule's train instructions, each with the shares sealed for its node and
   the layout of what to sum (:func:`strategies.secure.sums.secure_layout`), go out as
   ``configure_train``'s messages; ``aggregate_train`` receives the masked vectors;
4. ``unmask``: the survivors return the shares that rebuild their self masks and the dropped
   nodes' pairwise masks; the server removes them from the sum of the masked vectors.

What reaches the rule is the unmasked sum only (:meth:`SecureAggregation.aggregate_train`
decodes no reply on its own; :attr:`SecureAggregation.last_sum_inputs` records what it
summed), turned into the rule's new model by :func:`strategies.secure.sums.aggregate_from_sums`.

Dropouts: a node that shared its keys and then sent no masked vector is *dropped*; the round
goes on while every node whose mask must be removed has at least its threshold of share holders
answering in ``unmask``. Otherwise the round raises :class:`SecureAggregationError`, which ends
the run; its checkpoint of the previous round lets ``resume-from`` continue it.

Options that read individual replies cannot run here and are refused when the wrapper is built
(:func:`individual_reply_options`): the influence bounds (the client's clip and claim bound
replace two of them, :class:`~tasks.secure_aggregation.SecAggOptions`), robust aggregation,
pre-aggregation and reply observers. Server noise and trigger unlearning, which read only the
aggregated model, run as without it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any, TypedDict, cast

import numpy as np
import numpy.typing as npt
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

from beyond_averaging.strategies.base import ContractStrategy
from beyond_averaging.strategies.replies.reporting import reply_record
from beyond_averaging.strategies.replies.validation import REPLY_BYTES_SLACK
from beyond_averaging.strategies.replies.wire import ReplyObserver, record_arrays
from beyond_averaging.tasks.protocol import TRAIN_LOSS_KEY
from beyond_averaging.tasks.secure_aggregation import (
    MASKED_KEY,
    MASKED_RECORD,
    SECURE_RECORD,
    STAGE_KEY,
    SecAggOptions,
    join_secret,
    layout_sizes,
    neighbours,
    shared_seed,
    split_sum,
    threshold,
    unmask_sum,
)

from .sums import aggregate_from_sums, check_rule, mean_metrics, secure_layout


#: The rule arguments that turn the influence bounds off, as a rule under secure aggregation
#: needs them: ``ElasticAggregation(tau=0.5, **BOUNDS_OFF)``.
class BoundsOff(TypedDict):
    """The per-reply bounds' keyword arguments, each 0 (off): typed per key, so that
    ``Rule(**BOUNDS_OFF)`` type-checks against the rule's own signature."""

    update_norm_factor: float
    update_clip_factor: float
    direction_outlier_factor: float
    max_claim_factor: float


BOUNDS_OFF: BoundsOff = {
    "update_norm_factor": 0.0,
    "update_clip_factor": 0.0,
    "direction_outlier_factor": 0.0,
    "max_claim_factor": 0.0,
}


class SecureAggregationError(AggregationError):
    """Too few nodes answered for the round's masks to be removed: the round cannot aggregate."""


def individual_reply_options(strategy: ContractStrategy) -> list[str]:
    """The options of ``strategy`` that need each client's own reply, as ``name = value``."""
    bounds = strategy.bounds.options
    found = [
        f"{name} = {value}"
        for name, value in (
            ("update_norm_factor", bounds.update_norm_factor),
            ("update_clip_factor", bounds.update_clip_factor),
            ("direction_outlier_factor", bounds.direction_outlier_factor),
            ("max_claim_factor", bounds.max_claim_factor),
        )
        if value != 0.0
    ]
    if bounds.max_client_weight < 1.0:
        found.append(f"max_client_weight = {bounds.max_client_weight}")
    if strategy.robust_aggregation != "none":
        found.append(f"robust_aggregation = {strategy.robust_aggregation!r}")
    pre_aggregation = getattr(strategy, "pre_aggregation", "none")
    if pre_aggregation != "none":
        found.append(f"pre_aggregation = {pre_aggregation!r}")
    if strategy.reply_observers:
        found.append("reply observers (e.g. diagnostics)")
    return found


class SecureAggregation(Strategy):
    """Run ``strategy`` (FedAvg, FedAvgM, FedAdam, Elastic, FedGMA, FedGMASoft) under SecAgg+.

    Parameters
    ----------
    strategy : ContractStrategy
        The rule, built with its influence bounds off (``update_norm_factor``,
        ``update_clip_factor``, ``direction_outlier_factor`` and ``max_claim_factor`` 0) and
        no robust aggregation, pre-aggregation or reply observer.
    options : SecAggOptions
        What every client is told (clip, weight bound, quantisation, neighbours, threshold).
    stage_timeout : float
        Seconds each key stage (setup, share-keys, unmask) waits for replies.
    metrics : sequence of str
        The train metrics every client folds into its vector (weighted by its weight): the
        round gets their weighted means, never a client's own; each client's reply must carry
        them. Default: ``train-loss``, which this project's ClientApp sends.

    Raises
    ------
    ValueError
        For a rule that needs individual replies (FedLAW) or an option that does, naming it.
    """

    def __init__(
        self,
        strategy: ContractStrategy,
        options: SecAggOptions,
        *,
        stage_timeout: float = 600.0,
        metrics: Sequence[str] = (TRAIN_LOSS_KEY,),
    ) -> None:
        check_rule(strategy)
        needs = individual_reply_options(strategy)
        if needs:
            raise ValueError(
                f"secure aggregation shows the server only the sum of the replies, and "
                f"{', '.join(needs)} need each reply: set them off (build the rule with "
                "**BOUNDS_OFF from beyond_averaging.strategies.secure; 'none' for robust and "
                "pre-aggregation); the clip and weight bounds move to the clients "
                "(SecAggOptions.clip_norm, max_weight)"
            )
        self.strategy = strategy
        self.options = options
        self.stage_timeout = stage_timeout
        self.metrics = tuple(metrics)
        self._grid: Grid | None = None
        self._round: _RoundKeys | None = None
        #: What the last aggregation summed: the masked vectors (one per surviving node) and the
        #: unmasked sum, nothing else of any reply (the test of what reaches aggregation).
        self.last_sum_inputs: dict[str, Any] = {}
        self.last_client_records: list[dict[str, Any]] = []

    # ------------------------------------------------------------ what the ServerApp reads
    @property
    def reply_byte_limit(self) -> int:
        """The rule's byte limit on a reply, raised in a round to its masked vector's bytes
        plus the rule's slack where that is more. The rule's own default (4 x the model's bytes
        per record sent back) holds a float32 model's masked vector (at most 6 x the model's
        bytes modulo 2^64, FedGMA's hard mask: update, gradient and signs), but not a float16
        or bfloat16 model's (12 x): deployed, a large one's every masked reply was refused. A
        limit the user set (``max_reply_bytes``) and no limit (0) are kept as they are."""
        limit = self.strategy.reply_byte_limit
        keys = self._round
        if limit <= 0 or keys is None or self.strategy.max_reply_bytes:
            return limit
        values = sum(layout_sizes(keys.layout, keys.shapes))
        masked = values * np.dtype(keys.options.dtype).itemsize + REPLY_BYTES_SLACK
        return max(limit, masked)

    @property
    def last_round_metrics(self) -> dict[str, Any]:
        """The rule's figures of the last round, with the secure stages' counts."""
        return self.strategy.last_round_metrics

    @property
    def aggregation_metrics(self) -> dict[int, dict[str, Any]]:
        """Per round, the strategy's own figures."""
        return self.strategy.aggregation_metrics

    def add_reply_observer(self, observer: ReplyObserver) -> None:
        """Refused: an observer reads individual replies, which the server never holds here."""
        raise ValueError(
            "secure aggregation shows the server only the sum of the replies: a reply observer "
            "(diagnostics) cannot run; set diagnostics = false"
        )

    def state_dict(self) -> dict[str, Any]:
        """The rule's state (server-optimizer moments); no key outlives its round."""
        return self.strategy.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`."""
        self.strategy.load_state_dict(state)

    def summary(self) -> None:
        """The rule's summary, then the secure aggregation's options."""
        self.strategy.summary()
        options = self.options
        log(
            INFO,
            "\t└──> SecAgg+: clip norm %s, max weight %s, values in [-%s, %s] on 2^%s levels "
            "mod 2^%d, neighbours %s, threshold %s",
            options.clip_norm or "off",
            options.max_weight,
            options.clipping_range,
            options.clipping_range,
            options.quantization_bits or "(modulus - bit_length(cohort))",
            options.modulus_bits,
            options.neighbours or "all",
            options.threshold,
        )

    # ------------------------------------------------------------ the stages
    def _stage(
        self, grid: Grid, server_round: int, stage: str, records: Mapping[int, ConfigRecord]
    ) -> dict[int, ConfigRecord]:
        """Send each node its stage record; the answering nodes' reply records."""
        messages = []
        for node, record in records.items():
            record[STAGE_KEY] = stage
            record["server-round"] = server_round
            messages.append(
                Message(
                    content=RecordDict({SECURE_RECORD: record}),
                    message_type=MessageType.TRAIN,
                    dst_node_id=node,
                )
            )
        answers: dict[int, ConfigRecord] = {}
        for reply in grid.send_and_receive(messages, timeout=self.stage_timeout):
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                log(
                    WARNING,
                    "round %d: node %s failed %s: %s",
                    server_round,
                    node,
                    stage,
                    reply.error.reason,
                )
                continue
            answer = reply.content.config_records.get(SECURE_RECORD)
            if answer is not None and answer.get(STAGE_KEY) == stage:
                answers[node] = answer
        return answers

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The rule's train instructions, after the setup and share-keys stages, each carrying
        its node's sealed shares and the layout to send."""
        instructions = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if not instructions:
            return []
        self._grid = grid
        global_arrays = record_arrays(arrays)
        layout = secure_layout(self.strategy, global_arrays, self.metrics)
        nodes = sorted(int(m.metadata.dst_node_id) for m in instructions)
        # The round's levels: the finest its sampled cohort fits when quantization_bits is 0.
        options = self.options.for_cohort(len(nodes))
        setup = self._stage(
            grid,
            server_round,
            "setup",
            {node: ConfigRecord(dict(options.to_config())) for node in nodes},
        )
        full_graph = neighbours(sorted(setup), self.options.neighbours)
        shared = self._stage(
            grid,
            server_round,
            "share-keys",
            {
                node: ConfigRecord(
                    {
                        "ids": full_graph[node],
                        "channel-publics": [
                            cast(bytes, setup[o]["channel-public"]) for o in full_graph[node]
                        ],
                        "mask-publics": [
                            cast(bytes, setup[o]["mask-public"]) for o in full_graph[node]
                        ],
                    }
                )
                for node in full_graph
            },
        )
        # Ciphertexts relayed: to each node, those its neighbours sealed for it.
        inbox: dict[int, tuple[list[int], list[bytes]]] = {node: ([], []) for node in shared}
        for src, record in shared.items():
            for dst, ciphertext in zip(
                cast(list[int], record["ids"]),
                cast(list[bytes], record["ciphertexts"]),
                strict=True,
            ):
                if int(dst) in inbox:
                    inbox[int(dst)][0].append(src)
                    inbox[int(dst)][1].append(ciphertext)
        # A node masks with the neighbours that shared their keys only (those whose shares it
        # got); its secrets were shared among all its neighbours, which sets its threshold.
        graph = {node: [o for o in full_graph[node] if o in shared] for node in shared}
        self._round = _RoundKeys(
            server_round,
            layout,
            {key: tuple(value.shape) for key, value in global_arrays.items()},
            global_arrays,
            graph,
            {node: 1 + len(full_graph[node]) for node in shared},
            {node: cast(bytes, setup[node]["mask-public"]) for node in setup},
            sorted(shared),
            options,
        )
        left_out = sorted(set(nodes) - set(shared))
        if left_out:
            log(
                INFO,
                "round %d: %d node(s) left before sharing keys: %s",
                server_round,
                len(left_out),
                left_out[:10],
            )
        messages = []
        for message in instructions:
            node = int(message.metadata.dst_node_id)
            if node not in inbox:
                continue
            content = RecordDict(dict(message.content.items()))
            content[SECURE_RECORD] = ConfigRecord(
                {
                    STAGE_KEY: "collect",
                    "server-round": server_round,
                    "src-ids": inbox[node][0],
                    "ciphertexts": inbox[node][1],
                    "layout": layout,
                }
            )
            messages.append(
                Message(
                    content=content, message_type=message.metadata.message_type, dst_node_id=node
                )
            )
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Sum the masked vectors, unmask the sum with the survivors' shares, and give the rule
        the sums."""
        keys = self._round
        if keys is None or keys.server_round != server_round or self._grid is None:
            raise AggregationError(
                f"round {server_round}: aggregate_train without this round's configure_train: "
                "secure aggregation needs its key stages first"
            )
        masked: dict[int, npt.NDArray[np.unsignedinteger]] = {}
        size = sum(layout_sizes(keys.layout, keys.shapes))
        for message in replies:
            node = int(message.metadata.src_node_id)
            if message.has_error() or node not in keys.graph:
                continue
            record = message.content.array_records.get(MASKED_RECORD)
            if record is None or MASKED_KEY not in record:
                continue
            vector = record[MASKED_KEY].numpy()
            if vector.dtype != keys.options.dtype or vector.shape != (size,):
                log(
                    WARNING,
                    "round %d: node %s sent a masked vector of the wrong form: dropped",
                    server_round,
                    node,
                )
                continue
            masked[node] = vector
        alive = sorted(masked)
        dropped = sorted(set(keys.shared) - set(alive))
        self._check_survivors(server_round, keys, alive, dropped, set(alive))
        answers = self._stage(
            self._grid,
            server_round,
            "unmask",
            {
                node: ConfigRecord(
                    {
                        "alive": [o for o in [node, *keys.graph[node]] if o in masked],
                        "dropped": [o for o in keys.graph[node] if o in set(dropped)],
                    }
                )
                for node in alive
            },
        )
        self._check_survivors(server_round, keys, alive, dropped, set(answers))
        seed_shares: dict[int, list[bytes]] = {node: [] for node in alive}
        key_shares: dict[int, list[bytes]] = {node: [] for node in dropped}
        for answer in answers.values():
            for src, share in zip(
                cast(list[int], answer["ids"]), cast(list[bytes], answer["shares"]), strict=True
            ):
                src = int(src)
                if src in seed_shares:
                    seed_shares[src].append(share)
                elif src in key_shares:
                    key_shares[src].append(share)
        started = time.perf_counter()
        # Any threshold of a node's shares rebuilds its secret: more only cost time (Shamir's
        # combination is quadratic in the shares given).
        self_seeds = {
            node: join_secret(shares[: self._needed(keys, node)])
            for node, shares in seed_shares.items()
        }
        pair_seeds: dict[tuple[int, int], bytes] = {}
        for gone, shares in key_shares.items():
            mask_private = join_secret(shares[: self._needed(keys, gone)])
            for survivor in keys.graph[gone]:
                if survivor in masked:
                    pair_seeds[(survivor, gone)] = shared_seed(
                        mask_private, keys.mask_publics[survivor]
                    )
        total = np.zeros(size, dtype=keys.options.dtype)
        for vector in masked.values():
            total += vector
        unmasked = unmask_sum(total, self_seeds, pair_seeds)
        sums = split_sum(unmasked, keys.layout, keys.shapes, len(alive), keys.options)
        self.last_sum_inputs = {"masked": dict(masked), "sum": unmasked}
        self.strategy.global_arrays = keys.global_arrays
        new_arrays = aggregate_from_sums(
            self.strategy, server_round, keys.global_arrays, sums, len(alive)
        )
        seconds = time.perf_counter() - started
        means = mean_metrics(sums)
        client_metrics = MetricRecord(dict(means))
        figures: dict[str, Any] = {
            "replies-received": len(alive),
            "replies-valid": len(alive),
            "replies-dropped": len(dropped),
            "secure-dropped-after-keys": len(dropped),
            "aggregated": 1,
            "aggregation-seconds": seconds,
            **self.strategy.round_metrics(),
        }
        self.strategy.aggregation_metrics[server_round] = figures
        self.strategy.last_round_metrics = {**means, **figures}
        self.last_client_records = [
            reply_record(server_round, node, None, self.strategy.weighted_by_key, status="kept")
            for node in alive
        ] + [
            reply_record(
                server_round,
                node,
                None,
                self.strategy.weighted_by_key,
                status="dropped",
                reason="secure-dropout",
                detail="shared its keys, sent no masked vector",
            )
            for node in dropped
        ]
        self.strategy.last_client_records = self.last_client_records
        self._round = None
        record = ArrayRecord(
            {key: Array(np.asarray(value, order="C")) for key, value in new_arrays.items()}
        )
        log(
            INFO,
            "round %d: SecAgg+ summed %d masked vectors (%d dropped after sharing keys)",
            server_round,
            len(alive),
            len(dropped),
        )
        return record, client_metrics

    def _needed(self, keys: _RoundKeys, node: int) -> int:
        """Shares that rebuild ``node``'s secrets (its threshold among its share holders)."""
        return threshold(keys.holders[node], self.options.threshold)

    def _check_survivors(
        self,
        server_round: int,
        keys: _RoundKeys,
        alive: Sequence[int],
        dropped: Sequence[int],
        answering: set[int],
    ) -> None:
        """Raise unless the round has its minimum of vectors and every node to unmask has its
        threshold of share holders among ``answering``."""
        needed_vectors = max(self.strategy.min_train_replies, 1)
        if len(alive) < needed_vectors:
            raise SecureAggregationError(
                f"round {server_round}: {len(alive)} masked vectors arrived, "
                f"min-train-replies = {needed_vectors}: the round cannot aggregate securely. "
                "The run stops here; continue it with resume-from = <its run folder>"
            )
        for node in [*alive, *dropped]:
            holders = [node, *keys.graph[node]]
            needed = self._needed(keys, node)
            present = sum(holder in answering for holder in holders)
            if present < needed:
                raise SecureAggregationError(
                    f"round {server_round}: the mask of node {node} needs {needed} of its "
                    f"{keys.holders[node]} share holders and {present} answered ({len(dropped)} "
                    "node(s) dropped after sharing keys): below SecAgg+'s threshold the sum "
                    "cannot be unmasked. The run stops here; continue it with "
                    "resume-from = <its run folder>"
                )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The rule's federated evaluation (metrics only, no model leaves a client)."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The rule's aggregation of the evaluation metrics."""
        return self.strategy.aggregate_evaluate(server_round, replies)


class _RoundKeys:
    """What the server keeps of a round between its stages: public keys and the graph only."""

    def __init__(
        self,
        server_round: int,
        layout: list[str],
        shapes: dict[str, tuple[int, ...]],
        global_arrays: dict[str, npt.NDArray[Any]],
        graph: dict[int, list[int]],
        holders: dict[int, int],
        mask_publics: dict[int, bytes],
        shared: list[int],
        options: SecAggOptions,
    ) -> None:
        self.server_round = server_round
        self.layout = layout
        self.shapes = shapes
        self.global_arrays = global_arrays
        self.graph = graph
        self.holders = holders
        self.mask_publics = mask_publics
        self.shared = shared
        self.options = options  # with the round's quantisation levels resolved


#: What a run drives: a rule, or a rule under secure aggregation.
RunStrategy = ContractStrategy | SecureAggregation
