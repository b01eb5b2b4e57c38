"""The ClientApp's train and evaluate actions, called with a Message built outside a run."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from beyond_averaging.client.app import evaluate_local, train
from beyond_averaging.server.app import client_task, data_spec
from beyond_averaging.server.config import RunConfig
from beyond_averaging.tasks.federation import DataSpec, load_client_partition
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.protocol import ClientTask
from tests.conftest import instruction_message

CONFIG = RunConfig(num_clients=3, local_epochs=1, batch_size=16, device="cpu")


def context(partition_id: int = 0) -> Context:
    return Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": partition_id, "num-partitions": CONFIG.num_clients},
        state=RecordDict(),
        run_config={},
    )


def global_model() -> torch.nn.Module:
    return build_model(CONFIG.model, (1, 8, 8), 10, seed=0)


def instruction(config: RunConfig = CONFIG, **extra: Any) -> Any:
    entries = {**client_task(config).to_config(), "server-round": 1, **extra}
    return instruction_message(
        RecordDict(
            {"arrays": ArrayRecord(global_model().state_dict()), "config": ConfigRecord(entries)}
        )
    )


def partition_size(partition_id: int) -> int:
    spec = DataSpec(
        dataset="digits",
        data_dir="",
        partition=CONFIG.partition,
        dirichlet_alpha=CONFIG.dirichlet_alpha,
        classes_per_partition=CONFIG.classes_per_client,
        num_partitions=CONFIG.num_clients,
        seed=CONFIG.seed,
        proxy_per_class=0,
    )
    return len(load_client_partition(spec, partition_id))


def test_train_replies_with_trained_arrays_and_num_examples_of_the_partition() -> None:
    reply = train(instruction(), context(partition_id=1))
    assert not reply.has_error()
    arrays = reply.content["arrays"]
    metrics = reply.content["metrics"]
    assert metrics["num-examples"] == partition_size(1)
    assert np.isfinite(metrics["train-loss"])
    received = global_model().state_dict()
    assert set(arrays.keys()) == set(received)
    changed = [not np.array_equal(arrays[k].numpy(), received[k].numpy()) for k in received]
    assert any(changed)  # local training moved the model
    assert set(reply.content.array_records) == {"arrays"}  # nothing extra unless requested


def test_train_sends_the_gradient_record_only_when_requested() -> None:
    reply = train(instruction(**{"request-records": "gradient"}), context())
    gradient = reply.content["gradient"]
    parameters = dict(global_model().named_parameters())
    assert set(gradient.keys()) == set(parameters)
    for name, parameter in parameters.items():
        assert gradient[name].numpy().shape == tuple(parameter.shape)


def test_train_refuses_a_record_it_cannot_produce() -> None:
    with pytest.raises(ValueError, match=r"requested records \['hessian'\]"):
        train(instruction(**{"request-records": "hessian"}), context())


def test_train_without_the_task_config_names_the_missing_keys() -> None:
    message = instruction_message(
        RecordDict(
            {
                "arrays": ArrayRecord(global_model().state_dict()),
                "config": ConfigRecord({"server-round": 1}),
            }
        )
    )
    with pytest.raises(KeyError, match=r"train config lacks .*'batch-size'"):
        train(message, context())


def test_missing_partition_in_node_config_explains_the_supernode_flag() -> None:
    bare = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(KeyError, match=r"--node-config 'partition-id=<i> num-partitions=<n>'"):
        train(instruction(), bare)


def test_learning_rate_decays_once_per_round() -> None:
    task = client_task(RunConfig(learning_rate=0.1, lr_decay=0.5))
    assert task.round_learning_rate(1) == pytest.approx(0.1)
    assert task.round_learning_rate(3) == pytest.approx(0.1 * 0.5 * 0.5)


def test_evaluate_reports_accuracy_and_loss_on_the_local_partition() -> None:
    reply = evaluate_local(instruction(), context(partition_id=2))
    metrics = reply.content["metrics"]
    assert metrics["num-examples"] == partition_size(2)
    assert 0.0 <= metrics["eval-accuracy"] <= 1.0
    assert metrics["eval-loss"] > 0.0


def test_client_and_server_derive_the_same_data_spec_from_the_sent_task() -> None:
    config = RunConfig(
        dataset="synthetic",
        partition="classes",
        classes_per_client=3,
        dirichlet_alpha=0.3,
        num_clients=4,
        seed=5,
        proxy_per_class=7,
        synthetic_alpha=0.5,
        synthetic_beta=2.0,
    )
    expected = DataSpec(
        dataset="synthetic",
        data_dir="",
        partition="classes",
        dirichlet_alpha=0.3,
        classes_per_partition=3,
        num_partitions=4,
        seed=5,
        proxy_per_class=7,
        synthetic_alpha=0.5,
        synthetic_beta=2.0,
    )
    assert data_spec(config) == expected  # the server's, with its proxy split
    received = ClientTask.from_config(client_task(config).to_config())  # over the wire
    assert DataSpec.from_task(received, 4) == replace(expected, proxy_per_class=0)
