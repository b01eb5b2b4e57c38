"""Waiting for replies: pull soon after the push and while replies arrive, less often when none do.

Flower's ``Grid.send_and_receive`` pushes a round's instructions, then pulls their replies from
the SuperLink every 3 s until all are in or the timeout passes: a round that a node answers in
half a second waits up to 3 s more, every round. :class:`PollingGrid` waits by a
:class:`PullSchedule` instead: the first pull right after the push, the next ``first`` seconds
later, then each interval ``growth`` times the last while nothing arrives, up to ``cap``; a pull
that brings a reply starts again at ``first`` (the other nodes' replies tend to follow). The
same replies and the same timeout, with one more pull at the timeout itself (Flower's loop ends
after its last sleep without pulling again); the replies come in the order of their instructions
(Flower's come in the SuperLink's order of a set of message ids, which differs from process to
process), so that a round's aggregate does not depend on which node answered first.

What it costs the SuperLink: one ``PullMessages`` call per pull (what each reply's objects cost
is unchanged). With the defaults, at most ``1 / first`` = 10 calls a second, and a wait of ``T``
seconds in which ``R`` pulls bring replies makes at most :meth:`PullSchedule.max_pulls` pulls:
``2 + (R + 1) x 4 + T / cap``, against ``1 + T / 3`` for Flower's 3 s timer.

It also keeps, while it waits, which nodes' replies are still due (:meth:`PollingGrid.awaited`:
the round's waiting line names those, not every node sent to), and it names the node of an
error reply the SuperLink made in the node's place (a node that went away, a reply whose objects
never arrived): the SuperLink signs those with its own id (``SUPERLINK_NODE_ID``, 1), and the
instruction they answer says which node they stand for.

For a ServerApp of your own (docs/library.md, "Waiting for replies")::

    from beyond_averaging.server.pull import polling

    strategy.start(grid=polling(grid), initial_arrays=arrays, num_rounds=3)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

if TYPE_CHECKING:  # flwr 1.21, the library's floor, has no flwr.supercore.run; annotations only
    from flwr.supercore.run import Run


class DelegatingGrid(Grid):
    """A Grid that forwards every call to ``inner``; subclasses replace the calls they change."""

    def __init__(self, inner: Grid) -> None:
        self.inner = inner

    def set_run(self, run: Run) -> None:
        """As ``inner``."""
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        """As ``inner``."""
        return self.inner.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """As ``inner``."""
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """As ``inner``."""
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """As ``inner``."""
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """As ``inner``."""
        return self.inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """As ``inner``."""
        return self.inner.send_and_receive(messages, timeout=timeout)


@dataclass(frozen=True)
class PullSchedule:
    """Seconds between two pulls of replies: short after a reply, growing while none comes.

    Attributes
    ----------
    first : float
        The interval after the push's first pull and after every pull that brought a reply.
    growth : float
        Each interval after a pull that brought nothing is the last one times this (1: a fixed
        interval; ``PullSchedule(3.0, 1.0, 3.0)`` is Flower's 3 s timer).
    cap : float
        The longest interval: how late, at most, a reply is seen after it reached the SuperLink.
    """

    first: float = 0.1
    growth: float = 2.0
    cap: float = 1.0

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.first) and self.first > 0.0):
            problems.append(f"first = {self.first!r}: must be > 0 seconds (e.g. 0.1)")
        if not (math.isfinite(self.growth) and self.growth >= 1.0):
            problems.append(f"growth = {self.growth!r}: must be >= 1 (1 keeps the interval)")
        if not (math.isfinite(self.cap) and self.cap >= self.first):
            problems.append(f"cap = {self.cap!r}: must be >= first = {self.first!r} seconds")
        if problems:
            raise ValueError("PullSchedule: " + "; ".join(problems))

    def next_interval(self, last: float | None, received: bool) -> float:
        """Seconds to wait before the next pull, after a pull that ``received`` replies or not.

        ``last`` is the interval waited before that pull (None after the push's first pull).
        """
        if last is None or received:
            return self.first
        return min(last * self.growth, self.cap)

    def ramp(self) -> int:
        """How many intervals below ``cap`` follow each other from ``first`` while nothing comes."""
        intervals, interval = 0, self.first
        while interval < self.cap and self.growth > 1.0:
            intervals += 1
            interval *= self.growth
        return intervals

    def max_pulls(self, seconds: float, pulls_with_replies: int) -> int:
        """The most pulls a wait of ``seconds`` makes when ``pulls_with_replies`` of its pulls
        brought replies: the push's pull, a ramp from ``first`` after it and after each pull
        that brought replies, intervals of ``cap`` for the rest, and the last pull at the
        timeout."""
        return 2 + (pulls_with_replies + 1) * self.ramp() + math.floor(seconds / self.cap)


#: Flower's own loop (``Grid.send_and_receive`` of flwr 1.39-1.42): a pull every 3 s.
FLOWER_TIMER = PullSchedule(first=3.0, growth=1.0, cap=3.0)

#: Flower's first wait, in seconds, before it asks again for an object of a message that is not
#: stored yet (``PULL_INITIAL_BACKOFF``, flwr 1.39-1.42; each later wait twice the last, ±20 %,
#: up to 10 s).
FLOWER_OBJECT_RETRY = 1.0
#: This project's first wait for such an object: a reply is pulled while its node still uploads
#: it, a message while its SuperNode still stores it (docs/deployment.md, "How a round waits for
#: its replies").
OBJECT_RETRY_FIRST = 0.05
#: Flower's functions that pull a message's objects, each taking ``initial_backoff``.
_OBJECT_PULLS = ("pull_objects", "pull_and_inflate_object_from_tree")


def retry_objects_sooner(first: float = OBJECT_RETRY_FIRST) -> bool:
    """Make this process ask again for a message's object that is not stored yet after ``first``
    seconds, not Flower's 1 s; True if done, False (nothing changed) for a Flower without the
    setting.

    The SuperLink hands out a reply as soon as its node has announced it, while the node still
    pushes its objects; the ServerApp that pulls it then finds an object missing and waits
    Flower's :data:`FLOWER_OBJECT_RETRY` before it asks again, though the upload ends a fraction
    of a second later (a ClientApp started while its SuperNode still stores the message waits the
    same). Flower's pulls take that wait as a keyword argument (``initial_backoff``) whose
    default this sets; nothing of Flower's code is replaced, and what follows the first wait is
    Flower's (twice the last each time, up to 10 s, the same time limit and tries).

    What it costs the server asked: only an object that is missing is asked for again. Per such
    object, with the default 0.05 s, 5 asks in its first 1.55 s (0.05 + 0.1 + ... + 0.8) where
    Flower's makes 1, then the same doubling: about 4 more requests per missing object however
    long it stays missing, and still Flower's two pulls in flight per process.
    """
    if not (math.isfinite(first) and 0.0 < first <= FLOWER_OBJECT_RETRY):
        raise ValueError(
            f"the first wait for a missing object must be > 0 and at most Flower's "
            f"{FLOWER_OBJECT_RETRY:g} s, got {first!r}"
        )
    try:
        from flwr.supercore.inflatable import inflatable_utils
    except ImportError:  # a Flower without object pulls: nothing waits for objects
        return False
    defaults = [
        getattr(getattr(inflatable_utils, name, None), "__kwdefaults__", None) or {}
        for name in _OBJECT_PULLS
    ]
    if not all("initial_backoff" in keywords for keywords in defaults):
        return False
    for keywords in defaults:
        keywords["initial_backoff"] = first
    return True


class ReplyWait:
    """The replies due to one push: which node each instruction went to, and which are in.

    Parameters
    ----------
    sent : Mapping[str, int]
        Message id (as the Grid's ``push_messages`` returned it) -> the node it was sent to.
    """

    def __init__(self, sent: Mapping[str, int]) -> None:
        self.sent = dict(sent)
        self.due = dict(sent)
        self.pulls = 0
        self.pulls_with_replies = 0
        self._lock = threading.Lock()

    def awaited(self) -> list[int]:
        """The nodes whose replies are still due (safe to call from another thread)."""
        with self._lock:
            return list(self.due.values())

    def take(self, pulled: Iterable[Message]) -> list[Message]:
        """``pulled`` as received: each error reply the SuperLink made for a node named by that
        node, the replies' instructions no longer due."""
        replies = list(pulled)
        self.pulls += 1
        self.pulls_with_replies += bool(replies)
        for reply in replies:
            metadata = reply.metadata
            node = self.sent.get(metadata.reply_to_message_id)
            if node is not None and reply.has_error() and metadata.src_node_id != node:
                # Made by the SuperLink (or by the pull, for objects that never arrived), signed
                # with its own id: the instruction it answers says which node it stands for.
                metadata.__dict__["_src_node_id"] = node
        with self._lock:
            for reply in replies:
                self.due.pop(reply.metadata.reply_to_message_id, None)
        return replies


def wait_for_replies(
    grid: Grid,
    wait: ReplyWait,
    timeout: float | None,
    schedule: PullSchedule,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Message]:
    """Pull ``wait``'s replies from ``grid`` by ``schedule`` until none is due or ``timeout``
    seconds have passed (None: no limit); the replies in the order of their instructions.

    A pull right away, then one after each interval of the schedule; the last interval is cut
    to end at the timeout, where a last pull takes what has arrived by then. No pull at all when
    nothing is due (nothing was sent, as a round without federated evaluation sends).
    """
    end = None if timeout is None else clock() + timeout
    replies: list[Message] = []
    interval: float | None = None
    while wait.due:
        pulled = wait.take(grid.pull_messages(list(wait.due)))
        replies.extend(pulled)
        remaining = math.inf if end is None else end - clock()
        if not wait.due or remaining <= 0.0:
            break
        interval = schedule.next_interval(interval, bool(pulled))
        sleep(min(interval, remaining))
    # The order the instructions were sent in, not the order the replies arrived in: a round's
    # aggregate (a float sum) is then the same however the nodes raced (the in-process Grid's
    # order too); Flower's loop hands them over in the SuperLink's order of a set of ids.
    position = {message_id: index for index, message_id in enumerate(wait.sent)}
    return sorted(
        replies, key=lambda reply: position.get(reply.metadata.reply_to_message_id, len(position))
    )


class PollingGrid(DelegatingGrid):
    """``inner`` whose ``send_and_receive`` pulls by a :class:`PullSchedule`.

    Parameters
    ----------
    inner : Grid
        Any Grid whose replies are pulled (``push_messages`` then ``pull_messages``): Flower's
        ``HttpGrid`` behind a SuperLink, its ``InMemoryGrid`` in a simulation.
    schedule : PullSchedule, optional
        When to pull; :class:`PullSchedule`'s defaults when not given.
    clock, sleep : Callable, optional
        The time in seconds and the wait (tests give their own).

    Attributes
    ----------
    pulls : int
        Pulls made by every ``send_and_receive`` so far (what the SuperLink answered).
    """

    def __init__(
        self,
        inner: Grid,
        schedule: PullSchedule | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(inner)
        self.schedule = schedule or PullSchedule()
        self.clock, self.sleep = clock, sleep
        self.pulls = 0
        self._wait: ReplyWait | None = None

    def awaited(self) -> list[int] | None:
        """The nodes whose replies the running ``send_and_receive`` still waits for (None when
        none runs)."""
        wait = self._wait
        return None if wait is None else wait.awaited()

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages`` and pull their replies until all are in or ``timeout`` seconds
        have passed (None: no limit), as Flower's ``send_and_receive``, by the schedule."""
        messages = list(messages)
        message_ids = list(self.push_messages(messages))
        # A message the Grid could not push has the id None (HttpGrid): no reply will come.
        sent = {
            message_id: message.metadata.dst_node_id
            for message, message_id in zip(messages, message_ids, strict=False)
            if message_id
        }
        del messages
        wait = ReplyWait(sent)
        self._wait = wait
        try:
            return wait_for_replies(
                self, wait, timeout, self.schedule, clock=self.clock, sleep=self.sleep
            )
        finally:
            self._wait = None
            self.pulls += wait.pulls


def polling_grid(grid: Grid) -> PollingGrid | None:
    """The :class:`PollingGrid` that pulls for ``grid``: itself, or the one inside the wrappers
    that change only what is sent (:class:`server.packed_grid.PackedGrid`); None without one."""
    while not isinstance(grid, PollingGrid) and isinstance(grid, DelegatingGrid):
        grid = grid.inner
    return grid if isinstance(grid, PollingGrid) else None


def polling(grid: Grid, schedule: PullSchedule | None = None) -> Grid:
    """``grid`` as a :class:`PollingGrid` (unless it is one already).

    For a ServerApp of your own: ``strategy.start(grid=polling(grid), ...)``, or
    ``polling(grid).send_and_receive(messages, timeout=...)`` in place of
    ``grid.send_and_receive``. It also makes this process ask again for a reply's object still
    being uploaded after 0.05 s, not 1 s (:func:`retry_objects_sooner`).
    """
    retry_objects_sooner()
    if isinstance(grid, PollingGrid):
        return grid
    return PollingGrid(grid, schedule)
