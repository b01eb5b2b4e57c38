"""The docs' recipes, copied from docs/*.md, run two rounds in process on dict and tuple batches.

The fast twin of the wheel-in-a-clean-venv test apps (tests/apps/): no Ray, no install. Each rule's
server recipe binds ``strategy`` beside the names the recipes may assume (``net``,
``proxy_loader``); its client recipe, if it has one, defines the ClientApp's ``train`` in a module
namespace holding the names of Flower's quickstart-pytorch (``Net``, ``load_data``, ``train_fn``).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity
from torch import nn
from torch.utils.data import DataLoader, Dataset

DOCS = Path(__file__).resolve().parents[1] / "docs"
NODES = (1, 2, 3, 4)
PAIRS = [
    ("fedavg-server", None),
    ("elastic-server", "elastic-client"),
    ("fedlaw-server", None),
    ("fedgma-server", "fedgma-client"),
    ("fedgma-soft-server", None),
]


def recipe(name: str) -> str:
    """The python block after ``<!-- recipe: name -->``; exactly one in docs/."""
    found = [
        match.group(1)
        for page in sorted(DOCS.glob("*.md"))
        for match in re.finditer(
            rf"<!-- recipe: {re.escape(name)} -->\n```python\n(.*?)```", page.read_text(), re.S
        )
    ]
    assert len(found) == 1, f"recipe {name!r} appears {len(found)} times in docs/"
    return found[0]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class Digits(Dataset[Any]):
    """Random 8x8 images, labels 0..9; samples as the quickstart's dicts or as (x, y) tuples."""

    def __init__(self, seed: int, size: int, as_dict: bool) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 1, 8, 8, generator=generator)
        self.y = torch.arange(size) % 10
        self.as_dict = as_dict

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> Any:
        if self.as_dict:
            return {"img": self.x[index], "label": int(self.y[index])}
        return self.x[index], self.y[index]


def quickstart_names(as_dict: bool) -> dict[str, Any]:
    """The module namespace of a quickstart-style client_app.py (before the recipe)."""

    def load_data(partition_id: int, num_partitions: int, batch_size: int) -> tuple[Any, Any]:
        train = Digits(partition_id, 64, as_dict)
        return DataLoader(train, batch_size=batch_size, shuffle=True), None

    def train_fn(net: nn.Module, loader: Any, epochs: int, lr: float, device: Any) -> float:
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        total = 0.0
        for _ in range(epochs):
            for batch in loader:
                x, y = (batch["img"], batch["label"]) if as_dict else batch
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(net(x.to(device)), y.to(device))
                loss.backward()
                optimizer.step()
                total += loss.item()
        return total / (epochs * len(loader))

    app = ClientApp()
    return {
        "torch": torch,
        "ArrayRecord": ArrayRecord,
        "Context": Context,
        "Message": Message,
        "MetricRecord": MetricRecord,
        "RecordDict": RecordDict,
        "ClientApp": ClientApp,
        "Net": Net,
        "load_data": load_data,
        "train_fn": train_fn,
        "app": app,
    }


def client_app(client_recipe: str | None, as_dict: bool) -> ClientApp:
    names = quickstart_names(as_dict)
    app: ClientApp = names["app"]
    if client_recipe is not None:
        exec(recipe(client_recipe), names)  # the docs' recipe, verbatim
    else:  # the quickstart's own train function, unchanged

        @app.train()
        def train(msg: Message, context: Context) -> Message:
            model = Net()
            model.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
            loader, _ = names["load_data"](context.node_config["partition-id"], 4, 16)
            loss = names["train_fn"](model, loader, 1, msg.content["config"]["lr"], "cpu")  # type: ignore[index]
            metrics = MetricRecord({"train_loss": loss, "num-examples": len(loader.dataset)})
            content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
            return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
        data = Digits(100 + int(context.node_config["partition-id"]), 32, as_dict=False)
        with torch.no_grad():
            accuracy = float((model(data.x).argmax(1) == data.y).float().mean())
        metrics = MetricRecord({"accuracy": accuracy, "num-examples": len(data)})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


class InProcessGrid:
    """Delivers each message to the ClientApp of its node, in this process."""

    def __init__(self, app: ClientApp) -> None:
        self.app = app
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": node - 1, "num-partitions": len(NODES)},
                state=RecordDict(),
                run_config={"batch-size": 16, "local-epochs": 1},
            )
            for node in NODES
        }

    def get_node_ids(self) -> Iterable[int]:
        return list(NODES)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        replies = []
        for message in messages:
            delivered = Message(
                content=message.content,
                metadata=Metadata(
                    run_id=1,
                    message_id=uuid.uuid4().hex,
                    src_node_id=0,
                    dst_node_id=message.metadata.dst_node_id,
                    reply_to_message_id="",
                    group_id="1",
                    created_at=time.time(),
                    ttl=600.0,
                    message_type=message.metadata.message_type,
                ),
            )
            replies.append(self.app(delivered, self.contexts[message.metadata.dst_node_id]))
        return replies


@pytest.mark.parametrize("as_dict", [True, False], ids=["dict-batches", "tuple-batches"])
@pytest.mark.parametrize(("server", "client"), PAIRS, ids=[server for server, _ in PAIRS])
def test_recipe_runs_two_rounds_verbatim(
    server: str, client: str | None, as_dict: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)
    torch.manual_seed(0)
    net = Net()
    proxy_loader = DataLoader(Digits(99, 100, as_dict), batch_size=25)
    names: dict[str, Any] = {"net": net, "proxy_loader": proxy_loader}
    exec(recipe(server), names)  # the docs' recipe, verbatim
    strategy = names["strategy"]
    result = strategy.start(
        grid=InProcessGrid(client_app(client, as_dict)),
        initial_arrays=ArrayRecord(net.state_dict()),
        train_config=ConfigRecord({"lr": 0.1}),
        num_rounds=2,
    )
    for server_round in (1, 2):
        figures = strategy.aggregation_metrics[server_round]
        assert figures["aggregated"] == 1
        assert figures["replies-dropped"] == 0
        assert set(result.train_metrics_clientapp[server_round]) == {"train_loss"}
        assert set(result.evaluate_metrics_clientapp[server_round]) == {"accuracy"}
