"""Vectorized cohort training's memory, counted in bytes of torch's CPU allocator (not timed).

:func:`client.memory.torch_allocations` records every tensor allocation and free
with the allocator's running total, so the peak is exact and the same on any machine. The
models here are wide and the batches tiny, so the parameter-shaped tensors dominate and the
bounds are the training state counted from the shapes: one step's gradients, plus SGD's momentum
buffer when momentum is on, plus FedGMA's last-step gradient when kept. A gradient that outlived
its step (as one did before) would add a copy and fail these bounds.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from beyond_averaging.client.memory import peak_above_start, torch_allocations
from beyond_averaging.client.vectorized import StepPlan, sensitivity_stacked, train_stacked

CLIENTS, BATCH, STEPS, INPUTS, WIDTH, CLASSES = 3, 2, 4, 16, 256, 4
# Batch-sized tensors (inputs, activations, losses) and the allocator's small blocks: far below
# 5 % of a cohort copy at these shapes (3 x 2 x 256 floats per activation against 3 x 70k weights).
SLACK = 0.05


def wide_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(INPUTS, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4)
    )


def cohort_copy_bytes(model: nn.Module) -> int:
    """Bytes of one float32 copy of every client's parameters, from the shapes alone."""
    per_client = INPUTS * WIDTH + WIDTH + WIDTH * WIDTH + WIDTH + WIDTH * CLASSES + CLASSES
    assert per_client == sum(p.numel() for p in model.parameters())
    return CLIENTS * per_client * 4


def cohort() -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor, StepPlan]:
    """Stacked parameters, data and a plan of STEPS full batches per client (made beforehand)."""
    generator = torch.Generator().manual_seed(0)
    model = wide_model()
    parameters = {
        name: value.detach().unsqueeze(0).repeat(CLIENTS, *([1] * value.dim())).contiguous()
        for name, value in model.named_parameters()
    }
    rows = CLIENTS * STEPS * BATCH
    features = torch.randn(rows, INPUTS, generator=generator)
    labels = torch.randint(0, CLASSES, (rows,), generator=generator)
    batches = [
        list(torch.split(torch.arange(client * STEPS * BATCH, (client + 1) * STEPS * BATCH), BATCH))
        for client in range(CLIENTS)
    ]
    return model, parameters, features, labels, StepPlan.from_batches(batches, BATCH)


@pytest.mark.parametrize(
    ("momentum", "keep_last_gradient", "state_copies"),
    [(0.0, False, 1), (0.9, False, 2), (0.9, True, 3)],
    ids=["gradient", "gradient+momentum", "gradient+momentum+last-gradient"],
)
def test_local_training_allocates_one_step_of_gradients_plus_the_optimiser_state_at_most(
    momentum: float, keep_last_gradient: bool, state_copies: int
) -> None:
    model, parameters, features, labels, plan = cohort()
    before = {name: value.clone() for name, value in parameters.items()}

    def train() -> None:
        train_stacked(
            model,
            parameters,
            features,
            labels,
            plan,
            learning_rate=0.1,
            momentum=momentum,
            weight_decay=1e-3,
            keep_last_gradient=keep_last_gradient,
        )

    allocations = torch_allocations(train)
    copy_bytes = cohort_copy_bytes(model)
    assert any(not torch.equal(parameters[n], before[n]) for n in parameters)  # it trained
    peak = peak_above_start(allocations)
    assert peak >= (state_copies - 0.3) * copy_bytes  # the state is really there (and counted)
    assert peak <= (state_copies + SLACK) * copy_bytes


def test_sensitivity_pass_allocates_one_step_of_gradients_at_most() -> None:
    model, parameters, features, _, plan = cohort()
    previous = {name: torch.zeros_like(value) for name, value in parameters.items()}
    allocations = torch_allocations(
        lambda: sensitivity_stacked(model, parameters, features, plan, previous, 0.9)
    )
    copy_bytes = cohort_copy_bytes(model)
    assert any(bool(value.abs().sum() > 0) for value in previous.values())  # it ran
    assert (1 - 0.3) * copy_bytes <= peak_above_start(allocations) <= (1 + SLACK) * copy_bytes
