"""The batch plan (tasks.batching) against the seeded shuffling DataLoader it replaces."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from beyond_averaging.tasks.batching import epoch_orders, shuffled_batches


def dataloader_batches(
    num_samples: int, batch_size: int, epochs: int, seed: int
) -> list[torch.Tensor]:
    """Positions of the samples in each batch of a real DataLoader, epoch after epoch.

    Built like the ClientApp's loader before the fast path: one DataLoader with a seeded
    generator, iterated once per local epoch.
    """
    dataset = TensorDataset(torch.arange(num_samples))
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=0,
    )
    return [positions for _ in range(epochs) for (positions,) in loader]


@pytest.mark.parametrize(
    ("num_samples", "batch_size", "epochs", "seed"),
    [
        (10, 4, 3, 0),  # partial last batch
        (12, 4, 2, 7),  # batch size divides the data
        (1, 128, 2, 3),  # one sample
        (5, 128, 1, 11),  # batch larger than the data
        (300, 32, 5, 1_000_003 * 8 + 1009 * 3 + 17),  # a ClientApp-style seed
        (1000, 1000, 4, 42),  # one batch per epoch: the tail permutation still advances
    ],
)
def test_shuffled_batches_match_the_seeded_dataloader_step_for_step(
    num_samples: int, batch_size: int, epochs: int, seed: int
) -> None:
    expected = dataloader_batches(num_samples, batch_size, epochs, seed)
    planned = shuffled_batches(num_samples, batch_size, epochs, seed)
    assert len(planned) == len(expected)
    for step, (plan, reference) in enumerate(zip(planned, expected, strict=True)):
        assert torch.equal(plan, reference), f"step {step} differs"
        assert plan.dtype == torch.int64


def test_each_epoch_order_is_a_fresh_permutation_of_all_samples() -> None:
    orders = epoch_orders(50, 3, seed=5)
    assert orders.shape == (3, 50)
    for order in orders:
        assert torch.equal(order.sort().values, torch.arange(50))
    assert not torch.equal(orders[0], orders[1])
    assert torch.equal(epoch_orders(50, 3, seed=5), orders)
    assert not torch.equal(epoch_orders(50, 3, seed=6), orders)


def test_zero_epochs_give_no_steps() -> None:
    assert shuffled_batches(10, 4, 0, seed=0) == []


@pytest.mark.parametrize(
    ("num_samples", "batch_size", "epochs", "message"),
    [(0, 4, 1, "num_samples"), (10, 0, 1, "batch_size"), (10, 4, -1, "epochs")],
)
def test_bad_plan_arguments_name_the_value(
    num_samples: int, batch_size: int, epochs: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        shuffled_batches(num_samples, batch_size, epochs, seed=0)
