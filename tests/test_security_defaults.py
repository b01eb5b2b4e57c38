"""Secure by default: loopback-only APIs without TLS, private run outputs, documented exit codes.

- compose.yaml (insecure: no TLS, any SuperNode may join, anyone reaching the Control API may
  run code on the SuperLink) publishes its Fleet and Control APIs on 127.0.0.1 unless the user
  opts in with ``BA_BIND_ADDRESS`` / ``BA_CONTROL_BIND_ADDRESS``, with or without the TLS
  overlay (which adds no second binding of the ports). Checked on the compose files as Compose
  merges them (port lists of several files are concatenated);
- a run's folder is created 0700 and every file in it (metrics, summary, checkpoint, final model,
  owner lock) 0600, whatever the umask lets through;
- docs/deployment.md states the exit status a refused SuperNode really has: Flower logs
  ``Exit Code: 305`` and the process exits with status 1 (``flwr_exit`` maps every error code to
  1), checked here by running Flower's exit path.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from beyond_averaging.server.runtime.inprocess import run_inprocess
from tests.deploy_helpers import REPO, published_ports

SUPERLINK = "superlink"
FLEET, CONTROL = "9092", "9093"  # the SuperLink's ports inside its container


def host_addresses(files: list[str], env: dict[str, str]) -> dict[str, str]:
    """Container port -> the host address compose publishes it on, for the SuperLink."""
    ports = published_ports([REPO / name for name in files], env, SUPERLINK)
    return {container: address for address, _, container in ports}


def test_insecure_compose_publishes_the_fleet_and_control_apis_on_loopback_only() -> None:
    assert host_addresses(["compose.yaml"], {}) == {FLEET: "127.0.0.1", CONTROL: "127.0.0.1"}


def test_the_fleet_api_is_exposed_only_when_the_user_opts_in() -> None:
    opted = host_addresses(["compose.yaml"], {"BA_BIND_ADDRESS": "0.0.0.0"})
    assert opted == {FLEET: "0.0.0.0", CONTROL: "127.0.0.1"}
    both = host_addresses(
        ["compose.yaml"], {"BA_BIND_ADDRESS": "0.0.0.0", "BA_CONTROL_BIND_ADDRESS": "10.0.0.5"}
    )
    assert both == {FLEET: "0.0.0.0", CONTROL: "10.0.0.5"}


def test_the_tls_overlay_exposes_the_fleet_api_where_the_user_opts_in_only() -> None:
    files = ["compose.yaml", "compose.tls.yaml"]
    assert host_addresses(files, {}) == {FLEET: "127.0.0.1", CONTROL: "127.0.0.1"}
    opted = host_addresses(files, {"BA_BIND_ADDRESS": "0.0.0.0"})
    assert opted == {FLEET: "0.0.0.0", CONTROL: "127.0.0.1"}
    # one publication per port: a second binding of the same host port would fail to start
    ports = published_ports([REPO / name for name in files], {}, SUPERLINK)
    assert sorted(container for _, _, container in ports) == [FLEET, CONTROL]


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)  # the usual umask, under which open() makes files 0644
    try:
        yield
    finally:
        os.umask(previous)


def test_run_outputs_are_readable_by_their_owner_only(tmp_path: Path, umask_022: None) -> None:
    settings: dict[str, Any] = {
        "dataset": "digits",
        "model": "mlp",
        "num-clients": 3,
        "local-epochs": 1,
        "num-server-rounds": 1,
        "device": "cpu",
        "run-name": "private",
        "output-dir": str(tmp_path),
    }
    run_inprocess(REPO, settings)
    run_dir = tmp_path / "private"
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    files = {path.name: stat.S_IMODE(path.stat().st_mode) for path in run_dir.iterdir()}
    expected = {"metrics.jsonl", "summary.json", "checkpoint.pt", "final_model.pt", ".owner.lock"}
    expected.add("metrics.csv")  # the rounds as a table, private as the JSON lines are
    expected.add("curves.png")  # the run's accuracy and loss plot (server.runs.plots.plot_run)
    # Each reply's record, and the partition's label counts with their plot.
    expected |= {"clients.jsonl", "partitions.json", "partitions.png"}
    assert set(files) == expected
    assert files == dict.fromkeys(expected, 0o600)


def test_a_resumed_run_makes_an_older_world_readable_folder_private(
    tmp_path: Path, umask_022: None
) -> None:
    from beyond_averaging.server.runs.recorder import RunRecorder

    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    (old / "metrics.jsonl").write_text("")
    (old / "metrics.jsonl").chmod(0o644)
    RunRecorder(tmp_path, "old", {}, resume_round=0).write_summary("completed")
    assert stat.S_IMODE(old.stat().st_mode) == 0o700
    assert stat.S_IMODE((old / "metrics.jsonl").stat().st_mode) == 0o600


def test_a_refused_supernode_exits_with_status_1_as_the_docs_say() -> None:
    # Flower's exit path for "Failed to activate SuperNode" (grpc_rere connection.py):
    # flwr_exit(ExitCode.SUPERNODE_CONNECTION_ERROR, ...), run here as it runs there.
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            "from flwr.supercore.exit import ExitCode, flwr_exit\n"
            "flwr_exit(ExitCode.SUPERNODE_CONNECTION_ERROR, 'Failed to activate SuperNode.')",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
    )
    assert completed.returncode == 1
    assert "Exit Code: 305" in completed.stdout + completed.stderr
    page = " ".join((REPO / "docs" / "deployment.md").read_text(encoding="utf-8").split())
    assert "`Exit Code: 305`" in page
    assert "the process exits with status 1" in page
    assert "exits (code 305)" not in page
