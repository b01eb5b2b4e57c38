"""The in-process runtime (server.runtime.inprocess, ``ba-run --runtime inprocess``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.config import get_fused_config_from_dir
from flwr.supercore.task_identity import TaskIdentity

from beyond_averaging.client.app import app as client_app
from beyond_averaging.server.app import client_task
from beyond_averaging.server.app import main as server_main
from beyond_averaging.server.cli.main import main as ba_run
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.pull import DelegatingGrid
from beyond_averaging.server.runtime.inprocess import FIRST_NODE_ID, InProcessGrid, run_inprocess
from beyond_averaging.tasks.models import build_model
from tests.conftest import instruction_message

REPO = Path(__file__).resolve().parents[1]
SETTINGS: dict[str, Any] = {
    "strategy": "fedavg",
    "num-clients": 3,
    "num-server-rounds": 2,
    "local-epochs": 1,
    "device": "cpu",
    "seed": 3,
}


def fedavg_by_hand(settings: dict[str, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """The global model after the run, driving the ClientApp message by message.

    Every round, each node's ClientApp gets the global model and the task with the round number;
    the new global model is the num-examples-weighted mean of the replies (float64).
    """
    config = parse_run_config(settings)
    torch.manual_seed(config.seed)
    state = {
        name: value.detach().numpy().copy()
        for name, value in build_model(config.model, (1, 8, 8), 10, seed=config.seed)
        .state_dict()
        .items()
    }
    contexts = [
        Context(
            run_id=1,
            node_id=partition + 10,
            node_config={"partition-id": partition, "num-partitions": config.num_clients},
            state=RecordDict(),
            run_config={},
        )
        for partition in range(config.num_clients)
    ]
    for server_round in range(1, config.num_server_rounds + 1):
        task = {**client_task(config).to_config(), "server-round": server_round}
        replies = []
        for context in contexts:
            content = RecordDict(
                {
                    "arrays": ArrayRecord({k: Array(v) for k, v in state.items()}),
                    "config": ConfigRecord(task),  # type: ignore[arg-type]
                }
            )
            replies.append(client_app(instruction_message(content), context).content)
        weights = np.array([float(r["metrics"]["num-examples"]) for r in replies])  # type: ignore[arg-type]
        weights /= weights.sum()
        state = {
            name: sum(
                w * r["arrays"][name].numpy().astype(np.float64)  # type: ignore[union-attr]
                for w, r in zip(weights, replies, strict=True)
            ).astype(state[name].dtype)
            for name in state
        }
    return state


def test_inprocess_run_reaches_the_global_model_of_the_clientapp_driven_by_hand(
    tmp_path: Path,
) -> None:
    run_inprocess(REPO, {**SETTINGS, "output-dir": str(tmp_path), "run-name": "r"})
    final = torch.load(tmp_path / "r" / "final_model.pt")
    expected = fedavg_by_hand(SETTINGS)
    assert set(final) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(final[name].numpy(), value, rtol=0, atol=1e-5, err_msg=name)


def test_ba_run_inprocess_completes_a_run_with_metrics_and_summary(tmp_path: Path) -> None:
    overrides = " ".join(
        f"{key}={json.dumps(value)}"
        for key, value in {**SETTINGS, "output-dir": str(tmp_path), "run-name": "cli"}.items()
    )
    assert ba_run(["--app", str(REPO), "--runtime", "inprocess", "-c", overrides]) == 0
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["status"] == "completed"
    rounds = [
        json.loads(line)
        for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert summary["final"]["test-accuracy"] == rounds[-1]["test-accuracy"]


def test_ba_run_inprocess_fails_with_the_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = ba_run(
        [
            "--app",
            str(REPO),
            "--runtime",
            "inprocess",
            "-c",
            f'strategy="nope" output-dir="{tmp_path}"',
        ]
    )
    assert code == 2  # a value that is not allowed, refused before the run starts
    assert "strategy" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # and no run folder


# --- the Grid ---------------------------------------------------------------------------

echo_app = ClientApp()


@echo_app.train()
def echo_partition(message: Message, context: Context) -> Message:
    """Replies with its partition id; partition 1 fails."""
    partition = int(context.node_config["partition-id"])
    if partition == 1:
        raise RuntimeError("partition 1 is broken")
    return Message(
        RecordDict({"metrics": MetricRecord({"partition": partition})}), reply_to=message
    )


def train_messages(node_ids: Sequence[int]) -> list[Message]:
    return [Message(RecordDict(), node, "train") for node in node_ids]


def test_grid_delivers_to_each_nodes_partition_and_turns_a_raise_into_an_error_reply() -> None:
    grid = InProcessGrid(echo_app, 3, {})
    nodes = sorted(grid.get_node_ids())
    assert nodes == [FIRST_NODE_ID, FIRST_NODE_ID + 1, FIRST_NODE_ID + 2]
    messages = train_messages([nodes[2], nodes[0], nodes[1]])
    replies = list(grid.send_and_receive(messages))
    assert [r.metadata.reply_to_message_id for r in replies] == [
        m.metadata.message_id for m in messages
    ]
    assert len({m.metadata.message_id for m in messages}) == 3
    assert replies[0].content["metrics"]["partition"] == 2
    assert replies[1].content["metrics"]["partition"] == 0
    assert replies[2].has_error()
    assert "partition 1 is broken" in replies[2].error.reason


def test_grid_refuses_a_message_to_an_unknown_node_and_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match="not in this federation"):
        InProcessGrid(echo_app, 2, {}).send_and_receive(train_messages([5]))
    with pytest.raises(ValueError, match="client-backend"):
        InProcessGrid(echo_app, 2, {"client-backend": "threads"})


def test_vectorized_backend_gets_the_rounds_train_messages_at_once() -> None:
    calls: list[list[int]] = []

    def cohort(messages: Sequence[Message], contexts: Sequence[Context]) -> list[Message]:
        calls.append([int(c.node_config["partition-id"]) for c in contexts])
        return [
            Message(RecordDict({"metrics": MetricRecord({"cohort": len(messages)})}), reply_to=m)
            for m in messages
        ]

    grid = InProcessGrid(echo_app, 3, {"client-backend": "vectorized"}, cohort_trainer=cohort)
    nodes = sorted(grid.get_node_ids())
    replies = list(grid.send_and_receive(train_messages([nodes[0], nodes[2]])))
    assert calls == [[0, 2]]
    assert [r.content["metrics"]["cohort"] for r in replies] == [2, 2]
    evaluation = Message(RecordDict(), nodes[1], "evaluate")
    (reply,) = grid.send_and_receive([evaluation])
    assert calls == [[0, 2]]  # evaluate messages go to the ClientApp
    assert reply.has_error()  # echo_app registers no evaluate function


def test_vectorized_backend_outside_the_inprocess_runtime_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in (("_run_id", 1), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)  # what a ServerApp process is told
    run_config = get_fused_config_from_dir(
        REPO,
        {
            **SETTINGS,
            "num-server-rounds": 1,
            "client-backend": "vectorized",
            "output-dir": str(tmp_path),
            "run-name": "warned",
        },
    )
    # The forwarded Grid trains with the ClientApp: the option cannot take effect there.
    grid = DelegatingGrid(InProcessGrid(client_app, 3, {}))  # a Grid of another kind
    context = Context(
        run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config
    )
    with caplog.at_level(logging.WARNING):
        server_main(grid, context)
    assert "in-process runtime only" in caplog.text
    summary = json.loads((tmp_path / "warned" / "summary.json").read_text())
    assert summary["status"] == "completed"
