"""Device choice, data on the device and loss/accuracy evaluation."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from .datasets import LabeledData

DeviceRequest = Literal["auto", "cpu", "cuda"]


def resolve_device(requested: DeviceRequest) -> torch.device:
    """Turn a device request into a ``torch.device``.

    Parameters
    ----------
    requested : {"auto", "cpu", "cuda"}
        ``auto`` picks CUDA when available and the CPU otherwise.

    Returns
    -------
    torch.device

    Raises
    ------
    RuntimeError
        ``cuda`` was requested but torch sees no GPU.
    ValueError
        Any other request.
    """
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "device='cuda' was requested but torch.cuda.is_available() is False; use "
                "device='auto' or 'cpu', or install a CUDA build of torch"
            )
        return torch.device("cuda")
    raise ValueError(f"device={requested!r} is not allowed: choose 'auto', 'cpu' or 'cuda'")


@dataclass(frozen=True, eq=False)
class DeviceData:
    """Labelled samples as two tensors on one device, for batches cut by index or slice.

    Training and evaluation index these tensors directly: no DataLoader, no per-sample
    collation, no host-to-device copy per batch.

    Attributes
    ----------
    features : torch.Tensor
        float32, ``(N, *input_shape)``.
    labels : torch.Tensor
        int64, ``(N,)``, on the same device as ``features``.
    num_classes : int
        Number of classes of the whole data set.
    """

    features: torch.Tensor
    labels: torch.Tensor
    num_classes: int

    @classmethod
    def from_labeled(cls, data: LabeledData, device: torch.device) -> DeviceData:
        """Copy ``data`` onto ``device`` once.

        On the CPU the tensors share NumPy's memory where the arrays are writable.
        """
        return cls(
            _as_tensor(data.features).to(device),
            _as_tensor(data.labels).to(device),
            data.num_classes,
        )

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""
        return self.features.device

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample."""
        return tuple(int(size) for size in self.features.shape[1:])

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slices(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Consecutive ``(features, labels)`` views of ``batch_size`` samples, in order.

        The last view holds the remainder.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for start in range(0, len(self), batch_size):
            yield (
                self.features[start : start + batch_size],
                self.labels[start : start + batch_size],
            )


def evaluate(
    model: nn.Module,
    data: LabeledData | DeviceData | Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    batch_size: int = 512,
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on ``data``.

    The model runs in eval mode (BatchNorm uses its running statistics) without gradients;
    afterwards every submodule gets back the train/eval mode it had. The model is moved to
    ``device`` (in place, as ``nn.Module.to`` does) and stays there.

    Parameters
    ----------
    model : torch.nn.Module
        Maps a batch of features to logits ``(batch, num_classes)``.
    data : LabeledData, DeviceData or iterable of batches
        Samples to score. ``LabeledData`` is copied to ``device`` once and scored in slices;
        pass ``DeviceData`` to reuse tensors already there (what the ClientApp and the server
        do every round); any other iterable (e.g. a DataLoader) must yield
        ``(features, labels)`` batches.
    device : torch.device
        Where to compute.
    batch_size : int
        Batch size used when ``data`` is a ``LabeledData`` or ``DeviceData``.

    Returns
    -------
    loss : float
        Cross-entropy averaged over all samples (not over batches).
    accuracy : float
        Share of samples whose largest logit is the true label.

    Raises
    ------
    ValueError
        ``data`` holds no samples.
    """
    if isinstance(data, LabeledData):
        data = DeviceData.from_labeled(data, device)
    batches = data.slices(batch_size) if isinstance(data, DeviceData) else data
    training_modes = [module.training for module in model.modules()]
    model.to(device)
    model.eval()
    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    total_correct = torch.zeros((), dtype=torch.int64, device=device)
    total_samples = 0
    try:
        with torch.no_grad():
            for features, labels in batches:
                features, labels = features.to(device), labels.to(device)  # no-op if there
                logits = model(features)
                # Summing per-sample losses keeps the mean exact when the last batch is
                # smaller than the others.
                total_loss += nn.functional.cross_entropy(logits, labels, reduction="sum")
                total_correct += (logits.argmax(dim=1) == labels).sum()
                total_samples += int(labels.shape[0])
    finally:
        # Set the flag module by module: Module.train() would recurse and overwrite the
        # children's own (possibly different) modes.
        for module, was_training in zip(model.modules(), training_modes, strict=True):
            module.training = was_training
    if total_samples == 0:
        raise ValueError("cannot evaluate on data with no samples")
    return float(total_loss) / total_samples, int(total_correct) / total_samples


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    # torch.from_numpy shares memory but warns on read-only arrays (the cached federation
    # data is read-only); those are copied once instead, which is also what keeps the
    # cache safe from writes through the tensor.
    return torch.from_numpy(array if array.flags.writeable else array.copy())
