"""A ClientApp that fails on purpose in round 1: the warm executor's fault tests.

The deployment tests point a staged copy of the app at it (``clientapp =
"tests.crashing_app:app"``); a node behaves as the project's own ClientApp unless its
``--node-config`` names ``crash``, and then, in round 1 only:

- ``crash="raise"``: the ClientApp raises (Flower answers the instruction with an error reply);
- ``crash="kill"``: the ClientApp's process is killed (``SIGKILL``: no reply at all);
- ``crash="hang"``: the ClientApp sleeps for an hour (the executor's task timeout kills it).

Each node fails once: before failing it creates the file its ``crash-marker`` names, so that
anything that runs the instruction again trains honestly, as after a one-off fault. From round 2
on every node trains honestly: the same warm executor must still serve it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from beyond_averaging.client.app import evaluate_local as honest_evaluate
from beyond_averaging.client.app import train as honest_train
from beyond_averaging.tasks.protocol import CONFIG_RECORD, SERVER_ROUND_KEY

app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    """Fail as the node's ``crash`` setting says in round 1; train honestly otherwise."""
    crash = str(context.node_config.get("crash", ""))
    marker = Path(str(context.node_config.get("crash-marker", "")))
    first_round = int(message.content[CONFIG_RECORD][SERVER_ROUND_KEY]) == 1  # type: ignore[arg-type]
    if crash and first_round and not marker.exists():
        marker.touch()
        if crash == "raise":
            raise RuntimeError("crashing_app: raising in round 1 on purpose")
        if crash == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if crash == "hang":
            time.sleep(3600)
    return honest_train(message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """The project's own evaluation."""
    return honest_evaluate(message, context)
