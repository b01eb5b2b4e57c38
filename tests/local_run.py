"""The ServerApp's ``main`` driven in one process by a small Grid that runs the real ClientApp.

For the run-level tests (resume, stalled runs, round accounting): every instruction goes to the
project's ClientApp in this process, as a SuperNode would deliver it, so a run here is the same
computation as a deployed one without any process or network in between.

Run as a script (``python -m tests.local_run <settings.json> [--hang-in-round K]``) it is the
ServerApp process that ``tests/test_resume.py`` kills with SIGKILL: with ``--hang-in-round K`` the
grid writes ``<run folder>/hanging`` when round K's instructions arrive and then blocks, so the
kill lands after the checkpoint of round K - 1 and before round K ends, every time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, Metadata, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from beyond_averaging.client.app import app as client_app
from beyond_averaging.server.app import main as server_main

#: fn(message delivered to a node, that node's context) -> reply, or None for no reply.
NodeBehaviour = Callable[[Message, Context], Message | None]


def deliver(message: Message, message_id: str) -> Message:
    """An instruction as a SuperNode receives it (the SuperLink fills in the metadata)."""
    metadata = Metadata(
        run_id=1,
        message_id=message_id,
        src_node_id=0,
        dst_node_id=message.metadata.dst_node_id,
        reply_to_message_id="",
        group_id=message.metadata.group_id,
        created_at=time.time(),
        ttl=message.metadata.ttl,
        message_type=message.metadata.message_type,
    )
    delivered: Message = Message(metadata=metadata, content=message.content)  # type: ignore[call-overload]
    return delivered


class LocalGrid(Grid):
    """Nodes ``1..num_nodes`` (node i holds partition i - 1), each running ``behaviour``.

    ``behaviours`` overrides the ClientApp for some node ids; a behaviour returning ``None``
    models a node whose reply misses the round's timeout. ``hang_in_round`` blocks forever once
    that round's train instructions arrive, after touching ``hang_marker``.
    """

    def __init__(
        self,
        num_nodes: int,
        run_config: Mapping[str, Any],
        behaviours: Mapping[int, NodeBehaviour] | None = None,
        hang_in_round: int | None = None,
        hang_marker: Path | None = None,
    ) -> None:
        self.node_ids = list(range(1, num_nodes + 1))
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": node - 1, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for node in self.node_ids
        }
        self.behaviours = dict(behaviours or {})
        self.hang_in_round, self.hang_marker = hang_in_round, hang_marker
        self.sent = 0
        self.timeouts: list[float | None] = []

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        self.timeouts.append(timeout)
        replies = []
        for message in messages:
            self.sent += 1
            node = message.metadata.dst_node_id
            delivered = deliver(message, f"m{self.sent}")
            round_ = int(message.content.config_records["config"].get("server-round", 0))  # type: ignore[arg-type]
            if round_ == self.hang_in_round and self.hang_marker is not None:
                self.hang_marker.touch()
                while True:  # the test kills this process here
                    time.sleep(60.0)
            behaviour = self.behaviours.get(node, client_app)
            reply = behaviour(delivered, self.contexts[node])
            if reply is not None:
                replies.append(reply)
        return replies

    def _unused(self, *args: object, **kwargs: object) -> Any:
        raise NotImplementedError("the ServerApp uses get_node_ids and send_and_receive only")

    create_message = push_messages = pull_messages = set_run = get_nodes = _unused

    @property
    def run(self) -> Any:
        raise NotImplementedError


def run_server(
    settings: Mapping[str, Any],
    num_nodes: int,
    behaviours: Mapping[int, NodeBehaviour] | None = None,
    hang_in_round: int | None = None,
    hang_marker: Path | None = None,
) -> LocalGrid:
    """Run the ServerApp's main with ``settings`` as its run config over a :class:`LocalGrid`."""
    # What Flower's ServerApp runtime sets before main: the ids new messages are stamped with.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    grid = LocalGrid(num_nodes, settings, behaviours, hang_in_round, hang_marker)
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(settings)
    )
    server_main(grid, context)
    return grid


def main() -> None:
    """``python -m tests.local_run <settings.json> [--hang-in-round K]``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("settings", type=Path)
    parser.add_argument("--hang-in-round", type=int, default=None)
    args = parser.parse_args()
    settings = json.loads(args.settings.read_text(encoding="utf-8"))
    run_dir = Path(settings["output-dir"]) / settings["run-name"]
    run_server(
        settings,
        int(settings["num-clients"]),
        hang_in_round=args.hang_in_round,
        hang_marker=run_dir / "hanging",
    )


if __name__ == "__main__":
    main()
