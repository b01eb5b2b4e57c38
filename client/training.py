"""Local training of a client: SGD with momentum and weight decay, optional FedProx term."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader


@dataclass(frozen=True)
class TrainResult:
    """What local training reports back.

    ``last_gradient`` is the gradient of the training loss at the last local step, taken before
    that step's update, keyed like ``named_parameters`` (FedGMA sends it); None unless asked for.
    """

    mean_loss: float
    num_examples: int
    steps: int
    last_gradient: dict[str, torch.Tensor] | None = None


def train_local(
    model: nn.Module,
    loader: DataLoader[tuple[torch.Tensor, ...]],
    *,
    epochs: int,
    learning_rate: float,
    momentum: float,
    weight_decay: float,
    device: torch.device,
    proximal_mu: float = 0.0,
    keep_last_gradient: bool = False,
) -> TrainResult:
    """Train ``model`` in place for ``epochs`` passes over ``loader``.

    With ``proximal_mu > 0`` the loss gains FedProx's (mu / 2) * ||w - w_received||^2, where
    w_received are the parameters the model had on entry.
    """
    model.to(device)
    model.train()
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    optimizer = torch.optim.SGD(
        model.parameters(), lr=learning_rate, momentum=momentum, weight_decay=weight_decay
    )
    criterion = nn.CrossEntropyLoss()
    total_loss, seen, steps = 0.0, 0, 0
    last_gradient: dict[str, torch.Tensor] | None = None
    for _ in range(epochs):
        for features, labels in loader:
            features, labels = features.to(device), labels.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(features), labels)
            objective = loss
            if anchor:
                drift = sum(
                    torch.sum((p - a) ** 2) for p, a in zip(model.parameters(), anchor, strict=True)
                )
                objective = loss + 0.5 * proximal_mu * drift
            objective.backward()
            if keep_last_gradient:  # overwritten each step: what remains is the last step's
                last_gradient = {
                    name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                    for name, p in model.named_parameters()
                }
            optimizer.step()
            total_loss += float(loss.detach()) * labels.shape[0]
            seen += int(labels.shape[0])
            steps += 1
    return TrainResult(
        mean_loss=total_loss / max(seen, 1),
        num_examples=seen // max(epochs, 1),
        steps=steps,
        last_gradient=last_gradient,
    )
