"""Shared fixtures: repository paths, reply messages built outside a run, and real simulations."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    Error,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)

from beyond_averaging.server.overrides import run_config_argument
from beyond_averaging.server.runtime.launch import launch
from beyond_averaging.tasks.partition_cache import CACHE_ENV

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Partitions cached by the tests (and the runs they start) go to a temporary folder, not
    the user's cache; a folder given in the environment is kept."""
    os.environ.setdefault(CACHE_ENV, tempfile.mkdtemp(prefix="ba-test-partitions-"))


def reply_message(
    content: RecordDict | None = None,
    *,
    node_id: int = 1,
    error: str | None = None,
) -> Message:
    """A train reply as a SuperNode would send it, built outside a run (explicit Metadata)."""
    metadata = Metadata(
        run_id=1,
        message_id="",
        src_node_id=node_id,
        dst_node_id=0,
        reply_to_message_id="instruction",
        group_id="1",
        created_at=0.0,
        ttl=60.0,
        message_type="train",
    )
    if error is not None:
        return Message(metadata=metadata, error=Error(code=1, reason=error))
    return Message(metadata=metadata, content=content)


def instruction_message(content: RecordDict, *, node_id: int = 1) -> Message:
    """A train instruction as a ClientApp receives it, built outside a run (explicit Metadata)."""
    metadata = Metadata(
        run_id=1,
        message_id="instruction",
        src_node_id=0,
        dst_node_id=node_id,
        reply_to_message_id="",
        group_id="1",
        created_at=0.0,
        ttl=60.0,
        message_type="train",
    )
    return Message(metadata=metadata, content=content)


def train_reply(
    arrays: Mapping[str, np.ndarray[Any, Any]],
    num_examples: int | float = 10,
    *,
    node_id: int = 1,
    extra: Mapping[str, Mapping[str, np.ndarray[Any, Any]]] | None = None,
    metrics: Mapping[str, float] | None = None,
) -> Message:
    """A well-formed train reply carrying ``arrays``, ``metrics`` and optional extra records."""
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": num_examples, **(metrics or {})}),
        }
    )
    for name, record in (extra or {}).items():
        content[name] = ArrayRecord({k: Array(np.asarray(v)) for k, v in record.items()})
    return reply_message(content, node_id=node_id)


@pytest.fixture
def run_simulation(tmp_path: Path) -> Callable[..., Path]:
    """Run the real app in Flower simulation; returns the run folder (raises on failure).

    Usage: ``run_dir = run_simulation({"strategy": "elastic", "num-server-rounds": 2})``.
    Metrics are in ``run_dir / "metrics.jsonl"``; the SuperLink is always stopped.
    """

    def run(overrides: Mapping[str, Any], timeout: float = 420.0) -> Path:
        settings = {"output-dir": str(tmp_path / "runs"), "run-name": "test", **overrides}
        return launch(REPO, [run_config_argument(settings)], timeout=timeout, client_cpus=1)

    return run


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rounds of a run's metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
