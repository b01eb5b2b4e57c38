"""LAW's weight learning: a shrink factor and client weights fitted on a server proxy set.

The pure core of FedLAW (Li et al., ICML 2023; :mod:`strategies.fedlaw`) and of the
``proxy-weights`` defence (:class:`~strategies.defended.DefendedStrategy`), which both import it
from here: :func:`learn_aggregation_weights` fits gamma = exp(g) and lambda = softmax(a) to the
cross-entropy of gamma * sum_k lambda_k theta_k on the proxy batches (Adam, the authors' step
decay, or FedLAW (SWA)'s two stages with :func:`swa_learning_rates`), starting from FedAvg's
weights; :func:`weights_are_usable` says whether its result may build a model. The rule's own
model (:func:`strategies.fedlaw.aggregate_fedlaw`) and the Flower class stay in
:mod:`strategies.fedlaw`, whose docstring states the method and where it follows the authors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as functional
from torch import nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _NormBase

from beyond_averaging.strategies.defences.proxy_data import (
    ProxyBatch,
)
from beyond_averaging.strategies.replies.influence import read_only_tensor

from .aggregate import (
    as_numpy,
    normalise_weights,
    weighted_mean,
)

LearnWhat = Literal["both", "shrink", "clients"]
LEARN_CHOICES: tuple[str, ...] = get_args(LearnWhat)

# FedLAW (SWA)'s lambda stage, as the authors' server_funct.py runs it (constants of their code).
#: CosineAnnealingLR's period (fixed at 100 there, whatever the number of server epochs).
SWA_COSINE_T_MAX = 100
#: ``if epoch > swa_start``: lambda's logits are averaged at the end of every epoch after this one
#: (0-based; the 7th epoch is the first averaged), and the SWA schedule replaces the cosine one.
SWA_START_EPOCH = 5
#: SWALR's target learning rate, an absolute value there (10x the base 0.005; 5x CIFAR-10's 0.01).
SWA_LR = 0.05
#: SWALR's default annealing length (cosine), in epochs.
SWA_ANNEAL_EPOCHS = 10


# ----------------------------------------------------------------------------- weight learning
def norm_modules(model: nn.Module) -> list[tuple[str, _NormBase]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _NormBase)]


@contextmanager
def batch_statistics_mode(model: nn.Module) -> Iterator[None]:
    """Normalisation layers on batch statistics, everything else in eval mode; restored after."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        for _, norm in norm_modules(model):
            norm.train()
        yield
    finally:
        for module, training in modes:
            module.training = training


def _client_tensors(
    model: nn.Module,
    client_params: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    device: torch.device,
) -> dict[str, list[torch.Tensor]]:
    """Per tensor name, the K clients' tensors as torch tensors on ``device``.

    On the CPU in the model's dtype they are views of the received arrays (no copy: the
    read-only buffers of the replies are never written, hence the silenced warning); a stacked
    (K, *shape) tensor would cost one more model-sized buffer per client.
    """
    templates = dict(model.state_dict(keep_vars=False))
    tensors: dict[str, list[torch.Tensor]] = {}
    for name in names:
        template = templates[name]
        per_client = []
        for client in client_params:
            value = as_numpy(client[name])
            if value.shape != tuple(template.shape):
                raise ValueError(
                    f"client tensor '{name}' has shape {value.shape}, the model's is "
                    f"{tuple(template.shape)}"
                )
            tensor = read_only_tensor(value)
            per_client.append(tensor.to(device=device, dtype=template.dtype))
        tensors[name] = per_client
    return tensors


class _WeightedSum(torch.autograd.Function):
    """sum_k lambdas[k] * tensors[k], differentiable in ``lambdas`` only.

    The same value as ``tensordot(lambdas, stack(tensors), dims=1)`` without the stacked copy:
    the forward pass adds the K tensors into one output, the backward pass takes one dot product
    per client, d/d lambda_k = <grad, tensors[k]>.
    """

    @staticmethod
    def forward(ctx: Any, lambdas: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        total = torch.zeros_like(tensors[0])
        for weight, tensor in zip(lambdas.tolist(), tensors, strict=True):
            total.add_(tensor, alpha=weight)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tensors = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None, *(None for _ in tensors))
        flat = grad.reshape(-1)
        grad_lambdas = torch.stack([torch.dot(flat, tensor.reshape(-1)) for tensor in tensors])
        return (grad_lambdas, *(None for _ in tensors))


def weighted_sum(lambdas: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum_k lambdas[k] * tensors[k], differentiable in ``lambdas`` (see :class:`_WeightedSum`)."""
    total: torch.Tensor = _WeightedSum.apply(lambdas, *tensors)  # type: ignore[no-untyped-call]
    return total


def _check_inputs(
    model: nn.Module,
    client_params: Sequence[Mapping[str, Any]],
    data_weights: Sequence[float] | npt.NDArray[Any],
    *,
    epochs: int,
    lr: float,
    learn: str,
    swa: bool,
) -> None:
    if learn not in LEARN_CHOICES:
        raise ValueError(f"learn = {learn!r} is unknown: use one of {LEARN_CHOICES}")
    if swa and learn == "shrink":
        raise ValueError(
            "swa = True averages the client-weight logits, but learn = 'shrink' keeps the client "
            "weights fixed: use learn = 'both' or 'clients' with SWA, or swa = False"
        )
    if epochs < 0 or not lr >= 0.0:
        raise ValueError(f"epochs = {epochs} and lr = {lr}: both must be >= 0")
    if not client_params or len(client_params) != len(data_weights):
        raise ValueError(
            f"{len(client_params)} client models but {len(data_weights)} data weights: need "
            "one weight per client and at least one client"
        )
    expected = set(model.state_dict())
    for index, client in enumerate(client_params):
        missing = sorted(expected - set(client))
        if missing:
            raise ValueError(f"client {index} lacks model tensors {missing[:5]}")


def swa_learning_rates(lr: float, epochs: int) -> list[float]:
    """Adam's learning rate in each epoch of FedLAW (SWA)'s lambda stage, as the authors run it.

    Their loop steps ``CosineAnnealingLR(T_max=100)`` after epochs 0..5 and, from the end of
    epoch 6 on, ``SWALR(swa_lr=0.05)`` (cosine annealing over 10 epochs) instead. Closed form:

    - epoch 0: ``lr``;
    - epoch e in 1..6: ``lr * (1 + cos(pi * e / 100)) / 2``;
    - epoch 6 + k, k >= 1: ``0.05 * a_k + c * (1 - a_k)`` with ``c`` the rate of epoch 6 and
      ``a_k = (1 - cos(pi * min(k, 10) / 10)) / 2``, so 0.05 from epoch 16 on.

    Parameters
    ----------
    lr : float
        The base learning rate (``fedlaw-lr``; the authors' 0.005, 0.01 for CIFAR-10).
    epochs : int
        Epochs of the lambda stage.

    Returns
    -------
    list of float
        One rate per epoch.
    """
    rates: list[float] = []
    current = lr
    anchor = lr
    for epoch in range(epochs):
        rates.append(current)
        if epoch <= SWA_START_EPOCH:
            current = lr * (1.0 + math.cos(math.pi * (epoch + 1) / SWA_COSINE_T_MAX)) / 2.0
            anchor = current
        else:
            progress = min(epoch - SWA_START_EPOCH, SWA_ANNEAL_EPOCHS) / SWA_ANNEAL_EPOCHS
            share = (1.0 - math.cos(math.pi * progress)) / 2.0
            current = SWA_LR * share + anchor * (1.0 - share)
    return rates


def _adam_epochs(
    variables: Sequence[torch.Tensor],
    loss_of_batch: Any,
    proxy_batches: Sequence[ProxyBatch],
    *,
    epochs: int,
    lr: float,
    betas: tuple[float, float],
    lr_step: int,
    lr_gamma: float,
    epoch_rates: Sequence[float] | None = None,
    after_epoch: Any = None,
) -> bool:
    """Adam over ``variables``; False when the proxy loss became non-finite.

    The learning rate is ``lr`` with step decay (x ``lr_gamma`` every ``lr_step`` epochs), or
    ``epoch_rates[epoch]`` in each epoch when given (the SWA stage's schedule).
    ``after_epoch(epoch)`` runs at the end of every epoch.
    """
    if epochs == 0:
        return True
    optimizer = torch.optim.Adam(list(variables), lr=lr, betas=betas)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=lr_step, gamma=lr_gamma)
    for epoch in range(epochs):
        if epoch_rates is not None:
            for group in optimizer.param_groups:
                group["lr"] = epoch_rates[epoch]
        for features, labels in proxy_batches:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of_batch(features, labels)
            if not torch.isfinite(loss):
                return False
            loss.backward()
            optimizer.step()
        if after_epoch is not None:
            after_epoch(epoch)
        if epoch_rates is None:
            scheduler.step()
    return True


def learn_aggregation_weights(
    model: nn.Module,
    client_params: Sequence[Mapping[str, Any]],
    data_weights: Sequence[float] | npt.NDArray[Any],
    proxy_batches: Sequence[ProxyBatch],
    *,
    epochs: int,
    lr: float,
    learn: LearnWhat = "both",
    swa: bool = False,
    betas: tuple[float, float] = (0.5, 0.999),
    lr_step: int = 20,
    lr_gamma: float = 0.5,
    device: torch.device | None = None,
    running_buffers: Mapping[str, torch.Tensor] | None = None,
    scales: Sequence[float] | npt.NDArray[Any] | None = None,
    global_params: Mapping[str, Any] | None = None,
) -> tuple[float, list[float]]:
    """Learn FedLAW's shrinking factor gamma and client weights lambda on the proxy set.

    Minimises ``CE(f(x; gamma * sum_k lambda_k theta_k), y)`` over the proxy batches with
    ``gamma = exp(g)``, ``lambda = softmax(a)``, starting at ``g = 0``, ``a = log p`` (FedAvg).
    The weighted model runs through :func:`torch.func.functional_call`, so only g and a receive
    gradients: ``model`` (its tensors and its train/eval flags) and the client tensors are left
    exactly as they were.

    Parameters
    ----------
    model : nn.Module
        The architecture (its own tensors are not used, only its structure).
    client_params : Sequence[Mapping[str, array]]
        Each client's full trained model (``state_dict`` keys; numpy arrays or torch tensors).
    data_weights : Sequence[float]
        The clients' example counts n_k (normalised here to p_k).
    proxy_batches : Sequence[tuple[Tensor, Tensor]]
        (features, labels) batches of the proxy set, visited in this order every epoch.
    epochs : int
        Server epochs (passes over ``proxy_batches``); 0 returns FedAvg's weights.
    lr : float
        Adam's initial learning rate; 0 returns FedAvg's weights.
    learn : {"both", "shrink", "clients"}
        Which factor is learned: both (FedLAW), gamma only (adaptive GWS, lambda = p) or lambda
        only (attentive LAW, gamma = 1).
    swa : bool
        FedLAW (SWA): lambda first, with stochastic weight averaging of its logits, then gamma
        with lambda fixed (see the module docstring). Needs ``learn`` "both" or "clients".
    betas : tuple of float
        Adam's betas (the paper's 0.5, 0.999).
    lr_step, lr_gamma : int, float
        The learning rate is multiplied by ``lr_gamma`` every ``lr_step`` epochs.
    device : torch.device, optional
        Where the learning runs; default the model's device.
    running_buffers : Mapping[str, torch.Tensor], optional
        Every buffer of the model, on ``device``: the server's own BatchNorm running statistics
        (``fedlaw-bn = "authors"``). Every forward pass updates them in place (momentum update,
        counter + 1), as the authors' train-mode server model does. Default: fresh tensors
        holding the clients' mean, left for the caller to discard.
    scales, global_params : optional
        Clipped clients (:func:`strategies.replies.influence.clip_scales`): client k's model counts
        as
        theta'_k = w + s_k (theta_k - w), w = ``global_params``, in place of theta_k. The sum
        sum_k lambda_k theta'_k is computed as sum_k lambda_k s_k theta_k +
        (sum_k lambda_k (1 - s_k)) w, differentiable in lambda, with no scaled copy of any model.

    Returns
    -------
    gamma : float
        exp(g); exactly 1.0 when g never moved. NaN when the proxy loss became non-finite.
    lambdas : list of float
        softmax(a), in the order of ``client_params``; exactly p when a never moved (softmax of
        log p is p, returned without round-off). NaN when the proxy loss became non-finite.
    """
    _check_inputs(model, client_params, data_weights, epochs=epochs, lr=lr, learn=learn, swa=swa)
    probabilities = normalise_weights(data_weights)
    fedavg_lambdas = probabilities.tolist()
    if epochs == 0 or lr == 0.0:
        return 1.0, fedavg_lambdas
    if not proxy_batches:
        raise ValueError("proxy_batches is empty: FedLAW needs at least one proxy batch")
    target = device if device is not None else next(model.parameters()).device
    parameter_names = [name for name, _ in model.named_parameters()]
    buffer_names = [name for name, _ in model.named_buffers()]
    clients = _client_tensors(model, client_params, parameter_names, target)
    dtype = clients[parameter_names[0]][0].dtype
    clipped = scales is not None and bool(np.any(np.asarray(scales) != 1.0))
    scale_vector = torch.ones(len(client_params), dtype=dtype, device=target)
    if clipped:
        if global_params is None:
            raise ValueError("scales need global_params (w), the point the updates are scaled to")
        scale_vector = torch.as_tensor(np.asarray(scales), dtype=dtype, device=target)
        reference = _client_tensors(model, [global_params], parameter_names, target)
        for name in parameter_names:
            clients[name] = [*clients[name], reference[name][0]]
    # BatchNorm in batch-statistics mode normalises with the batch's statistics and only
    # updates its running ones in place. By default those are FedAvg's mean of the clients'
    # values in fresh tensors (nothing reads them afterwards); in the authors' mode the caller's.
    if running_buffers is not None:
        buffers = dict(running_buffers)
    else:
        buffer_means = weighted_mean(client_params, probabilities, keys=buffer_names)
        buffers = {
            name: torch.from_numpy(np.array(value)).to(target)
            for name, value in buffer_means.items()
        }
    batches = [(features.to(target), labels.to(target)) for features, labels in proxy_batches]

    initial_logits = torch.log(torch.as_tensor(probabilities, dtype=dtype, device=target))
    log_gamma = torch.zeros((), dtype=dtype, device=target, requires_grad=True)
    logits = initial_logits.clone().requires_grad_(True)

    def loss_with(gamma_log: torch.Tensor, client_logits: torch.Tensor) -> Any:
        def loss_of_batch(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            scale = torch.exp(gamma_log)
            lambdas = torch.softmax(client_logits, dim=0)
            if clipped:  # lambda_k s_k per client, then the weight left to w
                lambdas = torch.cat(
                    [lambdas * scale_vector, (lambdas * (1.0 - scale_vector)).sum().reshape(1)]
                )
            weighted = {
                name: scale * weighted_sum(lambdas, clients[name]) for name in parameter_names
            }
            output = functional_call(model, {**weighted, **buffers}, (features,))
            return functional.cross_entropy(output, labels)

        return loss_of_batch

    def run(variables: list[torch.Tensor], loss_of_batch: Any, count: int, **phase: Any) -> bool:
        return _adam_epochs(
            variables,
            loss_of_batch,
            batches,
            epochs=count,
            lr=lr,
            betas=betas,
            lr_step=lr_step,
            lr_gamma=lr_gamma,
            **phase,
        )

    with batch_statistics_mode(model):
        if not swa:
            learned = {"both": [log_gamma, logits], "shrink": [log_gamma], "clients": [logits]}
            finite = run(learned[learn], loss_with(log_gamma, logits), epochs)
            final_logits = logits.detach()
        else:
            # Stage 1: lambda alone (gamma = 1) with SWA of its logits; stage 2: gamma alone.
            # The authors give each stage epochs // 2 epochs; "clients" has no gamma stage.
            client_epochs = epochs if learn == "clients" else epochs // 2
            # Their AveragedModel starts as a copy of the initial logits, replaced by the first
            # averaged value: a stage too short to average (<= 6 epochs) keeps FedAvg's lambda.
            averaged = initial_logits.clone()
            averaged_count = 0

            def average(epoch: int) -> None:
                nonlocal averaged, averaged_count
                if epoch > SWA_START_EPOCH:
                    averaged_count += 1
                    averaged = averaged + (logits.detach() - averaged) / averaged_count

            unit_gamma_log = torch.zeros((), dtype=dtype, device=target)
            finite = run(
                [logits],
                loss_with(unit_gamma_log, logits),
                client_epochs,
                epoch_rates=swa_learning_rates(lr, client_epochs),
                after_epoch=average,
            )
            final_logits = averaged
            if finite and learn == "both":
                finite = run([log_gamma], loss_with(log_gamma, final_logits), epochs // 2)
    if not finite:
        return math.nan, [math.nan] * len(client_params)
    gamma = float(torch.exp(log_gamma.detach()).item())
    if torch.equal(final_logits, initial_logits):
        return gamma, fedavg_lambdas
    lambdas = torch.softmax(final_logits.to(torch.float64), dim=0)
    return gamma, [float(value) for value in lambdas.cpu()]


def weights_are_usable(gamma: float, lambdas: Sequence[float]) -> bool:
    """Whether learned weights may build a model: finite, gamma > 0, lambda >= 0."""
    values = np.asarray(lambdas, dtype=np.float64)
    return bool(
        math.isfinite(gamma) and gamma > 0.0 and np.all(np.isfinite(values)) and np.all(values >= 0)
    )
