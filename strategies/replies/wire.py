"""Wire decoding: from a reply's bytes to checked, read-only arrays. The first stage of a reply.

Stage 2 of a reply's path (the map: :mod:`strategies.replies`). Each requested ArrayRecord is
read only through :func:`decode_record` -> :func:`decode_array`, which parses the ``.npy`` header
(:func:`npy_header`), applies the dtype policy (:func:`allowed_dtype`) and the shape check before
any data is touched, never unpickles, refuses truncated or padded buffers, and returns a view of
the received bytes (:func:`npy_view`, no copy); :func:`check_values` then reads each tensor once
(finite, ``|v| <= REPLY_VALUE_LIMIT``, above a record's minimum), by its sum of squares where that
proves it (the norm the influence bounds need, computed once), else by :func:`value_range`.

Every problem found here raises :class:`ReplyRejected`, whose ``reason`` becomes the round's
``dropped-<reason>`` count; the later stages raise it too.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from flwr.app import Array, ArrayRecord
from numpy.lib import format as npy_format

from beyond_averaging.strategies.aggregate import NDArrayDict, is_floating
from beyond_averaging.tasks.packing import (
    PackingError,
    array_layout,
    is_packed,
    packed_key,
    packed_tensors,
    unpack,
)
from beyond_averaging.tasks.protocol import ARRAYS_RECORD

from .influence import read_only_tensor, record_norms, squared_norm

#: Largest magnitude accepted in any reply tensor and in a committed global model. No trained
#: parameter, sensitivity or gradient comes near it; far below float32's overflow (3.4e38), so a
#: weighted sum of many such values still fits, and far below float64's, so squares for norms do.
REPLY_VALUE_LIMIT = 1e15

#: Dtypes a reply tensor may have besides the global tensor's own: IEEE floats that NumPy and
#: torch both compute with (float16 is the half-size sensitivity upload).
REAL_FLOAT_SIZES = frozenset({2, 4, 8})


class ReplyRejected(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Why a reply is dropped (``reason`` is the metrics key suffix, ``detail`` the log line)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _reason(name: str, arrays_reason: str) -> str:
    # The model record has one reason per clause; an extra record has one, ``bad-<name>``.
    return arrays_reason if name == ARRAYS_RECORD else f"bad-{name}"


# ----------------------------------------------------------------------------- .npy bytes
class NpyHeader(NamedTuple):
    """What the header of serialized ``.npy`` bytes declares, and where the data starts."""

    shape: tuple[int, ...]
    fortran_order: bool
    dtype: np.dtype[Any]
    offset: int


def npy_header(data: bytes | bytearray | memoryview) -> NpyHeader:
    """Parse the header of ``.npy`` bytes (versions 1.0 and 2.0) without reading the data.

    Raises
    ------
    ValueError
        When ``data`` does not start with a well-formed ``.npy`` 1.0 or 2.0 header (any error of
        NumPy's header parser is turned into this one, so a caller catches a single type).
    """
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_2_0(stream)
        else:
            raise ValueError(f".npy format version {version} is not supported (1.0 and 2.0 are)")
    except ValueError:
        raise
    except Exception as error:  # the header parser may raise many types
        raise ValueError(f"not a readable .npy header: {error!r}"[:300]) from None
    return NpyHeader(tuple(int(n) for n in shape), bool(fortran_order), dtype, stream.tell())


def npy_view(
    data: bytes | bytearray | memoryview, header: NpyHeader | None = None
) -> npt.NDArray[Any]:
    """The array inside serialized ``.npy`` bytes (a Flower ``Array.data``), as a view: no copy.

    ``Array.numpy()`` (``np.load``) copies every tensor out of its message, which costs one
    model-sized buffer per client and record, and most of the time of aggregating large models.
    Aggregation only reads the clients' tensors, so a view of the received bytes serves; it is
    read-only when ``data`` is ``bytes``. ``header`` is :func:`npy_header`'s result when the
    caller has already read it (to check the dtype and shape before any data is touched).

    Raises
    ------
    ValueError
        When ``data`` is not ``.npy`` version 1 or 2, holds Python objects (never unpickled), or
        its length is not exactly the header plus the data it declares (truncated or padded).
    """
    header = npy_header(data) if header is None else header
    if header.dtype.hasobject:
        raise ValueError("the .npy data holds Python objects, which are never unpickled")
    count = math.prod(header.shape)
    expected = header.offset + count * header.dtype.itemsize
    size = memoryview(data).nbytes
    if size != expected:
        raise ValueError(
            f"the .npy data holds {size} bytes, its header declares {expected} "
            f"({header.shape} x {header.dtype})"
        )
    flat = np.frombuffer(data, dtype=header.dtype, count=count, offset=header.offset)
    return flat.reshape(header.shape, order="F" if header.fortran_order else "C")


_TORCH_FLOATS = frozenset(np.dtype(name) for name in ("float16", "float32", "float64"))


def value_range(array: npt.NDArray[Any]) -> tuple[float, float]:
    """(min, max) of a floating array in one pass; NaN in either when the array holds a NaN.

    Replies are checked with it (finite iff both ends are finite; a sensitivity is >= 0 iff the
    min is): torch's ``aminmax`` reads the tensor once, with no temporary mask, on several cores,
    and handles float16 natively, where NumPy's ``isfinite`` and ``min`` emulate it slowly.
    """
    if array.size == 0:
        return 0.0, 0.0
    if array.dtype.newbyteorder("=") not in _TORCH_FLOATS or not array.dtype.isnative:
        return float(array.min()), float(array.max())  # rare dtypes: NumPy, also NaN-propagating
    low, high = torch.aminmax(read_only_tensor(array))
    return float(low), float(high)


# ----------------------------------------------------------------------------- tensors of a reply
def allowed_dtype(dtype: np.dtype[Any], expected: np.dtype[Any], floating_only: bool) -> bool:
    """A real IEEE float (float16/32/64, either byte order), or the global tensor's own dtype.

    Booleans, complex numbers, strings, structured, sub-array and object dtypes never pass; a
    record other than the model (``floating_only``) must be floating.
    """
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        return False
    if dtype.kind == "f" and dtype.itemsize in REAL_FLOAT_SIZES:
        return True
    own = dtype.newbyteorder("=") == expected.newbyteorder("=")
    return own and not floating_only and dtype.kind in "iuf"


def decode_array(
    name: str, key: str, array: Array, expected: npt.NDArray[Any], *, floating_only: bool
) -> npt.NDArray[Any]:
    """A read-only view of one received tensor, its header checked before its data is read.

    Raises
    ------
    ReplyRejected
        ``bad-encoding`` (not ``.npy``, objects, truncated or padded), ``bad-dtype`` or
        ``shape-mismatch`` for the model record; ``bad-<name>`` for another record.
    """
    where = f"record '{name}' tensor '{key}'"
    data = array.data
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ReplyRejected(_reason(name, "bad-encoding"), f"{where} holds no bytes")
    try:
        header = npy_header(data)
    except ValueError as error:
        raise ReplyRejected(
            _reason(name, "bad-encoding"), f"{where} is not .npy data: {error}"
        ) from None
    if not allowed_dtype(header.dtype, expected.dtype, floating_only):
        raise ReplyRejected(
            _reason(name, "bad-dtype"),
            f"{where} has dtype {header.dtype.str!r}: allowed are float16/32/64"
            + ("" if floating_only else f" or the global model's {expected.dtype}"),
        )
    if header.shape != expected.shape:
        raise ReplyRejected(
            _reason(name, "shape-mismatch"),
            f"{where} has shape {header.shape}, global model has {expected.shape}",
        )
    try:
        return npy_view(data, header)
    except ValueError as error:
        raise ReplyRejected(_reason(name, "bad-encoding"), f"{where}: {error}") from None


#: Dtypes whose sum of squares (a BLAS dot product, faster than ``aminmax``) checks a tensor:
#: float16 would need a float32 copy first, so it is checked by its range.
_NORM_CHECKED = frozenset(np.dtype(name) for name in ("float32", "float64"))


def check_values(
    name: str,
    key: str,
    value: npt.NDArray[Any],
    minimum: float = -math.inf,
    limit: float = REPLY_VALUE_LIMIT,
) -> float | None:
    """One pass: finite, ``|v| <= limit``, ``v >= minimum``; else ``non-finite``,
    ``value-out-of-range`` (the model record) or ``bad-<name>``.

    Returns sum(v^2) when that was the pass (a float32/64 tensor without a lower bound; the
    influence bounds need it), else None. A sum of squares at most ``(limit / 2)^2`` proves every
    value finite (a NaN or Inf makes it NaN or Inf) and of magnitude at most ``limit`` (with a
    factor 2 to spare for float32 rounding); any other sum is checked again by the range, which
    names the fault.
    """
    if minimum == -math.inf and value.dtype.newbyteorder("=") in _NORM_CHECKED:
        squares = squared_norm(value)
        if squares <= (limit / 2) ** 2:  # False for NaN
            return squares
    low, high = value_range(value) if is_floating(value) else _int_range(value)
    where = f"record '{name}' tensor '{key}'"
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ReplyRejected(_reason(name, "non-finite"), f"{where} holds NaN or Inf")
    if max(-low, high) > limit:
        raise ReplyRejected(
            _reason(name, "value-out-of-range"),
            f"{where} holds a value of magnitude {max(-low, high):.3g} > {limit:g}",
        )
    if low < minimum:
        raise ReplyRejected(f"bad-{name}", f"{where} has values below {minimum} (smallest {low})")
    return None


def _int_range(value: npt.NDArray[Any]) -> tuple[float, float]:
    if value.size == 0:
        return 0.0, 0.0
    return float(value.min()), float(value.max())


class DecodedRecord(NamedTuple):
    """A checked record's read-only tensors, and its L2 norm over its floating tensors where the
    value checks computed it (None where a tensor was checked by its range)."""

    arrays: NDArrayDict
    norm: float | None


def _check_keys(name: str, keys: set[str], global_arrays: NDArrayDict, subset: bool) -> None:
    expected = (
        set(global_arrays)
        if not subset
        else {k for k, v in global_arrays.items() if is_floating(v)}
    )
    if (subset and (not keys or not keys <= expected)) or (not subset and keys != expected):
        unknown, missing = sorted(keys - expected), sorted(expected - keys)
        raise ReplyRejected(
            _reason(name, "key-mismatch"),
            f"record '{name}' keys differ from the global model's"
            f"{' floating tensors' if subset else ''} (unknown: {unknown[:5]}, missing: "
            f"{[] if subset else missing[:5]})",
        )


def _unpacked(
    name: str, record: ArrayRecord, global_arrays: NDArrayDict, subset: bool
) -> NDArrayDict:
    """A packed record's tensors (:mod:`tasks.packing`): views of its one decoded array, split
    by the global model's layout; its integer tensors decoded as in an unpacked record.

    Raises
    ------
    ReplyRejected
        ``bad-packing`` (the model record) or ``bad-<name>`` for a record that does not fit the
        global model's layout; any reason of :func:`decode_array`.
    """
    layout = array_layout(global_arrays)
    try:
        key = packed_key(record)
        size = sum(math.prod(shape) for _, shape in packed_tensors(key, layout, whole=not subset))
        # Decoded as any floating tensor of that length (the dtype policy of an extra record).
        expected = np.broadcast_to(np.zeros((), np.float32), (size,))
        arrays = {
            k: decode_array(
                name,
                k,
                array,
                expected if k == key else global_arrays[k],
                floating_only=k == key or subset,
            )
            for k, array in record.items()
            if k == key or k in global_arrays
        }
        if len(arrays) < len(record):  # a key the model does not have
            unknown = sorted(set(record) - set(arrays))
            raise PackingError(f"keys {unknown[:5]} are not the model's")
        return unpack(arrays, layout, whole=not subset)
    except PackingError as error:
        raise ReplyRejected(
            _reason(name, "bad-packing"), f"record '{name}': {error}"[:300]
        ) from None


def decode_record(
    name: str,
    record: ArrayRecord,
    global_arrays: NDArrayDict,
    *,
    subset: bool,
    minimum: float = -math.inf,
) -> DecodedRecord:
    """Decode and check an ArrayRecord against the global model, key by key.

    The model record (``subset=False``) must have exactly the global model's keys; another record
    (``subset=True``) a non-empty subset of its floating tensors, all floating. Each tensor is
    decoded by :func:`decode_array` and checked by :func:`check_values`; the record's L2 norm
    comes back with it where those checks computed every tensor's sum of squares. A packed record
    (:mod:`tasks.packing`: the floating tensors as one array) is decoded as one array and split
    into views by the global model's layout, then checked tensor by tensor the same way.

    Raises
    ------
    ReplyRejected
        ``key-mismatch`` (model record) or ``bad-<name>``, ``bad-packing`` for a packed model
        record that does not fit the global model, or any reason of the two helpers.
    """
    if is_packed(record):
        received = _unpacked(name, record, global_arrays, subset)
    else:
        _check_keys(name, set(record), global_arrays, subset)
        received = {
            key: decode_array(name, key, array, global_arrays[key], floating_only=subset)
            for key, array in record.items()
        }
    decoded: NDArrayDict = {}
    squares: float | None = 0.0
    for key, value in received.items():
        tensor_squares = check_values(name, key, value, minimum)
        if squares is not None and (tensor_squares is not None or not is_floating(value)):
            squares += tensor_squares or 0.0
        else:
            squares = None
        decoded[key] = value
    return DecodedRecord(decoded, None if squares is None else math.sqrt(squares))


# ----------------------------------------------------------------------------- unpacked replies
@dataclass(frozen=True)
class ClientReply:
    """A reply that passed the contract, unpacked to numpy."""

    node_id: int
    arrays: NDArrayDict
    #: The reply's weight: its metric ``weighted_by_key`` (by default ``num-examples``); under
    #: ``max_client_weight`` < 1, its capped share of the round's weights instead.
    num_examples: float
    metrics: dict[str, float]
    records: dict[str, NDArrayDict] = field(default_factory=dict)
    #: s_k in (0, 1]: the rule aggregates w + s_k (theta_k - w) in place of theta_k (update
    #: clipping, :func:`strategies.replies.influence.clip_scales`); 1 leaves the model as sent.
    update_scale: float = 1.0
    #: Per required record, the factor its tensors are scaled by (clipped as updates are).
    record_scales: dict[str, float] = field(default_factory=dict)
    #: ||record|| as received, for the records whose value checks computed it (the influence
    #: bounds read it instead of reading the record again).
    record_norms: dict[str, float] = field(default_factory=dict)


#: ``fn(server_round, global_arrays, valid_replies, weights) -> metrics``: called after each
#: aggregation with the round's valid replies and their normalised data-size weights; the metrics it
#: returns are merged into the round's metrics (e.g. strategies.diagnostics.ClientDiagnostics).
ReplyObserver = Callable[
    [int, NDArrayDict, Sequence[ClientReply], np.ndarray[Any, np.dtype[np.float64]]],
    Mapping[str, float | int | list[float]],
]


def received_norms(
    name: str, replies: Sequence[ClientReply]
) -> np.ndarray[Any, np.dtype[np.float64]]:
    """||record ``name``|| per reply: kept from its value checks, else read from the record."""
    if all(name in reply.record_norms for reply in replies):
        return np.array([reply.record_norms[name] for reply in replies], dtype=np.float64)
    return record_norms([reply.records[name] for reply in replies])


def record_arrays(record: ArrayRecord) -> NDArrayDict:
    """The record's tensors as read-only numpy views of its bytes."""
    # Read-only views of the received bytes: a copy per tensor (Array.numpy) would hold one more
    # model-sized buffer per client and record during aggregation (benchmarks/systems.py).
    return {key: npy_view(array.data) for key, array in record.items()}
