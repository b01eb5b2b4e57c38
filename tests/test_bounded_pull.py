"""A reply over the byte bound is dropped while the ServerApp pulls it, before it is held whole.

The SuperLink's side of the pull is a fake that serves real Flower objects (a reply deflated into
its object tree, as a SuperNode pushes it), so the bounded pull runs Flower's own pull and inflate
code on them; it counts which objects were asked for and which replies were confirmed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.app.message import make_message, remove_content_from_message
from flwr.app.metadata import Metadata
from flwr.common.serde import message_to_proto
from flwr.proto.message_pb2 import ObjectTree, PullObjectResponse
from flwr.proto.node_pb2 import Node
from flwr.proto.runtime_pb2 import PullAppMessagesResponse
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.run import Run

from beyond_averaging.server.bounded_pull import ByteBoundedGrid, bound_reply_bytes, pull_bound
from beyond_averaging.strategies import FedAvg
from beyond_averaging.strategies.replies.validation import REPLY_OVERSIZED_ERROR_CODE, ReplyRejected

MODEL = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, dtype=np.float32)}


def _reply(node_id: int, reply_to: str, extra_bytes: int = 0) -> Message:
    records: dict[str, Any] = {
        "arrays": ArrayRecord({k: Array(v + 1.0) for k, v in MODEL.items()}),
        "metrics": MetricRecord({"num-examples": 10}),
    }
    if extra_bytes:  # an unrequested record, chunked by Flower into 5 MB objects
        records["junk"] = ArrayRecord({"x": Array(np.zeros(extra_bytes, dtype=np.uint8))})
    metadata = Metadata(
        run_id=1,
        message_id="",
        src_node_id=node_id,
        dst_node_id=0,
        reply_to_message_id=reply_to,
        group_id="1",
        created_at=1.0,
        ttl=600.0,
        message_type="train",
    )
    message = make_message(metadata=metadata, content=RecordDict(records))
    message.metadata.__dict__["_message_id"] = message.object_id
    return message


@dataclass
class FakeSuperLink:
    """The Runtime API calls the pull makes, answered from deflated replies."""

    replies: list[Message]
    objects: dict[str, bytes] = field(default_factory=dict)
    trees: dict[str, ObjectTree] = field(default_factory=dict)
    pulled: list[str] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for reply in self.replies:
            self.objects.update(
                {oid: obj.deflate() for oid, obj in get_all_nested_objects(reply).items()}
            )
            self.trees[reply.metadata.message_id] = get_object_tree(reply)

    def PullMessages(self, request: Any) -> PullAppMessagesResponse:  # noqa: N802 (Flower's name)
        return PullAppMessagesResponse(
            messages_list=[
                message_to_proto(remove_content_from_message(reply)) for reply in self.replies
            ],
            message_object_trees=[self.trees[reply.metadata.message_id] for reply in self.replies],
        )

    def PullObject(self, request: Any) -> PullObjectResponse:  # noqa: N802
        self.pulled.append(request.object_id)
        return PullObjectResponse(
            object_found=True, object_available=True, object_content=self.objects[request.object_id]
        )

    def ConfirmMessageReceived(self, request: Any) -> None:  # noqa: N802
        self.confirmed.append(request.message_object_id)


class FakeHttpGrid:
    """What the bounded pull reads of Flower's HttpGrid."""

    def __init__(self, link: FakeSuperLink) -> None:
        self._runtime_client = link
        self.node = Node(node_id=0)
        self.run = Run.create_empty(1)


def test_an_oversized_reply_is_dropped_mid_pull_and_an_honest_one_arrives_intact() -> None:
    honest, huge = _reply(7, "instruction-a"), _reply(8, "instruction-b", extra_bytes=40 << 20)
    link = FakeSuperLink([honest, huge])
    limit = 1 << 20  # far above the honest reply, far below 40 MB
    grid = ByteBoundedGrid(FakeHttpGrid(link), lambda: limit)  # type: ignore[arg-type]

    received = list(grid.pull_messages(["instruction-a", "instruction-b"]))

    assert [m.metadata.reply_to_message_id for m in received] == ["instruction-a", "instruction-b"]
    intact, dropped = received
    assert not intact.has_error()
    for key, value in MODEL.items():
        np.testing.assert_array_equal(intact.content["arrays"][key].numpy(), value + 1.0)
    assert dropped.has_error()
    assert dropped.error.code == REPLY_OVERSIZED_ERROR_CODE
    assert dropped.metadata.src_node_id == 8  # the log and the drop name the sender
    # The pull stopped near the bound: far fewer bytes were fetched than the reply holds.
    huge_ids = set(get_all_nested_objects(huge)) - set(get_all_nested_objects(honest))
    fetched = sum(len(link.objects[oid]) for oid in link.pulled if oid in huge_ids)
    assert fetched <= pull_bound(limit) + 2 * (5 << 20)  # + the two pulls in flight
    assert fetched < 40 << 20
    # Both replies are confirmed, so the SuperLink frees the dropped one too.
    assert sorted(link.confirmed) == sorted(m.metadata.message_id for m in (honest, huge))


def test_the_strategy_counts_a_reply_dropped_mid_pull_as_oversized() -> None:
    link = FakeSuperLink([_reply(8, "instruction-b", extra_bytes=12 << 20)])
    grid = ByteBoundedGrid(FakeHttpGrid(link), lambda: 1 << 20)  # type: ignore[arg-type]
    (dropped,) = grid.pull_messages(["instruction-b"])
    strategy = FedAvg()
    with pytest.raises(ReplyRejected) as rejected:
        strategy.validate_reply(dropped)
    assert rejected.value.reason == "oversized"


def test_grids_other_than_flowers_http_grid_are_left_as_they_are() -> None:
    fake = FakeHttpGrid(FakeSuperLink([]))
    assert bound_reply_bytes(fake, lambda: 1) is fake  # type: ignore[arg-type]
