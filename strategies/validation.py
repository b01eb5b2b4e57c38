"""Reply validation and influence bounds: the checks around decoding (:mod:`strategies.wire`).

Pure functions, called by :class:`~strategies.base.ContractStrategy`, in the order a reply meets
them:

- **before decoding**: :func:`reply_bytes` against a byte limit (:func:`default_reply_byte_limit`,
  a small multiple of the model's bytes), :func:`check_reply_weight` (the reply's weight is a
  finite, positive, integer-valued number of examples);
- **decoding**: :func:`strategies.wire.decode_record` (``.npy`` header, dtype policy, shape,
  values; see that module);
- **across the round's replies**: :func:`common_key_set` (records that share no key);
- **influence**: :func:`update_norms` / :func:`record_norms` and :func:`norm_outliers` (a norm
  above ``factor`` x the round's median), :func:`cap_weights` (no client above a weight share);
- **after aggregation**: :func:`model_rejection` (a non-finite, out-of-range or exploding global
  model is never committed).

Every check raises :class:`~strategies.wire.ReplyRejected`, whose ``reason`` becomes the round's
``dropped-<reason>`` count; nothing else may escape a reply's validation.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from flwr.app import RecordDict

from .aggregate import NDArrayDict, is_floating
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
#: ``MODEL_GROWTH_FACTOR * (||w|| + max_k ||theta_k - w||) + MODEL_GROWTH_MARGIN * sqrt(elements)``.
#: ||w|| + max_k ||theta_k - w|| bounds every client model's norm, hence any average of them; the
#: factor leaves room for a server optimizer's step (FedAdam moves about lr per element, which the
#: margin covers from a near-zero start).
MODEL_GROWTH_FACTOR = 10.0
MODEL_GROWTH_MARGIN = 2.0

#: A ``sensitivity`` or ``gradient`` record is an outlier at this many times the update factor:
#: one batch's last-step gradient spreads more between honest clients than their updates do
#: (max/median up to 6.7 against 4.4 for updates on digits, docs/reliability.md).
RECORD_NORM_FACTOR_SCALE = 2.0


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


# ----------------------------------------------------------------------------- influence
def squared_norm(array: npt.NDArray[Any]) -> float:
    """sum(x^2) of a floating array, in float32 or wider (BLAS dot product, no float64 copy).

    Float32's relative error (about 1e-6 per element, 1e-4 on a million) is far below what a norm
    comparison by a factor needs, and it is several times faster than converting to float64.
    A sum that overflows float32 gives inf: such a norm is an outlier by any measure.
    """
    flat = array.reshape(-1)
    if flat.dtype.itemsize < 4:  # float16 would overflow at 65504
        flat = flat.astype(np.float32)
    with np.errstate(over="ignore"):
        return float(np.dot(flat, flat))


def update_norms(
    global_arrays: NDArrayDict, client_arrays: Sequence[Mapping[str, npt.NDArray[Any]]]
) -> npt.NDArray[np.float64]:
    """||theta_k - w||_2 per client, over the floating tensors (see :func:`squared_norm`)."""
    keys = [key for key, value in global_arrays.items() if is_floating(value)]
    norms = np.zeros(len(client_arrays))
    for index, arrays in enumerate(client_arrays):
        total = 0.0
        for key in keys:
            value, current = arrays[key], global_arrays[key]
            wide = np.promote_types(np.result_type(value, current), np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                # One tensor-sized temporary at a time, never a model-sized one.
                total += squared_norm(np.subtract(value, current, dtype=wide))
        norms[index] = math.sqrt(total)
    return norms


def record_norms(records: Sequence[Mapping[str, npt.NDArray[Any]]]) -> npt.NDArray[np.float64]:
    """||r_k||_2 per client's record, over all its tensors (see :func:`squared_norm`)."""
    return np.array(
        [math.sqrt(sum(squared_norm(value) for value in record.values())) for record in records],
        dtype=np.float64,
    )


def max_over_median(norms: npt.NDArray[np.float64] | Sequence[float]) -> float | None:
    """The largest norm over the median: what :func:`norm_outliers` compares with its factor.

    None without norms or with a median of 0 (no ratio to speak of).
    """
    values = np.asarray(norms, dtype=np.float64)
    median = float(np.median(values)) if values.size else 0.0
    return float(values.max()) / median if median > 0.0 else None


def norm_outliers(norms: npt.NDArray[np.float64], factor: float) -> npt.NDArray[np.bool_]:
    """True where a norm exceeds ``factor`` x the median of ``norms`` (factor 0: none is).

    With two replies the median is their mean, so no factor >= 2 can single one out; with a
    median of 0 (most clients did not move) nothing is flagged.
    """
    outliers = np.zeros(norms.shape, dtype=np.bool_)
    if factor <= 0.0 or norms.size == 0:
        return outliers
    median = float(np.median(norms))
    if median > 0.0:
        outliers = norms > factor * median
    return outliers


def cap_weights(
    weights: Sequence[float] | npt.NDArray[Any], max_share: float
) -> npt.NDArray[np.float64]:
    """Data-size weights with no share above ``max_share``, the excess spread proportionally.

    With p = weights / sum(weights) sorted in decreasing order, the m largest are set to the cap
    c = max(max_share, 1 / K) and the others scaled by (1 - m c) / sum_{j >= m} p_j, for the
    smallest m that leaves every scaled weight <= c (water-filling: the result is the weight
    vector closest to p, in the proportional sense, whose entries are all <= c). ``max_share`` >= 1
    returns p unchanged.

    Raises
    ------
    ValueError
        When a weight is not finite or not positive, or ``max_share`` is not positive.
    """
    counts = np.asarray(weights, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0 or not np.all(np.isfinite(counts)):
        raise ValueError(f"need finite weights, got {counts.tolist()}")
    if np.any(counts <= 0.0) or not max_share > 0.0:
        raise ValueError(f"weights {counts.tolist()} and max_share {max_share} must be > 0")
    shares: npt.NDArray[np.float64] = counts / counts.sum()
    cap = max(float(max_share), 1.0 / shares.size)
    if shares.max() <= cap:
        return shares
    order = np.argsort(-shares, kind="stable")
    ranked = shares[order]
    tail = np.cumsum(ranked[::-1])[::-1]  # tail[m] = sum of the weights from rank m on
    capped = np.arange(ranked.size)
    # Rank m fits under the cap once the m above it are capped: p_m (1 - m c) <= c tail_m.
    # At m = K - 1 this reads 1 - (K - 1) c <= c, true because c >= 1 / K.
    first = int(np.argmax(ranked * (1.0 - capped * cap) <= cap * tail))
    result = ranked * ((1.0 - first * cap) / tail[first])
    result[:first] = cap
    out: npt.NDArray[np.float64] = np.empty_like(result)
    out[order] = result
    return out


# ----------------------------------------------------------------------------- after aggregation
def model_rejection(
    new_arrays: Mapping[str, Any], previous: NDArrayDict, largest_update: float
) -> str | None:
    """Why a freshly aggregated global model must not be committed, or None when it may be.

    Rejected: a NaN or Inf, a magnitude above ``REPLY_VALUE_LIMIT`` (a model that every honest
    reply near it would break), or an L2 norm (floating tensors) above ``MODEL_GROWTH_FACTOR`` x
    (the previous model's norm + ``largest_update``, the largest ||theta_k - w|| of the round) +
    ``MODEL_GROWTH_MARGIN`` x sqrt(elements).
    """
    squares_new = squares_old = 0.0
    elements = 0
    for key, raw in new_arrays.items():
        value = np.asarray(raw)
        if not is_floating(value) or value.size == 0:
            continue
        low, high = value_range(value)
        if not (math.isfinite(low) and math.isfinite(high)):
            return f"tensor '{key}' holds NaN or Inf"
        if max(-low, high) > REPLY_VALUE_LIMIT:
            return f"tensor '{key}' holds a value of magnitude {max(-low, high):.3g}"
        squares_new += squared_norm(value)
        if key in previous:
            squares_old += squared_norm(previous[key])
        elements += value.size
    norm, previous_norm = math.sqrt(squares_new), math.sqrt(squares_old)
    reach = previous_norm + largest_update
    limit = MODEL_GROWTH_FACTOR * reach + MODEL_GROWTH_MARGIN * math.sqrt(elements)
    if norm > limit:
        return (
            f"its norm {norm:.4g} exceeds {MODEL_GROWTH_FACTOR:g} x (previous model's norm "
            f"{previous_norm:.4g} + largest client update {largest_update:.4g}) + "
            f"{MODEL_GROWTH_MARGIN:g} x sqrt({elements} elements)"
        )
    return None
