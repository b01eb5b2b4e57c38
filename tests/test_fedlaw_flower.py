"""FedLAW with Flower: a stock quickstart-style ClientApp, and the real app in simulation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from beyond_averaging.server.runtime.inprocess import InProcessGrid
from beyond_averaging.strategies import FedLAW
from beyond_averaging.tasks.datasets import LabeledData
from tests.conftest import read_metrics

NUM_NODES = 3
SERVER_NODE_ID = 0

# ----------------------------------------------------------------------------- a stock ClientApp
# Written the way Flower's PyTorch quickstart writes its client: its own Net and data loading,
# and a train function that replies with `arrays` and `metrics` (train loss and num-examples).
# It knows nothing of this project.


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def digits() -> tuple[np.ndarray, np.ndarray]:
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    return (data.images[order] / 16.0).astype(np.float32), data.target[order].astype(np.int64)


def load_data(partition_id: int, num_partitions: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    images, labels = digits()
    part = np.array_split(np.arange(1200), num_partitions)[partition_id]
    dataset = TensorDataset(torch.from_numpy(images[part]), torch.from_numpy(labels[part]))
    return DataLoader(dataset, batch_size=32, shuffle=True)


def train_fn(
    net: nn.Module, loader: DataLoader[tuple[torch.Tensor, ...]], epochs: int, lr: float
) -> float:
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(loader))


stock_app = ClientApp()


@stock_app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    trainloader = load_data(partition_id, num_partitions)
    train_loss = train_fn(
        model,
        trainloader,
        int(context.run_config["local-epochs"]),
        float(msg.content["config"]["lr"]),  # type: ignore[index,arg-type]
    )
    model_record = ArrayRecord(model.state_dict())
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}  # type: ignore[arg-type]
    content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: small problems run faster and steadier on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_stock_quickstart_clientapp_trains_under_fedlaw(monkeypatch: pytest.MonkeyPatch) -> None:
    # Strategy.start builds instruction Messages, which read the ServerApp's task identity.
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", SERVER_NODE_ID)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)
    images, labels = digits()
    heldout = np.arange(1200, len(labels))
    proxy_rows = np.concatenate([heldout[labels[heldout] == c][:10] for c in range(10)])
    test_rows = np.setdiff1d(heldout, proxy_rows)
    proxy = LabeledData(images[proxy_rows], labels[proxy_rows], 10)
    torch.manual_seed(0)
    net = Net()
    strategy = FedLAW(
        model=net,
        proxy_set=proxy,
        epochs=20,
        lr=0.05,
        min_train_replies=NUM_NODES,
        fraction_evaluate=0.0,  # the stock app below has no evaluate function
    )
    # The project's in-process Grid runs any ClientApp; its nodes hold partitions 0, 1, 2.
    grid = InProcessGrid(stock_app, NUM_NODES, {"local-epochs": 1})
    node_ids = sorted(grid.get_node_ids())
    accuracies: list[float] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            predictions = model(torch.from_numpy(images[test_rows])).argmax(1).numpy()
        accuracies.append(float(np.mean(predictions == labels[test_rows])))
        return MetricRecord({"accuracy": accuracies[-1]})

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(net.state_dict()),
        num_rounds=2,
        train_config=ConfigRecord({"lr": 0.1}),
        evaluate_fn=evaluate_fn,
    )

    for server_round in (1, 2):
        assert not any(
            k.startswith("fedlaw-") for k in result.train_metrics_clientapp[server_round]
        )
        metrics = strategy.aggregation_metrics[server_round]
        assert metrics["replies-valid"] == NUM_NODES
        assert metrics["fedlaw-fallback"] == 0
        assert sorted(metrics["fedlaw-node-ids"]) == node_ids
        lambdas = metrics["fedlaw-lambdas"]
        assert sum(lambdas) == pytest.approx(1.0)
        assert metrics["fedlaw-gamma"] > 0
    assert accuracies[-1] > max(0.5, accuracies[0])  # chance is 0.1


# ----------------------------------------------------------------------------- real simulation
@pytest.mark.simulation
def test_two_round_simulation_with_fedlaw_records_gamma_and_lambdas(
    run_simulation: Callable[..., Path],
) -> None:
    run_dir = run_simulation(
        {"strategy": "fedlaw", "num-server-rounds": 2, "num-clients": 3, "dataset": "digits"}
    )
    rounds = [entry for entry in read_metrics(run_dir) if entry["round"] > 0]
    assert [entry["round"] for entry in rounds] == [1, 2]
    for entry in rounds:
        assert entry["aggregated"] == 1
        assert entry["fedlaw-fallback"] == 0
        assert entry["fedlaw-gamma"] > 0
        assert len(entry["fedlaw-lambdas"]) == 3
        assert sum(entry["fedlaw-lambdas"]) == pytest.approx(1.0)
        assert len(entry["fedlaw-node-ids"]) == 3
        assert not any(k.startswith("fedlaw-lambda-") for k in entry)  # no key per node
    assert rounds[-1]["test-accuracy"] > 0.3  # ten digit classes: chance is 0.1
