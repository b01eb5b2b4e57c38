"""The fast client path (index batches on the device, cached partition and model) against the
DataLoader loop it replaced, written out here as the reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from beyond_averaging.client.app import train
from beyond_averaging.client.sensitivity import compute_sensitivity
from beyond_averaging.server.app import client_task
from beyond_averaging.server.config import RunConfig
from beyond_averaging.tasks.batching import shuffle_seed, shuffled_batches
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import DeviceData, evaluate
from beyond_averaging.tasks.federation import DataSpec, load_client_partition
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.training import train_local
from tests.conftest import instruction_message

CPU = torch.device("cpu")
TOLERANCE = {"rtol": 0.0, "atol": 1e-5}


def seeded_loader(data: LabeledData, batch_size: int, seed: int) -> DataLoader[Any]:
    """The ClientApp's loader before the fast path (tasks.evaluation.make_loader, shuffle=True)."""
    dataset = TensorDataset(torch.from_numpy(data.features), torch.from_numpy(data.labels))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=0,
    )


def dataloader_training(
    model: nn.Module,
    loader: DataLoader[Any],
    *,
    epochs: int,
    learning_rate: float,
    momentum: float,
    weight_decay: float,
    proximal_mu: float,
) -> tuple[float, dict[str, torch.Tensor]]:
    """The previous ``train_local``: its DataLoader loop, a host sync per step and all.

    Returns the mean loss and the last step's gradient.
    """
    model.train()
    anchor = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(
        model.parameters(), lr=learning_rate, momentum=momentum, weight_decay=weight_decay
    )
    total_loss, seen = 0.0, 0
    last_gradient: dict[str, torch.Tensor] = {}
    for _ in range(epochs):
        for features, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(features), labels)
            drift = sum(
                torch.sum((p - a) ** 2) for p, a in zip(model.parameters(), anchor, strict=True)
            )
            (loss + 0.5 * proximal_mu * drift).backward()
            last_gradient = {n: p.grad.detach().clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
            optimizer.step()
            total_loss += float(loss.detach()) * labels.shape[0]
            seen += int(labels.shape[0])
    return total_loss / seen, last_gradient


def random_data(num_samples: int, seed: int = 0) -> LabeledData:
    rng = np.random.default_rng(seed)
    return LabeledData(
        rng.random((num_samples, 1, 8, 8)).astype(np.float32),
        rng.integers(0, 10, num_samples).astype(np.int64),
        10,
    )


@pytest.mark.parametrize(
    ("model_name", "proximal_mu", "epochs", "batch_size"),
    [("mlp", 0.0, 3, 16), ("mlp", 0.1, 2, 32), ("cnn", 0.0, 2, 16), ("logreg", 0.01, 1, 7)],
)
def test_index_batch_training_matches_the_dataloader_loop(
    model_name: str, proximal_mu: float, epochs: int, batch_size: int
) -> None:
    data = random_data(101)  # partial last batch for every batch size above
    seed = shuffle_seed(8, 3, 5)
    settings = {"learning_rate": 0.05, "momentum": 0.9, "weight_decay": 1e-3}
    fast = build_model(model_name, (1, 8, 8), 10, seed=1)  # type: ignore[arg-type]
    reference = build_model(model_name, (1, 8, 8), 10, seed=1)  # type: ignore[arg-type]
    result = train_local(
        fast,
        DeviceData.from_labeled(data, CPU),
        shuffled_batches(len(data), batch_size, epochs, seed),
        proximal_mu=proximal_mu,
        keep_last_gradient=True,
        **settings,
    )
    expected_loss, expected_gradient = dataloader_training(
        reference,
        seeded_loader(data, batch_size, seed),
        epochs=epochs,
        proximal_mu=proximal_mu,
        **settings,
    )
    for (name, value), expected in zip(
        fast.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(value, expected, **TOLERANCE, msg=name)
    assert result.mean_loss == pytest.approx(expected_loss, abs=1e-5)
    assert result.last_gradient is not None
    for name, gradient in expected_gradient.items():
        torch.testing.assert_close(result.last_gradient[name], gradient, **TOLERANCE)
    assert result.num_examples == len(data)
    assert result.steps == epochs * -(-len(data) // batch_size)


def test_evaluation_in_device_slices_matches_per_sample_scores() -> None:
    data = random_data(37, seed=2)
    model = build_model("mlp", (1, 8, 8), 10, seed=3)
    with torch.no_grad():
        logits = torch.stack([model(torch.from_numpy(x[None]))[0] for x in data.features])
    labels = torch.from_numpy(data.labels)
    expected_loss = float(nn.functional.cross_entropy(logits, labels))
    expected_accuracy = float((logits.argmax(1) == labels).double().mean())
    for source in (data, DeviceData.from_labeled(data, CPU)):
        loss, accuracy = evaluate(model, source, CPU, batch_size=8)
        assert loss == pytest.approx(expected_loss, abs=1e-6)
        assert accuracy == pytest.approx(expected_accuracy)


# --- the ClientApp -----------------------------------------------------------------------

CONFIG = RunConfig(
    num_clients=4,
    local_epochs=2,
    batch_size=16,
    momentum=0.9,
    weight_decay=1e-3,
    proximal_mu=0.01,
    device="cpu",
)


def node(partition_id: int, config: RunConfig = CONFIG) -> Context:
    return Context(
        run_id=1,
        node_id=partition_id + 1,
        node_config={"partition-id": partition_id, "num-partitions": config.num_clients},
        state=RecordDict(),
        run_config={},
    )


def instruction(
    model: nn.Module, server_round: int, config: RunConfig = CONFIG, **extra: Any
) -> Message:
    entries = {**client_task(config).to_config(), "server-round": server_round, **extra}
    return instruction_message(
        RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(entries)})
    )


def test_clientapp_reply_matches_the_dataloader_client_it_replaced() -> None:
    partition_id, server_round = 2, 3
    received = build_model(CONFIG.model, (1, 8, 8), 10, seed=4)
    reply = train(
        instruction(received, server_round, **{"request-records": "gradient,sensitivity"}),
        node(partition_id),
    )
    # The previous ClientApp, step by step: a fresh partition and model, the seeded loader.
    spec = DataSpec(
        dataset=CONFIG.dataset,
        data_dir=CONFIG.data_dir,
        partition=CONFIG.partition,
        dirichlet_alpha=CONFIG.dirichlet_alpha,
        classes_per_partition=CONFIG.classes_per_client,
        num_partitions=CONFIG.num_clients,
        seed=CONFIG.seed,
        proxy_per_class=0,
    )
    data = load_client_partition(spec, partition_id)
    seed = CONFIG.seed * 1_000_003 + server_round * 1009 + partition_id
    reference = build_model(CONFIG.model, (1, 8, 8), 10, seed=4)
    expected_sensitivity = compute_sensitivity(reference, seeded_loader(data, 16, seed), None)
    expected_loss, expected_gradient = dataloader_training(
        reference,
        seeded_loader(data, 16, seed),
        epochs=CONFIG.local_epochs,
        learning_rate=CONFIG.learning_rate * CONFIG.lr_decay ** (server_round - 1),
        momentum=CONFIG.momentum,
        weight_decay=CONFIG.weight_decay,
        proximal_mu=CONFIG.proximal_mu,
    )
    arrays = reply.content["arrays"]
    for name, expected in reference.state_dict().items():
        torch.testing.assert_close(
            torch.from_numpy(arrays[name].numpy()), expected, **TOLERANCE, msg=name
        )
    for name, expected in expected_gradient.items():
        got = torch.from_numpy(reply.content["gradient"][name].numpy())
        torch.testing.assert_close(got, expected, **TOLERANCE, msg=name)
    for name, expected in expected_sensitivity.items():
        got = torch.from_numpy(reply.content["sensitivity"][name].numpy())
        torch.testing.assert_close(got, expected, **TOLERANCE, msg=name)
    metrics = reply.content["metrics"]
    assert metrics["train-loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert metrics["num-examples"] == len(data)


def test_reused_model_and_partition_leave_no_trace_between_messages() -> None:
    first = build_model(CONFIG.model, (1, 8, 8), 10, seed=5)
    other = build_model(CONFIG.model, (1, 8, 8), 10, seed=6)
    cnn_config = CONFIG.model_copy(update={"model": "cnn"})
    cnn = build_model("cnn", (1, 8, 8), 10, seed=7)
    before = train(instruction(first, 1), node(0))
    train(instruction(other, 2), node(1))  # same cached model object, another partition
    train(instruction(cnn, 1, cnn_config), node(0, cnn_config))  # another architecture
    after = train(instruction(first, 1), node(0))
    for name in before.content["arrays"]:
        np.testing.assert_array_equal(
            after.content["arrays"][name].numpy(), before.content["arrays"][name].numpy()
        )
    assert after.content["metrics"]["train-loss"] == before.content["metrics"]["train-loss"]
