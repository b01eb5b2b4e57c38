"""FedLAW's weight learning, aggregation, proxy-set checks and strategy, on tiny torch models."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from beyond_averaging.strategies import FedLAW, aggregate_fedavg
from beyond_averaging.strategies import fedlaw as fedlaw_module
from beyond_averaging.strategies.defences.proxy_data import (
    ProxySetError,
    make_proxy_batches,
    validate_proxy_set,
)
from beyond_averaging.strategies.fedlaw import aggregate_fedlaw
from beyond_averaging.strategies.law_weights import (
    _client_tensors,
    learn_aggregation_weights,
    weighted_sum,
)
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.models import build_model
from tests.conftest import train_reply

NUM_CLASSES, DIMENSION = 3, 5
CENTRES = np.random.default_rng(0).normal(0.0, 2.0, (NUM_CLASSES, DIMENSION))
Batch = tuple[torch.Tensor, torch.Tensor]
State = dict[str, torch.Tensor]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # The machine is shared; one intra-op thread keeps these small problems fast and stable.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def blobs(count: int, seed: int, swap_first_two_labels: bool = False) -> Batch:
    """Gaussian class clusters; optionally labels 0 and 1 swapped (the paper's corruption)."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % NUM_CLASSES
    features = CENTRES[labels] + rng.normal(0.0, 1.0, (count, DIMENSION))
    if swap_first_two_labels:
        labels = np.choose(labels, [1, 0, *range(2, NUM_CLASSES)])
    return torch.tensor(features, dtype=torch.float32), torch.tensor(labels, dtype=torch.int64)


def mlp(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIMENSION, 16), nn.ReLU(), nn.Linear(16, NUM_CLASSES))


def batchnorm_net(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(DIMENSION, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, NUM_CLASSES)
    )


def train_clients(
    model: nn.Module, count: int, corrupted: int | None = None, steps: int = 40
) -> list[State]:
    """Clients trained by full-batch SGD from the same global model on their own blobs."""
    clients = []
    for client in range(count):
        replica = copy.deepcopy(model)
        replica.train()
        features, labels = blobs(120, seed=10 + client, swap_first_two_labels=client == corrupted)
        optimizer = torch.optim.SGD(replica.parameters(), lr=0.1)
        for _ in range(steps):
            optimizer.zero_grad()
            nn.functional.cross_entropy(replica(features), labels).backward()
            optimizer.step()
        clients.append({k: v.detach().clone() for k, v in replica.state_dict().items()})
    return clients


def proxy_loss(model: nn.Module, state: dict[str, Any], batch: Batch) -> float:
    """Reference proxy loss: load the state into a copy of the model and evaluate it."""
    reference = mlp()
    reference.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()})
    with torch.no_grad():
        return float(nn.functional.cross_entropy(reference(batch[0]), batch[1]))


# ----------------------------------------------------------------------------- FedAvg identity
@pytest.mark.parametrize(("epochs", "lr"), [(0, 0.05), (5, 0.0)])
@pytest.mark.parametrize("swa", [False, True])
def test_zero_epochs_or_zero_lr_gives_exactly_fedavg(epochs: int, lr: float, swa: bool) -> None:
    model = mlp()
    clients = train_clients(model, 3, steps=5)
    counts = [10, 30, 60]
    gamma, lambdas = learn_aggregation_weights(
        model, clients, counts, [blobs(30, 99)], epochs=epochs, lr=lr, swa=swa
    )
    assert gamma == 1.0
    assert lambdas == [0.1, 0.3, 0.6]  # n_k / sum n, by hand
    ours = aggregate_fedlaw(model, clients, gamma, lambdas, [blobs(30, 99)])
    fedavg = aggregate_fedavg(model.state_dict(), clients, counts)
    assert ours.keys() == fedavg.keys()
    for key in fedavg:
        np.testing.assert_array_equal(ours[key], fedavg[key])


# ----------------------------------------------------------------------------- no side effects
@pytest.mark.parametrize("swa", [False, True])
def test_only_gamma_and_lambda_change_clients_and_model_stay_bit_identical(swa: bool) -> None:
    model = batchnorm_net()
    model.train()
    clients = train_clients(model, 3, steps=5)
    numpy_client = {k: v.numpy().copy() for k, v in clients[0].items()}
    before_model = {k: v.clone() for k, v in model.state_dict().items()}
    before_clients = [{k: v.clone() for k, v in c.items()} for c in clients]
    modes = [m.training for m in model.modules()]

    gamma, lambdas = learn_aggregation_weights(
        model,
        [numpy_client, *clients[1:]],
        [1, 1, 1],
        [blobs(30, 99)],
        epochs=20,
        lr=0.05,
        swa=swa,
    )

    assert gamma != 1.0
    assert lambdas != [1 / 3] * 3
    for key, value in model.state_dict().items():
        assert torch.equal(value, before_model[key]), key
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()] == modes
    for client, before in zip(clients, before_clients, strict=True):
        assert all(torch.equal(client[k], before[k]) for k in before)
    assert all(np.array_equal(numpy_client[k], before_clients[0][k].numpy()) for k in before_model)


# ----------------------------------------------------------------------------- what is learned
def test_corrupted_client_gets_the_smallest_lambda() -> None:
    model = mlp()
    clients = train_clients(model, 4, corrupted=2)
    _, lambdas = learn_aggregation_weights(
        model, clients, [120] * 4, [blobs(60, 99)], epochs=50, lr=0.05
    )
    assert int(np.argmin(lambdas)) == 2
    assert lambdas[2] < 0.25 < max(lambdas)


def test_learned_weights_lower_the_proxy_loss_below_fedavg() -> None:
    model = mlp()
    clients = train_clients(model, 4, corrupted=1)
    proxy = blobs(60, 99)
    gamma, lambdas = learn_aggregation_weights(
        model, clients, [120] * 4, [proxy], epochs=50, lr=0.05
    )
    learned = aggregate_fedlaw(model, clients, gamma, lambdas, [proxy])
    fedavg = aggregate_fedavg(model.state_dict(), clients, [120] * 4)
    assert proxy_loss(model, learned, proxy) < proxy_loss(model, fedavg, proxy)


def test_shrink_only_learns_gamma_and_keeps_lambda_at_the_data_weights() -> None:
    model = mlp()
    clients = train_clients(model, 3)
    gamma, lambdas = learn_aggregation_weights(
        model, clients, [1, 1, 2], [blobs(60, 99)], epochs=20, lr=0.05, learn="shrink"
    )
    assert gamma != 1.0
    assert lambdas == [0.25, 0.25, 0.5]


def test_clients_only_learns_lambda_and_keeps_gamma_at_one() -> None:
    model = mlp()
    clients = train_clients(model, 3, corrupted=0)
    gamma, lambdas = learn_aggregation_weights(
        model, clients, [1, 1, 2], [blobs(60, 99)], epochs=20, lr=0.05, learn="clients"
    )
    assert gamma == 1.0
    assert lambdas != [0.25, 0.25, 0.5]
    assert sum(lambdas) == pytest.approx(1.0)


def test_swa_with_clients_only_keeps_gamma_at_one_and_swa_needs_client_weights() -> None:
    model = mlp()
    clients = train_clients(model, 3, corrupted=0)
    gamma, lambdas = learn_aggregation_weights(
        model, clients, [1, 1, 1], [blobs(60, 99)], epochs=20, lr=0.05, learn="clients", swa=True
    )
    assert gamma == 1.0
    assert lambdas != [1 / 3] * 3
    with pytest.raises(ValueError, match="learn = 'shrink' keeps the client weights fixed"):
        learn_aggregation_weights(
            model, clients, [1, 1, 1], [blobs(60, 99)], epochs=2, lr=0.05, learn="shrink", swa=True
        )


# ----------------------------------------------------------------------------- aggregation
def test_weighted_sum_and_its_lambda_gradient_match_a_stacked_tensordot() -> None:
    generator = torch.Generator().manual_seed(4)
    tensors = [torch.randn(3, 4, generator=generator, dtype=torch.float64) for _ in range(5)]
    upstream = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    lambdas = torch.softmax(torch.randn(5, generator=generator, dtype=torch.float64), 0)
    ours = lambdas.clone().requires_grad_(True)
    reference = lambdas.clone().requires_grad_(True)
    value = weighted_sum(ours, tensors)
    expected = torch.tensordot(reference, torch.stack(tensors), dims=1)
    torch.testing.assert_close(value, expected)
    (value * upstream).sum().backward()
    (expected * upstream).sum().backward()
    assert ours.grad is not None
    assert reference.grad is not None
    torch.testing.assert_close(ours.grad, reference.grad)


def test_cpu_client_tensors_are_views_of_the_received_arrays_not_copies() -> None:
    model = nn.Linear(3, 2)
    received = np.arange(6, dtype=np.float32).reshape(2, 3)
    received.flags.writeable = False  # like a view of a reply's bytes
    clients = [{"weight": received, "bias": np.zeros(2, np.float32)}] * 2
    tensors = _client_tensors(model, clients, ["weight"], torch.device("cpu"))
    assert all(t.data_ptr() == received.ctypes.data for t in tensors["weight"])


def test_aggregate_scales_the_lambda_weighted_sum_by_gamma_elementwise() -> None:
    model = nn.Linear(2, 1)
    clients = [
        {"weight": np.array([[1.0, -2.0]], np.float32), "bias": np.array([4.0], np.float32)},
        {"weight": np.array([[3.0, 2.0]], np.float32), "bias": np.array([0.0], np.float32)},
    ]
    gamma, lambdas = 0.5, [0.25, 0.75]
    result = aggregate_fedlaw(model, clients, gamma, lambdas, [])
    for key in ("weight", "bias"):
        expected = np.zeros_like(clients[0][key])
        for index in np.ndindex(expected.shape):  # naive per-element reference
            expected[index] = gamma * sum(
                lam * client[key][index] for lam, client in zip(lambdas, clients, strict=True)
            )
        np.testing.assert_allclose(result[key], expected, rtol=1e-6)
        assert result[key].dtype == np.float32


def test_batchnorm_model_learns_and_its_running_stats_come_from_the_proxy_set() -> None:
    model = batchnorm_net()
    clients = train_clients(model, 3, corrupted=1, steps=10)
    for index, client in enumerate(clients):  # distinct running statistics and counters
        client["1.running_mean"] += index
        client["1.num_batches_tracked"] = torch.tensor(10 * (index + 1))
    proxy = blobs(60, 99)
    gamma, lambdas = learn_aggregation_weights(
        model, clients, [1, 1, 1], [proxy], epochs=20, lr=0.05
    )
    assert np.isfinite(gamma)
    assert gamma != 1.0
    assert np.all(np.isfinite(lambdas))

    result = aggregate_fedlaw(model, clients, gamma, lambdas, [proxy])

    def weighted(key: str) -> np.ndarray:
        return sum(lam * c[key].double().numpy() for lam, c in zip(lambdas, clients, strict=True))

    # Affine BatchNorm parameters are part of the gamma-scaled vector.
    np.testing.assert_allclose(result["1.weight"], gamma * weighted("1.weight"), rtol=1e-5)
    np.testing.assert_allclose(result["1.bias"], gamma * weighted("1.bias"), rtol=1e-5)
    # Running statistics: of the final model's pre-BatchNorm activations on the proxy set.
    pre_activation = proxy[0].double().numpy() @ result["0.weight"].T + result["0.bias"]
    np.testing.assert_allclose(result["1.running_mean"], pre_activation.mean(0), atol=1e-5)
    np.testing.assert_allclose(result["1.running_var"], pre_activation.var(0, ddof=1), rtol=1e-4)
    # The counter is the lambda-weighted mean, rounded.
    assert int(result["1.num_batches_tracked"]) == round(float(weighted("1.num_batches_tracked")))


def test_project_cnn_with_batchnorm2d_learns_weights() -> None:
    model = build_model("cnn", (1, 8, 8), 4, seed=0)
    clients = []
    for index in range(2):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state["0.weight"] += 0.05 * index
        clients.append(state)
    generator = torch.Generator().manual_seed(0)
    proxy = (torch.rand(16, 1, 8, 8, generator=generator), torch.arange(16) % 4)
    gamma, lambdas = learn_aggregation_weights(model, clients, [1, 1], [proxy], epochs=3, lr=0.05)
    result = aggregate_fedlaw(model, clients, gamma, lambdas, [proxy])
    assert np.isfinite(gamma)
    assert len(lambdas) == 2
    assert all(np.all(np.isfinite(v)) for v in result.values())


def test_non_finite_proxy_loss_returns_nan_weights() -> None:
    model = mlp()
    clients = train_clients(model, 2, steps=2)
    clients[0] = {k: torch.full_like(v, 3e38) for k, v in clients[0].items()}  # finite, overflows
    gamma, lambdas = learn_aggregation_weights(
        model, clients, [1, 1], [blobs(30, 99)], epochs=3, lr=0.05
    )
    assert np.isnan(gamma)
    assert np.all(np.isnan(lambdas))


# ----------------------------------------------------------------------------- proxy set
def labelled(labels: list[int], classes: int = 3) -> LabeledData:
    array = np.asarray(labels, dtype=np.int64)
    return LabeledData(np.zeros((array.size, 2), np.float32), array, classes)


@pytest.mark.parametrize(
    ("labels", "batch_size", "message"),
    [
        ([], 1, r"is empty: .*proxy-per-class >= 1"),
        ([0, 2, 0, 2], 2, r"no sample of class\(es\) \[1\] of the 3 classes"),
        (
            [0, 1, 2, 0, 1],
            8,
            r"holds 5 samples, fewer than one batch \(batch_size = 8, run option "
            r"fedlaw-batch-size\): set batch_size <= 5, .*proxy-per-class >= 3",
        ),
    ],
)
def test_bad_proxy_set_is_a_clear_error(labels: list[int], batch_size: int, message: str) -> None:
    data = labelled(labels)
    with pytest.raises(ProxySetError, match=message):
        validate_proxy_set(data.features, data.labels, 3, batch_size)


def test_strategy_rejects_a_bad_proxy_set_before_round_one() -> None:
    with pytest.raises(ProxySetError, match=r"proxy-dir = /x.*no sample of class\(es\) \[2\]"):
        FedLAW(
            model=mlp(),
            proxy_set=labelled([0, 1, 0, 1]),
            batch_size=2,
            proxy_source="proxy-dir = /x",
        )


def test_proxy_batches_cover_the_set_without_a_small_remainder_batch() -> None:
    data = labelled(list(np.arange(130) % 3))
    batches = make_proxy_batches(data, 100, seed=0, device=torch.device("cpu"))
    assert [len(labels) for _, labels in batches] == [65, 65]
    assert sorted(torch.cat([labels for _, labels in batches]).tolist()) == sorted(data.labels)


# ----------------------------------------------------------------------------- strategy
def proxy_set() -> LabeledData:
    features, labels = blobs(60, 99)
    return LabeledData(features.numpy(), labels.numpy(), NUM_CLASSES)


def strategy_round(strategy: FedLAW, clients: list[State], counts: list[int]) -> Any:
    strategy.global_arrays = {k: v.numpy() for k, v in mlp().state_dict().items()}
    replies = [
        train_reply({k: v.numpy() for k, v in c.items()}, n, node_id=100 + i)
        for i, (c, n) in enumerate(zip(clients, counts, strict=True))
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays, strategy.aggregation_metrics[1]


def test_strategy_writes_gamma_and_every_lambda_into_the_round_metrics() -> None:
    strategy = FedLAW(model=mlp(), proxy_set=proxy_set(), epochs=10, lr=0.05, batch_size=60)
    clients = train_clients(mlp(), 3, corrupted=2)
    arrays, metrics = strategy_round(strategy, clients, [10, 10, 20])
    assert arrays is not None
    assert metrics is not None
    lambdas = metrics["fedlaw-lambdas"]
    assert len(lambdas) == 3
    assert sum(lambdas) == pytest.approx(1.0)
    assert metrics["fedlaw-node-ids"] == [100, 101, 102]
    assert metrics["fedlaw-data-weights"] == [0.25, 0.25, 0.5]
    assert metrics["fedlaw-gamma"] > 0
    assert metrics["fedlaw-fallback"] == 0
    expected = aggregate_fedlaw(
        mlp(), clients, metrics["fedlaw-gamma"], lambdas, strategy.proxy_batches
    )
    for key, value in expected.items():
        np.testing.assert_allclose(arrays[key].numpy(), value, rtol=1e-6)


def test_big_endian_replies_give_the_model_their_native_twins_give() -> None:
    # A reply may send either byte order; torch reads only the machine's, and FedLAW's weight
    # learning reads the clients' tensors through torch (it raised ValueError on '>f4').
    clients = train_clients(mlp(), 3)
    results = []
    for order in ("=", ">"):
        strategy = FedLAW(model=mlp(), proxy_set=proxy_set(), epochs=3, lr=0.05, batch_size=60)
        swapped = [
            {k: v.numpy().astype(v.numpy().dtype.newbyteorder(order)) for k, v in c.items()}
            for c in clients
        ]
        strategy.global_arrays = {k: v.numpy() for k, v in mlp().state_dict().items()}
        replies = [train_reply(c, 10, node_id=100 + i) for i, c in enumerate(swapped)]
        arrays, _ = strategy.aggregate_train(1, replies)
        assert arrays is not None, order
        results.append({k: v.numpy() for k, v in arrays.items()})
    for key, value in results[0].items():
        np.testing.assert_array_equal(value, results[1][key])


def test_non_finite_learned_weights_keep_fedavg_weights_with_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    strategy = FedLAW(model=mlp(), proxy_set=proxy_set(), epochs=3, lr=0.05, batch_size=60)
    clients = train_clients(mlp(), 2, steps=2)
    # A reply of 3e38 values no longer reaches a rule (dropped as value-out-of-range), so the
    # weight learning itself is made to diverge.
    monkeypatch.setattr(
        fedlaw_module,
        "learn_aggregation_weights",
        lambda *args, **kwargs: (float("nan"), [float("nan"), float("nan")]),
    )
    logging.getLogger("flwr").propagate = True
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, metrics = strategy_round(strategy, clients, [1, 3])
    assert arrays is not None
    assert metrics is not None
    assert metrics["fedlaw-fallback"] == 1
    assert metrics["fedlaw-gamma"] == 1.0
    assert metrics["fedlaw-lambdas"] == [0.25, 0.75]
    fedavg = aggregate_fedavg(clients[0], clients, [1, 3])
    for key, value in fedavg.items():
        np.testing.assert_array_equal(arrays[key].numpy(), value)
    assert "keeping FedAvg's weights" in caplog.text


def test_batchnorm_model_with_one_sample_proxy_batches_is_rejected() -> None:
    with pytest.raises(ProxySetError, match=r"at least 2 samples per proxy batch.*batches of 1"):
        FedLAW(model=batchnorm_net(), proxy_set=labelled([0, 1, 2]), batch_size=1)
