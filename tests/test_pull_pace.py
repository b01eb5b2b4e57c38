"""The paced pull loops (server/deploy/pull_pace.py): the wait after a message, its back-off to
Flower's pace, the wake pipe from the SuperNode to the warm executor, and the installed
Flower's loops taking the paced clock (tests/test_deployment_warm.py runs them for real)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

from beyond_averaging.server.deploy import pull_pace, supervise
from beyond_averaging.server.deploy.pull_pace import (
    FLOWER_IDLE_WAIT,
    FLOWER_REPLY_WAIT,
    PacedClock,
    PullPace,
)


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds each ``time.sleep`` of the paced clock asked for (none is slept)."""
    asked: list[float] = []
    monkeypatch.setattr(pull_pace.time, "sleep", asked.append)
    return asked


def test_an_idle_node_backs_off_from_the_fastest_pull_to_flower_s_wait(slept: list[float]) -> None:
    clock = PacedClock(PullPace(fastest=0.2, growth=2.0), FLOWER_IDLE_WAIT)
    for _ in range(6):
        clock.sleep(3)  # Flower's idle wait, as its loop writes it
    assert slept == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.0, 3.0])


def test_a_message_sets_the_wait_back_to_the_fastest(slept: list[float]) -> None:
    clock = PacedClock(PullPace(fastest=0.2, growth=2.0), FLOWER_IDLE_WAIT)
    for _ in range(4):
        clock.sleep(FLOWER_IDLE_WAIT)
    clock.work_arrived()
    clock.sleep(FLOWER_IDLE_WAIT)
    assert slept[-1] == pytest.approx(0.2)


def test_the_reply_wait_is_shortened_and_any_other_sleep_is_left_alone(
    slept: list[float],
) -> None:
    clock = PacedClock(PullPace(), FLOWER_IDLE_WAIT, {FLOWER_REPLY_WAIT: 0.05})
    clock.sleep(0.5)
    clock.sleep(7)
    assert slept == [0.05, 7]
    assert clock.monotonic() <= time.monotonic()  # the rest of Python's time module


def test_the_extra_pulls_after_a_message_match_a_hand_count() -> None:
    # fastest 1, growth 2, Flower's 3: waits 1 and 2 (3 s), then Flower's 3 s again. Flower's
    # node pulls once in those 3 s; the paced one twice: one more.
    pace = PullPace(fastest=1.0, growth=2.0)
    assert pace.waits() == [1.0, 2.0]
    assert pace.extra_pulls() == pytest.approx(1.0)
    defaults = PullPace()
    assert len(defaults.waits()) == 13
    assert defaults.extra_pulls() == pytest.approx(13 - sum(defaults.waits()) / 3)


@pytest.mark.parametrize(
    ("fastest", "growth", "named"),
    [(0.0, 1.25, "0.0"), (4.0, 1.25, "4.0"), (float("nan"), 1.25, "nan"), (0.2, 1.0, "1.0")],
)
def test_a_pace_out_of_range_is_refused_with_its_value(
    fastest: float, growth: float, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        PullPace(fastest=fastest, growth=growth)


def test_a_byte_on_the_wake_pipe_ends_the_wait_at_once() -> None:
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(read_end, False)
        clock = PacedClock(PullPace(fastest=5.0, slowest=5.0), None, wake_fd=read_end)
        os.write(write_end, b"!!")
        started = time.monotonic()
        clock.sleep(1.0)
        assert time.monotonic() - started < 1.0
        with pytest.raises(BlockingIOError):  # both bytes were read: the next wait is whole
            os.read(read_end, 1)
        started = time.monotonic()
        PacedClock(PullPace(fastest=0.3, slowest=0.3), None, wake_fd=read_end).sleep(1.0)
        assert time.monotonic() - started >= 0.29
    finally:
        os.close(read_end)
        os.close(write_end)


def test_the_installed_supernode_loop_takes_the_paced_clock_and_tells_the_executor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flwr.supernode import start_client_internal as loop

    pulled: list[Any] = [None, 42]

    def flower_pull(**_: Any) -> Any:
        return pulled.pop(0)

    # Restored after the test: the names pace_supernode replaces.
    monkeypatch.setattr(loop, "time", loop.time)
    monkeypatch.setattr(loop, "_pull_and_store_message", flower_pull)
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(read_end, False)
        clock = pull_pace.pace_supernode(PullPace(fastest=0.2), notify_fd=write_end)
        assert clock is not None
        assert loop.time is clock
        clock.wait = 2.0
        assert loop._pull_and_store_message(state=None) is None  # nothing waiting
        assert clock.wait == 2.0
        with pytest.raises(BlockingIOError):
            os.read(read_end, 1)
        assert loop._pull_and_store_message(state=None) == 42  # a message: its task exists
        assert clock.wait == 0.2
        assert os.read(read_end, 16) == b"!"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_the_installed_superexec_loop_takes_the_paced_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flwr.supercore.superexec import run_superexec as superexec

    monkeypatch.setattr(superexec, "time", superexec.time)
    clock = pull_pace.pace_superexec(PullPace(fastest=0.05, slowest=1.0))
    assert clock is not None
    assert superexec.time is clock


def test_ba_supernode_paces_the_supernode_unless_told_flower_s_three_seconds() -> None:
    paced = supervise.supernode_command(["--insecure"], 0.2, notify_fd=7)
    assert paced[1:3] == ["-m", "beyond_averaging.server.deploy.pull_pace"]
    assert paced[paced.index("--fastest") + 1] == "0.2"
    assert paced[paced.index("--notify-fd") + 1] == "7"
    flower = paced[paced.index("--") + 1]
    assert os.path.basename(flower) == "flower-supernode"
    assert paced[-1] == "--insecure"
    assert supervise.supernode_command(["--insecure"], 3.0) == [flower, "--insecure"]


def test_ba_supernode_refuses_a_non_positive_pull_interval(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as leaving:
        supervise.main(["--pull-every", "0", "--insecure"])
    assert leaving.value.code == 2
    assert "--pull-every must be positive seconds, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("loop_known", [True, False])
def test_the_paced_supernode_asks_again_for_a_missing_object_soon_only_when_paced(
    monkeypatch: pytest.MonkeyPatch, loop_known: bool
) -> None:
    import flwr.supernode.cli

    ran: list[list[str]] = []
    retried: list[bool] = []
    clock = PacedClock(PullPace(), FLOWER_IDLE_WAIT) if loop_known else None
    monkeypatch.setattr(pull_pace, "pace_supernode", lambda *_args: clock)
    monkeypatch.setattr(pull_pace, "retry_objects_sooner", lambda: retried.append(True) or True)
    monkeypatch.setattr(pull_pace, "set_process_name", lambda _name: None)
    monkeypatch.setattr(flwr.supernode.cli, "flower_supernode", lambda: ran.append(sys.argv[:]))
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    assert pull_pace.main(["--", "flower-supernode", "--insecure"]) == 0
    assert ran == [["flower-supernode", "--insecure"]]  # Flower's own entry point, either way
    # A loop this module does not know runs unchanged: Flower's 1 s object wait too.
    assert retried == ([True] if loop_known else [])
