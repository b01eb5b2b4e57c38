"""Where the model input and the labels are in a batch or sample of any common format.

One rule for the whole library (the Elastic sensitivity on clients, FedLAW's proxy set on the
server), so that a batch Flower's quickstart produces needs no extra argument anywhere:

- a tensor (or numpy array): the input itself, no labels;
- a tuple or list ``(input, label, ...)``: its first and second items, the convention of
  ``TensorDataset`` and torchvision;
- a dict: the input under the one key of :data:`INPUT_KEYS` it has (``"img"`` in Flower's
  quickstarts, ``"pixel_values"`` from Hugging Face image processors), else its only floating
  tensor of rank >= 2; the labels under the one key of :data:`LABEL_KEYS` it has.

Anything else, or a dict with several candidates, raises :class:`BatchFormatError` listing what it
found; the caller appends how to name the input explicitly (its own argument).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

#: Keys under which a dict batch holds the model input, in no particular order.
INPUT_KEYS = ("img", "image", "images", "pixel_values", "x", "input", "inputs", "features")
#: Keys under which a dict batch holds the labels.
LABEL_KEYS = ("label", "labels", "y", "target", "targets")


class BatchFormatError(TypeError):
    """A batch whose input or labels cannot be told without help."""


def as_tensor(value: Any) -> torch.Tensor | None:
    """``value`` as a tensor when it is a tensor, a numeric numpy array or a Python number."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray) and value.dtype != np.object_:
        return torch.from_numpy(value)
    if isinstance(value, int | float | np.number) and not isinstance(value, bool):
        return torch.as_tensor(value)
    return None


def _keys(batch: Mapping[Any, Any]) -> list[str]:
    return sorted(map(str, batch))


def batch_inputs(batch: Any) -> torch.Tensor:
    """The model input of a batch or sample (see the module docstring for the rule).

    Raises
    ------
    BatchFormatError
        When the rule finds no input, or several candidates in a dict.
    """
    tensor = as_tensor(batch)
    if tensor is not None:
        return tensor
    if isinstance(batch, list | tuple) and batch:
        first = as_tensor(batch[0])
        if first is not None:
            return first
    if isinstance(batch, Mapping):
        named = [key for key in INPUT_KEYS if key in batch and as_tensor(batch[key]) is not None]
        if len(named) == 1:
            return as_tensor(batch[named[0]])  # type: ignore[return-value]
        floating = [
            key
            for key, value in batch.items()
            if (t := as_tensor(value)) is not None and t.is_floating_point() and t.dim() >= 2
        ]
        if not named and len(floating) == 1:
            return as_tensor(batch[floating[0]])  # type: ignore[return-value]
        found = (
            f"several candidates {named or floating}"
            if named or floating
            else f"no tensor under a key of {list(INPUT_KEYS)} and no floating tensor of rank >= 2"
        )
        raise BatchFormatError(f"cannot tell the input of a dict with keys {_keys(batch)}: {found}")
    raise BatchFormatError(
        f"cannot find the input in a {type(batch).__name__}: expected a tensor, an (input, label) "
        "tuple or a dict"
    )


def batch_labels(batch: Any) -> torch.Tensor:
    """The labels of a batch or sample: the second item of a tuple, or a dict's label key.

    Raises
    ------
    BatchFormatError
        When the batch has no labels the rule can find (a bare tensor, a dict without exactly
        one key of :data:`LABEL_KEYS`).
    """
    if isinstance(batch, list | tuple) and len(batch) >= 2:
        labels = as_tensor(batch[1])
        if labels is not None:
            return labels
    if isinstance(batch, Mapping):
        named = [key for key in LABEL_KEYS if key in batch and as_tensor(batch[key]) is not None]
        if len(named) == 1:
            return as_tensor(batch[named[0]])  # type: ignore[return-value]
        found = f"several label keys {named}" if named else f"no key of {list(LABEL_KEYS)}"
        raise BatchFormatError(
            f"cannot tell the labels of a dict with keys {_keys(batch)}: {found}"
        )
    raise BatchFormatError(
        f"cannot find labels in a {type(batch).__name__}: expected an (input, label) tuple or a "
        "dict with a label key"
    )
