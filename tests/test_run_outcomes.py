"""Runs tell the truth about their state.

A run that cannot train ends ``failed`` with the reason; late replies count as dropped; a run
whose model collapses to chance or whose loss explodes says so every round and in its summary; a
run whose process died is reported ``interrupted``, never ``running``, and a run still alive
cannot be resumed beside itself.

Runs use the in-process runtime (the real ServerApp and ClientApp, ``server/runtime/inprocess.py``).
A learning rate of 1e30 makes every client's model non-finite, so every reply is dropped and no
round can aggregate: the honest way for a whole federation to be unable to train.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from flwr.app import Message

from beyond_averaging.server.app import RunStalledError, chance_accuracy, round_alarms
from beyond_averaging.server.attacks import ATTACKS, AttackGrid
from beyond_averaging.server.cli.main import main as ba_run
from beyond_averaging.server.cli.status import ALARMS_EXIT_CODE
from beyond_averaging.server.overrides import run_config_argument
from beyond_averaging.server.runs.recorder import RunInUseError, RunRecorder, run_status
from beyond_averaging.server.runtime.inprocess import InProcessGrid, run_inprocess
from tests.deploy_helpers import REPO, read_metrics

BA_RUN = Path(sys.executable).parent / "ba-run"

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
            str(BA_RUN),
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
        grid.late_node, grid.timeouts = max(grid.get_node_ids()), []
        grids.append(grid)
        return grid

    monkeypatch.setattr("beyond_averaging.server.runtime.inprocess.InProcessGrid", make_grid)
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


# --------------------------------------------------------------------------- a run going wrong
CHANCE = 0.1


def alarms_of(accuracies: list[float], losses: list[float] | None = None) -> list[set[str]]:
    """The alarm kinds of every round 1.. of a run whose server evaluation gave ``accuracies``
    (round 0 first), as the ServerApp judges them: each round against the ones before it, the
    last one as the last."""
    figures = list(zip(accuracies, losses or [2.3] * len(accuracies), strict=True))
    return [
        set(round_alarms(figures[:index], *figures[index], CHANCE, last=index == len(figures) - 1))
        for index in range(1, len(figures))
    ]


@pytest.mark.parametrize(
    ("history", "accuracy", "loss", "expected"),
    [
        # learned (best 0.6 >= chance + 0.2), within 0.05 of chance for 3 rounds: collapsed
        ([(0.08, 2.3), (0.6, 1.0), (0.12, 1.4), (0.11, 1.5)], 0.12, 1.5, {"accuracy-at-chance"}),
        ([(0.08, 2.3), (0.6, 1.0), (0.01, 1.4), (0.02, 1.5)], 0.01, 1.5, {"accuracy-at-chance"}),
        # one or two rounds at chance mid-run are a dip, not a collapse
        ([(0.08, 2.3), (0.6, 1.0)], 0.12, 1.5, set()),
        ([(0.08, 2.3), (0.6, 1.0), (0.12, 1.4)], 0.12, 1.5, set()),
        ([(0.08, 2.3), (0.6, 1.0), (0.12, 1.4), (0.5, 1.0)], 0.12, 1.5, set()),
        # never learned (best 0.25 < 0.3): a slow start is not a collapse
        ([(0.08, 2.3), (0.25, 2.0), (0.1, 2.0), (0.1, 2.0)], 0.1, 2.1, set()),
        # dropped, but not to chance (0.16 > 0.15)
        ([(0.08, 2.3), (0.9, 0.3), (0.16, 2.0), (0.16, 2.0)], 0.16, 2.0, set()),
        # loss > 2 x untrained (4.6) and > 10 x lowest (3.0): exploded
        ([(0.08, 2.3), (0.9, 0.3)], 0.5, 4.7, {"loss-exploded"}),
        # above 2 x untrained but within 10 x the lowest (best 0.5): not exploded
        ([(0.08, 2.3), (0.3, 0.5)], 0.3, 4.7, set()),
        ([(0.08, 2.3)], 0.3, float("nan"), {"loss-exploded"}),
        ([(0.08, 2.3)], 0.3, float("inf"), {"loss-exploded"}),
        ([], 0.08, 2.3, set()),  # round 0 has nothing to compare with
    ],
)
def test_round_alarms_name_a_collapse_to_chance_and_an_exploded_loss(
    history: list[tuple[float, float]], accuracy: float, loss: float, expected: set[str]
) -> None:
    assert set(round_alarms(history, accuracy, loss, CHANCE)) == expected


def test_an_honest_dip_to_chance_that_recovers_raises_no_alarm() -> None:
    # The shape of the honest FLAME run of issue 35 (FedAvg, digits, Dirichlet 0.1, seed 1):
    # learning, one round at chance (round 6), then back up to 50.9 % at the end.
    accuracies = [0.09, 0.25, 0.38, 0.41, 0.45, 0.33, 0.11, 0.30, 0.509]
    assert alarms_of(accuracies) == [set()] * 8


@pytest.mark.parametrize(
    "accuracies",
    [
        # peaked between chance + 0.05 and chance + 0.2, then fell to chance (FedLAW + FLAME
        # under the norm-aware attack: best 18.0 %, last 10.3 %)
        [0.09, 0.14, 0.18, 0.16, 0.12, 0.103],
        # learned well, then fell to chance in the last round only
        [0.09, 0.6, 0.7, 0.72, 0.11],
        # learned well, at chance for the last two rounds (too few for a mid-run collapse)
        [0.09, 0.6, 0.7, 0.12, 0.11],
    ],
)
def test_a_run_that_ends_at_chance_after_learning_raises_an_alarm_at_its_last_round(
    accuracies: list[float],
) -> None:
    alarms = alarms_of(accuracies)
    assert alarms[-1] == {"accuracy-at-chance"}
    assert all(not kinds for kinds in alarms[:-1])  # none before: no round stayed at chance


def test_a_run_that_ends_above_chance_raises_no_chance_alarm() -> None:
    # Low but above chance + 0.05 at the end (an honest FLAME run ending at 19.7 %): the model
    # is weak, not at chance, and the run says nothing false about it.
    assert alarms_of([0.09, 0.3, 0.12, 0.25, 0.197]) == [set()] * 4


def test_alarm_messages_name_the_figures_and_suggest_causes_without_accusing() -> None:
    collapsed = round_alarms(
        [(0.08, 2.3), (0.6, 1.0), (0.12, 1.4), (0.11, 1.5)], 0.12, 1.6, CHANCE
    )["accuracy-at-chance"]
    assert "test accuracy 0.1200 (test loss 1.6)" in collapsed
    assert "in rounds 2-4, after 0.6000 in round 1" in collapsed
    never = round_alarms([(0.08, 2.3), (0.1, 2.31), (0.11, 2.29)], 0.09, 2.3, CHANCE, last=True)[
        "never-above-chance"
    ]
    assert "the best was 0.1100 in round 2 of 3 rounds" in never
    assert "too few rounds" in never
    assert "learning rate" in never
    for message in (collapsed, never):
        assert "possible causes" in message
        assert "Byzantine" not in message  # a cause to check, not a verdict


def test_chance_is_the_share_of_the_most_frequent_test_label() -> None:
    assert chance_accuracy(np.array([0, 1, 1, 2, 1])) == 0.6


def test_a_collapsing_run_logs_its_alarm_every_round_and_marks_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The server's evaluation of rounds 0..7, scripted: it learns, then collapses to chance from
    # round 3 on and its loss explodes (what one sign-flipping attacker did to every rule); the
    # collapse alarm fires once the model has stayed at chance 3 rounds (round 5).
    script = iter(
        [(2.30, 0.08), (1.0, 0.55), (0.5, 0.85), (2.5, 0.09), (40.0, 0.10), (9e9, 0.1)]
        + [(9e9, 0.1)] * 2
    )
    monkeypatch.setattr(
        "beyond_averaging.server.app.evaluate", lambda *args, **kwargs: next(script)
    )
    settings = {**LEAN, "num-server-rounds": 7, "run-name": "sick", "output-dir": str(tmp_path)}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_inprocess(REPO, settings)
    rounds = read_metrics(tmp_path / "sick")
    at_chance = [r["round"] for r in rounds if r.get("alarm-accuracy-at-chance")]
    exploded = [r["round"] for r in rounds if r.get("alarm-loss-exploded")]
    assert at_chance == [5, 6, 7]
    assert exploded == [4, 5, 6, 7]  # round 3's 2.5 is under 2 x the untrained 2.30
    warned = [m for m in caplog.messages if "ALARM accuracy-at-chance" in m]
    assert len(warned) == 3  # one warning per alarmed round, not once
    summary = json.loads((tmp_path / "sick" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "completed-with-alarms"  # never plain "completed"
    assert summary["alarms"]["accuracy-at-chance"]["rounds"] == 3
    assert summary["alarms"]["accuracy-at-chance"]["first-round"] == 5
    assert summary["alarms"]["accuracy-at-chance"]["last-round-alarmed"] is True
    assert summary["alarms"]["loss-exploded"]["first-round"] == 4
    assert "after 0.8500 in round 2" in summary["alarms"]["accuracy-at-chance"]["message"]
    assert "in rounds 5-7" in summary["alarms"]["accuracy-at-chance"]["message"]


def ba_run_inprocess(settings: dict[str, Any]) -> int:
    """``ba-run --runtime inprocess`` in this process, its exit code."""
    return ba_run(
        ["--app", str(REPO), "--runtime", "inprocess", "-c", run_config_argument(settings)]
    )


def test_a_sybil_majority_run_ends_with_the_alarm_status_and_exit_4(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Three of four clients send their honest update sign-flipped and five times as long (the
    # attack table's attacker, server/attacks/), from round 1.
    honest_send = InProcessGrid.send_and_receive

    def sybil_send(
        grid: InProcessGrid, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        inner = SimpleNamespace(
            send_and_receive=lambda m, timeout=None: honest_send(grid, m, timeout=timeout)
        )
        sybils = sorted(grid.get_node_ids())[:3]
        attacked = AttackGrid(inner, sybils, ATTACKS["sign-flip"], seed=0)  # type: ignore[arg-type]
        return attacked.send_and_receive(messages, timeout=timeout)

    monkeypatch.setattr(InProcessGrid, "send_and_receive", sybil_send)
    settings = {
        **LEAN,
        "num-clients": 4,
        "partition": "iid",
        "num-server-rounds": 3,
        "run-name": "sybil",
        "output-dir": str(tmp_path),
    }
    with caplog.at_level(logging.WARNING, logger="flwr"):
        code = ba_run_inprocess(settings)
    assert code == ALARMS_EXIT_CODE == 4
    summary = json.loads((tmp_path / "sybil" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "completed-with-alarms"
    assert summary["alarms"]  # e.g. never-above-chance, loss-exploded
    assert "ran every round but raised alarms" in capsys.readouterr().err
    # The honest client is the one pointing against the others: the drop's message does not
    # blame it, it says that the majority may be the Byzantine side.
    dropped = [m for m in caplog.messages if "direction" in m and "dropped reply" in m]
    assert dropped, caplog.messages
    assert all("if most replies are Byzantine" in m and "may be honest" in m for m in dropped)
    assert ba_run(["--status", str(tmp_path / "sybil")]) == 4


def test_a_run_at_chance_from_round_1_raises_never_above_chance_and_exits_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's evaluation of rounds 0..3, scripted: never above chance (the digits test
    # split's most frequent label is about 0.1), so the collapse alarm (which needs a model that
    # had learned) never fires.
    script = iter([(2.30, 0.08), (2.31, 0.10), (2.29, 0.11), (2.30, 0.09)])
    monkeypatch.setattr(
        "beyond_averaging.server.app.evaluate", lambda *args, **kwargs: next(script)
    )
    settings = {**LEAN, "num-server-rounds": 3, "run-name": "chance", "output-dir": str(tmp_path)}
    assert ba_run_inprocess(settings) == 4
    rounds = read_metrics(tmp_path / "chance")
    assert [r["round"] for r in rounds if r.get("alarm-never-above-chance")] == [3]  # the last
    summary = json.loads((tmp_path / "chance" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "completed-with-alarms"
    message = summary["alarms"]["never-above-chance"]["message"]
    assert "the best was 0.1100 in round 2 of 3 rounds" in message


@pytest.mark.parametrize(
    ("accuracies", "alarmed"),
    [
        ([0.10, 0.12, 0.14], True),  # within chance (0.1) + 0.05 throughout
        ([0.10, 0.16, 0.12], False),  # rose above it once
        ([0.50, 0.12, 0.12], True),  # round 0 (untrained) does not count as learning
    ],
)
def test_never_above_chance_judges_the_trained_rounds_at_the_last_round(
    accuracies: list[float], alarmed: bool
) -> None:
    history = [(accuracy, 2.3) for accuracy in accuracies[:-1]]
    last = round_alarms(history, accuracies[-1], 2.3, CHANCE, last=True)
    assert ("never-above-chance" in last) is alarmed
    assert "never-above-chance" not in round_alarms(history, accuracies[-1], 2.3, CHANCE)


# ------------------------------------------------------------------ a dead run is never running
def test_a_second_writer_of_a_live_run_folder_is_refused(tmp_path: Path) -> None:
    first = RunRecorder(tmp_path, "run", {"seed": 0})
    with pytest.raises(RunInUseError, match=f"pid {os.getpid()}"):
        RunRecorder(tmp_path, "run", {"seed": 0}, resume_round=0)
    assert run_status(tmp_path / "run").status == "running"
    first.write_summary("failed", error="boom")  # a final status gives the folder up
    RunRecorder(tmp_path, "run", {"seed": 0}, resume_round=0).close()


def test_a_serverapp_stopped_from_outside_ends_interrupted_with_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What Flower does to a ServerApp on SIGTERM, on `flwr stop`, and when a restarted SuperLink
    # no longer knows its run: SystemExit(0) in the middle of a round (it used to end "failed"
    # with the error "SystemExit: 0").
    calls = iter(range(100))

    def stopped(self: InProcessGrid, messages: Any, **kwargs: Any) -> Any:
        if next(calls) == 1:  # round 2's train instructions
            raise SystemExit(0)
        return InProcessGrid.pull_messages(self, list(self.push_messages(messages)))

    monkeypatch.setattr(InProcessGrid, "send_and_receive", stopped)
    settings = {**LEAN, "num-server-rounds": 3, "run-name": "stop", "output-dir": str(tmp_path)}
    with pytest.raises(SystemExit):
        run_inprocess(REPO, settings)
    summary = json.loads((tmp_path / "stop" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "interrupted"
    assert "stopped after round 1 by SystemExit 0" in summary["error"]
    assert f'resume-from = "{tmp_path / "stop"}"' in summary["error"]


class ForcedExit(BaseException):
    """Stands for Flower's force-exit timer (``os._exit``), which no except clause sees."""


def test_flowers_exit_records_the_interruption_before_its_force_exit_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # flwr_exit runs the handlers registered "before force exit", starts a 5 s timer that calls
    # os._exit, then cleans up; after a SuperLink restart the clean-up outlasted the timer and
    # the run's own `except SystemExit` never ran (the summary kept "running").
    from flwr.supercore.exit import exit_handler as flower_exit

    handlers_before = len(flower_exit.registered_exit_handlers)
    calls = iter(range(100))

    def killed(self: InProcessGrid, messages: Any, **kwargs: Any) -> Any:
        if next(calls) == 1:  # round 2
            flower_exit.trigger_exit_handlers(run_before_force_exit=True)
            raise ForcedExit
        return InProcessGrid.pull_messages(self, list(self.push_messages(messages)))

    monkeypatch.setattr(InProcessGrid, "send_and_receive", killed)
    settings = {**LEAN, "num-server-rounds": 3, "run-name": "forced", "output-dir": str(tmp_path)}
    with pytest.raises(ForcedExit):
        run_inprocess(REPO, settings)
    summary = json.loads((tmp_path / "forced" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "interrupted"  # not "failed" by the ForcedExit that followed
    assert "stopped after round 1 by Flower" in summary["error"]
    assert run_status(tmp_path / "forced").status == "interrupted"
    # A run that ends leaves no handler behind in Flower's process-wide list.
    run_inprocess(REPO, {**settings, "run-name": "normal", "num-server-rounds": 1})
    assert len(flower_exit.registered_exit_handlers) == handlers_before


def _ba_run(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BA_RUN), *arguments], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_a_run_killed_with_sigkill_is_reported_and_marked_interrupted(tmp_path: Path) -> None:
    settings = {
        **LEAN,
        "num-server-rounds": 500,  # far more than the test lets it run
        "run-name": "victim",
        "output-dir": str(tmp_path),
    }
    run_dir = tmp_path / "victim"
    victim = subprocess.Popen(
        [str(BA_RUN), "--runtime", "inprocess", "-c", run_config_argument(settings)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while len(read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []) < 2:
            assert victim.poll() is None, "the run ended early"
            assert time.monotonic() < deadline, "the run did not reach round 1"
            time.sleep(0.1)
        alive = _ba_run("--status", str(run_dir))
        assert alive.returncode == 3, alive.stdout + alive.stderr
        assert ": running," in alive.stdout
        refused = _ba_run("--resume", str(run_dir))
        assert refused.returncode == 1
        assert "the run is still running" in refused.stderr
    finally:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
    # kill -9 leaves "running" in the file; the owner check sees that its writer is gone.
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"
    dead = _ba_run("--status", str(run_dir))
    assert dead.returncode == 1, dead.stdout + dead.stderr
    assert ": interrupted," in dead.stdout
    assert f"pid {victim.pid}" in dead.stdout
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "interrupted"
    assert "ended without a final status" in summary["error"]
    # and it continues (here: cut to its first 3 rounds).
    resumed = _ba_run(
        "--runtime", "inprocess", "--resume", str(run_dir), "-c", "num-server-rounds=3"
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert run_status(run_dir).status == "completed"
