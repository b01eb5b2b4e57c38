"""Recovery after ``kill -9``, with SuperLink and SuperNodes as local processes on loopback.

The processes run as docs/deployment.md ("Local processes") runs them: ``flower-superlink`` with its
state in memory (as compose.yaml), and each SuperNode under ``ba-supernode``
(:mod:`server.deploy.supervise`), which starts it again whenever it ends or the SuperLink forgets
it. One module-wide deployment (3 SuperNodes) and one uninterrupted reference run serve the tests:

- **SuperLink killed mid-run** (``kill -9`` of its process only, in round 3 of 4) and started
  again on the same ports: the orphaned ServerApp ends ``interrupted`` (it used to record the
  error "SystemExit: 0"), the three SuperNodes are back within 120 s (plain ``flower-supernode``
  processes were not, after 180 s: two exited with status 0, one hung retrying), the run resumes
  with ``resume-from`` and its final model equals the uninterrupted run's;
- **ServerApp killed mid-run**: ``flwr run`` ends and ``summary.json`` still says ``running``;
  ``ba-run --status`` reports it ``interrupted`` (and writes so), and the run resumes to the same
  final model;
- **one SuperNode killed mid-round**: the round goes on without it. Flower's SuperLink answers
  the lost instruction with an error reply once the node's heartbeat has expired (about a
  minute), so that round aggregates the other two replies (``dropped-error-reply = 1``), waits
  far less than ``round-timeout``, and the SuperNode, started again by ``ba-supernode`` under a
  new node id, trains in the later rounds. That run's model is not the uninterrupted run's (a
  round lacked a client), and no test claims it is.

"Equals": bit for bit, or, where the replies of a round arrived in another order (the weighted
mean then sums in another order), within 1e-6 (two uninterrupted runs differed by 9.3e-10).
Run with ``-s`` for the timings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from beyond_averaging.server.overrides import run_config_argument
from beyond_averaging.server.runs.folder import CLIENTS_FILE, read_summary
from beyond_averaging.server.runtime.processes import descendants
from tests.deploy_helpers import (
    CONNECTION,
    REPO,
    LocalDeployment,
    assert_same_final_model,
    command_line,
    read_metrics,
)

pytestmark = pytest.mark.deployment

NUM_SUPERNODES = 3
ROUNDS = 4
#: FedAvgM: the server optimizer's momentum is state the checkpoint must carry across the crash.
SETTINGS: dict[str, Any] = {
    "dataset": "digits",
    "model": "mlp",
    "num-clients": NUM_SUPERNODES,
    "num-server-rounds": ROUNDS,
    "local-epochs": 1,
    "fraction-train": 1.0,
    "seed": 0,
    "strategy": "fedavg",
    "server-optimizer": "momentum",
    "round-timeout": 300.0,
}
BA_RUN = Path(sys.executable).parent / "ba-run"
STARTED = time.monotonic()


def say(line: str) -> None:
    print(f"\n[recovery {time.monotonic() - STARTED:5.0f} s] {line}", flush=True)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    local = LocalDeployment(REPO, tmp_path_factory.mktemp("recovery"), file_state=False)
    try:
        local.start()
        for partition in range(NUM_SUPERNODES):
            local.start_supernode(partition, NUM_SUPERNODES, supervised=True)
        local.wait_for_nodes(NUM_SUPERNODES)
        yield local
    finally:
        local.close()


def settings(deployment: LocalDeployment, name: str, **extra: Any) -> dict[str, Any]:
    return {**SETTINGS, "run-name": name, "output-dir": str(deployment.workdir / "runs"), **extra}


@pytest.fixture(scope="module")
def reference(deployment: LocalDeployment) -> Path:
    """An uninterrupted run of SETTINGS."""
    run_dir = deployment.run(settings(deployment, "reference"), timeout=900.0)
    say("reference run completed")
    return run_dir


def start_run(deployment: LocalDeployment, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``flwr run`` in the background; its process and the run folder."""
    command = ["flwr", "run", str(deployment.staged_app), CONNECTION, "--stream"]
    command += ["--run-config", run_config_argument(settings(deployment, name))]
    with (deployment.workdir / f"flwr-run-{name}.log").open("wb") as log:
        process = subprocess.Popen(
            command, env=deployment.env, cwd=deployment.staged_app, stdout=log, stderr=log
        )
    return process, deployment.workdir / "runs" / name


def wait_for_round(run_dir: Path, server_round: int, process: subprocess.Popen[bytes]) -> None:
    """Block until ``server_round`` is recorded (round 0 is the initial model)."""
    deadline = time.monotonic() + 600
    while not ((run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) > server_round):
        assert process.poll() is None, f"flwr run ended before round {server_round}"
        assert time.monotonic() < deadline, f"round {server_round} was not reached in 600 s"
        time.sleep(0.1)


def ba_run_status(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BA_RUN), "--status", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def resume(deployment: LocalDeployment, run_dir: Path) -> Path:
    return deployment.run(
        settings(deployment, run_dir.name, **{"resume-from": str(run_dir)}), timeout=900.0
    )


def assert_resumed_to_the_same_model(run_dir: Path, reference: Path) -> None:
    assert_same_final_model(run_dir, reference, "resumed and uninterrupted")
    rounds = read_metrics(run_dir)
    assert [entry["round"] for entry in rounds] == list(range(ROUNDS + 1))
    accuracies = [entry["test-accuracy"] for entry in read_metrics(reference)]
    assert [entry["test-accuracy"] for entry in rounds] == pytest.approx(accuracies, abs=0.003)


@pytest.mark.http_fleet
def test_superlink_killed_mid_run_comes_back_with_its_nodes_and_the_run_resumes(
    deployment: LocalDeployment, reference: Path
) -> None:
    assert deployment.superlink is not None
    process, run_dir = start_run(deployment, "superlink-killed")
    wait_for_round(run_dir, 2, process)
    orphans = deployment.serverapp_pids()
    os.kill(deployment.superlink.pid, signal.SIGKILL)  # the SuperLink alone: its ServerApp lives
    deployment.superlink.wait(timeout=30)
    process.wait(timeout=120)
    say(f"SuperLink killed in round 3; flwr run exited {process.returncode}")

    deployment.start_superlink()
    started = time.monotonic()
    deployment.wait_for_nodes(NUM_SUPERNODES, timeout=120.0)
    back_after = time.monotonic() - started
    say(f"SuperLink restarted; {NUM_SUPERNODES} SuperNodes back in {back_after:.0f} s")

    # The orphaned ServerApp learns that the new SuperLink does not know its run, and stops.
    deadline = time.monotonic() + 120
    while read_summary(run_dir).get("status") == "running":
        assert time.monotonic() < deadline, f"ServerApps {orphans} still running after 120 s"
        time.sleep(1.0)
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted", summary
    assert f'resume-from = "{run_dir}"' in summary["error"]
    checkpoint_round = summary["rounds-completed"]
    assert checkpoint_round >= 2

    resumed = resume(deployment, run_dir)
    say("resumed run completed")
    assert read_summary(resumed)["resumed-from-round"] == checkpoint_round
    assert_resumed_to_the_same_model(resumed, reference)


def test_serverapp_killed_mid_run_is_reported_interrupted_and_resumes(
    deployment: LocalDeployment, reference: Path
) -> None:
    process, run_dir = start_run(deployment, "serverapp-killed")
    wait_for_round(run_dir, 2, process)
    victims = deployment.serverapp_pids()
    assert victims, "no ServerApp process under the SuperLink"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    process.wait(timeout=300)
    say(f"ServerApp killed in round 3; flwr run exited {process.returncode}")

    # Nothing was left to rewrite the summary: the file still claims "running" ...
    assert read_summary(run_dir)["status"] == "running"
    # ... and the owner check tells the truth, and writes it.
    status = ba_run_status(run_dir)
    assert status.returncode == 1, status.stdout + status.stderr
    assert ": interrupted," in status.stdout
    assert f"pid {victims[0]}" in status.stdout
    assert read_summary(run_dir)["status"] == "interrupted"

    resumed = resume(deployment, run_dir)
    say("resumed run completed")
    assert_resumed_to_the_same_model(resumed, reference)


def test_a_supernode_killed_mid_round_is_dropped_from_that_round_and_trains_again(
    deployment: LocalDeployment,
) -> None:
    deployment.wait_for_nodes(NUM_SUPERNODES)
    before = set(deployment.online_node_ids())
    process, run_dir = start_run(deployment, "supernode-killed")
    wait_for_round(run_dir, 1, process)  # round 2's instructions are on their way
    node = deployment.supernodes[0]
    killed = [p for p in descendants(node.process.pid) if "flower-supernode" in command_line(p)]
    assert len(killed) == 1, killed
    os.kill(killed[0], signal.SIGKILL)
    process.wait(timeout=1200)
    say(f"SuperNode {killed[0]} killed in round 2; flwr run exited {process.returncode}")

    summary = read_summary(run_dir)
    assert summary["status"] == "completed", summary.get("error")
    rounds = read_metrics(run_dir)[1:]
    print(
        json.dumps(
            [{k: v for k, v in r.items() if "replies" in k or "dropped" in k} for r in rounds]
        )
    )
    assert all(entry["aggregated"] == 1 for entry in rounds)
    # The round it died in lost its reply (and the next one too, had the SuperLink still listed
    # the dead node when that round sampled) ...
    lossy = [entry for entry in rounds if entry["replies-dropped"]]
    assert 1 <= len(lossy) <= 2
    assert lossy[0]["round"] == 2
    for entry in lossy:
        assert entry["replies-valid"] >= NUM_SUPERNODES - 1, entry
        assert entry["dropped-error-reply"] == 1, entry
        # ... and did not wait for the round timeout: the SuperLink answered for the dead node.
        assert entry["round-seconds"] < SETTINGS["round-timeout"] / 2, entry
    # The SuperNode came back under a new node id and trained in the last round.
    assert rounds[-1]["replies-valid"] == NUM_SUPERNODES
    assert rounds[-1]["replies-dropped"] == 0
    after = set(deployment.online_node_ids())
    assert len(after) == NUM_SUPERNODES
    assert len(after - before) == 1, "the killed SuperNode did not register again"
    assert node.process.poll() is None, "ba-supernode itself must not have ended"
    # The SuperLink's error reply is recorded and logged under the killed node's id and the
    # partition it named in round 1 (supernodes[0] holds partition 0), not the SuperLink's id 1.
    (gone,) = before - after
    records = [json.loads(line) for line in (run_dir / CLIENTS_FILE).read_text().splitlines()]
    dropped = [r for r in records if r["round"] == 2 and r["status"] == "dropped"]
    assert [(r["node-id"], r["partition"], r["reason"]) for r in dropped] == [
        (gone, 0, "error-reply")
    ]
    streamed = (deployment.workdir / "flwr-run-supernode-killed.log").read_text(errors="replace")
    assert f"round 2: dropped reply from node {gone} (partition 0)" in streamed


def test_a_warm_executor_killed_mid_run_is_started_again_and_the_run_completes(
    deployment: LocalDeployment,
) -> None:
    """``kill -9`` of a node's warm ClientApp parent (server/deploy/warm_executor.py) in round 2:
    its ClientApp, if one was running, ends with it (as Flower's own ClientApps end with their
    SuperExec), ``ba-supernode`` starts the executor again, and the run completes."""
    deployment.wait_for_nodes(NUM_SUPERNODES)
    node = deployment.supernodes[0]

    def warm_parents() -> list[int]:
        return [p for p in descendants(node.process.pid) if "warm_executor" in command_line(p)]

    before = warm_parents()
    assert len(before) == 1, before
    process, run_dir = start_run(deployment, "executor-killed")
    wait_for_round(run_dir, 1, process)
    os.kill(before[0], signal.SIGKILL)
    process.wait(timeout=1200)
    say(f"warm executor {before[0]} killed in round 2; flwr run exited {process.returncode}")

    summary = read_summary(run_dir)
    assert summary["status"] == "completed", summary.get("error")
    rounds = read_metrics(run_dir)
    assert [entry["round"] for entry in rounds] == list(range(ROUNDS + 1))
    assert all(entry["aggregated"] == 1 for entry in rounds[1:])
    assert rounds[-1]["replies-valid"] == NUM_SUPERNODES  # the node trains again
    after = warm_parents()
    assert len(after) == 1, after
    assert after != before, "ba-supernode did not start the warm executor again"
    assert node.process.poll() is None, "ba-supernode itself must not have ended"
