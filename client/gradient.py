"""Client side of hard FedGMA: the loss gradient of the last local step, from any training loop.

FedGMA's AND-mask (``mask="hard"``) needs, from every client, the gradient of its training loss at
its last local step (Tenison et al., 2021), sent as the ArrayRecord ``gradient`` keyed like the
model's trainable parameters. :func:`last_step_gradient` records it around a training call or loop
the user already has, without changing it. Wrapping the call changes one line::

    train_loss, gradient = last_step_gradient.wrap(train_fn)(model, trainloader, epochs, lr)
    content["gradient"] = gradient

and the ``with`` form wraps any block of code::

    with last_step_gradient(model) as gradient:
        train(model, trainloader, epochs, lr)          # your own loop, unchanged
    content["gradient"] = gradient.record()

How: a hook on every trainable parameter (``register_post_accumulate_grad_hook``) copies
``param.grad`` into a buffer of its own each time backward has finished accumulating it, so what
remains when the loop ends is the gradient of the last backward pass, as backward left it in
``.grad``: before gradient clipping or the optimizer's weight decay and momentum, and the sum over
micro-batches when the loop accumulates several backward passes per step. The hooks are removed
when the call or the ``with`` block ends, and the model is not changed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import ParamSpec, TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import nn

P = ParamSpec("P")
R = TypeVar("R")


class LastStepGradient:
    """The gradient each trainable parameter had after the last backward pass that reached it.

    A context manager: ``with last_step_gradient(model) as gradient:`` records while the block
    runs; :meth:`wrap` records around one call of a training function.

    Parameters
    ----------
    model : torch.nn.Module
        The model being trained; its trainable parameters are watched.
    """

    def __init__(self, model: nn.Module) -> None:
        self.parameters = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self.parameters:
            raise ValueError(
                "last_step_gradient(model): the model has no trainable parameter (requires_grad)"
            )
        self.gradients: dict[str, torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> LastStepGradient:
        self._handles.extend(self.attach())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @staticmethod
    def wrap(
        train: Callable[P, R], model: nn.Module | None = None
    ) -> Callable[P, tuple[R, ArrayRecord]]:
        """``train`` that also returns the gradient record of its last backward pass.

        The wrapped function takes ``train``'s arguments and returns ``(what train returned,
        the ArrayRecord 'gradient')``, so hard FedGMA's client side is a change of the line that
        calls the training function, not a block to indent around it::

            train_loss, gradient = last_step_gradient.wrap(train_fn)(model, trainloader, ...)

        Parameters
        ----------
        train : Callable
            The training function, called once per call of the wrapper with its arguments.
        model : torch.nn.Module, optional
            The model to watch. By default the one ``torch.nn.Module`` among the call's
            arguments; pass it when the call has none (the model is a global, or a closure's) or
            several.

        Raises
        ------
        TypeError
            When ``model`` is not given and the call's arguments hold no module, or several.
        """

        @functools.wraps(train)
        def recorded(*args: P.args, **kwargs: P.kwargs) -> tuple[R, ArrayRecord]:
            watched = model if model is not None else _the_module_among(train, args, kwargs)
            with LastStepGradient(watched) as gradient:
                result = train(*args, **kwargs)
            return result, gradient.record()

        return recorded

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
            When no backward pass ran inside the ``with last_step_gradient(model)`` block (or
            the wrapped call).
        """
        if not self.gradients:
            raise RuntimeError(
                "last_step_gradient recorded no gradient: run the training loop (its "
                "loss.backward()) inside the `with last_step_gradient(model) as gradient:` block, "
                "or call a function that trains through last_step_gradient.wrap(train_fn)"
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


def _the_module_among(
    train: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
) -> nn.Module:
    """The one distinct ``nn.Module`` among a call's arguments (:meth:`LastStepGradient.wrap`)."""
    modules: list[nn.Module] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, nn.Module) and all(value is not m for m in modules):
            modules.append(value)
    if len(modules) == 1:
        return modules[0]
    name = getattr(train, "__name__", repr(train))
    found = "no torch.nn.Module" if not modules else f"{len(modules)} torch.nn.Modules"
    raise TypeError(
        f"last_step_gradient.wrap({name}): the call's arguments hold {found}, so the model to "
        f"watch is not known; name it: last_step_gradient.wrap({name}, model=model)"
    )


#: ``with last_step_gradient(model) as gradient: ...`` then ``gradient.record()``, or
#: ``result, gradient = last_step_gradient.wrap(train_fn)(...)``: the one class, under the name
#: the recipes use (docs/fedgma.md).
last_step_gradient = LastStepGradient
