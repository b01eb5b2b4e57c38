"""The model sent as one array per message: a Grid that packs what the ServerApp sends.

Over Flower's HTTP Fleet API (flwr 1.40 and later) every object of a message is one request:
the message, its records, each array and each array's chunks. The content of the digits MLP's
train message is 15 objects, 12 of them its six tensors; packed (:mod:`tasks.packing`), its
model is one array and the content 5 objects, and this project's ClientApp answers in kind, its
model and any ``sensitivity`` or ``gradient`` record one array each. docs/deployment.md, "What a
reply costs", has the counts and the rounds' seconds measured both ways.

:class:`PackedGrid` wraps the Grid the ServerApp's rounds use and packs the ``arrays`` record of
every message it sends; the strategies' wire decoding reads packed and unpacked replies alike
(:func:`strategies.replies.wire.decode_record`), so a node whose ClientApp answers per tensor is
still served. What it gives up: a ClientApp must understand a packed model to train on it (this
project's does; :func:`tasks.packing.unpack` is what a user's ClientApp calls), so the ServerApp
packs only where ``pack-model`` is on (the default) and never under secure aggregation, whose
clients read the model per tensor (and whose upload is one masked vector already).
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Array, ArrayRecord, Message, RecordDict

from beyond_averaging.strategies.replies.wire import record_arrays
from beyond_averaging.tasks.packing import array_layout, is_packed, pack
from beyond_averaging.tasks.protocol import ARRAYS_RECORD

from .pull import DelegatingGrid


def packed_content(content: RecordDict, record_name: str = ARRAYS_RECORD) -> RecordDict:
    """``content`` with its ``record_name`` ArrayRecord packed (the other records as they are);
    ``content`` itself when it has no such record or it is packed already."""
    record = content.array_records.get(record_name)
    if record is None or is_packed(record):
        return content
    arrays = record_arrays(record)
    packed = ArrayRecord(
        {key: Array(value) for key, value in pack(arrays, array_layout(arrays)).items()}
    )
    return RecordDict({**dict(content.items()), record_name: packed})


class PackedGrid(DelegatingGrid):
    """A Grid whose messages carry their model packed (:func:`packed_content`).

    Messages that share one content (a round's train messages, each to its node) share one
    packed content: the model is packed once a round, not once a node.
    """

    def _packed(self, messages: Iterable[Message]) -> list[Message]:
        contents: dict[int, RecordDict] = {}
        packed_messages = []
        for message in messages:
            if message.has_error():
                packed_messages.append(message)
                continue
            key = id(message.content)
            if key not in contents:
                contents[key] = packed_content(message.content)
            if contents[key] is message.content:
                packed_messages.append(message)
                continue
            packed_messages.append(
                Message(
                    content=contents[key],
                    message_type=message.metadata.message_type,
                    dst_node_id=message.metadata.dst_node_id,
                    group_id=message.metadata.group_id,
                    ttl=message.metadata.ttl,
                )
            )
        return packed_messages

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """As ``inner``, each message's model packed."""
        return self.inner.push_messages(self._packed(messages))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """As ``inner``, each message's model packed."""
        return self.inner.send_and_receive(self._packed(messages), timeout=timeout)
