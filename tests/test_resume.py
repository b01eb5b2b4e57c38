"""A run killed with SIGKILL resumes from its checkpoint and ends exactly where it would have.

``ba-run --runtime inprocess`` (the real ServerApp and ClientApp in one process) runs in a
subprocess that is killed with SIGKILL once round 2 is recorded, wherever it then is in round 3;
``ba-run --resume <run folder>`` continues it in a new process. Its final model must equal, bit
for bit, the final model of an uninterrupted run in a third process, for every strategy (the
state that makes this hard: FedAdam's moments, Elastic's server momentum and its clients'
sensitivity moving average (each node's ``context.state``), FedLAW's kept BatchNorm statistics,
and the torch generator the server draws from).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from beyond_averaging.client.app import app as client_app
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.overrides import run_config_argument
from beyond_averaging.server.runs.checkpoint import (
    CheckpointError,
    RunCheckpoint,
    atomic_torch_save,
    capture_rng,
)
from beyond_averaging.server.runs.folder import CHECKPOINT_FILE
from beyond_averaging.server.runtime.inprocess import FIRST_NODE_ID, InProcessGrid
from tests.deploy_helpers import REPO, read_metrics

#: The launcher of the environment running the tests (another Python's venv in the version legs).
BA_RUN = Path(sys.executable).parent / "ba-run"
ROUNDS = 5
KILLED_AFTER_ROUND = 2
BASE: dict[str, Any] = {
    "dataset": "digits",
    "model": "mlp",
    "num-clients": 3,
    "num-server-rounds": ROUNDS,
    "local-epochs": 1,
    "seed": 3,
    "device": "cpu",
}
#: Every rule, each with the state it carries between rounds.
STRATEGIES: dict[str, dict[str, Any]] = {
    "fedadam": {"strategy": "fedavg", "server-optimizer": "adam", "server-lr": 0.05},
    # The default sensitivity-decay 0.9: the clients' moving average lives in each node's
    # Context.state, which the in-process checkpoint saves and the resume gives back.
    "elastic-momentum": {"strategy": "elastic", "server-optimizer": "momentum"},
    "fedlaw": {"strategy": "fedlaw", "fedlaw-epochs": 5},
    "fedgma": {"strategy": "fedgma"},
    # The triggers the last round's search found, unlearned again in the next: the memory
    # rides in the checkpoint, or the resumed round would unlearn less than the reference's.
    "unlearning-memory": {
        "backdoor-defence": "trigger-unlearning",
        "unlearning-memory": 1,
        "unlearning-epochs": 1,
        "unlearning-l1": 0.5,  # cheap patches: 7-9 of 10 work from round 1 on, and are kept
    },
}


def _ba_run(*arguments: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BA_RUN), "--runtime", "inprocess", *arguments],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, killed as one
    )


def _new_run(tmp_path: Path, name: str, extra: dict[str, Any]) -> subprocess.Popen[str]:
    settings = {**BASE, **extra, "run-name": name, "output-dir": str(tmp_path)}
    return _ba_run("-c", run_config_argument(settings))


def _finish(process: subprocess.Popen[str], timeout: float = 400.0) -> None:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-3000:]


def _rounds_recorded(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text(encoding="utf-8").splitlines()) if path.is_file() else 0


def _final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(run_dir / "final_model.pt", weights_only=True)
    return state


@pytest.mark.parametrize("variant", list(STRATEGIES))
def test_run_killed_mid_round_resumes_to_the_uninterrupted_final_model(
    tmp_path: Path, variant: str
) -> None:
    reference = _new_run(tmp_path, "reference", STRATEGIES[variant])
    run_dir = tmp_path / "killed"
    victim = _new_run(tmp_path, "killed", STRATEGIES[variant])
    deadline = time.monotonic() + 400.0
    while _rounds_recorded(run_dir) <= KILLED_AFTER_ROUND:  # round 0 is the first line
        assert victim.poll() is None, victim.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run never reached the round where it is killed"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "running", "the run ended before the kill: make it longer"
    assert not (run_dir / "final_model.pt").exists()
    checkpoint_round = torch.load(run_dir / CHECKPOINT_FILE, weights_only=True)["round"]
    assert KILLED_AFTER_ROUND - 1 <= checkpoint_round < ROUNDS

    _finish(_ba_run("--resume", str(run_dir)))
    _finish(reference)

    expected, actual = _final_model(tmp_path / "reference"), _final_model(run_dir)
    assert list(actual) == list(expected)
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{variant}: tensor {key} differs"
    rounds = read_metrics(run_dir)
    assert [entry["round"] for entry in rounds] == list(range(ROUNDS + 1))
    reference_rounds = read_metrics(tmp_path / "reference")
    assert [entry["test-accuracy"] for entry in rounds] == [
        entry["test-accuracy"] for entry in reference_rounds
    ]
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "completed"
    assert summary["resumed-from-round"] == checkpoint_round


def default_sigint() -> None:
    """In the child before exec: SIGINT handled by default, whatever the test inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.simulation
def test_simulation_run_stopped_mid_run_resumes_with_every_round_recorded_once(
    tmp_path: Path,
) -> None:
    # Many more rounds than the stop needs: on an idle machine a digits round takes well under a
    # second, and the run must still be going when Ctrl-C lands after round 2.
    rounds_total = 30
    settings = {
        **BASE,
        "num-server-rounds": rounds_total,
        "run-name": "sim",
        "output-dir": str(tmp_path),
    }
    run_dir = tmp_path / "sim"
    with (tmp_path / "first.log").open("wb") as log:
        first = subprocess.Popen(
            [str(BA_RUN), "-c", run_config_argument(settings)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Ctrl-C as in a terminal: a suite started in the background by a shell without job
            # control inherits SIGINT ignored, and the launcher then (rightly) never stops.
            preexec_fn=default_sigint,
        )
    deadline = time.monotonic() + 400.0
    while _rounds_recorded(run_dir) <= 2:  # rounds 0, 1 and 2 recorded
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the simulation never reached round 2"
        time.sleep(0.2)
    # Ctrl-C: the launcher stops the SuperLink and everything below it (Ray, the ServerApp).
    first.send_signal(signal.SIGINT)
    first.wait(timeout=120)
    assert json.loads((run_dir / "summary.json").read_text())["status"] != "completed"
    checkpoint_round = torch.load(run_dir / CHECKPOINT_FILE, weights_only=True)["round"]
    assert 2 <= checkpoint_round < rounds_total

    resumed = subprocess.run(
        [str(BA_RUN), "--resume", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        start_new_session=True,
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    rounds = read_metrics(run_dir)
    assert [entry["round"] for entry in rounds] == list(range(rounds_total + 1))
    assert all(entry["replies-valid"] == 3 for entry in rounds[1:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["resumed-from-round"] == checkpoint_round


def _checkpoint(config: dict[str, Any], round_: int = 2) -> RunCheckpoint:
    return RunCheckpoint(
        round=round_,
        model={"w": torch.arange(4, dtype=torch.float32)},
        strategy={"optimizer": {"first-moment": {}, "second-moment": {}}},
        rng=capture_rng(),
        idle_rounds=0,
        config=config,
    )


def test_resume_with_another_configuration_is_refused_naming_each_changed_key(
    tmp_path: Path,
) -> None:
    config = parse_run_config({}).to_run_config()
    _checkpoint(config).save(tmp_path)
    changed = {**config, "learning-rate": 0.1, "strategy": "elastic", "num-server-rounds": 40}
    with pytest.raises(CheckpointError) as error:
        RunCheckpoint.load(tmp_path, changed)
    message = str(error.value)
    assert "learning-rate: 0.05 -> 0.1" in message
    assert "strategy: 'fedavg' -> 'elastic'" in message
    assert "num-server-rounds" not in message  # a run may be extended by more rounds
    assert RunCheckpoint.load(tmp_path, {**config, "num-server-rounds": 40}).round == 2


def test_a_crash_while_writing_keeps_the_previous_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = parse_run_config({}).to_run_config()
    _checkpoint(config, round_=4).save(tmp_path)

    def torn_save(obj: Any, stream: Any) -> None:
        stream.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        _checkpoint(config, round_=5).save(tmp_path)
    monkeypatch.undo()
    assert RunCheckpoint.load(tmp_path, config).round == 4
    assert [path.name for path in tmp_path.iterdir()] == [CHECKPOINT_FILE]


def test_checkpoint_of_an_older_format_is_refused_with_the_reason(tmp_path: Path) -> None:
    atomic_torch_save({"w": torch.zeros(2)}, tmp_path / CHECKPOINT_FILE)  # weights only
    with pytest.raises(CheckpointError, match="stored only the model weights"):
        RunCheckpoint.load(tmp_path, parse_run_config({}).to_run_config())


def test_resume_without_a_checkpoint_names_the_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no checkpoint\.pt there"):
        RunCheckpoint.load(tmp_path / "nowhere", parse_run_config({}).to_run_config())


def test_in_process_node_state_survives_a_checkpoint_bit_for_bit(tmp_path: Path) -> None:
    grid = InProcessGrid(client_app, 3, parse_run_config({}).to_run_config())
    average = np.array([[1e-8, 3.0], [np.pi, -0.0]], dtype=np.float32)
    grid.context(FIRST_NODE_ID + 1).state = RecordDict(
        {
            "sensitivity-average": ArrayRecord({"fc.weight": Array(average)}),
            "counters": MetricRecord({"rounds": 4, "loss": 0.25}),
        }
    )
    config = parse_run_config({}).to_run_config()
    checkpoint = _checkpoint(config)
    checkpoint.nodes = grid.node_states()
    checkpoint.save(tmp_path)

    fresh = InProcessGrid(client_app, 3, config)
    fresh.load_node_states(RunCheckpoint.load(tmp_path, config).nodes)
    state = fresh.context(FIRST_NODE_ID + 1).state
    restored = state.array_records["sensitivity-average"]["fc.weight"].numpy()
    assert restored.dtype == np.float32
    assert restored.tobytes() == average.tobytes()
    assert dict(state.metric_records["counters"]) == {"rounds": 4, "loss": 0.25}
    assert not fresh.context(FIRST_NODE_ID).state  # nodes without state stay empty


def test_node_state_of_another_federation_is_refused_naming_the_node() -> None:
    grid = InProcessGrid(client_app, 2, parse_run_config({}).to_run_config())
    with pytest.raises(ValueError, match=f"node {FIRST_NODE_ID + 5}, which is not in"):
        grid.load_node_states({str(FIRST_NODE_ID + 5): {"arrays": {}}})
