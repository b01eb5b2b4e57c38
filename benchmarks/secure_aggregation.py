"""What secure aggregation costs per round: CPU seconds and payload bytes, server and per client.

One round of FedAvg on the digits MLP (55,210 values) in process, with and without SecAgg+, at
each cohort size and neighbourhood given. The clients do not train (each reply is a fixed update):
what is measured is the protocol alone, on top of whatever training costs.

- ``server-cpu-s``: CPU seconds of the server's side of the round (the strategy's
  ``configure_train`` and ``aggregate_train``, its stages' sending included), the clients' time
  taken out;
- ``client-cpu-s``: CPU seconds one client spends in the secure-aggregation mod over the round's
  four stages (the mean over the clients), training excluded;
- ``client-bytes``: payload bytes to and from one client over the round (the mean): array bytes and
  the config records' values (keys, public keys, sealed shares, the masked vector), counted as the
  strategies count a reply's size (:func:`strategies.replies.validation.reply_bytes`);
- ``server-bytes``: the same summed over the clients.

Each secure row is run at every ``--modulus-bits`` (64, the default: 8 bytes a value; 32,
Flower's: 4 bytes), on the finest levels the cohort fits.

Usage::

    .venv/bin/python -m benchmarks.secure_aggregation --clients 10 50 100 --neighbours 0 8
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.supercore.task_identity import TaskIdentity

from beyond_averaging.client.secure import secure_aggregation_mod
from beyond_averaging.server.runtime.inprocess import InProcessGrid
from beyond_averaging.strategies import FedAvg
from beyond_averaging.strategies.replies.validation import reply_bytes
from beyond_averaging.strategies.secure import BOUNDS_OFF, SecAggOptions, SecureAggregation
from beyond_averaging.tasks.models import build_model


class Meter:
    """Client CPU time in the mod and bytes per node, gathered over one round."""

    def __init__(self) -> None:
        self.client_cpu: dict[int, float] = {}
        self.bytes: dict[int, int] = {}

    def mod(self, message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        node = message.metadata.dst_node_id
        started = time.process_time()
        inner = 0.0

        def timed_next(inner_message: Message, inner_context: Context) -> Message:
            nonlocal inner
            began = time.process_time()
            reply = call_next(inner_message, inner_context)
            inner += time.process_time() - began
            return reply

        reply = secure_aggregation_mod(message, context, timed_next)
        spent = time.process_time() - started - inner
        self.client_cpu[node] = self.client_cpu.get(node, 0.0) + spent
        sent = reply_bytes(message.content) + reply_bytes(reply.content)
        self.bytes[node] = self.bytes.get(node, 0) + sent
        return reply


def make_app(meter: Meter, model: dict[str, np.ndarray]) -> ClientApp:
    app = ClientApp()

    @app.train(mods=[meter.mod])
    def train(message: Message, context: Context) -> Message:
        rng = np.random.default_rng(message.metadata.dst_node_id)
        trained = {
            k: (v + rng.normal(scale=0.01, size=v.shape)).astype(v.dtype) for k, v in model.items()
        }
        return Message(
            content=RecordDict(
                {
                    "arrays": ArrayRecord({k: Array(v) for k, v in trained.items()}),
                    "metrics": MetricRecord({"num-examples": 100, "train-loss": 0.5}),
                }
            ),
            reply_to=message,
        )

    return app


def one_round(clients: int, neighbours: int | None, modulus: int = 64) -> dict[str, Any]:
    """One round's figures; ``neighbours`` None: plain FedAvg (no secure aggregation)."""
    model = {k: v.numpy() for k, v in build_model("mlp", (64,), 10).state_dict().items()}
    meter = Meter()
    grid = InProcessGrid(make_app(meter, model), clients, {})
    rule = FedAvg(
        min_train_nodes=clients,
        min_available_nodes=clients,
        fraction_evaluate=0.0,
        log_rounds=False,
        **BOUNDS_OFF,
    )
    strategy = (
        rule
        if neighbours is None
        else SecureAggregation(rule, SecAggOptions(neighbours=neighbours, modulus_bits=modulus))
    )
    arrays = ArrayRecord({k: Array(v) for k, v in model.items()})
    started = time.process_time()
    instructions = list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))
    replies: Iterable[Message] = grid.send_and_receive(instructions)
    if neighbours is None:  # the plain round's bytes: the model down, the reply up
        replies = list(replies)
        for message, reply in zip(instructions, replies, strict=True):
            node = message.metadata.dst_node_id
            meter.bytes[node] = reply_bytes(message.content) + reply_bytes(reply.content)
    new, _ = strategy.aggregate_train(1, replies)
    total = time.process_time() - started
    assert new is not None
    client_cpu = sum(meter.client_cpu.values())
    return {
        "clients": clients,
        "secure": "no" if neighbours is None else f"neighbours {neighbours or 'all'}, 2^{modulus}",
        "server-cpu-s": total - client_cpu,
        "client-cpu-s": client_cpu / clients,
        "client-bytes": sum(meter.bytes.values()) / clients,
        "server-bytes": sum(meter.bytes.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--neighbours", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--modulus-bits", type=int, nargs="+", default=[64, 32])
    args = parser.parse_args()
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 0
    print(
        "| clients | secure aggregation | server CPU s | client CPU s | client bytes "
        "| server bytes |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for clients in args.clients:
        rows = [(None, 64)]
        rows += [(k, m) for k in args.neighbours for m in args.modulus_bits]
        for neighbours, modulus in rows:
            if neighbours is not None and 0 < neighbours >= clients - 1:
                continue
            row = one_round(clients, neighbours, modulus)
            print(
                f"| {row['clients']} | {row['secure']} | {row['server-cpu-s']:.3f} | "
                f"{row['client-cpu-s']:.3f} | {row['client-bytes'] / 1e3:,.0f} kB | "
                f"{row['server-bytes'] / 1e6:,.1f} MB |",
                flush=True,
            )


if __name__ == "__main__":
    main()
