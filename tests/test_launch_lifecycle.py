"""``ba-run`` never hangs and never leaks.

- Ray's ``ray_current_cluster`` file, left by a ``ray start`` whose cluster died without ``ray
  stop``, made every simulation's ``ray.init()`` connect to the dead address and wait forever:
  the simulation gets ``RAY_ADDRESS=local`` (a Ray of its own) unless ``--ray-address`` names one.
- A round that waits for replies says, every ``WAIT_NOTICE_SECONDS``, which nodes it waits for.
- SIGTERM, SIGINT and SIGHUP stop the run and every process ``ba-run`` started (SuperLink,
  SuperExec, simulation, Ray), and the run is left ``interrupted``, resumable.

The simulation tests start Flower's simulation (a SuperLink and Ray: about a minute each on the
shared 2-core machine) and are marked ``simulation``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from beyond_averaging.server import rounds
from beyond_averaging.server.overrides import run_config_argument
from beyond_averaging.server.rounds import RoundOutcome, run_rounds
from beyond_averaging.server.runtime.processes import free_port, processes_with_environment
from beyond_averaging.server.runtime.simulation import LOCAL_RAY, local_ray
from tests.conftest import instruction_message
from tests.deploy_helpers import REPO, read_metrics
from tests.test_run_outcomes import LEAN as LEAN_RUN

BA_RUN = Path(sys.executable).parent / "ba-run"
LEAN: dict[str, Any] = {**LEAN_RUN, "num-clients": 2}


@pytest.fixture
def stale_ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``$RAY_TMPDIR/ray/ray_current_cluster`` naming an address where no Ray answers, as a
    ``ray start`` whose cluster died leaves it (a short folder: Ray's sockets live under it)."""
    root = Path(tempfile.mkdtemp(prefix="ba-r", dir="/tmp"))
    (root / "ray").mkdir()
    dead = f"127.0.0.1:{free_port()}"
    (root / "ray" / "ray_current_cluster").write_text(dead, encoding="utf-8")
    monkeypatch.setenv("RAY_TMPDIR", str(root))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield dead
    shutil.rmtree(root, ignore_errors=True)


def test_ray_connects_to_a_stale_cluster_file_unless_ray_address_is_local(
    stale_ray_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The mechanism, in the installed Ray: what ray.init() resolves its address to.
    from ray._private.services import canonicalize_bootstrap_address

    found = canonicalize_bootstrap_address(None)  # 127.0.0.1 is given as this host's address
    assert found is not None
    assert found.rsplit(":", 1)[1] == stale_ray_cluster.rsplit(":", 1)[1]  # the dead one
    monkeypatch.setenv("RAY_ADDRESS", LOCAL_RAY)
    # ray.init() takes RAY_ADDRESS for an unspecified address; "local" starts a new instance.
    assert canonicalize_bootstrap_address(os.environ["RAY_ADDRESS"]) is None


def test_the_simulation_starts_its_own_ray_whatever_the_environment_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert local_ray(None) == LOCAL_RAY
    assert capsys.readouterr().err == ""
    assert local_ray("10.0.0.5:6379") == LOCAL_RAY
    assert "RAY_ADDRESS=10.0.0.5:6379 in the environment is not used" in capsys.readouterr().err


# --- a round that waits --------------------------------------------------------------------
class SilentGrid:
    """A Grid whose nodes answer nothing: send_and_receive waits, then returns no reply."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float) -> list[Message]:
        time.sleep(self.seconds)
        return []


class OneRoundStrategy:
    """The calls run_rounds makes: train instructions to nodes 7 and 9, nothing aggregated."""

    def configure_train(self, *args: Any) -> list[Message]:
        return [instruction_message(RecordDict(), node_id=node) for node in (7, 9)]

    def aggregate_train(self, *args: Any) -> tuple[None, None]:
        return None, None

    def configure_evaluate(self, *args: Any) -> list[Message]:
        return []


def one_round(grid: SilentGrid) -> list[RoundOutcome]:
    """Round 1 of :class:`OneRoundStrategy` on ``grid`` (round-timeout 30 s); its outcome."""
    outcomes: list[RoundOutcome] = []
    run_rounds(
        OneRoundStrategy(),  # type: ignore[arg-type]
        grid,  # type: ignore[arg-type]
        ArrayRecord(),
        first_round=1,
        num_rounds=1,
        timeout=30.0,
        train_config=ConfigRecord(),
        evaluate_config=ConfigRecord(),
        on_round_end=lambda arrays, outcome: outcomes.append(outcome),
    )
    return outcomes


def test_a_round_that_waits_says_for_which_nodes_and_why_they_may_be_silent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(rounds, "WAIT_NOTICE_SECONDS", 0.2)
    with caplog.at_level("INFO", logger="flwr"):
        outcomes = one_round(SilentGrid(0.7))
    waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert 2 <= len(waits) <= 4  # about every 0.2 s of the 0.7 s wait, and no more after it
    assert "round 1: waiting 0 s for the train replies of 2 node(s) (7, 9)" in waits[0]
    assert "round-timeout = 30 s" in waits[0]
    assert "Ray" in waits[0]
    assert outcomes[0].train_received == 0


def test_a_round_that_answers_at_once_logs_no_wait(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="flwr"):
        one_round(SilentGrid(0.0))
    assert "waiting" not in caplog.text


# --- stop signals --------------------------------------------------------------------------
def start_ba_run(settings: dict[str, Any], runtime: str, marker: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BA_RUN), "--runtime", runtime, "-c", run_config_argument(settings)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "BA_TEST_MARKER": marker},
        start_new_session=True,  # a signal to ba-run alone, as `kill <pid>` sends it
    )


def wait_for_round(run_dir: Path, process: subprocess.Popen[str], done: int) -> None:
    deadline = time.monotonic() + 400
    while len(read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []) <= done:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run did not reach its round"
        time.sleep(0.2)


def left_processes(marker: str, seconds: float = 20.0) -> list[int]:
    """The processes that inherited ``marker`` still alive after ``seconds`` (a process may
    take a moment to be reaped after SIGKILL)."""
    deadline = time.monotonic() + seconds
    while processes_with_environment(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    return processes_with_environment(marker)


def stop_and_check(
    process: subprocess.Popen[str], stop: signal.Signals, run_dir: Path, marker: str
) -> str:
    try:
        process.send_signal(stop)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 128 + stop, err
    assert f"ba-run: stopped by {stop.name}" in err
    assert f"ba-run --resume {run_dir}" in err
    assert left_processes(marker) == []
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "interrupted"
    return str(summary["error"])


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_a_stop_signal_ends_an_in_process_run_interrupted_and_resumable(
    tmp_path: Path, stop: signal.Signals
) -> None:
    marker = f"ba-test-{uuid.uuid4().hex}"
    settings = {**LEAN, "num-server-rounds": 500, "run-name": "r", "output-dir": str(tmp_path)}
    process = start_ba_run(settings, "inprocess", marker)
    wait_for_round(tmp_path / "r", process, done=1)
    error = stop_and_check(process, stop, tmp_path / "r", marker)
    assert f"by {stop.name}, sent to ba-run" in error  # the ServerApp's own word


@pytest.mark.simulation
def test_sigterm_stops_the_superlink_superexec_and_simulation_ba_run_started(
    tmp_path: Path,
) -> None:
    marker = f"ba-test-{uuid.uuid4().hex}"
    settings = {**LEAN, "num-server-rounds": 200, "run-name": "sim", "output-dir": str(tmp_path)}
    process = start_ba_run(settings, "simulation", marker)
    wait_for_round(tmp_path / "sim", process, done=1)  # Ray's actors are up and training
    assert len(processes_with_environment(marker)) >= 4  # ba-run, SuperLink, SuperExec, Ray...
    stop_and_check(process, signal.SIGTERM, tmp_path / "sim", marker)


@pytest.mark.simulation
def test_a_stale_ray_cluster_file_does_not_hold_up_the_simulation(
    stale_ray_cluster: str, tmp_path: Path
) -> None:
    settings = {**LEAN, "num-server-rounds": 1, "run-name": "stale", "output-dir": str(tmp_path)}
    done = subprocess.run(
        [str(BA_RUN), "--timeout", "240", "-c", run_config_argument(settings)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Flower's log lines streamed through ba-run: plain off a terminal, and kept in log.txt.
    assert "\x1b" not in done.stdout
    log = (tmp_path / "stale" / "log.txt").read_text(encoding="utf-8")
    assert "round 1/1 | test accuracy" in log
    assert "\x1b" not in log


# --- colour codes off a terminal ------------------------------------------------------------
def test_a_runs_output_off_a_terminal_carries_no_colour_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import logging

    from flwr.supercore.logger import FLOWER_LOGGER, ConsoleHandler

    from beyond_averaging.server.runtime.launch import plain_flower_logs, run_command

    # ba-sweep's log in a file: `flwr run`'s coloured lines (simulation) reach it plain ...
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    coloured = "print('\\x1b[92mINFO \\x1b[0m:      round 1/2')"
    assert run_command([sys.executable, "-c", coloured], os.environ, tmp_path, 60, None) == 0
    assert capsys.readouterr().out == "INFO :      round 1/2\n"
    # ... and so do Flower's own records in this process (the in-process runtime).
    stream = io.StringIO()
    handler = ConsoleHandler(timestamps=False, json=False, colored=True)
    handler.setStream(stream)
    FLOWER_LOGGER.addHandler(handler)
    try:
        with plain_flower_logs():
            FLOWER_LOGGER.log(logging.INFO, "round 1/2")
        assert "\x1b" not in stream.getvalue()
        assert "round 1/2" in stream.getvalue()
        assert handler.colored  # Flower's setting is back for what runs after
    finally:
        FLOWER_LOGGER.removeHandler(handler)
