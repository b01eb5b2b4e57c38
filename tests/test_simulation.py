"""The real app under Flower simulation, and the launcher's failure handling."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from server.launch import LaunchError, launch
from tests.conftest import REPO, read_metrics

pytestmark = pytest.mark.simulation


FLOWER_PROCESS_NAMES = ("flower-superlink", "flower-superexec", "flwr-serverapp", "flwr-simulation")


def flower_processes() -> set[int]:
    """PIDs of the Flower runtime processes alive now."""
    listing = subprocess.run(
        ["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True
    ).stdout
    return {
        int(line.split(maxsplit=1)[0])
        for line in listing.splitlines()
        if any(name in line for name in FLOWER_PROCESS_NAMES)
    }


def test_fedavg_simulation_beats_the_initial_model_and_records_every_round(
    run_simulation: Callable[..., Path],
) -> None:
    before = flower_processes()
    run_dir = run_simulation({"num-clients": 3, "num-server-rounds": 2, "min-train-replies": 2})
    rounds = read_metrics(run_dir)
    assert [entry["round"] for entry in rounds] == [0, 1, 2]
    assert rounds[-1]["test-accuracy"] > rounds[0]["test-accuracy"]
    assert all(entry["replies-valid"] == 3 for entry in rounds[1:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["config"]["num-clients"] == 3
    assert (run_dir / "final_model.pt").is_file()
    # The launcher stops the SuperLink it started, with its children: none outlives the run.
    assert flower_processes() - before == set()


def test_invalid_run_config_fails_the_launch_with_the_key_named(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"did not complete"):
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
            str(REPO / ".venv" / "bin" / "ba-run"),
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
