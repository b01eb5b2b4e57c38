"""Replies over the byte bound are dropped while they are pulled, before the ServerApp holds them.

In a deployment the ServerApp pulls each reply from the SuperLink as a tree of objects (the
message, its records, each array's chunks of at most 5 MB) and Flower's ``HttpGrid`` pulls every
object of a reply before it hands the reply over. The strategies check a reply's size before they
decode it (``max-reply-bytes``, :func:`strategies.replies.validation.check_reply_size`), but by
then the process has held the whole reply, twice while Flower inflates it: a client sending a 1 GB
record costs the server 2 GB.

:class:`ByteBoundedGrid` wraps Flower's ``HttpGrid`` and pulls each reply's objects through a
counter: once a reply's pulled bytes pass its bound, the pull stops, what was pulled is released,
the SuperLink is told the reply was received (so it frees it too), and the reply is answered by
an error reply with code :data:`~strategies.replies.validation.REPLY_OVERSIZED_ERROR_CODE`, which
the strategies count as ``dropped-oversized``. The ServerApp then holds at most the bound plus the
objects in flight (two concurrent pulls) per reply. One object is pulled whole: an array chunk
is at most 5 MB, but a config or metric record is one object, bounded only by the transport.

Everything else is Flower's ``HttpGrid`` (it is called for push, nodes and run), but for when
``send_and_receive`` pulls: by a :class:`server.pull.PullSchedule` (:class:`ByteBoundedGrid` is a
:class:`server.pull.PollingGrid`). The pull uses Flower internals of the version this project
pins (flwr 1.39); with another version, or another Grid (simulation, the in-process runtime,
where replies are in memory already), :func:`bound_reply_bytes` returns the Grid unchanged.
:func:`round_grid` is the Grid the ServerApp's rounds use, whichever Flower gave.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from logging import INFO
from typing import cast

import flwr
from flwr.app import Message, Metadata
from flwr.app.error import Error
from flwr.serverapp import Grid
from flwr.supercore import log

from beyond_averaging.strategies.replies.validation import REPLY_OVERSIZED_ERROR_CODE

from .pull import PollingGrid, PullSchedule, polling

#: Flower versions whose ``HttpGrid.pull_messages`` this module re-implements with a bound.
SUPPORTED_FLOWER = ("1.39.",)
#: Room above the strategy's byte limit for what the wire adds (object headers, protobuf
#: framing): the strategy's exact check still applies to what gets through.
WIRE_SLACK_BYTES = 1 << 20


class ReplyTooLargeError(Exception):
    """Raised inside the pull when a reply's objects pass its byte bound."""


def pull_bound(limit: int) -> int:
    """Bytes of pulled objects one reply may hold: the strategy's ``limit`` plus wire slack."""
    return limit + limit // 4 + WIRE_SLACK_BYTES


class ByteBoundedGrid(PollingGrid):
    """Flower's ``HttpGrid``, with each reply's pull stopped at a byte bound.

    Parameters
    ----------
    inner : Grid
        The ``HttpGrid`` Flower gave the ServerApp.
    byte_limit : Callable[[], int]
        The strategy's current limit (``reply_byte_limit``, set when a round is configured);
        ``<= 0`` pulls without a bound.
    schedule : PullSchedule, optional
        When ``send_and_receive`` pulls (:class:`server.pull.PollingGrid`).
    """

    def __init__(
        self, inner: Grid, byte_limit: Callable[[], int], schedule: PullSchedule | None = None
    ) -> None:
        super().__init__(inner, schedule)
        self.byte_limit = byte_limit

    # --- the bounded pull ------------------------------------------------------------------
    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` that are ready; an oversized one as an error reply."""
        limit = self.byte_limit()
        if limit <= 0:
            return self.inner.pull_messages(message_ids)
        return _pull_bounded(self.inner, list(message_ids), pull_bound(limit))


def _pull_bounded(grid: Grid, message_ids: list[str], bound: int) -> list[Message]:
    """``HttpGrid.pull_messages`` (flwr 1.39) with a per-reply byte bound on the pulled objects."""
    # Flower internals of the pinned version, imported here so that other versions never load them.
    from flwr.app.message import make_message
    from flwr.common.constant import ErrorCode
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest
    from flwr.supercore.date import now
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
    from flwr.supercore.inflatable.inflatable_utils import (
        ObjectPullError,
        inflate_object_from_contents,
        pull_objects,
    )

    client = grid._runtime_client  # type: ignore[attr-defined]
    node = grid.node  # type: ignore[attr-defined]
    run_id = grid.run.run_id
    response = client.PullMessages(PullAppMessagesRequest(message_ids=message_ids))
    messages: list[Message] = []
    for proto, tree in zip(response.messages_list, response.message_object_trees, strict=True):
        message_id = proto.metadata.message_id
        pull_one = make_pull_object_fn_protobuf(
            pull_object_protobuf=client.PullObject, node=node, run_id=run_id
        )
        counted = _counting(pull_one, bound)
        error: Error | None = None
        try:
            contents = pull_objects(
                object_ids=[subtree.object_id for subtree in iterate_object_tree(tree)],
                pull_object_fn=counted,
            )
        except ReplyTooLargeError as too_large:
            error = Error(code=REPLY_OVERSIZED_ERROR_CODE, reason=str(too_large))
            log(
                INFO,
                "reply of node %d dropped while pulled: %s",
                proto.metadata.src_node_id,
                too_large,
            )
        except ObjectPullError as unavailable:  # as Flower: an error reply, not confirmed
            error = Error(
                code=ErrorCode.MESSAGE_UNAVAILABLE,
                reason=f"Reply message objects are unavailable. {unavailable}",
            )
        if error is None or error.code == REPLY_OVERSIZED_ERROR_CODE:
            # Received (an oversized one too): the SuperLink may free the reply's objects.
            client.ConfirmMessageReceived(
                ConfirmMessageReceivedRequest(
                    node=node, run_id=run_id, message_object_id=message_id
                )
            )
        if error is not None:
            metadata = Metadata(
                run_id=run_id,
                message_id="",
                src_node_id=proto.metadata.src_node_id,
                dst_node_id=node.node_id,
                message_type=proto.metadata.message_type,
                group_id=proto.metadata.group_id,
                ttl=0,
                reply_to_message_id=proto.metadata.reply_to_message_id,
                created_at=now().timestamp(),
            )
            messages.append(make_message(metadata=metadata, error=error))
            continue
        message = cast(Message, inflate_object_from_contents(message_id, contents))
        message.metadata.__dict__["_message_id"] = message_id
        messages.append(message)
    return messages


def _counting(pull_one: Callable[[str], bytes], bound: int) -> Callable[[str], bytes]:
    """``pull_one`` that raises :class:`ReplyTooLargeError` once the pulled bytes pass ``bound``.

    Flower pulls a reply's objects from two threads; the count is shared under a lock.
    """
    lock = threading.Lock()
    pulled = [0]

    def pull(object_id: str) -> bytes:
        content = pull_one(object_id)
        with lock:
            pulled[0] += len(content)
            total = pulled[0]
        if total > bound:
            raise ReplyTooLargeError(
                f"its objects passed {bound} bytes while pulled (max-reply-bytes plus wire "
                "slack): dropped unread"
            )
        return content

    return pull


def bound_reply_bytes(
    grid: Grid, byte_limit: Callable[[], int], schedule: PullSchedule | None = None
) -> Grid:
    """``grid`` wrapped in a :class:`ByteBoundedGrid` where that is possible, else ``grid``.

    Possible: Flower's ``HttpGrid`` (a ServerApp behind a SuperLink) of a supported version.
    ``schedule`` is when the bounded Grid pulls (:class:`server.pull.PollingGrid`).
    """
    try:
        from flwr.superlink.grid.http_grid import HttpGrid
    except ImportError:  # a Flower without it: nothing to wrap
        return grid
    if type(grid) is HttpGrid and flwr.__version__.startswith(SUPPORTED_FLOWER):
        return ByteBoundedGrid(grid, byte_limit, schedule)
    if type(grid) is HttpGrid:
        log(
            INFO,
            "flwr %s: replies are pulled whole before their size is checked (the bounded pull "
            "is written for flwr %s)",
            flwr.__version__,
            " / ".join(v + "x" for v in SUPPORTED_FLOWER),
        )
    return grid


def round_grid(
    grid: Grid, byte_limit: Callable[[], int], schedule: PullSchedule | None = None
) -> Grid:
    """The Grid this project's ServerApp runs its rounds on, ``grid`` being the one Flower gave.

    - Flower's ``HttpGrid`` (behind a SuperLink): pulled by ``schedule``
      (:class:`server.pull.PullSchedule`'s defaults when not given), each reply's pull stopped
      at its byte bound where the Flower version allows (:func:`bound_reply_bytes`), an object
      of a reply still being uploaded asked for again after 0.05 s
      (:func:`server.pull.retry_objects_sooner`);
    - Flower's ``InMemoryGrid`` (a simulation): pulled every ``pull_interval`` seconds, its own
      interval (0.1 s), by a :class:`server.pull.PollingGrid`, which tells the round's waiting
      line which nodes' replies are still due;
    - any other Grid (the in-process runtime's, whose replies are ready when pushed) as it is.
    """
    try:
        from flwr.superlink.grid.http_grid import HttpGrid
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid
    except ImportError:  # a Flower without them: nothing to wrap
        return grid
    if type(grid) is HttpGrid:  # pulled as a user's ServerApp is by polling(), byte-bounded
        return polling(bound_reply_bytes(grid, byte_limit, schedule), schedule)
    if type(grid) is InMemoryGrid:
        every = grid.pull_interval
        return PollingGrid(grid, PullSchedule(first=every, growth=1.0, cap=every))
    return grid
