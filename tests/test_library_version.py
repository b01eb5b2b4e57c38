"""The FAB carries no code, so every node runs its installed beyond-averaging: a run refuses a
SuperLink or SuperNode of another release than the one ``flwr run`` was started from, naming both
releases and the fix, instead of training under a contract the two sides may not share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from beyond_averaging import __version__
from beyond_averaging.client import app as client_module
from beyond_averaging.server.app import check_fab_version, client_task
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.runtime.inprocess import run_inprocess
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.protocol import (
    LIBRARY_VERSION_KEY,
    LibraryVersionError,
    check_library_version,
)
from tests.conftest import instruction_message

REPO = Path(__file__).resolve().parents[1]
OTHER = "0.0.1"


def test_a_message_from_the_same_release_or_from_another_app_is_accepted() -> None:
    check_library_version({LIBRARY_VERSION_KEY: __version__}, __version__)
    check_library_version({}, __version__)  # a user's ServerApp sends no release


def test_a_message_from_another_release_is_refused_naming_both_and_the_fix() -> None:
    with pytest.raises(LibraryVersionError) as refused:
        check_library_version({LIBRARY_VERSION_KEY: OTHER}, __version__)
    assert OTHER in str(refused.value)
    assert __version__ in str(refused.value)
    assert f"install beyond-averaging=={OTHER}" in str(refused.value)


def test_the_clientapp_refuses_to_train_for_a_serverapp_of_another_release() -> None:
    config = parse_run_config({"num-clients": 2, "device": "cpu"})
    state = build_model(config.model, (1, 8, 8), 10, seed=0).state_dict()
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v.numpy()) for k, v in state.items()}),
            "config": ConfigRecord(
                {**client_task(config).to_config(), LIBRARY_VERSION_KEY: OTHER}  # type: ignore[dict-item]
            ),
        }
    )
    context = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 0, "num-partitions": 2},
        state=RecordDict(),
        run_config={},
    )
    with pytest.raises(LibraryVersionError, match=OTHER):
        client_module.train(instruction_message(content), context)


def test_a_fab_of_another_release_is_refused_before_the_run_starts() -> None:
    check_fab_version("")  # no FAB: the in-process runtime
    check_fab_version(__version__)
    with pytest.raises(RuntimeError, match=f"FAB is beyond-averaging {OTHER}.*has {__version__}"):
        check_fab_version(OTHER)


def test_nodes_of_another_release_are_dropped_with_the_reason_and_the_run_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Every node runs another release than the ServerApp: each reply is an error reply whose
    # drop is logged with the reason, the rounds aggregate nothing and the run ends failed.
    monkeypatch.setattr(client_module, "__version__", OTHER)
    settings: dict[str, Any] = {
        "num-clients": 2,
        "num-server-rounds": 2,
        "local-epochs": 1,
        "device": "cpu",
        "max-idle-rounds": 2,
        "output-dir": str(tmp_path),
        "run-name": "mixed",
    }
    with pytest.raises(Exception, match="no round"):
        run_inprocess(REPO, settings)
    summary = json.loads((tmp_path / "mixed" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "failed"
    assert "error-reply 2" in summary["error"]
    drops = [r.getMessage() for r in caplog.records if "dropped reply" in r.getMessage()]
    assert len(drops) == 4  # 2 nodes x 2 rounds
    assert all(f"install beyond-averaging=={__version__}" in drop for drop in drops)
