"""The ClientApp: trains the received global model on this node's partition and replies.

Reply records follow :mod:`tasks.protocol`: ``arrays`` and ``metrics`` always, plus the extra
ArrayRecords a strategy requests through the train config (``gradient``, ``sensitivity``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from beyond_averaging import __version__
from beyond_averaging.tasks.batching import shuffle_seed, shuffled_batches
from beyond_averaging.tasks.datasets import DatasetNotFoundError, load_dataset
from beyond_averaging.tasks.evaluation import DeviceData, evaluate, resolve_device
from beyond_averaging.tasks.federation import DataSpec, load_client_partition
from beyond_averaging.tasks.models import ModelName, build_model
from beyond_averaging.tasks.packing import Layout, array_layout, is_packed, pack, unpack
from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    CLIENT_RECORD,
    CONFIG_RECORD,
    GRADIENT_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
    PARTITION_ID_KEY,
    SENSITIVITY_RECORD,
    SERVER_ROUND_KEY,
    TRAIN_LOSS_KEY,
    ClientTask,
    check_library_version,
    requested_records,
)
from beyond_averaging.tasks.training import train_local

from .secure import secure_aggregation_mod
from .sensitivity import sensitivity_record

app = ClientApp()

#: Extra records this ClientApp knows how to produce when a strategy asks for them.
SUPPORTED_RECORDS = frozenset({GRADIENT_RECORD, SENSITIVITY_RECORD})


def warm(node_config: Mapping[str, Any]) -> None:
    """The warm executor's warm-up for this ClientApp (``ba-warm-executor``'s default
    ``--warm``): parse the digits table once in the warm parent, so that every ClientApp forked
    from it inherits the parsed table instead of parsing it again for its message (about 50 ms
    of CPU a message, more than the digits MLP's two epochs of training).

    The run's config (which data set, which split) arrives with each message, so nothing else is
    loaded here; Fashion-MNIST and MNIST are read per message. ``node_config`` is not needed. A
    table that is not installed is left to the message's ClientApp to report.
    """
    del node_config  # the warm-up's signature (server.deploy.warm_executor.warm_up)
    with contextlib.suppress(DatasetNotFoundError):
        load_dataset("digits")


def node_partition(context: Context) -> tuple[int, int]:
    """The node's (partition id, number of partitions) from its node config, for every client
    backend (this ClientApp, the vectorised one)."""
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as err:
        raise KeyError(
            f"node config lacks {err}: start the SuperNode with "
            "--node-config 'partition-id=<i> num-partitions=<n>' (the in-process runtime and "
            "Flower's simulation give every node both)"
        ) from None


#: Partitions kept on their training device per process, least recently used dropped first.
#: A process that hosts several nodes or rounds (the in-process runtime; a Ray actor of the
#: simulation, which serves many nodes in turn) loads and copies each partition once. A
#: SuperNode starts a ClientApp process per message, so there the cache spans one message (the
#: disk cache of tasks/partition_cache.py and :func:`warm` are what help there). The partitions
#: of one federation add up to its training pool, so the bound is about one data set per
#: federation held (Fashion-MNIST: 188 MB).
CACHED_PARTITIONS = 256
#: Model objects kept per process (one per architecture, device and thread): each message loads
#: the received state into it, so no model is rebuilt per round.
CACHED_MODELS = 8


@functools.lru_cache(maxsize=CACHED_PARTITIONS)
def device_partition(spec: DataSpec, partition_id: int, device: torch.device) -> DeviceData:
    """This node's training partition as tensors on ``device``, cached (read-only use)."""
    return DeviceData.from_labeled(load_client_partition(spec, partition_id), device)


@functools.lru_cache(maxsize=CACHED_MODELS)
def _model_shell(
    name: ModelName,
    input_shape: tuple[int, ...],
    num_classes: int,
    device: torch.device,
    thread: int,
) -> torch.nn.Module:
    # Keyed by thread as well: a model object is never shared by two concurrent messages.
    return build_model(name, input_shape, num_classes).to(device)


def prepare(
    message: Message, context: Context
) -> tuple[ClientTask, DeviceData, torch.nn.Module, int]:
    """Read the task, fetch this node's partition and load the received model on its device."""
    config: ConfigRecord = message.content[CONFIG_RECORD]  # type: ignore[assignment]
    check_library_version(config, __version__)
    task = ClientTask.from_config(config)
    partition_id, num_partitions = node_partition(context)
    device = resolve_device(task.device)  # type: ignore[arg-type]
    data = device_partition(DataSpec.from_task(task, num_partitions), partition_id, device)
    model = _model_shell(
        task.model,
        data.input_shape,
        data.num_classes,
        device,
        threading.get_ident(),
    )
    received: ArrayRecord = message.content[ARRAYS_RECORD]  # type: ignore[assignment]
    model.load_state_dict(received_state(received, model))
    server_round = int(config.get(SERVER_ROUND_KEY, 1))  # type: ignore[arg-type]
    return task, data, model, server_round


def received_state(record: ArrayRecord, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The received model as a state dict for ``model``, sent per tensor or packed
    (:mod:`tasks.packing`; a packed model for another architecture is refused, naming both)."""
    if not is_packed(record):
        return record.to_torch_state_dict()
    arrays = {key: array.numpy() for key, array in record.items()}
    unpacked = unpack(arrays, array_layout(model.state_dict()), whole=True)
    return {key: torch.from_numpy(value) for key, value in unpacked.items()}


def cpu_state(tensors: dict[str, torch.Tensor], packed: Layout | None = None) -> ArrayRecord:
    """An ArrayRecord of CPU copies (a model trained on CUDA is sent from host memory); packed
    by the model's layout ``packed`` when the model came packed (:func:`tasks.packing.pack`)."""
    if packed is None:
        return ArrayRecord({key: value.detach().cpu() for key, value in tensors.items()})
    arrays = {key: value.detach().cpu().numpy() for key, value in tensors.items()}
    return ArrayRecord({key: Array(value) for key, value in pack(arrays, packed).items()})


# Secure aggregation's stages (client/secure.py): a train message without them passes through.
@app.train(mods=[secure_aggregation_mod])
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
    # A model that came packed is answered packed (its layout: the model's own).
    packed = array_layout(model.state_dict()) if is_packed(message.content[ARRAYS_RECORD]) else None
    partition_id, _ = node_partition(context)
    seed = shuffle_seed(task.seed, server_round, partition_id)
    plan = shuffled_batches(len(data), task.batch_size, task.local_epochs, seed)
    sensitivity = None
    if SENSITIVITY_RECORD in requested:
        # Elastic aggregation: on the received global model, before training, over the batches
        # of the first local epoch.
        first_epoch = plan[: len(plan) // max(task.local_epochs, 1)]
        sensitivity = sensitivity_record(
            model, (data.features[positions] for positions in first_epoch), message, context
        )
    result = train_local(
        model,
        data,
        plan,
        learning_rate=task.round_learning_rate(server_round),
        momentum=task.momentum,
        weight_decay=task.weight_decay,
        proximal_mu=task.proximal_mu,
        keep_last_gradient=GRADIENT_RECORD in requested,
    )
    content = RecordDict(
        {
            ARRAYS_RECORD: cpu_state(model.state_dict(), packed),
            METRICS_RECORD: MetricRecord(
                {NUM_EXAMPLES_KEY: result.num_examples, TRAIN_LOSS_KEY: result.mean_loss}
            ),
            CLIENT_RECORD: ConfigRecord({PARTITION_ID_KEY: partition_id}),
        }
    )
    if result.last_gradient is not None:
        content[GRADIENT_RECORD] = cpu_state(result.last_gradient, packed)
    if sensitivity is not None:
        content[SENSITIVITY_RECORD] = (
            sensitivity if packed is None else cpu_state(sensitivity.to_torch_state_dict(), packed)
        )
    return Message(content=content, reply_to=message)


@app.evaluate()
def evaluate_local(message: Message, context: Context) -> Message:
    """Evaluate the received global model on this node's partition."""
    _, data, model, _ = prepare(message, context)
    loss, accuracy = evaluate(model, data, data.device)
    metrics = MetricRecord(
        {NUM_EXAMPLES_KEY: len(data), "eval-loss": loss, "eval-accuracy": accuracy}
    )
    return Message(content=RecordDict({METRICS_RECORD: metrics}), reply_to=message)
