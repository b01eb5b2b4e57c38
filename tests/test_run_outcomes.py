"""A run that cannot train ends ``failed`` with the reason; late replies count as dropped.

Runs use the in-process runtime (the real ServerApp and ClientApp, ``server/inprocess.py``). A
learning rate of 1e30 makes every client's model non-finite, so every reply is dropped and no
round can aggregate: the honest way for a whole federation to be unable to train.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message

from beyond_averaging.server.app import RunStalledError
from beyond_averaging.server.inprocess import InProcessGrid, run_inprocess
from beyond_averaging.server.launch import run_config_argument
from tests.deploy_helpers import REPO, read_metrics

LEAN: dict[str, Any] = {
    "dataset": "digits",
    "model": "mlp",
    "num-clients": 3,
    "local-epochs": 1,
    "device": "cpu",
}
DIVERGING = {"learning-rate": 1e30}


def test_ba_run_exits_non_zero_when_no_round_aggregates_for_max_idle_rounds(
    tmp_path: Path,
) -> None:
    settings = {
        **LEAN,
        **DIVERGING,
        "num-server-rounds": 6,
        "max-idle-rounds": 2,
        "run-name": "stalled",
        "output-dir": str(tmp_path),
    }
    completed = subprocess.run(
        [
            str(Path(sys.executable).parent / "ba-run"),
            "--runtime",
            "inprocess",
            "-c",
            run_config_argument(settings),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode != 0
    assert "no round aggregated in the last 2 rounds" in completed.stderr
    summary = json.loads((tmp_path / "stalled" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "failed"
    assert "RunStalledError" in summary["error"]
    assert "0 valid of 3" in summary["error"]
    assert "non-finite 3" in summary["error"]
    # It stopped at the second idle round, not after all six.
    assert [entry["round"] for entry in read_metrics(tmp_path / "stalled")] == [0, 1, 2]


def test_a_run_in_which_no_round_aggregated_fails_even_below_max_idle_rounds(
    tmp_path: Path,
) -> None:
    overrides = {
        **LEAN,
        **DIVERGING,
        "num-server-rounds": 2,
        "max-idle-rounds": 5,
        "run-name": "never",
        "output-dir": str(tmp_path),
    }
    with pytest.raises(RunStalledError, match="no round of the run aggregated"):
        run_inprocess(REPO, overrides)
    summary = json.loads((tmp_path / "never" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "failed"


class LateNodeGrid(InProcessGrid):
    """Answers like InProcessGrid, except that the reply of ``late_node`` never arrives in time
    (what Flower's grid returns when a node misses ``timeout``); records each timeout it got."""

    late_node = 0
    timeouts: list[float | None]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        self.timeouts.append(timeout)
        replies = super().send_and_receive(messages, timeout=timeout)
        return [m for m in replies if m.metadata.src_node_id != self.late_node]


def test_replies_missing_at_the_round_timeout_are_counted_as_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grids: list[LateNodeGrid] = []

    def make_grid(*args: Any, **kwargs: Any) -> LateNodeGrid:
        grid = LateNodeGrid(*args, **kwargs)
        grid.late_node, grid.timeouts = max(grid.contexts), []
        grids.append(grid)
        return grid

    monkeypatch.setattr("beyond_averaging.server.inprocess.InProcessGrid", make_grid)
    overrides = {
        **LEAN,
        "num-server-rounds": 2,
        "round-timeout": 42.0,
        "run-name": "late",
        "output-dir": str(tmp_path),
    }
    run_inprocess(REPO, overrides)
    (grid,) = grids
    assert grid.timeouts == [42.0, 42.0]  # every round waited round-timeout, no longer
    for entry in read_metrics(tmp_path / "late")[1:]:
        assert entry["replies-sent"] == 3
        assert entry["replies-received"] == 2
        assert entry["dropped-timeout"] == 1
        assert entry["replies-dropped"] == 1
        assert entry["replies-valid"] == 2
        assert entry["aggregated"] == 1
