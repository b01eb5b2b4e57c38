"""The Elastic recipe (docs/elastic.md): sensitivity added to a Flower ClientApp in two lines.

``recipe_app`` below is a stock-style Flower ClientApp (as in Flower's PyTorch quickstart) with
exactly the two lines the docs/elastic.md section "Use in an existing Flower app"
adds. ElasticAggregation accepts its replies; the same app without the two lines is refused with
the recipe in the error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from beyond_averaging.client.sensitivity import sensitivity_record
from beyond_averaging.strategies import ElasticAggregation, MissingRecordError
from tests.conftest import instruction_message


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def load_data(partition_id: int) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(partition_id)
    features = torch.randn(40, 4, generator=generator)
    labels = torch.randint(0, 3, (40,), generator=generator)
    return DataLoader(TensorDataset(features, labels), batch_size=8, shuffle=True)


def train_fn(net: nn.Module, trainloader: DataLoader[Any]) -> float:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    net.train()
    total = 0.0
    for features, labels in trainloader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(net(features), labels)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / len(trainloader)


recipe_app = ClientApp()


@recipe_app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader = load_data(int(context.node_config["partition-id"]))
    sensitivity = sensitivity_record(model, trainloader, msg, context)  # (1) before training
    train_loss = train_fn(model, trainloader)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord(
                {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}  # type: ignore[arg-type]
            ),
        }
    )
    content["sensitivity"] = sensitivity  # (2) send it
    return Message(content=content, reply_to=msg)


stock_app = ClientApp()


@stock_app.train()
def stock_train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader = load_data(int(context.node_config["partition-id"]))
    train_loss = train_fn(model, trainloader)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord(
                {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}  # type: ignore[arg-type]
            ),
        }
    )
    return Message(content=content, reply_to=msg)


@pytest.fixture(autouse=True)
def serverapp_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """configure_train builds instruction Messages, which read the ServerApp's task identity."""
    for attribute in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attribute, 1 if attribute == "_run_id" else 0)


class TwoNodeGrid:
    """The one Grid method configure_train uses."""

    def get_node_ids(self) -> list[int]:
        return [1, 2]


def run_round(
    app: ClientApp, strategy: ElasticAggregation, arrays: ArrayRecord, contexts: list[Context]
) -> tuple[ArrayRecord | None, Any]:
    instructions = strategy.configure_train(1, arrays, ConfigRecord(), TwoNodeGrid())  # type: ignore[arg-type]
    replies = []
    for instruction in instructions:
        message = instruction_message(instruction.content, node_id=instruction.metadata.dst_node_id)
        replies.append(app(message, contexts[instruction.metadata.dst_node_id - 1]))
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays, strategy.aggregation_metrics[1]


def contexts() -> list[Context]:
    return [
        Context(
            run_id=1,
            node_id=node,
            node_config={"partition-id": node - 1},
            state=RecordDict(),
            run_config={},
        )
        for node in (1, 2)
    ]


def elastic_for(net: nn.Module) -> ElasticAggregation:
    keys = [name for name, p in net.named_parameters() if p.requires_grad]
    return ElasticAggregation(parameter_keys=keys, sensitivity_dtype="float16", fraction_train=1.0)


def test_recipe_client_app_replies_are_accepted_and_aggregated_over_two_rounds() -> None:
    torch.manual_seed(0)
    net = Net()
    strategy, nodes = elastic_for(net), contexts()
    arrays = ArrayRecord(net.state_dict())
    for _ in range(2):
        new_arrays, metrics = run_round(recipe_app, strategy, arrays, nodes)
        assert new_arrays is not None
        assert metrics["replies-valid"] == 2
        assert metrics["replies-dropped"] == 0
        assert 0.5 <= metrics["elastic-zeta-min"] <= metrics["elastic-zeta-mean"] <= 1.5
        arrays = new_arrays
    # The moving average lives in each node's context state from one round to the next.
    for node in nodes:
        stored = node.state.array_records["elastic-sensitivity"]
        assert set(stored) == {name for name, _ in net.named_parameters()}
        assert all(np.all(array.numpy() >= 0) for array in stored.values())


def test_the_same_app_without_the_two_lines_is_refused_with_the_recipe() -> None:
    net = Net()
    with pytest.raises(MissingRecordError, match=r"sensitivity_record\(model, batches"):
        run_round(stock_app, elastic_for(net), ArrayRecord(net.state_dict()), contexts())
