"""FedLAW against the authors' code: the SWA schedule and the BatchNorm running statistics.

The references are independent of strategies/fedlaw.py: torch's own schedulers driven exactly as
the authors' server_funct.py drives them, a literal port of their two-stage SWA loop, and the
closed form of a momentum-0.1 running mean.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.optim.lr_scheduler import CosineAnnealingLR, StepLR
from torch.optim.swa_utils import SWALR

from beyond_averaging.strategies import FedLAW
from beyond_averaging.strategies.fedlaw import aggregate_fedlaw
from beyond_averaging.strategies.law_weights import learn_aggregation_weights, swa_learning_rates
from beyond_averaging.tasks.datasets import LabeledData
from tests.conftest import train_reply

DIMENSION, NUM_CLASSES = 4, 3
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- SWA schedule
def authors_lambda_stage_rates(base_lr: float, epochs: int) -> list[float]:
    """The lr of each epoch of the authors' lambda stage, read off torch's schedulers.

    server_funct.py: CosineAnnealingLR(T_max=100) and SWALR(swa_lr=0.05) on one optimizer;
    after each epoch ``if epoch > 5: swa_scheduler.step() else: scheduler.step()``.
    """
    variable = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([variable], lr=base_lr, betas=(0.5, 0.999))
    scheduler = CosineAnnealingLR(optimizer, T_max=100)
    swa_scheduler = SWALR(optimizer, swa_lr=0.05)
    rates = []
    for epoch in range(epochs):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # keeps the schedulers' "step before optimizer.step" check quiet
        if epoch > 5:
            swa_scheduler.step()
        else:
            scheduler.step()
    return rates


@pytest.mark.parametrize(("base_lr", "epochs"), [(0.005, 50), (0.01, 50), (0.005, 12)])
def test_swa_learning_rates_are_the_authors_cosine_then_swalr_sequence(
    base_lr: float, epochs: int
) -> None:
    expected = authors_lambda_stage_rates(base_lr, epochs)
    np.testing.assert_allclose(swa_learning_rates(base_lr, epochs), expected, rtol=1e-12)


def test_swa_rate_starts_at_the_base_rate_and_reaches_0_05_after_16_epochs() -> None:
    rates = swa_learning_rates(0.005, 50)
    assert rates[0] == 0.005
    assert rates[6] == pytest.approx(0.005 * (1 + math.cos(math.pi * 6 / 100)) / 2)
    assert all(rate == pytest.approx(0.05) for rate in rates[16:])
    assert all(a < b for a, b in itertools.pairwise(rates[6:17]))  # annealed up


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIMENSION, 8), nn.ReLU(), nn.Linear(8, NUM_CLASSES)).double()


def proxy_batch(seed: int = 5, count: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(count, DIMENSION, generator=generator, dtype=torch.float64)
    labels = torch.arange(count) % NUM_CLASSES
    return features, labels


def client_states(model: nn.Module, count: int) -> list[dict[str, torch.Tensor]]:
    """Client models: the global model plus seeded perturbations of different sizes."""
    generator = torch.Generator().manual_seed(11)
    return [
        {
            name: value.detach() + 0.3 * (k + 1) * torch.randn(value.shape, generator=generator)
            for name, value in model.state_dict().items()
        }
        for k in range(count)
    ]


def authors_swa(
    model: nn.Module,
    clients: list[dict[str, torch.Tensor]],
    sizes: list[float],
    batch: tuple[torch.Tensor, torch.Tensor],
    server_epochs: int,
    base_lr: float,
) -> tuple[float, list[float]]:
    """A literal port of server_funct.py's ``whether_swa == 'swa'`` branch (``exp`` functions)."""
    names = [name for name, _ in model.named_parameters()]
    flat = [torch.cat([c[name].reshape(-1) for name in names]) for c in clients]
    shapes = [model.state_dict()[name].shape for name in names]

    def forward_with_param(param: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(param, [math.prod(shape) for shape in shapes])
        tensors = {n: p.view(s) for n, p, s in zip(names, pieces, shapes, strict=True)}
        return functional_call(model, tensors, (data,))

    weights = [s / sum(sizes) for s in sizes]
    lam = torch.tensor([math.log(w) for w in weights], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam([lam], lr=base_lr, betas=(0.5, 0.999))
    scheduler = CosineAnnealingLR(optimizer, T_max=100)
    swa_module, n_averaged = lam.detach().clone(), 0  # AveragedModel(lam)
    swa_scheduler = SWALR(optimizer, swa_lr=0.05)
    for epoch in range(server_epochs // 2):
        param = sum(torch.softmax(lam, 0)[i] * flat[i] for i in range(len(flat)))
        optimizer.zero_grad()
        nn.functional.cross_entropy(forward_with_param(param, batch[0]), batch[1]).backward()
        optimizer.step()
        if epoch > 5:
            if n_averaged == 0:
                swa_module = lam.detach().clone()
            else:
                swa_module = swa_module + (lam.detach() - swa_module) / (n_averaged + 1)
            n_averaged += 1
            swa_scheduler.step()
        else:
            scheduler.step()
    lambdas = torch.softmax(swa_module, 0)
    gamma = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam([gamma], lr=base_lr, betas=(0.5, 0.999))
    step_decay = StepLR(optimizer, step_size=20, gamma=0.5)
    for _ in range(server_epochs // 2):
        param = sum(torch.exp(gamma) * lambdas[i] * flat[i] for i in range(len(flat)))
        optimizer.zero_grad()
        nn.functional.cross_entropy(forward_with_param(param, batch[0]), batch[1]).backward()
        optimizer.step()
        step_decay.step()
    return float(torch.exp(gamma.detach())), [float(v) for v in lambdas]


@pytest.mark.parametrize("server_epochs", [40, 100, 12])
def test_swa_gamma_and_lambda_match_a_port_of_the_authors_two_stage_loop(
    server_epochs: int,
) -> None:
    model = mlp()
    clients = client_states(model, 3)
    sizes = [30.0, 50.0, 20.0]
    batch = proxy_batch()
    expected_gamma, expected_lambdas = authors_swa(
        model, clients, sizes, batch, server_epochs, 0.005
    )
    gamma, lambdas = learn_aggregation_weights(
        model, clients, sizes, [batch], epochs=server_epochs, lr=0.005, swa=True
    )
    np.testing.assert_allclose(lambdas, expected_lambdas, rtol=1e-9, atol=1e-12)
    assert gamma == pytest.approx(expected_gamma, rel=1e-9)
    if server_epochs // 2 <= 6:  # no epoch was averaged: the authors keep the initial lambda
        np.testing.assert_allclose(lambdas, np.array(sizes) / sum(sizes), rtol=1e-12)
    else:
        assert max(abs(a - b / 100) for a, b in zip(lambdas, sizes, strict=True)) > 1e-3


# ----------------------------------------------------------------------------- BatchNorm
def batchnorm_net(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(DIMENSION, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, NUM_CLASSES)
    )


def bn_proxy_set() -> LabeledData:
    features, labels = proxy_batch(seed=3, count=24)
    return LabeledData(features.float().numpy(), labels.numpy(), NUM_CLASSES)


def round_replies(clients: list[dict[str, torch.Tensor]], counts: list[int]) -> list[Any]:
    return [
        train_reply({k: v.numpy() for k, v in c.items()}, n, node_id=10 + i)
        for i, (c, n) in enumerate(zip(clients, counts, strict=True))
    ]


def test_authors_bn_mode_keeps_a_momentum_running_mean_carried_across_rounds() -> None:
    """With a vanishing learning rate the weighted model stays FedAvg's, so after E forward
    passes of the one proxy batch the server's running mean is the closed form
    (1 - 0.9^E) * batch mean + 0.9^E * previous value, continued in the next round."""
    model = batchnorm_net()
    proxy = bn_proxy_set()
    clients = [
        {k: v.detach().clone() for k, v in batchnorm_net(seed).state_dict().items()}
        for seed in (2, 3)
    ]
    epochs = 7
    strategy = FedLAW(
        model=model, proxy_set=proxy, epochs=epochs, lr=1e-12, batch_size=24, bn="authors"
    )
    strategy.global_arrays = {k: v.numpy() for k, v in model.state_dict().items()}
    # Independent reference: the FedAvg model's first-layer outputs on the proxy batch.
    fedavg = {k: (clients[0][k].double() + clients[1][k].double()) / 2 for k in clients[0]}
    hidden = torch.from_numpy(proxy.features).double() @ fedavg["0.weight"].T + fedavg["0.bias"]
    batch_mean = hidden.mean(dim=0).numpy()
    batch_var = hidden.var(dim=0, unbiased=True).numpy()
    running_mean, running_var = np.zeros(6), np.ones(6)
    for server_round in (1, 2):
        arrays, _ = strategy.aggregate_train(server_round, round_replies(clients, [5, 5]))
        assert arrays is not None
        state = arrays.to_torch_state_dict()
        decay = 0.9**epochs
        running_mean = (1 - decay) * batch_mean + decay * running_mean
        running_var = (1 - decay) * batch_var + decay * running_var
        np.testing.assert_allclose(state["1.running_mean"].numpy(), running_mean, rtol=1e-4)
        np.testing.assert_allclose(state["1.running_var"].numpy(), running_var, rtol=1e-4)
        assert int(state["1.num_batches_tracked"]) == epochs * server_round
        strategy.global_arrays = {k: v.numpy() for k, v in state.items()}


def test_bn_modes_share_the_parameters_and_differ_in_the_running_statistics() -> None:
    model = batchnorm_net()
    clients = [
        {k: v.detach().clone() for k, v in batchnorm_net(seed).state_dict().items()}
        for seed in (2, 3, 4)
    ]
    kwargs: dict[str, Any] = {"epochs": 6, "lr": 0.05, "batch_size": 12}
    results = {}
    for bn in ("reestimate", "authors"):
        strategy = FedLAW(model=copy.deepcopy(model), proxy_set=bn_proxy_set(), bn=bn, **kwargs)
        strategy.global_arrays = {k: v.numpy() for k, v in model.state_dict().items()}
        arrays, _ = strategy.aggregate_train(1, round_replies(clients, [4, 4, 8]))
        metrics = strategy.aggregation_metrics[1]
        assert arrays is not None
        results[bn] = (arrays.to_torch_state_dict(), metrics)
    (reestimated, metrics_a), (authors, metrics_b) = results["reestimate"], results["authors"]
    assert metrics_a["fedlaw-lambdas"] == metrics_b["fedlaw-lambdas"]
    for name, _ in model.named_parameters():
        torch.testing.assert_close(reestimated[name], authors[name], rtol=0, atol=0)
    # reestimate: the cumulative statistics of the final model over the 2 proxy batches
    expected = aggregate_fedlaw(
        model,
        clients,
        metrics_a["fedlaw-gamma"],
        metrics_a["fedlaw-lambdas"],
        FedLAW(model=model, proxy_set=bn_proxy_set(), **kwargs).proxy_batches,
    )
    np.testing.assert_allclose(reestimated["1.running_mean"].numpy(), expected["1.running_mean"])
    # authors: a momentum average of 6 epochs x 2 batches of intermediate models, from 0 / 1
    assert int(authors["1.num_batches_tracked"]) == 12
    assert not np.allclose(reestimated["1.running_var"].numpy(), authors["1.running_var"].numpy())


def test_default_bn_mode_is_reestimate_and_unknown_mode_is_a_clear_error() -> None:
    assert FedLAW(model=batchnorm_net(), proxy_set=bn_proxy_set(), batch_size=24).bn == (
        "reestimate"
    )
    with pytest.raises(ValueError, match=r"'clients'.*unknown.*'reestimate', 'authors'"):
        FedLAW(model=batchnorm_net(), proxy_set=bn_proxy_set(), batch_size=24, bn="clients")  # type: ignore[arg-type]


def test_authors_bn_state_round_trips_through_the_checkpoint_state() -> None:
    model = batchnorm_net()
    clients = [{k: v.detach().clone() for k, v in batchnorm_net(2).state_dict().items()}] * 2
    strategy = FedLAW(model=model, proxy_set=bn_proxy_set(), epochs=2, batch_size=24, bn="authors")
    assert strategy.state_dict() == {}
    strategy.global_arrays = {k: v.numpy() for k, v in model.state_dict().items()}
    strategy.aggregate_train(1, round_replies(clients, [3, 3]))
    state = strategy.state_dict()
    resumed = FedLAW(model=model, proxy_set=bn_proxy_set(), epochs=2, batch_size=24, bn="authors")
    resumed.load_state_dict(state)
    for name, value in state["server-buffers"].items():
        np.testing.assert_array_equal(resumed.state_dict()["server-buffers"][name], value)
