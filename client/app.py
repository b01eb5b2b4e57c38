"""The ClientApp: trains the received global model on this node's partition and replies.

Reply records follow :mod:`tasks.protocol`: ``arrays`` and ``metrics`` always, plus the extra
ArrayRecords a strategy requests through the train config (``gradient``, ``sensitivity``).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..tasks.evaluation import evaluate, make_loader, resolve_device
from ..tasks.federation import DataSpec, load_client_partition
from ..tasks.models import build_model
from ..tasks.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    GRADIENT_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
    SENSITIVITY_RECORD,
    SERVER_ROUND_KEY,
    TRAIN_LOSS_KEY,
    ClientTask,
    requested_records,
)
from .sensitivity import sensitivity_record
from .training import train_local

app = ClientApp()

#: Extra records this ClientApp knows how to produce when a strategy asks for them.
SUPPORTED_RECORDS = frozenset({GRADIENT_RECORD, SENSITIVITY_RECORD})


def _partition(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as err:
        raise KeyError(
            f"node config lacks {err}: start the SuperNode with "
            "--node-config 'partition-id=<i> num-partitions=<n>'"
        ) from None


def prepare(message: Message, context: Context) -> tuple[ClientTask, Any, torch.nn.Module, int]:
    """Read the task, load this node's partition and build the received model on its device."""
    config: ConfigRecord = message.content[CONFIG_RECORD]  # type: ignore[assignment]
    task = ClientTask.from_config(config)
    partition_id, num_partitions = _partition(context)
    spec = DataSpec.from_task(task, num_partitions)
    data = load_client_partition(spec, partition_id)
    model = build_model(task.model, data.input_shape, data.num_classes)  # type: ignore[arg-type]
    received: ArrayRecord = message.content[ARRAYS_RECORD]  # type: ignore[assignment]
    model.load_state_dict(received.to_torch_state_dict())
    server_round = int(config.get(SERVER_ROUND_KEY, 1))  # type: ignore[arg-type]
    return task, data, model.to(resolve_device(task.device)), server_round  # type: ignore[arg-type]


def cpu_state(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """An ArrayRecord of CPU copies (a model trained on CUDA is sent from host memory)."""
    return ArrayRecord({key: value.detach().cpu() for key, value in tensors.items()})


@app.train()
def train(message: Message, context: Context) -> Message:
    """Local training; replies with ``arrays``, ``metrics`` and any requested extra records."""
    config: ConfigRecord = message.content[CONFIG_RECORD]  # type: ignore[assignment]
    requested = requested_records(config)
    unsupported = sorted(requested - SUPPORTED_RECORDS)
    if unsupported:
        raise ValueError(
            f"the strategy requested records {unsupported} that this ClientApp cannot produce "
            f"(it supports {sorted(SUPPORTED_RECORDS)})"
        )
    task, data, model, server_round = prepare(message, context)
    device = next(model.parameters()).device
    partition_id, _ = _partition(context)
    shuffle_seed = task.seed * 1_000_003 + server_round * 1009 + partition_id
    loader = make_loader(data, task.batch_size, shuffle=True, seed=shuffle_seed)
    sensitivity = None
    if SENSITIVITY_RECORD in requested:
        # Elastic aggregation: on the received global model, before training, over the batches
        # of the first local epoch (a loader of its own, so training's shuffling is unchanged).
        sensitivity_batches = make_loader(data, task.batch_size, shuffle=True, seed=shuffle_seed)
        sensitivity = sensitivity_record(model, sensitivity_batches, message, context)
    result = train_local(
        model,
        loader,
        epochs=task.local_epochs,
        learning_rate=task.round_learning_rate(server_round),
        momentum=task.momentum,
        weight_decay=task.weight_decay,
        device=device,
        proximal_mu=task.proximal_mu,
        keep_last_gradient=GRADIENT_RECORD in requested,
    )
    content = RecordDict(
        {
            ARRAYS_RECORD: cpu_state(model.state_dict()),
            METRICS_RECORD: MetricRecord(
                {NUM_EXAMPLES_KEY: result.num_examples, TRAIN_LOSS_KEY: result.mean_loss}
            ),
        }
    )
    if result.last_gradient is not None:
        content[GRADIENT_RECORD] = cpu_state(result.last_gradient)
    if sensitivity is not None:
        content[SENSITIVITY_RECORD] = sensitivity
    return Message(content=content, reply_to=message)


@app.evaluate()
def evaluate_local(message: Message, context: Context) -> Message:
    """Evaluate the received global model on this node's partition."""
    _, data, model, _ = prepare(message, context)
    loss, accuracy = evaluate(model, data, next(model.parameters()).device)
    metrics = MetricRecord(
        {NUM_EXAMPLES_KEY: len(data), "eval-loss": loss, "eval-accuracy": accuracy}
    )
    return Message(content=RecordDict({METRICS_RECORD: metrics}), reply_to=message)
