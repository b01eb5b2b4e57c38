"""Waiting for replies by a schedule (server/pull.py), and what the round says about the nodes.

The Grid is a fake whose nodes answer at set times on a fake clock: each test knows when every
reply reaches the "SuperLink", so when the loop pulls, how many times, and when it returns are
exact. Flower's own loop (``HttpGrid.send_and_receive``, a pull every 3 s) runs on the same fake
Grid and clock as the reference for the replies and their order.
"""

from __future__ import annotations

import logging
import math
import random
import time
import types
from collections.abc import Iterable
from typing import Any

import flwr
import numpy as np
import pytest
from flwr.app import Error, Message, Metadata, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from beyond_averaging.server import rounds
from beyond_averaging.server.bounded_pull import SUPPORTED_FLOWER, ByteBoundedGrid, round_grid
from beyond_averaging.server.pull import (
    FLOWER_OBJECT_RETRY,
    FLOWER_TIMER,
    OBJECT_RETRY_FIRST,
    PollingGrid,
    PullSchedule,
    ReplyWait,
    polling,
    retry_objects_sooner,
)
from beyond_averaging.server.rounds import awaited_nodes, missing_nodes, waiting_notice
from beyond_averaging.server.runtime.inprocess import InProcessGrid
from beyond_averaging.strategies import FedAvg
from tests.conftest import reply_message, train_reply
from tests.test_reporting import client, from_partition, started


@pytest.fixture(autouse=True)
def flowers_object_retry() -> Iterable[None]:
    """Flower's object pulls as installed, before and after each test (``polling`` and
    ``round_grid`` set their first retry for the whole process)."""
    from flwr.supercore.inflatable import inflatable_utils

    functions = [inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree]
    saved = [dict(function.__kwdefaults__) for function in functions]
    yield
    for function, defaults in zip(functions, saved, strict=True):
        function.__kwdefaults__ = defaults


#: What a node does after the push: answer at these seconds, or the SuperLink answers in its
#: place with an error at these seconds (a node gone), or nothing (None).
Answer = tuple[float, str] | None


class FakeTime:
    """A clock that moves only when the loop sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def instruction(node: int) -> Message:
    metadata = Metadata(
        run_id=1,
        message_id="",
        src_node_id=SUPERLINK_NODE_ID,
        dst_node_id=node,
        reply_to_message_id="",
        group_id="1",
        created_at=0.0,
        ttl=60.0,
        message_type="train",
    )
    return Message(metadata=metadata, content=RecordDict())


def reply(node: int, reply_to: str, kind: str) -> Message:
    """A node's reply, or (``kind == "lost"``) the error reply the SuperLink makes for it,
    signed with the SuperLink's own id as flwr's ``create_message_error_unavailable_res_message``
    signs it."""
    metadata = Metadata(
        run_id=1,
        message_id=f"reply-{reply_to}",
        src_node_id=SUPERLINK_NODE_ID if kind == "lost" else node,
        dst_node_id=SUPERLINK_NODE_ID,
        reply_to_message_id=reply_to,
        group_id="1",
        created_at=0.0,
        ttl=60.0,
        message_type="train",
    )
    if kind == "lost":
        error = Error(code=ErrorCode.NODE_UNAVAILABLE, reason="node unavailable")
        return Message(metadata=metadata, error=error)
    return Message(metadata=metadata, content=RecordDict())


class ScriptedGrid(Grid):
    """Nodes answering at set seconds after the push; every pull's moment and what the round's
    Grid said was still due at that moment are kept."""

    def __init__(self, clock: FakeTime, answers: dict[int, Answer]) -> None:
        self.clock, self.answers = clock, answers
        self.pushed_at = 0.0
        self.pending: dict[str, Message] = {}
        self.pulls: list[float] = []
        self.due_at_pulls: list[list[int] | None] = []
        self.outer: PollingGrid | None = None

    def set_run(self, run: Run) -> None:
        raise NotImplementedError

    @property
    def run(self) -> Run:
        return Run.create_empty(1)

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.answers)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self.pushed_at = self.clock.now
        ids = []
        for message in messages:
            node = message.metadata.dst_node_id
            message.metadata.__dict__["_message_id"] = f"m{node}"
            answer = self.answers[node]
            if answer is not None:
                self.pending[f"m{node}"] = reply(node, f"m{node}", answer[1])
            ids.append(f"m{node}")
        return ids

    def arrival(self, message_id: str) -> float:
        answer = self.answers[int(message_id[1:])]
        return math.inf if answer is None else self.pushed_at + answer[0]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self.pulls.append(self.clock.now)
        self.due_at_pulls.append(None if self.outer is None else sorted(self.outer.awaited() or []))
        ready = sorted(
            (i for i in message_ids if i in self.pending and self.arrival(i) <= self.clock.now),
            key=self.arrival,
        )
        return [self.pending.pop(i) for i in ready]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        raise NotImplementedError


def scripted(
    answers: dict[int, Answer], schedule: PullSchedule | None = None
) -> tuple[PollingGrid, ScriptedGrid, FakeTime]:
    fake = FakeTime()
    inner = ScriptedGrid(fake, answers)
    grid = PollingGrid(inner, schedule, clock=fake.clock, sleep=fake.sleep)
    inner.outer = grid
    return grid, inner, fake


def flowers_loop(answers: dict[int, Answer], timeout: float, monkeypatch: Any) -> tuple[Any, ...]:
    """Flower's own ``HttpGrid.send_and_receive`` (flwr 1.39-1.42) on the same fake Grid."""
    from flwr.superlink.grid import http_grid

    fake = FakeTime()
    inner = ScriptedGrid(fake, answers)
    monkeypatch.setattr(http_grid, "time", types.SimpleNamespace(time=fake.clock, sleep=fake.sleep))
    replies = http_grid.HttpGrid.send_and_receive(  # type: ignore[arg-type]
        inner, [instruction(n) for n in answers], timeout=timeout
    )
    return list(replies), inner, fake


def received(replies: Iterable[Message]) -> list[tuple[int, str]]:
    return [(m.metadata.src_node_id, m.metadata.reply_to_message_id) for m in replies]


# ------------------------------------------------------------------------------ the schedule
def test_the_interval_starts_short_grows_while_nothing_comes_and_restarts_after_a_reply() -> None:
    schedule = PullSchedule(first=0.1, growth=2.0, cap=1.0)
    intervals, last = [], None
    for got in (False, False, False, False, False, False, True, False):
        last = schedule.next_interval(last, got)
        intervals.append(last)
    assert intervals == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 0.1, 0.2])
    assert schedule.ramp() == 4  # 0.1, 0.2, 0.4, 0.8 below the cap
    assert FLOWER_TIMER.ramp() == 0
    assert [FLOWER_TIMER.next_interval(3.0, got) for got in (False, True)] == [3.0, 3.0]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"first": 0.0}, "first = 0.0"),
        ({"growth": 0.5}, "growth = 0.5"),
        ({"first": 2.0, "cap": 1.0}, "cap = 1.0"),
        ({"first": math.nan}, "first = nan"),
    ],
)
def test_a_schedule_that_cannot_work_is_refused_naming_the_value(
    options: dict[str, float], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        PullSchedule(**options)


# ------------------------------------------------------------------------------ the wait
def test_replies_that_come_early_are_taken_at_once_as_flowers_loop_takes_them_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers: dict[int, Answer] = {5: (0.25, "reply"), 6: (0.05, "reply"), 7: (0.26, "reply")}
    grid, inner, fake = scripted(answers)
    replies = list(grid.send_and_receive([instruction(n) for n in answers], timeout=60.0))
    flower, flower_inner, flower_time = flowers_loop(answers, 60.0, monkeypatch)
    # The same replies, 2.7 s sooner, in the order of their instructions (not of arrival).
    assert received(replies) == [(5, "m5"), (6, "m6"), (7, "m7")]
    assert received(flower) == [(6, "m6"), (5, "m5"), (7, "m7")]
    assert inner.pulls == pytest.approx([0.0, 0.1, 0.2, 0.4])  # 6 at 0.1: back to 0.1 s
    assert fake.now == pytest.approx(0.4)
    assert flower_inner.pulls == [0.0, 3.0]
    assert flower_time.now == 3.0
    assert grid.pulls == 4


def test_a_late_reply_is_seen_at_most_cap_seconds_after_it_arrives_with_bounded_pulls() -> None:
    schedule = PullSchedule()
    grid, inner, fake = scripted({5: (7.3, "reply")}, schedule)
    replies = list(grid.send_and_receive([instruction(5)], timeout=600.0))
    assert received(replies) == [(5, "m5")]
    assert 7.3 <= fake.now <= 7.3 + schedule.cap
    assert max(fake.sleeps) == schedule.cap
    # 0, 0.1, 0.3, 0.7, 1.5, then every second: 2.5 ... 7.5.
    assert len(inner.pulls) == 11 <= schedule.max_pulls(fake.now, 1)
    # Flower's timer: seen at 9.0 s, after 4 pulls.
    timer, timer_inner, timer_time = scripted({5: (7.3, "reply")}, FLOWER_TIMER)
    timer.send_and_receive([instruction(5)], timeout=600.0)
    assert (timer_time.now, len(timer_inner.pulls)) == (9.0, 4)


def test_replies_that_never_come_end_the_wait_at_the_timeout_with_what_came(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers: dict[int, Answer] = {5: (0.2, "reply"), 6: None, 7: (59.95, "reply")}
    schedule = PullSchedule()
    grid, inner, fake = scripted(answers, schedule)
    replies = list(grid.send_and_receive([instruction(n) for n in answers], timeout=60.0))
    # A last pull at the timeout itself takes node 7's reply; node 6's never came.
    assert received(replies) == [(5, "m5"), (7, "m7")]
    assert fake.now == pytest.approx(60.0)
    assert inner.pulls[-1] == pytest.approx(60.0)
    assert len(inner.pulls) <= schedule.max_pulls(60.0, 2)
    assert len(inner.pulls) <= 2 + 60.0 / schedule.cap + 3 * schedule.ramp()
    # Flower's loop ends after its last 3 s sleep without pulling again: it misses node 7.
    flower, flower_inner, flower_time = flowers_loop(answers, 60.0, monkeypatch)
    assert received(flower) == [(5, "m5")]
    assert (flower_inner.pulls[-1], flower_time.now) == (57.0, 60.0)


def test_the_wait_knows_which_nodes_are_still_due_and_names_the_node_of_a_superlink_error() -> None:
    answers: dict[int, Answer] = {5: (0.05, "reply"), 6: (0.2, "reply"), 7: (0.5, "lost")}
    grid, inner, _ = scripted(answers)
    assert grid.awaited() is None  # no wait runs
    replies = list(grid.send_and_receive([instruction(n) for n in answers], timeout=60.0))
    assert inner.due_at_pulls[0] == [5, 6, 7]
    assert [5, 6, 7] not in inner.due_at_pulls[2:]
    assert inner.due_at_pulls[-1] == [7]
    # The SuperLink signed the error with its own id; the instruction names the node.
    lost = replies[-1]
    assert lost.has_error()
    assert lost.metadata.src_node_id == 7
    assert grid.awaited() is None


def test_a_push_the_grid_refused_is_not_waited_for() -> None:
    grid, inner, fake = scripted({5: (0.05, "reply")})
    original = inner.push_messages
    inner.push_messages = lambda messages: [*original(messages), ""]  # type: ignore[method-assign]
    replies = list(grid.send_and_receive([instruction(5)], timeout=60.0))
    assert received(replies) == [(5, "m5")]
    assert fake.now < 1.0


def test_polling_wraps_a_grid_once() -> None:
    inner = ScriptedGrid(FakeTime(), {})
    wrapped = polling(inner)
    assert isinstance(wrapped, PollingGrid)
    assert wrapped.inner is inner
    assert polling(wrapped) is wrapped


def test_the_serverapp_pulls_flowers_grids_by_a_schedule_and_leaves_the_in_process_one() -> None:
    from flwr.superlink.grid.http_grid import HttpGrid
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    http = object.__new__(HttpGrid)
    deployed = round_grid(http, lambda: 1 << 20)
    assert isinstance(deployed, PollingGrid)
    assert deployed.schedule == PullSchedule()
    # Replies bounded while pulled where the bounded pull is written for the Flower installed.
    assert isinstance(deployed, ByteBoundedGrid) is flwr.__version__.startswith(SUPPORTED_FLOWER)
    simulated = object.__new__(InMemoryGrid)
    simulated.pull_interval = 0.1
    simulation = round_grid(simulated, lambda: 1 << 20)
    assert isinstance(simulation, PollingGrid)
    assert simulation.schedule == PullSchedule(first=0.1, growth=1.0, cap=0.1)  # Flower's own
    in_process = object.__new__(InProcessGrid)
    assert round_grid(in_process, lambda: 1 << 20) is in_process


def first_retry(pull_objects: Any) -> float:
    """Seconds between the first and the second ask of Flower's ``pull_objects`` for an object
    that is missing at the first ask and there at the second."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    asked: list[float] = []

    def pull_one(object_id: str) -> bytes:
        asked.append(time.monotonic())
        if len(asked) == 1:  # still being uploaded
            raise ObjectUnavailableError(object_id)
        return b"content"

    assert pull_objects(["reply-object"], pull_one) == {"reply-object": b"content"}
    return asked[1] - asked[0]


def test_an_object_still_being_uploaded_is_asked_for_again_after_a_twentieth_of_flowers_wait() -> (
    None
):
    from flwr.supercore.inflatable import inflatable_utils

    # Flower's own first wait: 1 s, +-20 %.
    assert first_retry(inflatable_utils.pull_objects) >= 0.8 * FLOWER_OBJECT_RETRY
    from flwr.superlink.grid.http_grid import HttpGrid

    grid = object.__new__(HttpGrid)
    round_grid(grid, lambda: 1 << 20)  # the project's ServerApp behind a SuperLink
    waited = first_retry(inflatable_utils.pull_objects)
    assert 0.8 * OBJECT_RETRY_FIRST <= waited < 0.5
    # The ClientApp's pull of its message (Flower's run_clientapp) takes the same first wait.
    tree_pull = inflatable_utils.pull_and_inflate_object_from_tree
    assert tree_pull.__kwdefaults__["initial_backoff"] == OBJECT_RETRY_FIRST
    # What follows is Flower's: the cap and the limits are untouched.
    assert inflatable_utils.pull_objects.__kwdefaults__["backoff_cap"] == 10


def test_polling_a_users_grid_retries_objects_sooner_too() -> None:
    from flwr.supercore.inflatable import inflatable_utils

    polling(ScriptedGrid(FakeTime(), {}))
    assert inflatable_utils.pull_objects.__kwdefaults__["initial_backoff"] == OBJECT_RETRY_FIRST


def test_a_flower_whose_object_pulls_lack_the_setting_is_left_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flwr.supercore.inflatable import inflatable_utils

    def pull_tree(tree: object, pull: object, confirm: object) -> None:  # no initial_backoff
        raise AssertionError("not called")

    monkeypatch.setattr(inflatable_utils, "pull_and_inflate_object_from_tree", pull_tree)
    assert retry_objects_sooner() is False
    assert inflatable_utils.pull_objects.__kwdefaults__["initial_backoff"] == FLOWER_OBJECT_RETRY


@pytest.mark.parametrize("first", [0.0, -0.05, math.nan, 2.0])
def test_a_first_retry_out_of_range_is_refused_naming_it(first: float) -> None:
    with pytest.raises(ValueError, match=f"got {first!r}"):
        retry_objects_sooner(first)


# ------------------------------------------------------------------------ what the round says
def test_the_waiting_line_names_only_the_nodes_still_due_and_the_timeout_line_the_missing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(rounds, "WAIT_NOTICE_SECONDS", 0.2)
    answers: dict[int, Answer] = {5: (0.0, "reply"), 6: (0.0, "reply"), 7: None}
    inner = ScriptedGrid(FakeTime(), answers)
    inner.clock.clock = time.monotonic  # type: ignore[method-assign]
    inner.clock.now = time.monotonic()
    grid = PollingGrid(inner, PullSchedule(first=0.02, growth=1.0, cap=0.02))
    with (
        caplog.at_level(logging.INFO, logger="flwr"),
        waiting_notice(3, "train", awaited_nodes(grid, [5, 6, 7]), 1.0),
    ):
        replies = list(grid.send_and_receive([instruction(n) for n in answers], timeout=1.0))
    waits = [r for r in caplog.records if "waiting" in r.getMessage()]
    assert waits
    assert all("replies of 1 node(s) (7)" in r.getMessage() for r in waits), caplog.text
    # A wait is news (INFO) until half the round's timeout has passed, then a warning.
    assert waits[0].levelno == logging.INFO
    assert waits[-1].levelno == logging.WARNING
    assert missing_nodes([5, 6, 7], replies) == [7]
    # Without a Grid that keeps them, every node sent to.
    assert awaited_nodes(inner, [5, 6, 7])() == [5, 6, 7]


def test_an_error_reply_names_its_node_and_the_partition_it_named_before(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = started(FedAvg(min_train_replies=1))
    first = [
        from_partition(train_reply(client(1.0), 10, node_id=node), partition)
        for node, partition in ((11, 0), (12, 1), (13, 2))
    ]
    strategy.aggregate_train(1, first)
    # Round 2: node 13 is gone; the SuperLink answers its instruction, signed with its own id.
    wait = ReplyWait({"m11": 11, "m12": 12, "m13": 13})
    lost = reply(13, "m13", "lost")
    assert lost.metadata.src_node_id == SUPERLINK_NODE_ID
    second = [from_partition(train_reply(client(1.0), 10, node_id=n), n - 11) for n in (11, 12)]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.aggregate_train(2, [*second, *wait.take([lost])])
    records = {r["node-id"]: r for r in strategy.last_client_records}
    assert records[13]["partition"] == 2
    assert records[13]["reason"] == "error-reply"
    assert "dropped reply from node 13 (partition 2): error reply" in caplog.text
    # A Grid that did not name the node (Flower's own loop): unknown, not the SuperLink's id 1.
    caplog.clear()
    unnamed = reply(13, "m13", "lost")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.aggregate_train(3, [*second, unnamed])
    records = {r["node-id"]: r for r in strategy.last_client_records}
    assert SUPERLINK_NODE_ID not in records
    assert records[None]["partition"] is None
    assert "dropped reply from an unknown node (partition unknown)" in caplog.text
    # A node never heard from before: its partition is unknown.
    fresh = started(FedAvg(min_train_replies=1))
    fresh.aggregate_train(1, [*first[:2], reply_message(node_id=14, error="gone")])
    assert {r["node-id"]: r["partition"] for r in fresh.last_client_records}[14] is None
    assert np.isfinite(fresh.aggregation_metrics[1]["replies-valid"])


# ------------------------------------------------------------------ a ServerApp of your own
def test_flowers_own_strategy_runs_over_polling_as_docs_library_md_shows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``strategy.start(grid=polling(grid), ...)``: Flower's FedAvg trains the same model over
    the wrapped Grid as over the Grid itself (here the in-process one, whose replies are ready
    at the push: a wait that pulls once)."""
    from flwr.app import ArrayRecord, Context, MetricRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)  # what a ServerApp process is told
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        arrays = message.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
        moved = ArrayRecord([a + partition + 1.0 for a in arrays])
        metrics = MetricRecord({"num-examples": 10 * (partition + 1)})
        return Message(RecordDict({"arrays": moved, "metrics": metrics}), reply_to=message)

    def trained(grid: Grid) -> list[np.ndarray[Any, Any]]:
        random.seed(0)  # Flower samples the nodes with Python's random: the same order twice
        strategy = FlowerFedAvg(fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=3)
        start = ArrayRecord([np.zeros(4, dtype=np.float32)])
        result = strategy.start(grid=grid, initial_arrays=start, num_rounds=2, timeout=30.0)
        return result.arrays.to_numpy_ndarrays()

    wrapped = polling(InProcessGrid(app, 3, {}))
    assert isinstance(wrapped, PollingGrid)
    np.testing.assert_array_equal(trained(wrapped), trained(InProcessGrid(app, 3, {})))
    assert wrapped.pulls == 2  # one a round: every reply was in at the push


def test_the_users_helper_imports_only_flower_s_public_app_api_at_run_time() -> None:
    # `polling` is for users' ServerApps on every supported Flower, down to the floor (1.21),
    # which has no flwr.supercore.run: at run time server/pull.py may import only what every
    # release has, flwr.app and flwr.serverapp (other names, for annotations, under
    # TYPE_CHECKING). The userapp matrix deploys it there. (The attack set's AttackGrid, built on
    # DelegatingGrid, needs flwr 1.39+ for its other imports: docs/library.md.)
    import ast
    from pathlib import Path

    import beyond_averaging.server.pull as pull

    tree = ast.parse(Path(pull.__file__).read_text(encoding="utf-8"))
    runtime = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    flower = sorted({str(node.module) for node in runtime if str(node.module).startswith("flwr")})
    assert flower == ["flwr.app", "flwr.serverapp"]
