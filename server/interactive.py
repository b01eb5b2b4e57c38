"""This project's app in process, one round at a time in your hands: the ServerApp's model and
strategy, the real ClientApp behind an in-process Grid
(:class:`server.runtime.inprocess.InProcessGrid`), and the round loop yours, to read, measure or
rewrite instructions and replies between rounds (a reply analysis, an attack of your own: wrap
``grid``). ``ba-run --runtime inprocess`` runs the same parts under the ServerApp's own loop.
docs/running.md ("Round by round in Python")::

    from beyond_averaging.server.interactive import federation

    fed = federation({"strategy": "elastic", "num-clients": 5})
    replies = fed.round(1)  # the sampled nodes train, the strategy aggregates
    loss, accuracy = fed.evaluate()  # the global model on the server's test split
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import LoadClientAppError
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore.object_ref import load_app
from flwr.supercore.task_identity import TaskIdentity

from beyond_averaging.server.runtime.inprocess import InProcessGrid
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import DeviceData, evaluate
from beyond_averaging.tasks.federation import load_server_splits
from beyond_averaging.tasks.models import build_model

from .app import client_task, data_spec
from .config import RunConfig, parse_run_config
from .strategy_factory import ServerResources, build_strategy

#: This project's ClientApp, by its component string (as pyproject.toml names it to Flower).
CLIENT_APP = "beyond_averaging.client.app:app"


@dataclass
class Federation:
    """The server's side of an in-process federation, driven round by round by its caller."""

    config: RunConfig
    model: torch.nn.Module
    strategy: Strategy
    grid: Grid
    arrays: ArrayRecord
    test_set: LabeledData

    def instructions(self, server_round: int) -> list[Message]:
        """The strategy's train instructions of a round, for the current global model."""
        task = ConfigRecord(client_task(self.config).to_config())
        return list(self.strategy.configure_train(server_round, self.arrays, task, self.grid))

    def round(self, server_round: int) -> list[Message]:
        """Train one round on the sampled nodes and aggregate; returns the replies."""
        replies = list(self.grid.send_and_receive(self.instructions(server_round)))
        arrays, _ = self.strategy.aggregate_train(server_round, replies)
        self.arrays = arrays if arrays is not None else self.arrays
        return replies

    def evaluate(self) -> tuple[float, float]:
        """Loss and accuracy of the current global model on the server's test split."""
        self.model.load_state_dict(self.arrays.to_torch_state_dict())
        cpu = torch.device("cpu")
        return evaluate(self.model, DeviceData.from_labeled(self.test_set, cpu), cpu)


def federation(
    settings: Mapping[str, Any],
    strategy: Callable[[RunConfig, ServerResources], Strategy] = build_strategy,
) -> Federation:
    """A :class:`Federation` of run-config ``settings`` (the rest: the defaults): model and
    strategy as the ServerApp builds them, or the strategy ``strategy`` builds (e.g. one of
    Flower's own), on the CPU.

    Raises
    ------
    server.config.ConfigError
        ``settings`` the app refuses.
    """
    config = parse_run_config(settings)
    # The ClientApp reads the task identity Flower's runtime sets; this runtime sets its own.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    torch.manual_seed(config.seed)
    test_set, proxy_set = load_server_splits(data_spec(config))
    model = build_model(config.model, test_set.input_shape, test_set.num_classes, seed=config.seed)
    rule = strategy(config, ServerResources(model, proxy_set, torch.device("cpu"), test_set))
    client_app = cast(ClientApp, load_app(CLIENT_APP, LoadClientAppError))
    grid = InProcessGrid(client_app, config.num_clients, config.to_run_config())
    arrays = ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return Federation(config, model, rule, grid, arrays, test_set)
