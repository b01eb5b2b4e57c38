"""Batch plans as index tensors: the order of a client's local epochs without a DataLoader.

Local training cuts its batches by index from tensors that already sit on the training device,
so the order of samples must come from a pure function. :func:`epoch_orders` reproduces, draw
for draw, the order that ``torch.utils.data.DataLoader(dataset, batch_size, shuffle=True,
generator=torch.Generator().manual_seed(seed))`` yields over consecutive epochs (what
``tasks.evaluation.make_loader`` built and the ClientApp used until the fast path): the same
seed gives the same batches as before, so results of earlier runs stay reproducible.

What one epoch of that loader draws from its generator (torch 2.x, ``num_workers=0``; read in
``torch/utils/data/dataloader.py`` and ``sampler.py``):

1. creating the epoch's iterator draws a 64-bit base seed for workers:
   ``torch.empty((), dtype=torch.int64).random_(generator=g)``;
2. ``RandomSampler.__iter__`` yields ``torch.randperm(n, generator=g)``, the epoch's order;
3. when that order is exhausted, the sampler's generator function runs on to its tail
   ``torch.randperm(n, generator=g)[: num_samples % n]``, which draws a second permutation and
   keeps none of it; the batch sampler always exhausts the sampler, so every epoch makes it.

The test ``tests/test_batching.py`` compares the plan with a real DataLoader's batches.
"""

from __future__ import annotations

import torch


def epoch_orders(num_samples: int, epochs: int, seed: int) -> torch.Tensor:
    """Sample order of each local epoch, as a seeded shuffling DataLoader draws it.

    Parameters
    ----------
    num_samples : int
        Samples in the partition (>= 1).
    epochs : int
        Consecutive passes over the data drawn from one generator (>= 0).
    seed : int
        Seed of the generator (``torch.Generator().manual_seed(seed)``).

    Returns
    -------
    torch.Tensor
        int64 on the CPU, shape ``(epochs, num_samples)``; row ``e`` is a permutation of
        ``range(num_samples)``, the order of epoch ``e``.

    Raises
    ------
    ValueError
        ``num_samples < 1`` (a RandomSampler refuses it too) or ``epochs < 0``.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 to shuffle, got {num_samples}")
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    generator = torch.Generator().manual_seed(seed)
    orders = torch.empty((epochs, num_samples), dtype=torch.int64)
    for epoch in range(epochs):
        torch.empty((), dtype=torch.int64).random_(generator=generator)  # workers' base seed
        orders[epoch] = torch.randperm(num_samples, generator=generator)
        torch.randperm(num_samples, generator=generator)  # the sampler's empty tail, drawn
    return orders


def shuffled_batches(
    num_samples: int, batch_size: int, epochs: int, seed: int
) -> list[torch.Tensor]:
    """Index tensors of every local step, epoch after epoch, in the seeded DataLoader's order.

    Each epoch's order (:func:`epoch_orders`) is cut into consecutive batches of
    ``batch_size``; the last batch of an epoch holds the remainder (``drop_last=False``).

    Parameters
    ----------
    num_samples : int
        Samples in the partition (>= 1).
    batch_size : int
        Samples per step (>= 1).
    epochs : int
        Local epochs (>= 0).
    seed : int
        Seed of the shuffling (the ClientApp derives it from run seed, round and partition).

    Returns
    -------
    list of torch.Tensor
        One int64 CPU tensor per step, ``epochs * ceil(num_samples / batch_size)`` of them.

    Raises
    ------
    ValueError
        ``batch_size < 1``, ``num_samples < 1`` or ``epochs < 0``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    orders = epoch_orders(num_samples, epochs, seed)
    return [batch for order in orders for batch in torch.split(order, batch_size)]


def shuffle_seed(run_seed: int, server_round: int, partition_id: int) -> int:
    """Seed of a client's batch plan in a round: distinct per (run seed, round, partition).

    The ClientApp and the vectorized cohort backend both derive their plans from it, so the
    two train on the same batches.
    """
    return run_seed * 1_000_003 + server_round * 1009 + partition_id
