"""Local training of a client: SGD with momentum and weight decay, optional FedProx term.

The batches are cut by index from tensors that already live on the training device
(:class:`tasks.evaluation.DeviceData`), in the order of a batch plan
(:func:`tasks.batching.shuffled_batches`). The loop never waits for the device: the loss is
summed on the device and read once at the end, so on CUDA the host queues steps ahead of the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.sgd import sgd as sgd_update

from beyond_averaging.tasks.evaluation import DeviceData


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
    data: DeviceData,
    plan: Sequence[torch.Tensor],
    *,
    learning_rate: float,
    momentum: float,
    weight_decay: float,
    proximal_mu: float = 0.0,
    keep_last_gradient: bool = False,
) -> TrainResult:
    """Train ``model`` in place, one SGD step per index batch of ``plan``.

    With ``proximal_mu > 0`` the loss gains FedProx's (mu / 2) * ||w - w_received||^2, where
    w_received are the parameters the model had on entry.

    Parameters
    ----------
    model : torch.nn.Module
        The received model; moved to ``data``'s device.
    data : DeviceData
        The partition, on the training device.
    plan : Sequence[torch.Tensor]
        Sample positions of every step, all local epochs in a row (e.g.
        ``shuffled_batches(len(data), batch_size, epochs, seed)``).
    learning_rate, momentum, weight_decay : float
        ``torch.optim.SGD``'s settings.
    proximal_mu : float
        FedProx's mu (0: plain SGD).
    keep_last_gradient : bool
        Return the last step's loss gradient (before its update).

    Returns
    -------
    TrainResult
        ``mean_loss`` averages the per-step mean loss weighted by the step's batch size;
        ``num_examples`` is the partition's size.
    """
    device = data.device
    model.to(device)
    model.train()
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    parameters = list(model.parameters())
    momentum_buffers: list[torch.Tensor | None] = [None] * len(parameters)
    criterion = nn.CrossEntropyLoss()
    # One host-to-device copy of the whole plan instead of one per step.
    sizes = [int(batch.shape[0]) for batch in plan]
    steps = torch.split(torch.cat(list(plan)).to(device), sizes) if plan else ()
    # float64 on the device: the same precision as the Python float sum it replaces.
    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    last_gradient: dict[str, torch.Tensor] | None = None
    for step, positions in enumerate(steps):
        features, labels = data.features[positions], data.labels[positions]
        for parameter in parameters:
            parameter.grad = None
        loss = criterion(model(features), labels)
        objective = loss
        if anchor:
            drift = sum(
                torch.sum((p - a) ** 2) for p, a in zip(model.parameters(), anchor, strict=True)
            )
            objective = loss + 0.5 * proximal_mu * drift
        objective.backward()
        if keep_last_gradient and step == len(sizes) - 1:
            last_gradient = {
                name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                for name, p in model.named_parameters()
            }
        _sgd_step(parameters, momentum_buffers, learning_rate, momentum, weight_decay)
        total_loss += loss.detach().double() * sizes[step]
    seen = sum(sizes)
    return TrainResult(
        mean_loss=float(total_loss) / max(seen, 1),
        num_examples=len(data),
        steps=len(sizes),
        last_gradient=last_gradient,
    )


def _sgd_step(
    parameters: list[nn.Parameter],
    momentum_buffers: list[torch.Tensor | None],
    learning_rate: float,
    momentum: float,
    weight_decay: float,
) -> None:
    """One ``torch.optim.SGD(lr, momentum, weight_decay).step()``, through its own update function.

    ``SGD.step`` calls this same ``torch.optim.sgd.sgd`` on the parameters that have a gradient
    (with their momentum buffers), so the update is the optimizer's to the bit; but constructing
    an optimizer imports ``torch._dynamo`` (with SymPy, about 800 modules and 70 MB), which
    every ClientApp process of a deployment, started afresh per message, would pay.
    """
    live = [index for index, parameter in enumerate(parameters) if parameter.grad is not None]
    params: list[torch.Tensor] = [parameters[index] for index in live]
    grads = [parameter.grad for parameter in params if parameter.grad is not None]
    # As SGD._init_group: momentum buffers are passed only when momentum is used.
    buffers = [momentum_buffers[index] for index in live] if momentum != 0 else []
    with torch.no_grad():
        sgd_update(
            params,
            grads,
            buffers,
            has_sparse_grad=any(grad.is_sparse for grad in grads),
            weight_decay=weight_decay,
            momentum=momentum,
            lr=learning_rate,
            dampening=0.0,
            nesterov=False,
            maximize=False,
        )
    if momentum != 0:
        for index, buffer in zip(live, buffers, strict=True):
            momentum_buffers[index] = buffer
