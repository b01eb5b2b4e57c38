"""Client side of Elastic aggregation: parameter sensitivity, its moving average and its upload.

The sensitivity Omega of a parameter element measures how much the model's output moves when that
element moves, without labels (Chen et al., CVPR 2023): for every batch x,
loss = (1/B) sum_b ||f(x_b)||^2 and Omega <- decay * Omega + (1 - decay) * |d loss / d theta|.
The authors' code uses ``mse_loss(f(x), 0)``, the same loss divided by the number of outputs; that
constant factor cancels in the server's zeta = 1 + tau - Omega / max(Omega).

Two entry points:

- :func:`compute_sensitivity`: the math, on any ``torch.nn.Module`` and iterable of batches;
- :func:`sensitivity_record`: what a ClientApp calls on the received global model before local
  training. It reads the decay and the upload dtype from the train config, keeps the moving average
  in ``context.state`` across the rounds the node joins, and returns the ArrayRecord to send as
  ``content["sensitivity"]``. This project's ClientApp uses it, and so can anyone else's.

How the model is left untouched: the authors run the pass in train mode (BatchNorm then normalises
with batch statistics and moves its running statistics, dropout is active). We keep train mode for
the forward pass but run it with :func:`torch.func.functional_call` on *copies* of the parameters
and buffers, take gradients with :func:`torch.autograd.grad` (never ``.backward()``, so ``.grad``
stays as it was), restore every submodule's train/eval flag afterwards, and fork the random number
generators so that dropout draws here do not change the local training that follows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message
from flwr.common import log
from torch import nn

from beyond_averaging.tasks.batch_format import BatchFormatError
from beyond_averaging.tasks.batch_format import batch_inputs as find_inputs
from beyond_averaging.tasks.protocol import (
    CONFIG_RECORD,
    SENSITIVITY_DECAY_KEY,
    SENSITIVITY_DTYPE_KEY,
)

#: The paper's moving-average decay (the authors' code).
DEFAULT_DECAY = 0.9
#: Key of the moving average in ``context.state`` (kept in float32, whatever the upload dtype).
STATE_KEY = "elastic-sensitivity"
UPLOAD_DTYPES: Mapping[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
}
_FLOAT16_MAX = float(np.finfo(np.float16).max)


def batch_inputs(batch: Any) -> torch.Tensor:
    """The model input of a batch: a tensor, the first item of a tuple, or a dict's input.

    The rule is :func:`tasks.batch_format.batch_inputs` (a dict: its ``"img"``, ``"image"``,
    ``"pixel_values"``, ``"x"``, ... key, else its only floating tensor of rank >= 2).

    Raises
    ------
    TypeError
        When the rule cannot tell the input; the message names ``input_of=``.
    """
    try:
        return find_inputs(batch)
    except BatchFormatError as error:
        raise TypeError(
            f"{error}. Pass input_of=lambda batch: <its input tensor>, e.g. batch['img']"
        ) from None


def trainable_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that get a sensitivity (``requires_grad``), keyed like ``state_dict``."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def mismatch(previous: Mapping[str, torch.Tensor], parameters: Mapping[str, torch.Tensor]) -> str:
    """Why ``previous`` cannot continue for these parameters ("" when it can)."""
    if set(previous) != set(parameters):
        return (
            f"previous sensitivity has keys {sorted(previous)[:5]}, the model's trainable "
            f"parameters are {sorted(parameters)[:5]}"
        )
    for name, value in previous.items():
        if tuple(value.shape) != tuple(parameters[name].shape):
            return (
                f"previous sensitivity {name!r} has shape {tuple(value.shape)}, the parameter "
                f"{tuple(parameters[name].shape)}"
            )
    return ""


def compute_sensitivity(
    model: nn.Module,
    batches: Iterable[Any],
    previous: Mapping[str, torch.Tensor] | None = None,
    decay: float = DEFAULT_DECAY,
    *,
    input_of: Callable[[Any], torch.Tensor] = batch_inputs,
) -> dict[str, torch.Tensor]:
    """Parameter sensitivity of ``model`` over ``batches``, as an exponential moving average.

    For each batch x: loss = mean over the batch of ||f(x)||^2 (labels unused), then per element
    ``Omega <- decay * Omega + (1 - decay) * |d loss / d theta|``, starting from ``previous``
    (zeros when None). Runs in train mode, like the authors' code, and leaves the model exactly as
    found: parameters, buffers (BatchNorm running statistics), ``.grad`` and train/eval flags.

    Parameters
    ----------
    model : torch.nn.Module
        The received global model (not yet trained locally).
    batches : Iterable
        Batches of inputs, (features, labels) tuples or dicts (see :func:`batch_inputs`); moved
        to the model's device.
    previous : Mapping[str, torch.Tensor], optional
        The moving average of the rounds before, keyed like the trainable parameters.
    decay : float
        Moving-average decay in [0, 1) (paper: 0.9).
    input_of : Callable, optional
        Extracts the input tensor from a batch (default: :func:`batch_inputs`).

    Returns
    -------
    dict[str, torch.Tensor]
        One float32 tensor per trainable parameter, shaped like it, on the model's device.

    Raises
    ------
    ValueError
        For a decay outside [0, 1), or a ``previous`` that does not match the model.
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"sensitivity decay = {decay}: allowed is [0, 1) (the paper uses 0.9)")
    parameters = trainable_parameters(model)
    reason = mismatch(previous, parameters) if previous is not None else ""
    if reason:
        raise ValueError(f"{reason}: it belongs to another model")
    device = next(iter(parameters.values())).device if parameters else torch.device("cpu")
    average = {
        name: (
            previous[name].detach().to(device=device, dtype=torch.float32).clone()
            if previous is not None
            else torch.zeros(p.shape, dtype=torch.float32, device=device)
        )
        for name, p in parameters.items()
    }
    # Copies: BatchNorm updates its running statistics in place on these, not on the model.
    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    leaves = {name: state[name].requires_grad_(True) for name in parameters}
    modes = {name: module.training for name, module in model.named_modules()}
    forked = [device.index or 0] if device.type == "cuda" else []
    try:
        model.train()
        with torch.random.fork_rng(devices=forked), torch.enable_grad():
            for batch in batches:
                inputs = input_of(batch).to(device)
                output = torch.func.functional_call(model, state, (inputs,))
                loss = output.pow(2).flatten(start_dim=1).sum(dim=1).mean()
                grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
                for (name, leaf), grad in zip(leaves.items(), grads, strict=True):
                    magnitude = grad.abs() if grad is not None else torch.zeros_like(leaf)
                    average[name].mul_(decay).add_(magnitude.float(), alpha=1.0 - decay)
    finally:
        for name, module in model.named_modules():
            module.training = modes[name]  # per module: train() would overwrite children
    return average


def to_upload(sensitivity: Mapping[str, torch.Tensor], dtype: str) -> ArrayRecord:
    """The ArrayRecord to send: CPU numpy arrays in ``dtype`` ("float32" or "float16").

    A float16 upload halves the bytes; only the relative size of elements within a tensor
    matters to the server. A tensor with values beyond float16's range (65504) is sent in float32
    rather than clipped, with a warning, so the server never sees a distorted ratio.
    """
    if dtype not in UPLOAD_DTYPES:
        raise ValueError(f"sensitivity dtype {dtype!r}: use one of {sorted(UPLOAD_DTYPES)}")
    arrays: dict[str, Array] = {}
    for name, value in sensitivity.items():
        values = value.detach().cpu().float().numpy()
        target = UPLOAD_DTYPES[dtype]
        if target == np.float16 and values.size and float(values.max()) > _FLOAT16_MAX:
            log(WARNING, "sensitivity %r exceeds float16's range: sent as float32", name)
            target = np.dtype(np.float32)
        arrays[name] = Array(np.asarray(values.astype(target), order="C"))  # keeps 0-d shapes
    return ArrayRecord(arrays)


def _stored(context: Context) -> dict[str, torch.Tensor] | None:
    record = context.state.array_records.get(STATE_KEY)
    if record is None:
        return None
    return {name: torch.from_numpy(array.numpy().copy()) for name, array in record.items()}


def sensitivity_record(
    model: nn.Module,
    batches: Iterable[Any],
    message: Message,
    context: Context,
    *,
    input_of: Callable[[Any], torch.Tensor] = batch_inputs,
) -> ArrayRecord:
    """This round's ``sensitivity`` record; call it on the received model before training.

    Reads ``sensitivity-decay`` and ``sensitivity-dtype`` from the message's ``config`` record,
    or its only ConfigRecord (defaults: 0.9 and float32), continues the moving average stored in
    ``context.state`` from the rounds this node joined before, stores the new average there
    (float32), and returns it in the upload dtype, keyed like the model's trainable parameters.

    Recipe for any Flower ClientApp (docs/elastic.md, "Use in an existing Flower app")::

        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        sensitivity = sensitivity_record(model, trainloader, msg, context)  # before training
        ...train the model, build the reply content as usual...
        content["sensitivity"] = sensitivity
    """
    records = message.content.config_records
    # The ConfigRecord named "config", or the message's only one (a strategy's configrecord_key).
    only = next(iter(records.values())) if len(records) == 1 else ConfigRecord()
    config = records.get(CONFIG_RECORD, only)
    decay = float(config.get(SENSITIVITY_DECAY_KEY, DEFAULT_DECAY))  # type: ignore[arg-type]
    dtype = str(config.get(SENSITIVITY_DTYPE_KEY, "float32"))
    previous = _stored(context)
    reason = mismatch(previous, trainable_parameters(model)) if previous is not None else ""
    if reason:  # a node reused with another model: the old average means nothing for this one
        log(WARNING, "%s: starting a new sensitivity average", reason)
        previous = None
    sensitivity = compute_sensitivity(model, batches, previous, decay, input_of=input_of)
    context.state[STATE_KEY] = to_upload(sensitivity, "float32")
    return to_upload(sensitivity, dtype)
