"""FedLAW's proxy set from whatever a Flower app has at hand, and a check against the test set.

:func:`to_labeled_data` turns each of these into the :class:`~tasks.datasets.LabeledData` that
FedLAW learns its weights on (float32 inputs, int64 labels):

- a ``LabeledData``: as is;
- an ``(inputs, labels)`` pair of tensors or numpy arrays;
- a ``torch.utils.data.DataLoader``: every batch it yields;
- a ``torch.utils.data.Dataset`` (``len`` and indexing): every sample;
- a Hugging Face ``datasets.Dataset``: every row, after ``transform`` when one is given, applied
  as the dataset's own (``dataset.with_transform(transform)``), so the ``apply_transforms`` of
  Flower's quickstarts works unchanged. Without it, image columns hold PIL images, which are
  refused with that hint.

Batches and samples may be tensors, ``(input, label)`` tuples or dicts; the input and the labels
are found by the rule of :mod:`tasks.batch_format` (a dict's ``"img"`` / ``"label"``, ...).

:func:`count_shared_samples` compares two sets by a hash of each sample's input, so that FedLAW can
warn when its proxy set overlaps the test set the results are reported on.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from beyond_averaging.tasks.batch_format import (
    BatchFormatError,
    as_tensor,
    batch_inputs,
    batch_labels,
)
from beyond_averaging.tasks.datasets import LabeledData


class ProxySetError(ValueError):
    """The proxy set cannot drive FedLAW; the message names the values and the fix."""


def _is_huggingface_dataset(data: Any) -> bool:
    return hasattr(data, "with_transform") and hasattr(data, "column_names")


def _fix(argument: str) -> str:
    return (
        f"pass {argument}=(inputs, labels) as tensors or numpy arrays, a torch Dataset or "
        "DataLoader yielding (input, label) pairs or dicts with 'img'/'label'-like keys, or a "
        "Hugging Face dataset with proxy_transform= turning its columns into tensors"
    )


def _pairs(items: Iterable[Any], argument: str, what: str) -> tuple[list[Any], list[Any]]:
    inputs, labels = [], []
    for item in items:
        try:
            inputs.append(batch_inputs(item))
            labels.append(batch_labels(item))
        except BatchFormatError as error:
            raise ProxySetError(f"{argument}= ({what}): {error}; {_fix(argument)}") from None
    if not inputs:
        raise ProxySetError(f"{argument}= ({what}) holds no sample; {_fix(argument)}")
    return inputs, labels


def _arrays(
    inputs: torch.Tensor, labels: torch.Tensor, argument: str, what: str
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    features = inputs.detach().cpu()
    targets = labels.detach().cpu().reshape(-1)
    if features.dim() < 2 or features.shape[0] != targets.shape[0]:
        raise ProxySetError(
            f"{argument}= ({what}): inputs of shape {tuple(features.shape)} and labels of shape "
            f"{tuple(labels.shape)}: expected inputs (N, ...) and one integer label per sample"
        )
    if targets.is_floating_point():
        if not torch.equal(targets, targets.round()):
            raise ProxySetError(
                f"{argument}= ({what}): labels must be class indices; got non-integer values"
            )
    elif targets.dtype == torch.bool:
        raise ProxySetError(f"{argument}= ({what}): labels must be class indices, not bool")
    return (
        np.ascontiguousarray(features.to(torch.float32).numpy()),
        np.ascontiguousarray(targets.to(torch.int64).numpy()),
    )


def proxy_arrays(
    data: Any,
    *,
    transform: Callable[[Any], Any] | None = None,
    argument: str = "proxy_set",
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Inputs ``(N, ...)`` float32 and labels ``(N,)`` int64 of any supported set.

    Parameters
    ----------
    data : LabeledData, (inputs, labels), DataLoader, Dataset or Hugging Face Dataset
        The set (see the module docstring).
    transform : callable, optional
        Applied to a Hugging Face dataset as ``data.with_transform(transform)``; only there.
    argument : str
        The constructor argument ``data`` came from, for the messages.

    Raises
    ------
    ProxySetError
        Naming ``argument``, the form found and the forms accepted.
    """
    if transform is not None and not _is_huggingface_dataset(data):
        raise ProxySetError(
            f"proxy_transform= applies to a Hugging Face dataset, but {argument}= is a "
            f"{type(data).__name__}: transform a torch Dataset in the Dataset itself"
        )
    if isinstance(data, LabeledData):
        return data.features, data.labels
    if isinstance(data, tuple | list) and len(data) == 2:
        inputs, labels = as_tensor(data[0]), as_tensor(data[1])
        if inputs is not None and labels is not None:
            return _arrays(inputs, labels, argument, "an (inputs, labels) pair")
    if isinstance(data, torch.utils.data.DataLoader):
        inputs_list, labels_list = _pairs(data, argument, "a DataLoader")
        return _arrays(torch.cat(inputs_list), torch.cat(labels_list), argument, "a DataLoader")
    if _is_huggingface_dataset(data):
        rows = data.with_transform(transform) if transform is not None else data
        what = "a Hugging Face dataset" + (" after proxy_transform=" if transform else "")
        samples = (rows[index] for index in range(len(rows)))
        inputs_list, labels_list = _pairs(samples, argument, what)
        return _arrays(torch.stack(inputs_list), torch.stack(labels_list), argument, what)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(data, str):
        what = f"a {type(data).__name__} of samples"
        inputs_list, labels_list = _pairs((data[i] for i in range(len(data))), argument, what)
        return _arrays(torch.stack(inputs_list), torch.stack(labels_list), argument, what)
    raise ProxySetError(f"{argument}= is a {type(data).__name__}; {_fix(argument)}")


def to_labeled_data(
    data: Any,
    num_classes: int,
    *,
    transform: Callable[[Any], Any] | None = None,
    argument: str = "proxy_set",
) -> LabeledData:
    """Any supported set as ``LabeledData`` with ``num_classes`` (a ``LabeledData`` as is).

    Labels outside ``[0, num_classes)`` are kept for the caller's check to report (the class
    count is widened to hold them).
    """
    if isinstance(data, LabeledData) and transform is None:
        return data
    features, labels = proxy_arrays(data, transform=transform, argument=argument)
    largest = int(labels.max()) + 1 if labels.size else 0
    if labels.size and int(labels.min()) < 0:
        raise ProxySetError(f"{argument}= has negative labels: use class indices 0, 1, ...")
    return LabeledData(features, labels, max(num_classes, largest, 1))


def sample_hashes(features: npt.NDArray[Any]) -> list[bytes]:
    """One SHA-1 digest per sample of its float32 input bytes."""
    rows = np.ascontiguousarray(features, dtype=np.float32).reshape(len(features), -1)
    return [hashlib.sha1(row.tobytes(), usedforsecurity=False).digest() for row in rows]


def count_shared_samples(proxy: npt.NDArray[Any], test: npt.NDArray[Any]) -> int:
    """How many proxy samples have an input identical to some test sample (by hash)."""
    test_hashes = set(sample_hashes(test))
    return sum(digest in test_hashes for digest in sample_hashes(proxy))


# ----------------------------------------------------------------------------- FedLAW's batches
ProxyBatch = tuple[torch.Tensor, torch.Tensor]


def validate_proxy_set(
    features: npt.NDArray[Any],
    labels: npt.NDArray[Any],
    num_classes: int,
    batch_size: int,
    *,
    source: str = "the proxy set",
) -> None:
    """Reject a proxy set that is empty, lacks a class, or cannot fill one batch.

    "Smaller than a batch" means fewer samples than ``batch_size`` (``fedlaw-batch-size``): a
    configured batch size the proxy set cannot fill would silently become a smaller one.
    Messages name the constructor argument, then the run option of this project's ServerApp.

    Parameters
    ----------
    features, labels : np.ndarray
        The proxy samples, shape ``(N, *input_shape)`` and ``(N,)``.
    num_classes : int
        Classes of the model's output; every one must occur (the paper's proxy set is
        class-balanced, like the global objective it stands for).
    batch_size : int
        Proxy batch size of the weight learning.
    source : str
        Where the set came from, for the message (e.g. ``"proxy-dir = /data/proxy"``).

    Raises
    ------
    ProxySetError
        With the offending values, the constructor arguments and run options that fix it.
    """
    size = int(labels.shape[0])
    if size == 0:
        raise ProxySetError(
            f"FedLAW's proxy set ({source}) is empty: it learns the aggregation weights on it. "
            "Pass a non-empty proxy_set= (run options: proxy-per-class >= 1, the paper uses 10, "
            "or a proxy-dir whose IDX files hold samples)."
        )
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ProxySetError(
            f"FedLAW's proxy set ({source}) has labels in [{int(labels.min())}, "
            f"{int(labels.max())}] but the model has {num_classes} classes: use labels "
            f"0..{num_classes - 1}."
        )
    missing = np.flatnonzero(np.bincount(labels, minlength=num_classes) == 0)
    if missing.size:
        raise ProxySetError(
            f"FedLAW's proxy set ({source}, {size} samples) has no sample of class(es) "
            f"{missing.tolist()} of the {num_classes} classes: the proxy set stands for the "
            "global objective and must cover every class. Add samples of those classes to "
            "proxy_set= (run options: proxy-per-class >= 1, or the proxy-dir files)."
        )
    if size < batch_size:
        per_class = math.ceil(batch_size / num_classes)
        raise ProxySetError(
            f"FedLAW's proxy set ({source}) holds {size} samples, fewer than one batch "
            f"(batch_size = {batch_size}, run option fedlaw-batch-size): set batch_size <= "
            f"{size}, or enlarge proxy_set= (run options: proxy-per-class >= {per_class}, or "
            "more samples in proxy-dir)."
        )
    if not np.all(np.isfinite(features)):
        raise ProxySetError(f"FedLAW's proxy set ({source}) holds NaN or Inf inputs.")


def make_proxy_batches(
    proxy_set: LabeledData, batch_size: int, *, seed: int, device: torch.device
) -> list[ProxyBatch]:
    """Split the proxy set, shuffled once by ``seed``, into ceil(N / batch_size) batches.

    The batches differ in size by at most one sample (``np.array_split``), so there is no small
    remainder batch: a one-sample batch would make the step noisy and break BatchNorm. Every
    batch holds at most ``batch_size`` samples and, for N >= batch_size, more than half of it.
    """
    order = np.random.default_rng(seed).permutation(len(proxy_set))
    count = math.ceil(len(proxy_set) / batch_size)
    return [
        (
            torch.from_numpy(np.ascontiguousarray(proxy_set.features[part])).to(device),
            torch.from_numpy(np.ascontiguousarray(proxy_set.labels[part])).to(device),
        )
        for part in np.array_split(order, count)
    ]
