"""Reply validation: the checks before and around decoding, and the guard of the new model.

Stages 1 and 6 of a reply's path (the map: :mod:`strategies.replies`), pure functions:

- **before decoding**: :func:`reply_bytes` against a byte limit (:func:`default_reply_byte_limit`,
  a small multiple of the model's bytes), :func:`check_reply_weight` (the reply's weight is a
  finite, positive, integer-valued number of examples);
- **across the round's replies**: :func:`common_key_set` (records that share no key), used by
  the reply bounds (:mod:`strategies.replies.bounds`);
- **after aggregation**: :func:`model_rejection` (a non-finite, out-of-range or exploding global
  model is never committed) and :class:`ModelGuard` (nor one that outgrew the run's honest scale).

Every check raises :class:`~strategies.replies.wire.ReplyRejected`, whose ``reason`` becomes the
round's
``dropped-<reason>`` count; nothing else may escape a reply's validation.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import RecordDict

from beyond_averaging.strategies.aggregate import NDArrayDict, is_floating

from .influence import squared_norm
from .wire import REPLY_VALUE_LIMIT as REPLY_VALUE_LIMIT  # re-exported: the model guard's bound
from .wire import ReplyRejected as ReplyRejected  # re-exported: every check raises it
from .wire import value_range

#: Largest accepted number of examples: 2**53, the largest integer that float64 (a MetricRecord's
#: number type) holds exactly. A weight claim below it is still bounded by ``max_client_weight``.
MAX_NUM_EXAMPLES = float(2**53)

#: Default byte limit of one reply: this many times the bytes of the model and of each requested
#: record at the model's size (a float64 reply of a float32 model is twice its size), plus slack.
REPLY_BYTES_FACTOR = 4
REPLY_BYTES_SLACK = 1 << 20
#: Error code of the reply a bounded pull (``server/bounded_pull.py``) puts in place of a reply
#: whose objects passed the byte limit while they were pulled (413: HTTP's "content too large").
REPLY_OVERSIZED_ERROR_CODE = 413

#: A global model is not committed when its L2 norm (floating tensors) exceeds
#: ``MODEL_GROWTH_FACTOR * (||w|| + median_k ||theta_k - w||) + MODEL_GROWTH_MARGIN *
#: sqrt(elements)``. ||w|| + the median update bounds the norm of an honest majority's models;
#: the factor leaves room for the rules' own steps (FedLAW's gamma > 1, Elastic's zeta <= 1 +
#: tau, a server optimizer's step; FedAdam moves about lr per element, which the margin covers
#: from a near-zero start).
MODEL_GROWTH_FACTOR = 10.0
MODEL_GROWTH_MARGIN = 2.0


# ----------------------------------------------------------------------------- before decoding
def reply_bytes(content: RecordDict) -> int:
    """Bytes a reply holds: every ArrayRecord's buffers (requested or not) and its other records.

    Metric and config values count 8 bytes per number and their length for strings and bytes;
    arrays dominate any real reply.
    """
    total = 0
    for record in content.array_records.values():
        total += sum(len(array.data) for array in record.values())
    for records in (content.metric_records, content.config_records):
        for items in records.values():
            for value in items.values():
                if isinstance(value, str | bytes):
                    total += len(value)
                elif isinstance(value, list):
                    total += sum(len(v) if isinstance(v, str | bytes) else 8 for v in value)
                else:
                    total += 8
    return total


def default_reply_byte_limit(global_arrays: NDArrayDict, requested_records: int) -> int:
    """``REPLY_BYTES_FACTOR`` x (model bytes) x (1 + requested records) + ``REPLY_BYTES_SLACK``."""
    model_bytes = sum(int(value.nbytes) for value in global_arrays.values())
    return REPLY_BYTES_FACTOR * model_bytes * (1 + requested_records) + REPLY_BYTES_SLACK


def check_reply_size(content: RecordDict, limit: int) -> None:
    """Raise ``oversized`` when the reply holds more than ``limit`` bytes (0: no limit)."""
    if limit > 0 and (size := reply_bytes(content)) > limit:
        raise ReplyRejected(
            "oversized",
            f"reply holds {size} bytes, more than max-reply-bytes = {limit} (records: "
            f"{sorted(content.array_records)[:5]})",
        )


def check_reply_weight(value: Any, key: str, *, whole: bool = True) -> float:
    """The reply's weight ``value`` as a float, or ``bad-num-examples``.

    Allowed is a finite number in (0, ``MAX_NUM_EXAMPLES``], integer-valued when ``whole`` (a
    count of examples, the default ``num-examples``): 0.5, infinity, NaN, lists, strings,
    booleans and 1e300 are all dropped.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReplyRejected(
            "bad-num-examples", f"{key} = {value!r}"[:200] + ": must be a number of examples"
        )
    weight = float(value)
    if isinstance(value, int) and value > MAX_NUM_EXAMPLES:  # float() would round 2**53 + 1 down
        weight = math.inf
    if not (
        math.isfinite(weight)
        and 0.0 < weight <= MAX_NUM_EXAMPLES
        and (weight.is_integer() or not whole)
    ):
        raise ReplyRejected(
            "bad-num-examples",
            f"{key} = {value!r}: must be a "
            + ("whole number of examples in [1, 2**53]" if whole else "number in (0, 2**53]"),
        )
    return weight


def common_key_set(key_sets: Sequence[frozenset[str]]) -> frozenset[str] | None:
    """The key set to keep when the records of a round share no key at all, else None.

    The most frequent key set (the larger one on a tie): one reply with a disjoint record must not
    leave a rule without any tensor to work on.
    """
    if not key_sets or frozenset.intersection(*key_sets):
        return None
    counts = Counter(key_sets)
    return max(counts, key=lambda keys: (counts[keys], len(keys), sorted(keys)))


# ----------------------------------------------------------------------------- after aggregation
def model_rejection(
    new_arrays: Mapping[str, Any], previous: NDArrayDict, median_update: float
) -> str | None:
    """Why a freshly aggregated global model must not be committed, or None when it may be.

    Rejected: a NaN or Inf, a magnitude above ``REPLY_VALUE_LIMIT`` (a model that every honest
    reply near it would break), or an L2 norm (floating tensors) above ``MODEL_GROWTH_FACTOR`` x
    (the previous model's norm + ``median_update``, the median ||theta_k - w|| of the round's
    aggregated replies) + ``MODEL_GROWTH_MARGIN`` x sqrt(elements). The median, not the largest
    update: the largest is whatever one attacker sends, so a bound on it bounds nothing.
    """
    return _model_scan(new_arrays, previous, median_update)[0]


def _model_scan(
    new_arrays: Mapping[str, Any], previous: NDArrayDict, median_update: float
) -> tuple[str | None, float, int]:
    """:func:`model_rejection`'s reason, with the new model's norm and element count that its
    one pass over the model computed (:class:`ModelGuard` bounds the same norm again)."""
    squares_new = squares_old = 0.0
    elements = 0
    for key, raw in new_arrays.items():
        value = np.asarray(raw)
        if not is_floating(value) or value.size == 0:
            continue
        low, high = value_range(value)
        if not (math.isfinite(low) and math.isfinite(high)):
            return f"tensor '{key}' holds NaN or Inf", math.nan, elements
        if max(-low, high) > REPLY_VALUE_LIMIT:
            reason = f"tensor '{key}' holds a value of magnitude {max(-low, high):.3g}"
            return reason, math.nan, elements
        squares_new += squared_norm(value)
        if key in previous:
            squares_old += squared_norm(previous[key])
        elements += value.size
    norm, previous_norm = math.sqrt(squares_new), math.sqrt(squares_old)
    reach = previous_norm + median_update
    limit = MODEL_GROWTH_FACTOR * reach + MODEL_GROWTH_MARGIN * math.sqrt(elements)
    if norm > limit:
        return (
            f"its norm {norm:.4g} exceeds {MODEL_GROWTH_FACTOR:g} x (previous model's norm "
            f"{previous_norm:.4g} + median client update {median_update:.4g}) + "
            f"{MODEL_GROWTH_MARGIN:g} x sqrt({elements} elements)",
            norm,
            elements,
        )
    return None, norm, elements


def floating_norm(arrays: Mapping[str, Any]) -> tuple[float, int]:
    """The L2 norm of the floating tensors of ``arrays`` and their number of elements."""
    values = [np.asarray(value) for value in arrays.values()]
    floating = [value for value in values if is_floating(value) and value.size]
    return math.sqrt(sum(squared_norm(value) for value in floating)), sum(v.size for v in floating)


@dataclass
class ModelGuard:
    """The model guard of a run: :func:`model_rejection` against the previous model, and a bound
    against the run's honest scale, which a model growing round after round cannot follow.

    :func:`model_rejection` compares a model with the previous one, so a model that grows by a
    factor below ``MODEL_GROWTH_FACTOR`` every round passes every round (three of four clients
    sending -3 x the honest mean update, IPM, took the weights from 0.3 to 1e13 in six rounds).
    So the guard also keeps the run's initial norm ||w_0|| and the median update norm of every
    committed round, and rejects a model whose norm exceeds ``MODEL_GROWTH_FACTOR`` x (||w_0|| +
    t x m_t) + ``MODEL_GROWTH_MARGIN`` x t x sqrt(elements) after t committed rounds (this one
    included), m_t the median of those rounds' median update norms: an honest model is at most
    ||w_0|| plus t steps of about the median update (x the rules' own factors, which
    ``MODEL_GROWTH_FACTOR`` covers), and a server optimizer's per-element steps are covered by
    the margin. A run whose median update grows geometrically has its median over rounds lag
    behind it, so its model is refused within a few rounds. The state is part of the strategy's
    checkpoint (:meth:`state_dict`).
    """

    initial_norm: float | None = None
    medians: list[float] = field(default_factory=list)

    def rejection(
        self, new_arrays: Mapping[str, Any], previous: NDArrayDict, median_update: float
    ) -> str | None:
        """Why ``new_arrays`` must not be committed, or None (then the round counts as one)."""
        if self.initial_norm is None:
            self.initial_norm = floating_norm(previous)[0]
        refusal, norm, elements = _model_scan(new_arrays, previous, median_update)
        if refusal is not None:
            return refusal
        rounds = len(self.medians) + 1
        scale = float(np.median([*self.medians, median_update]))
        limit = MODEL_GROWTH_FACTOR * (
            self.initial_norm + rounds * scale
        ) + MODEL_GROWTH_MARGIN * rounds * math.sqrt(elements)
        if norm > limit:
            return (
                f"its norm {norm:.4g} exceeds the run's honest scale, {MODEL_GROWTH_FACTOR:g} x "
                f"(initial model's norm {self.initial_norm:.4g} + {rounds} rounds x the median "
                f"over rounds of the median client update, {scale:.4g}) + "
                f"{MODEL_GROWTH_MARGIN:g} x {rounds} x sqrt({elements} elements): the model "
                "grows round after round (a diverging run, or a Byzantine majority)"
            )
        self.medians.append(float(median_update))
        return None

    def state_dict(self) -> dict[str, Any]:
        """The guard's state for a checkpoint (empty before its first round)."""
        if self.initial_norm is None:
            return {}
        return {"guard-initial-norm": self.initial_norm, "guard-medians": list(self.medians)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (an older checkpoint without it starts afresh)."""
        initial = state.get("guard-initial-norm")
        self.initial_norm = None if initial is None else float(initial)
        self.medians = [float(value) for value in state.get("guard-medians", [])]
