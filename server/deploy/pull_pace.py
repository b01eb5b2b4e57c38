"""How often a node asks for work: fast right after a message, Flower's pace once idle.

Two loops decide how soon a deployed node starts on a message, and both sleep a fixed time when
there is nothing to do (flwr 1.39 to 1.42 alike):

- **the SuperNode** (``flwr.supernode.start_client_internal``) pulls the SuperLink's Fleet API
  and, when no message is waiting, sleeps ``time.sleep(3)``; while its ClientApp runs it looks
  for the reply every ``time.sleep(0.5)``. A message pushed just after an empty pull waits up to
  3 s before the node sees it, and a finished reply up to 0.5 s before it leaves.
- **the SuperExec** (``run_superexec``, which the warm executor runs) asks the SuperNode's
  Runtime API for a task every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds (1 s by default).

Flower has no setting for the first two (the SuperExec's interval is one, but fixed: 0.05 s
would keep an idle node's CPU busy for ever). So ``ba-supernode`` runs Flower's own
``flower-supernode`` entry point in a Python that replaces, before it starts, the name ``time``
in that one module with a :class:`PacedClock`: every other call goes to Python's ``time``;
Flower's idle sleep becomes a wait that starts at :attr:`PullPace.fastest` after each message
and grows by :attr:`PullPace.growth` per empty pull back to Flower's 3 s, and the reply wait
becomes :attr:`PullPace.reply_poll`. Nothing of Flower's source is copied or changed; a release
whose loop no longer has these names or sleeps runs unchanged (:func:`pace_supernode` says so),
and ``ba-supernode --pull-every 3`` runs plain ``flower-supernode``. The warm executor paces its
SuperExec loop the same way (:func:`pace_superexec`), from ``fastest_task`` after each task
back to Flower's interval. The paced SuperNode also asks again for an object of a message that
the ServerApp is still pushing after 0.05 s, not Flower's 1 s
(:func:`server.pull.retry_objects_sooner`).

**What it costs the SuperLink.** Each pull is one Fleet API request. After a message, a node
pulls at most :meth:`PullPace.extra_pulls` more times than Flower's node would before it is back
at Flower's pace (8.4 with the defaults: 13 pulls over the 13.75 s in which Flower's makes 4.6),
and never more often than every :attr:`PullPace.fastest` seconds (5 pulls a second with the
default 0.2 s): 50 nodes that have all just replied ask 250 times a second for about one second,
then ever less often. A node idle for longer than that costs what Flower's costs
(docs/deployment.md, "How soon a node sees a message").
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from beyond_averaging.server.pull import retry_objects_sooner

from .resources import set_process_name

#: Flower's SuperNode: seconds it sleeps after a pull that found no message.
FLOWER_IDLE_WAIT = 3.0
#: Flower's SuperNode: seconds between its looks for the reply of the ClientApp it runs.
FLOWER_REPLY_WAIT = 0.5
#: Flower's SuperExec: its default seconds between asks for a task (when the variable is unset).
FLOWER_TASK_POLL = 1.0
#: The process name (``comm``) the paced SuperNode keeps: Flower's (``ps``, the benchmark's
#: accounting by kind of process and the tests find it by this name).
SUPERNODE_NAME = "flower-supernode"


@dataclass(frozen=True)
class PullPace:
    """How a paced loop waits between empty polls.

    Attributes
    ----------
    fastest : float
        Seconds between polls right after work arrived.
    slowest : float
        The wait the loop backs off to (Flower's own).
    growth : float
        Factor the wait grows by per empty poll.
    """

    fastest: float = 0.2
    slowest: float = FLOWER_IDLE_WAIT
    growth: float = 1.25

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fastest) and 0 < self.fastest <= self.slowest):
            raise ValueError(
                f"the fastest pull must be positive seconds, at most {self.slowest:g} "
                f"(Flower's), got {self.fastest!r}"
            )
        if not (math.isfinite(self.growth) and self.growth > 1):
            raise ValueError(f"the back-off growth must be above 1, got {self.growth!r}")

    def waits(self) -> list[float]:
        """The waits after a message until the pace is back at :attr:`slowest` (excluded)."""
        waits, wait = [], self.fastest
        while wait < self.slowest:
            waits.append(wait)
            wait *= self.growth
        return waits

    def extra_pulls(self) -> float:
        """Pulls after a message beyond those Flower's fixed wait makes in the same time."""
        waits = self.waits()
        return len(waits) - sum(waits) / self.slowest


class PacedClock:
    """Stands in for Python's ``time`` module inside one of Flower's modules.

    ``sleep(idle)`` waits the current paced wait, which then grows; ``sleep`` of one of
    ``replaced`` waits the mapped seconds; every other attribute is Python's ``time``.
    :meth:`work_arrived` sets the wait back to the fastest.
    """

    def __init__(
        self,
        pace: PullPace,
        idle: float | None,
        replaced: dict[float, float] | None = None,
        wake_fd: int | None = None,
    ) -> None:
        self.pace = pace
        self.idle = idle
        self.replaced = dict(replaced or {})
        self.wake_fd = wake_fd
        self.wait = pace.fastest

    def work_arrived(self) -> None:
        self.wait = self.pace.fastest

    def sleep(self, seconds: float) -> None:
        if self.idle is None or seconds == self.idle:
            if self._woken_within(self.wait):
                self.work_arrived()
            else:
                self.wait = min(self.wait * self.pace.growth, self.pace.slowest)
        else:
            time.sleep(self.replaced.get(seconds, seconds))

    def _woken_within(self, seconds: float) -> bool:
        """Wait ``seconds``, or less when a byte arrives on the wake pipe (all read)."""
        if self.wake_fd is None:
            time.sleep(seconds)
            return False
        readable, _, _ = select.select([self.wake_fd], [], [], seconds)
        if not readable:
            return False
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_fd, 4096):
                pass
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def pace_supernode(
    pace: PullPace, reply_poll: float = 0.05, notify_fd: int | None = None
) -> PacedClock | None:
    """Pace the installed Flower's SuperNode loop (this process must then run it); None, with
    nothing changed, when the loop is not the one this module knows.

    ``notify_fd``: a pipe that gets a byte whenever a message has been stored and its task
    created, so that a warm executor waiting on the other end (:func:`pace_superexec`) asks
    for the task at once instead of at its next poll.
    """
    import inspect

    from flwr.supernode import start_client_internal as loop

    pull = getattr(loop, "_pull_and_store_message", None)
    try:
        source = inspect.getsource(loop)
    except OSError:
        return None
    if (
        getattr(loop, "time", None) is not time
        or pull is None
        or f"time.sleep({FLOWER_IDLE_WAIT:g})" not in source
    ):
        return None
    clock = PacedClock(pace, FLOWER_IDLE_WAIT, {FLOWER_REPLY_WAIT: reply_poll})

    def pull_and_note(*args: Any, **kwargs: Any) -> Any:
        run_id = pull(*args, **kwargs)
        if run_id is not None:
            clock.work_arrived()
            if notify_fd is not None:
                with contextlib.suppress(OSError):  # a full pipe or an executor gone
                    os.write(notify_fd, b"!")
        return run_id

    # The loop looks both names up in its module at each call: replaced here, nowhere else.
    setattr(loop, "time", clock)  # noqa: B010 - a module attribute, not a typed field
    setattr(loop, "_pull_and_store_message", pull_and_note)  # noqa: B010
    return clock


def pace_superexec(pace: PullPace, wake_fd: int | None = None) -> PacedClock | None:
    """Pace the installed Flower's SuperExec loop (``run_superexec``): its only sleep, the wait
    between asks for a task, which a byte on ``wake_fd`` (the paced SuperNode's notify pipe)
    ends at once. None, with nothing changed, when the module is not as expected."""
    from flwr.supercore.superexec import run_superexec as superexec

    if getattr(superexec, "time", None) is not time:
        return None
    if wake_fd is not None:
        os.set_blocking(wake_fd, False)
    clock = PacedClock(pace, None, wake_fd=wake_fd)
    setattr(superexec, "time", clock)  # noqa: B010 - a module attribute, not a typed field
    return clock


def main(argv: Sequence[str] | None = None) -> int:
    """Run Flower's ``flower-supernode`` (its arguments after ``--``) with a paced pull loop."""
    parser = argparse.ArgumentParser(
        prog="python -m beyond_averaging.server.deploy.pull_pace",
        description="flower-supernode, pulling fast right after a message (ba-supernode runs it)",
    )
    parser.add_argument("--fastest", type=float, default=PullPace.fastest)
    parser.add_argument("--reply-poll", type=float, default=0.05)
    parser.add_argument("--notify-fd", type=int, help="a pipe told of each message stored")
    parser.add_argument("supernode", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    supernode = args.supernode[1:] if args.supernode[:1] == ["--"] else args.supernode
    if not supernode:
        parser.error("give flower-supernode and its arguments after --")
    try:
        pace = PullPace(fastest=args.fastest)
    except ValueError as problem:
        parser.error(f"--fastest: {problem}")
    set_process_name(SUPERNODE_NAME)
    if args.notify_fd is not None:
        os.set_blocking(args.notify_fd, False)
    if pace_supernode(pace, args.reply_poll, args.notify_fd) is not None:
        retry_objects_sooner()  # a message pulled while the ServerApp still pushes its objects
    else:
        print(
            "ba-supernode: this Flower's SuperNode loop is not the one pull pacing knows "
            f"(time.sleep({FLOWER_IDLE_WAIT:g}) after an empty pull): running it unchanged",
            file=sys.stderr,
            flush=True,
        )
    from flwr.supernode.cli import flower_supernode

    sys.argv = list(supernode)
    flower_supernode()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
