"""Pieces for driving the real strategies and ClientApp in one process, without Ray or gRPC.

The evidence and systems benchmarks use them to time and run the project's own code paths
(``configure_train``, the ClientApp's ``train``, ``aggregate_train``) where a Ray simulation would
spend most of its time starting up.
"""

from __future__ import annotations

import time

from flwr.app import Message, Metadata


class NodeGrid:
    """The one Grid method ``configure_train`` uses: the connected node ids."""

    def __init__(self, num_nodes: int) -> None:
        self.node_ids = list(range(1, num_nodes + 1))

    def get_node_ids(self) -> list[int]:
        """Node i runs partition i - 1."""
        return self.node_ids


def delivered(message: Message, message_id: str) -> Message:
    """An instruction as a SuperNode receives it (the SuperLink fills in the metadata)."""
    metadata = Metadata(
        run_id=1,
        message_id=message_id,
        src_node_id=0,
        dst_node_id=message.metadata.dst_node_id,
        reply_to_message_id="",
        group_id=message.metadata.group_id,
        created_at=time.time(),
        ttl=message.metadata.ttl,
        message_type=message.metadata.message_type,
    )
    # Flower's stubs omit the (metadata, content) form that its runtime uses for delivered messages.
    delivered_message: Message = Message(  # type: ignore[call-overload]
        metadata=metadata, content=message.content
    )
    return delivered_message
