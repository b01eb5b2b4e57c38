"""The real app under Flower simulation, and the launcher's failure handling."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from beyond_averaging.server.overrides import LaunchError
from beyond_averaging.server.runtime.launch import launch
from beyond_averaging.server.runtime.processes import processes_with_environment
from tests.conftest import REPO, read_metrics

pytestmark = pytest.mark.simulation


def test_fedavg_simulation_beats_the_initial_model_and_records_every_round(
    run_simulation: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = f"ba-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("BA_TEST_MARKER", marker)
    run_dir = run_simulation({"num-clients": 3, "num-server-rounds": 2, "min-train-replies": 2})
    rounds = read_metrics(run_dir)
    assert [entry["round"] for entry in rounds] == [0, 1, 2]
    assert rounds[-1]["test-accuracy"] > rounds[0]["test-accuracy"]
    assert all(entry["replies-valid"] == 3 for entry in rounds[1:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["config"]["num-clients"] == 3
    assert (run_dir / "final_model.pt").is_file()
    # The launcher stops the SuperLink it started and everything below it (Ray included);
    # a process may take a moment to be reaped after SIGKILL.
    deadline = time.monotonic() + 15.0
    while processes_with_environment(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with_environment(marker) == []


def test_invalid_run_config_fails_the_launch_with_the_key_named(tmp_path: Path) -> None:
    # Refused before any process starts (the merged options are validated first), naming the key.
    with pytest.raises(
        LaunchError, match=r"key 'local-epochs' = 0 is not allowed: allowed is >= 1"
    ):
        launch(
            REPO,
            [f'output-dir="{tmp_path}" run-name="bad" local-epochs=0 num-clients=2'],
            timeout=300,
        )
    summary = tmp_path / "bad" / "summary.json"
    assert not summary.exists()  # validation stops the run before anything is written


def test_ba_run_exits_non_zero_and_prints_the_reason(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            str(Path(sys.executable).parent / "ba-run"),
            "-c",
            f'output-dir="{tmp_path}" run-name="bad" model="lenet5" num-clients=2',
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        start_new_session=True,
    )
    assert completed.returncode != 0
    assert "ba-run: error:" in completed.stderr
    assert "lenet5" in completed.stderr + completed.stdout
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "lenet5" in summary["error"]
