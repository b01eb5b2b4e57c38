"""Elastic: a parameter the forward pass never uses gets zero sensitivity, hence zeta = 1 + tau."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from beyond_averaging.client.sensitivity import compute_sensitivity
from beyond_averaging.strategies.elastic import aggregate_elastic


class WithUnusedHead(nn.Module):
    """A linear model with a second head that ``forward`` never calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(3, 2)
        self.unused = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_unused_parameter_has_zero_sensitivity_and_gets_the_largest_boost() -> None:
    model = WithUnusedHead()
    batches = [
        (torch.randn(8, 3, generator=torch.Generator().manual_seed(i)), None) for i in (1, 2)
    ]
    sensitivity = compute_sensitivity(model, batches, decay=0.9)
    assert torch.count_nonzero(sensitivity["unused.weight"]) == 0
    assert torch.count_nonzero(sensitivity["unused.bias"]) == 0
    assert torch.count_nonzero(sensitivity["used.weight"]) > 0

    tau = 0.3
    global_state = {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    clients = [{k: v - rng.normal(size=v.shape) for k, v in global_state.items()} for _ in range(2)]
    omega = [{k: v.numpy() for k, v in sensitivity.items()}] * 2
    new = aggregate_elastic(global_state, clients, omega, [1.0, 1.0], tau=tau)
    mean_update = {k: global_state[k] - (clients[0][k] + clients[1][k]) / 2 for k in global_state}
    # zeta = 1 + tau - 0 / (0 + 1e-13) = 1 + tau on every element of the unused tensors
    for key in ("unused.weight", "unused.bias"):
        np.testing.assert_allclose(
            new[key], global_state[key] - (1 + tau) * mean_update[key], rtol=1e-12
        )
    # a used tensor's largest-sensitivity element gets zeta = tau (the smallest step)
    largest = np.unravel_index(np.argmax(omega[0]["used.weight"]), omega[0]["used.weight"].shape)
    assert new["used.weight"][largest] == pytest.approx(
        global_state["used.weight"][largest] - tau * mean_update["used.weight"][largest]
    )
