"""Client side of hard FedGMA: the loss gradient of the last local step, from any training loop.

FedGMA's AND-mask (``mask="hard"``) needs, from every client, the gradient of its training loss at
its last local step (Tenison et al., 2021), sent as the ArrayRecord ``gradient`` keyed like the
model's trainable parameters. :func:`last_step_gradient` records it around a training loop the
user already has, without changing it::

    with last_step_gradient(model) as gradient:
        train(model, trainloader, epochs, lr)          # your own loop, unchanged
    content["gradient"] = gradient.record()

How: a hook on every trainable parameter (``register_post_accumulate_grad_hook``) copies
``param.grad`` into a buffer of its own each time backward has finished accumulating it, so what
remains when the loop ends is the gradient of the last backward pass, as backward left it in
``.grad``: before gradient clipping or the optimizer's weight decay and momentum, and the sum over
micro-batches when the loop accumulates several backward passes per step. The hooks are removed
when the ``with`` block ends, and the model is not changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import nn


class LastStepGradient:
    """The gradient each trainable parameter had after the last backward pass that reached it."""

    def __init__(self, model: nn.Module) -> None:
        self.parameters = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self.parameters:
            raise ValueError(
                "last_step_gradient(model): the model has no trainable parameter (requires_grad)"
            )
        self.gradients: dict[str, torch.Tensor] = {}

    def attach(self) -> list[torch.utils.hooks.RemovableHandle]:
        """Hook every watched parameter; remove the returned handles to stop recording."""
        return [
            parameter.register_post_accumulate_grad_hook(self._copier(name))  # type: ignore[no-untyped-call]
            for name, parameter in self.parameters.items()
        ]

    def _copier(self, name: str) -> Callable[[torch.Tensor], None]:
        def copy_gradient(parameter: torch.Tensor) -> None:
            if parameter.grad is None:
                return
            stored = self.gradients.get(name)
            if stored is None or stored.shape != parameter.grad.shape:
                self.gradients[name] = parameter.grad.detach().clone()
            else:  # one buffer per parameter, reused every step
                stored.copy_(parameter.grad.detach())

        return copy_gradient

    def tensors(self) -> dict[str, torch.Tensor]:
        """The recorded gradients, keyed like ``named_parameters``; zeros for a parameter that
        never received one (unused in the forward pass).

        Raises
        ------
        RuntimeError
            When no backward pass ran inside the ``with last_step_gradient(model)`` block.
        """
        if not self.gradients:
            raise RuntimeError(
                "last_step_gradient recorded no gradient: run the training loop (its "
                "loss.backward()) inside the `with last_step_gradient(model) as gradient:` block"
            )
        return {
            name: self.gradients.get(name, torch.zeros_like(parameter.detach()))
            for name, parameter in self.parameters.items()
        }

    def record(self) -> ArrayRecord:
        """The ArrayRecord to send as ``content["gradient"]``: CPU float32 arrays."""
        return ArrayRecord(
            {
                name: Array(np.asarray(value.detach().cpu().float().numpy(), order="C"))
                for name, value in self.tensors().items()
            }
        )


@contextmanager
def last_step_gradient(model: nn.Module) -> Iterator[LastStepGradient]:
    """Record the last local step's loss gradient of ``model`` while the block runs.

    Parameters
    ----------
    model : torch.nn.Module
        The model the block trains; its trainable parameters are watched.

    Yields
    ------
    LastStepGradient
        After the block, ``.record()`` gives the ArrayRecord ``gradient`` that hard FedGMA needs.
    """
    gradient = LastStepGradient(model)
    handles = gradient.attach()
    try:
        yield gradient
    finally:
        for handle in handles:
            handle.remove()
