"""What a strategy tells about each round: one log line about its rule, and a record per reply.

:class:`~strategies.base.ContractStrategy` calls both once per round, from the figures it keeps
in ``aggregation_metrics``, so that every rule reports the same way:

- :func:`round_line`: the line logged through Flower's logger (INFO) after each aggregation,
  the rule's own figures first (each rule names them in ``round_log_fields``: Elastic's zeta,
  FedGMA's share of kept coordinates, FedLAW's gamma and client weights), then what the reply
  checks and defences did (kept, clipped, dropped and why);
- :func:`reply_record`: one dict per train reply (node, partition, weight claimed, train loss,
  update norm, direction cosine, trust, and whether it was kept, clipped or dropped, with the
  reason), kept in ``ContractStrategy.last_client_records`` (this project's ServerApp appends
  them to ``clients.jsonl``).

An error reply carries no content, so its partition is the one the node named in an earlier
reply of the run, where it sent one (``ContractStrategy.node_partitions``), else unknown (None
in the record, "partition unknown" in the log). Its node is the reply's source, except for an
error reply the SuperLink made in a node's place and signed with its own id
(``SUPERLINK_NODE_ID``) where the Grid did not name the node (this project's ServerApp's Grid
does, server/pull.py): that node is unknown (None, "an unknown node").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID

from beyond_averaging.strategies.aggregate import normalise_weights
from beyond_averaging.tasks.protocol import CLIENT_RECORD, PARTITION_ID_KEY, TRAIN_LOSS_KEY

from .metrics import reply_metric_record
from .wire import ClientReply, ReplyRejected

#: A rule's figures in its round line: metric key -> (label, format spec of each number, or
#: ``"flag"``: the label alone, when the value is true); see :func:`figures_text`.
RoundLogFields = Mapping[str, tuple[str, str]]
#: Lists longer than this are shown by their range in a round line (one value per client).
LISTED_VALUES = 8
#: The defences' own figures, shown whichever rule runs them (strategies.defended).
DEFENCE_FIELDS: RoundLogFields = {
    "fltrust-trust": ("trust", ".2f"),
    "proxy-weights": ("proxy weights", ".3f"),
    "flame-noise-std": ("FLAME noise std", ".3g"),
    "unlearning-patches": ("trigger patches unlearned", "d"),
    "unlearning-anomaly": ("anomaly index", ".1f"),
}


def _number(value: Any, spec: str) -> str:
    try:
        return format(value, spec)
    except (TypeError, ValueError):  # a value of another type than the rule declared
        return str(value)


def format_figure(value: Any, spec: str) -> str:
    """``value`` by ``spec``; a list in full up to :data:`LISTED_VALUES` values, else its range."""
    if not isinstance(value, list | tuple):
        return _number(value, spec)
    if len(value) <= LISTED_VALUES:
        return "[" + ", ".join(_number(item, spec) for item in value) + "]"
    return (
        f"[{len(value)} values, min {_number(min(value), spec)}, max {_number(max(value), spec)}]"
    )


def figures_text(figures: Mapping[str, Any], fields: RoundLogFields) -> str:
    """Each of ``fields`` present in ``figures``, comma-separated: ``label value``, or the
    label with the value in place of its ``{}``; a ``"flag"`` field is its label, shown only
    when the value is true."""
    parts = []
    for key, (label, spec) in fields.items():
        if key not in figures:
            continue
        if spec == "flag":
            if figures[key]:
                parts.append(label)
            continue
        text = format_figure(figures[key], spec)
        parts.append(label.format(text) if "{}" in label else f"{label} {text}")
    return ", ".join(parts)


def replies_text(figures: Mapping[str, Any]) -> str:
    """What the reply checks and defences did: kept, clipped, bounded, dropped with reasons."""
    drops = {
        key.removeprefix("dropped-"): int(count)
        for key, count in sorted(figures.items())
        if key.startswith("dropped-")
    }
    text = (
        f"{figures.get('replies-valid', 0)}/{figures.get('replies-received', 0)} replies kept, "
        f"{figures.get('replies-clipped', 0)} clipped, {figures.get('replies-dropped', 0)} dropped"
    )
    if drops:
        text += " (" + ", ".join(f"{reason} {count}" for reason, count in drops.items()) + ")"
    if figures.get("claims-bounded"):
        text += f", {figures['claims-bounded']} claims bounded"
    return text


def round_line(
    strategy: str, server_round: int, figures: Mapping[str, Any], fields: RoundLogFields
) -> str:
    """The line a strategy logs about round ``server_round`` (its ``aggregation_metrics``).

    ``round 3: ElasticAggregation | zeta mean 0.9312, ... | 4/4 replies kept, 0 clipped, 0
    dropped``; a round that kept the previous model says so instead of the rule's figures.
    """
    parts = [f"round {server_round}: {strategy}"]
    if figures.get("aggregated", 1):
        rule = figures_text(figures, {**fields, **DEFENCE_FIELDS})
        if rule:
            parts.append(rule)
    elif figures.get("model-rejected"):
        parts.append("aggregate refused (non-finite or exploding): previous model kept")
    else:
        parts.append("too few valid replies: previous model kept")
    parts.append(replies_text(figures))
    return " | ".join(parts)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def partition_of(content: RecordDict | None) -> int | None:
    """The partition id a reply names in its ``client`` ConfigRecord, if it names one."""
    if content is None:
        return None
    record = content.config_records.get(CLIENT_RECORD)
    value = None if record is None else record.get(PARTITION_ID_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def reply_node(message: Message) -> int | None:
    """The node a reply came from, None where it is unknown: an error reply signed with the
    SuperLink's own id (``SUPERLINK_NODE_ID``) that no Grid named the node of."""
    node = message.metadata.src_node_id
    return None if message.has_error() and node == SUPERLINK_NODE_ID else node


def node_label(node: int | None, partition: int | None) -> str:
    """``node 7 (partition 2)`` for a log line; unknown parts said as such."""
    who = "an unknown node" if node is None else f"node {node}"
    return f"{who} (partition {'unknown' if partition is None else partition})"


def reply_record(
    server_round: int,
    node_id: int | None,
    content: RecordDict | None,
    weighted_by_key: str,
    *,
    status: str,
    reason: str | None = None,
    detail: str | None = None,
    partition: int | None = None,
    **figures: float | None,
) -> dict[str, Any]:
    """One line of ``clients.jsonl``: a train reply and what the round made of it.

    Parameters
    ----------
    server_round : int
        The round.
    node_id : int, optional
        The node that sent the reply (None: unknown, :func:`reply_node`).
    content : RecordDict, optional
        The reply's content (None for an error reply): its partition id (``client`` record),
        its weight ``weighted_by_key`` and its train loss are read from it.
    partition : int, optional
        The node's partition where ``content`` names none (an error reply): the one it named
        in an earlier reply; None where unknown.
    weighted_by_key : str
        The metric that weighs a reply (``num-examples``).
    status : {"kept", "clipped", "dropped"}
        Aggregated as sent, aggregated scaled down, or left out.
    reason, detail : str, optional
        Why it was dropped or clipped: the reason's short name and its sentence.
    **figures
        ``update-norm``, ``update-scale``, ``direction-cosine``, ``trust``, ``weight``: the
        round's figures about this reply (None where the round did not compute one).
    """
    metrics = None if content is None else reply_metric_record(content)
    return {
        "round": server_round,
        "node-id": node_id,
        "partition": named if (named := partition_of(content)) is not None else partition,
        weighted_by_key: None if metrics is None else _finite(metrics.get(weighted_by_key)),
        "train-loss": None if metrics is None else _finite(metrics.get(TRAIN_LOSS_KEY)),
        **{key.replace("_", "-"): _finite(value) for key, value in figures.items()},
        "status": status,
        "reason": reason,
        "detail": detail,
    }


@dataclass(frozen=True)
class InfluenceView:
    """What the reply bounds found about each reply the contract accepted (by its index)."""

    update_norms: np.ndarray[Any, np.dtype[np.float64]]
    rejected: Mapping[int, ReplyRejected]
    direction_cosines: Mapping[int, float]


def reply_records(
    server_round: int,
    refused: Sequence[tuple[Message, ReplyRejected]],
    accepted: Sequence[tuple[ClientReply, RecordDict]],
    view: InfluenceView,
    kept: Sequence[ClientReply],
    figures: Mapping[str, Any],
    weighted_by_key: str,
    partitions: Mapping[int, int] | None = None,
) -> list[dict[str, Any]]:
    """One :func:`reply_record` per train reply of a round.

    Parameters
    ----------
    refused : sequence of (Message, ReplyRejected)
        The replies the contract refused, with why.
    accepted : sequence of (ClientReply, RecordDict)
        The replies it accepted, in order; ``view`` describes them by index.
    kept : sequence of ClientReply
        The accepted replies ``view`` did not reject, in order, as aggregated (claims bounded,
        updates clipped, weights capped): their ``update_scale`` and weight share.
    figures : mapping
        The round's ``aggregation_metrics``: ``fltrust-trust`` (one per kept reply) marks the
        replies FLTrust left out (trust 0).
    partitions : mapping, optional
        Node -> the partition it named in an earlier reply: an error reply's partition.
    """
    known = partitions or {}
    records = []
    for message, refusal in refused:
        node = reply_node(message)
        records.append(
            reply_record(
                server_round,
                node,
                None if message.has_error() else message.content,
                weighted_by_key,
                status="dropped",
                reason=refusal.reason,
                detail=refusal.detail,
                partition=None if node is None else known.get(node),
            )
        )
    positions = {
        index: position
        for position, index in enumerate(i for i in range(len(accepted)) if i not in view.rejected)
    }
    shares = normalise_weights([reply.num_examples for reply in kept]) if kept else None
    trust = figures.get("fltrust-trust")
    for index, (reply, content) in enumerate(accepted):
        rejection = view.rejected.get(index)
        position = positions.get(index)
        scale = kept[position].update_scale if position is not None else None
        reply_trust = trust[position] if position is not None and trust else None
        status, reason, detail = "kept", None, None
        if rejection is not None:
            status, reason, detail = "dropped", rejection.reason, rejection.detail
        elif reply_trust == 0.0:
            status, reason = "dropped", "untrusted"
            detail = "FLTrust's trust 0: its update points away from the server's root update"
        elif scale is not None and scale < 1.0:
            status, reason = "clipped", "update-clip"
            detail = f"scaled by {scale:.4g} to update-clip-factor x the round's median norm"
        records.append(
            reply_record(
                server_round,
                reply.node_id,
                content,
                weighted_by_key,
                status=status,
                reason=reason,
                detail=detail,
                update_norm=float(view.update_norms[index])
                if index < len(view.update_norms)
                else None,
                update_scale=scale,
                direction_cosine=view.direction_cosines.get(index),
                trust=reply_trust,
                weight=None if shares is None or position is None else float(shares[position]),
            )
        )
    return records
