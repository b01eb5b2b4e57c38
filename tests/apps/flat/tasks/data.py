"""The flat app's data: synthetic 8x8 images of 4 classes as (x, y) tuple batches."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

NUM_CLASSES = 4
_PROTOTYPES = torch.randn(NUM_CLASSES, 8, 8, generator=torch.Generator().manual_seed(0))


def _samples(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (size,), generator=generator)
    images = _PROTOTYPES[labels] + 0.8 * torch.randn(size, 8, 8, generator=generator)
    return TensorDataset(images, labels)


def load_data(
    partition_id: int, num_partitions: int, batch_size: int
) -> tuple[DataLoader[tuple[torch.Tensor, ...]], DataLoader[tuple[torch.Tensor, ...]]]:
    """This node's training and validation loaders (64 and 16 samples)."""
    seed = 1 + partition_id + 100 * num_partitions
    train, test = _samples(64, seed), _samples(16, seed + 50_000)
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(test, batch_size)


def load_centralized_dataset() -> DataLoader[tuple[torch.Tensor, ...]]:
    """The server's test set (1,000 samples, apart from every partition), as the quickstart's."""
    return DataLoader(_samples(1000, seed=10_000), batch_size=128)
