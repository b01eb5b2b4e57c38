"""Local training steps exactly as ``torch.optim.SGD`` does, without constructing an optimizer.

Constructing ``torch.optim.SGD`` imports ``torch._dynamo`` (SymPy included: ~70 MB and seconds
in every ClientApp process of a deployment, see docs/results/load.md). ``train_local`` calls
the optimizer's own update function instead; these tests hold it to the optimizer's results
bit for bit and check that the import is gone.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from beyond_averaging.tasks.batching import shuffled_batches
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import DeviceData
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.training import train_local

CPU = torch.device("cpu")


def optimizer_training(
    model: nn.Module,
    data: LabeledData,
    plan: list[torch.Tensor],
    *,
    learning_rate: float,
    momentum: float,
    weight_decay: float,
    proximal_mu: float,
) -> None:
    """The same steps on the same batches, with ``torch.optim.SGD`` doing the update."""
    model.train()
    anchor = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(
        model.parameters(), lr=learning_rate, momentum=momentum, weight_decay=weight_decay
    )
    features, labels = torch.from_numpy(data.features), torch.from_numpy(data.labels)
    for positions in plan:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.CrossEntropyLoss()(model(features[positions]), labels[positions])
        objective = loss
        if proximal_mu > 0:
            drift = sum(
                torch.sum((p - a) ** 2) for p, a in zip(model.parameters(), anchor, strict=True)
            )
            objective = loss + 0.5 * proximal_mu * drift
        objective.backward()
        optimizer.step()


@pytest.mark.parametrize(
    ("model_name", "momentum", "weight_decay", "proximal_mu"),
    [("mlp", 0.9, 1e-3, 0.0), ("mlp", 0.0, 0.0, 0.0), ("cnn", 0.5, 1e-4, 0.1)],
)
def test_local_training_equals_torch_sgd_bit_for_bit(
    model_name: str, momentum: float, weight_decay: float, proximal_mu: float
) -> None:
    rng = np.random.default_rng(4)
    data = LabeledData(
        rng.random((45, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 45).astype(np.int64), 10
    )
    plan = shuffled_batches(len(data), 8, 2, 11)
    trained = build_model(model_name, (1, 8, 8), 10, seed=2)  # type: ignore[arg-type]
    reference = build_model(model_name, (1, 8, 8), 10, seed=2)  # type: ignore[arg-type]
    train_local(
        trained,
        DeviceData.from_labeled(data, CPU),
        plan,
        learning_rate=0.05,
        momentum=momentum,
        weight_decay=weight_decay,
        proximal_mu=proximal_mu,
    )
    optimizer_training(
        reference,
        data,
        list(plan),
        learning_rate=0.05,
        momentum=momentum,
        weight_decay=weight_decay,
        proximal_mu=proximal_mu,
    )
    for (name, value), expected in zip(
        trained.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(value, expected), name
    untouched = build_model(model_name, (1, 8, 8), 10, seed=2)  # type: ignore[arg-type]
    first = next(iter(untouched.state_dict()))
    assert not torch.equal(trained.state_dict()[first], untouched.state_dict()[first])


def test_local_training_does_not_import_torch_dynamo() -> None:
    script = (
        "import sys, numpy as np, torch\n"
        "from beyond_averaging.tasks.training import train_local\n"
        "from beyond_averaging.tasks.batching import shuffled_batches\n"
        "from beyond_averaging.tasks.datasets import LabeledData\n"
        "from beyond_averaging.tasks.evaluation import DeviceData\n"
        "from beyond_averaging.tasks.models import build_model\n"
        "data = LabeledData(np.ones((20, 1, 8, 8), np.float32), np.arange(20) % 10, 10)\n"
        "model = build_model('mlp', (1, 8, 8), 10, seed=0)\n"
        "train_local(model, DeviceData.from_labeled(data, torch.device('cpu')),\n"
        "            shuffled_batches(20, 4, 1, 0), learning_rate=0.1, momentum=0.9,\n"
        "            weight_decay=0.0)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    assert result.stdout.strip().splitlines()[-1] == "False"
