"""A record's floating tensors as one array on the wire: fewer objects, so fewer requests.

Flower sends a message as a tree of objects (the message, each record, each array, each array's
chunks), one request each over the HTTP Fleet API (flwr 1.40 and later): a model of six tensors
is 13 objects before any byte of it moves (docs/deployment.md, "What a reply costs"). Packed,
a record's floating tensors travel as one array: their values concatenated in the model's
state-dict order, under one key that says which tensors it holds,

    ``packed/<layout>/<mask>``

- ``layout``: :func:`layout_digest` of the model's floating tensors (names and shapes, in
  order), so that a receiver whose model differs refuses the record instead of misreading it;
- ``mask``: which of those tensors the array holds, in order (:func:`mask_hex`): all of them in
  a model record, the trainable parameters in a ``sensitivity`` record.

Integer tensors (BatchNorm's ``num_batches_tracked``) keep their own key beside it. Unpacking
splits the array into views of it (no copy) shaped by the receiver's own model, and refuses any
record whose key, layout, mask or length disagrees with that model (:class:`PackingError`).

Both sides import this module: the ServerApp's packing Grid (:mod:`server.packed_grid`) packs
what it sends, the strategies' wire decoding (:func:`strategies.replies.wire.decode_record`)
unpacks replies, and this project's ClientApp unpacks what it receives and packs its reply the
same way.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

#: The first part of a packed array's key. State-dict keys are dotted attribute names
#: (``fc1.weight``), so none starts with it in practice; a record holding one is read as packed.
PACKED_PREFIX = "packed/"

#: (name, shape, floating) of each tensor of a model, in state-dict order.
Layout = Sequence[tuple[str, tuple[int, ...], bool]]


class PackingError(ValueError):
    """A packed record that does not fit the receiver's model (the message says how)."""


def array_layout(arrays: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...], bool]]:
    """The :data:`Layout` of NumPy arrays or torch tensors (a state dict), in their order."""
    layout = []
    for key, value in arrays.items():
        dtype = value.dtype
        floating = (
            bool(dtype.is_floating_point)
            if hasattr(dtype, "is_floating_point")  # a torch dtype
            else bool(np.issubdtype(dtype, np.floating))
        )
        layout.append((key, tuple(int(n) for n in value.shape), floating))
    return layout


def layout_digest(layout: Layout) -> str:
    """16 hex digits naming the floating tensors' names and shapes, in order."""
    text = ";".join(
        f"{key}:{'x'.join(map(str, shape))}" for key, shape, floating in layout if floating
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mask_hex(mask: Sequence[bool]) -> str:
    """``mask`` as hex digits, four tensors a digit, the first tensor the lowest bit of the
    first digit (so that the string grows at its end as the model grows)."""
    digits = []
    for start in range(0, len(mask), 4):
        nibble = sum(1 << bit for bit, on in enumerate(mask[start : start + 4]) if on)
        digits.append(format(nibble, "x"))
    return "".join(digits)


def parse_mask(text: str, count: int) -> list[bool]:
    """The mask of :func:`mask_hex` for ``count`` tensors.

    Raises
    ------
    PackingError
        For a string that is not ``ceil(count / 4)`` hex digits, or that sets a bit past
        ``count``.
    """
    if len(text) != -(-count // 4) or any(c not in "0123456789abcdef" for c in text):
        raise PackingError(
            f"mask {text[:40]!r} is not {-(-count // 4)} hex digits ({count} tensors)"
        )
    mask = [bool(int(text[i // 4], 16) >> (i % 4) & 1) for i in range(len(text) * 4)]
    if any(mask[count:]):
        raise PackingError(f"mask {text[:40]!r} names a tensor past the model's {count}")
    return mask[:count]


def is_packed(keys: Sequence[str] | Mapping[str, Any]) -> bool:
    """Whether a record (its keys) holds a packed array."""
    return any(key.startswith(PACKED_PREFIX) for key in keys)


def pack(arrays: Mapping[str, npt.NDArray[Any]], layout: Layout) -> dict[str, npt.NDArray[Any]]:
    """``arrays`` (a model's tensors, or a subset of its floating ones) as a packed record.

    The floating tensors, in ``layout``'s order, become one 1-D array of their common dtype
    (float32 for a float32 model, float16 for a float16 sensitivity); integer tensors are kept
    as they are, under their own keys.

    Raises
    ------
    PackingError
        For a tensor that ``layout`` does not name with its shape.
    """
    shapes = {key: (shape, floating) for key, shape, floating in layout}
    for key, value in arrays.items():
        if key not in shapes or tuple(value.shape) != shapes[key][0]:
            where = "not in the model" if key not in shapes else f"shaped {tuple(value.shape)}"
            raise PackingError(f"tensor {key!r} is {where}: it cannot be packed")
    floating = [key for key, _, is_float in layout if is_float]
    chosen = [key for key in floating if key in arrays]
    if not chosen:
        return dict(arrays)
    dtype = np.result_type(*(arrays[key].dtype for key in chosen))
    flat = np.concatenate([np.asarray(arrays[key], dtype=dtype).reshape(-1) for key in chosen])
    name = f"{PACKED_PREFIX}{layout_digest(layout)}/{mask_hex([k in arrays for k in floating])}"
    others = {key: value for key, value in arrays.items() if not shapes[key][1]}
    return {name: flat, **others}


def packed_tensors(key: str, layout: Layout, *, whole: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) of each tensor the packed array under ``key`` holds, in order.

    ``whole``: the record must hold every floating tensor of the model (a model record), else a
    non-empty subset of them (an extra record such as ``sensitivity``).

    Raises
    ------
    PackingError
        For a key laid out for another model, a malformed mask, or one that does not fit
        ``whole``.
    """
    parts = key[len(PACKED_PREFIX) :].split("/") if key.startswith(PACKED_PREFIX) else []
    floating = [(name, shape) for name, shape, is_float in layout if is_float]
    if len(parts) != 2 or parts[0] != layout_digest(layout):
        raise PackingError(
            f"packed array {key[:60]!r} is laid out for another model (this model's layout is "
            f"{layout_digest(layout)}): both sides must build the same model"
        )
    mask = parse_mask(parts[1], len(floating))
    if whole and not all(mask):
        raise PackingError("a packed model record must hold every floating tensor")
    if not any(mask):
        raise PackingError("a packed record names no tensor")
    return [tensor for tensor, on in zip(floating, mask, strict=True) if on]


def packed_key(keys: Sequence[str] | Mapping[str, Any]) -> str:
    """The one packed key of a record.

    Raises
    ------
    PackingError
        For a record with none or several.
    """
    packed = [key for key in keys if key.startswith(PACKED_PREFIX)]
    if len(packed) != 1:
        raise PackingError(f"a packed record holds one packed array, this one {len(packed)}")
    return packed[0]


def unpack(
    arrays: Mapping[str, npt.NDArray[Any]], layout: Layout, *, whole: bool
) -> dict[str, npt.NDArray[Any]]:
    """A packed record's tensors, by the receiver's ``layout``: views of the packed array.

    ``whole`` as in :func:`packed_tensors`; a whole record holds the model's integer tensors
    beside the packed array, an extra record nothing else. Keys come back in ``layout``'s order.

    Raises
    ------
    PackingError
        For a record without exactly one packed key, any fault :func:`packed_tensors` finds, a
        packed array that is not 1-D and floating, a length other than its tensors' sizes, or
        unpacked keys other than the model's integer tensors.
    """
    key = packed_key(arrays)
    chosen = packed_tensors(key, layout, whole=whole)
    flat = arrays[key]
    if flat.ndim != 1 or not np.issubdtype(flat.dtype, np.floating):
        raise PackingError(
            f"packed array {key[:60]!r} is {flat.dtype} shaped {flat.shape}: allowed is a 1-D "
            "floating array"
        )
    sizes = [math.prod(shape) for _, shape in chosen]
    if flat.size != sum(sizes):
        raise PackingError(
            f"packed array {key[:60]!r} holds {flat.size} values, its {len(chosen)} tensors "
            f"{sum(sizes)}"
        )
    integers = {name for name, _, is_float in layout if not is_float} if whole else set()
    others = set(arrays) - {key}
    if others != integers:
        raise PackingError(
            f"beside the packed array a {'model' if whole else 'record'} holds "
            f"{sorted(integers)[:5]} (the model's integer tensors), this one {sorted(others)[:5]}"
        )
    views: dict[str, npt.NDArray[Any]] = {name: arrays[name] for name in others}
    start = 0
    for (name, shape), size in zip(chosen, sizes, strict=True):
        views[name] = flat[start : start + size].reshape(shape)
        start += size
    return {name: views[name] for name, _, _ in layout if name in views}
