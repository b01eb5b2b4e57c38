"""The client side of secure aggregation: a Flower mod that answers SecAgg+'s four stages.

Put it on a ClientApp's train function (``@app.train(mods=[secure_aggregation_mod])``; this
project's ClientApp has it): a train message without the ``secure-aggregation`` ConfigRecord
goes straight to the function, as without the mod. With it, by its ``stage``
(:mod:`tasks.secure_aggregation` has the math):

- ``setup``: make two fresh ECDH key pairs (one to seal the shares sent through the server, one
  to agree the pairwise masks) and reply with their public halves;
- ``share-keys``: given the neighbours' public keys, draw the self-mask seed b, split b and the
  mask key into Shamir shares among this node and its neighbours, and reply with each
  neighbour's pair of shares sealed for it;
- ``collect``: open the shares the neighbours sealed for this node, train (the wrapped
  function), and reply with the masked vector only (:func:`tasks.secure_aggregation
  .client_vector`): the weight, the update (clipped to the server's ``clip-norm``), the
  records and metrics the server's layout names, each folded in; no model, example count,
  metric or partition id is sent in the clear;
- ``unmask``: reply with the shares the server needs for the nodes it names (the self-mask
  seed share of each survivor, the mask-key share of each dropped node; never both of one
  node), then forget the round's secrets.

The round's secrets live in ``context.state`` between stages, as Flower's ``secaggplus_mod``
keeps them, and are deleted after ``unmask`` (and replaced by the next ``setup``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
)
from beyond_averaging.tasks.secure_aggregation import (
    MASKED_KEY,
    MASKED_RECORD,
    SECURE_RECORD,
    STAGE_KEY,
    SecAggOptions,
    check_unmask_request,
    client_vector,
    mask_vector,
    new_key_pair,
    new_seed,
    seal,
    shared_key,
    shared_seed,
    split_secret,
    threshold,
    unseal,
)

#: The next handler of a ClientApp's mod chain: Flower's ``ClientAppCallable``, written out
#: because its module (``flwr.clientapp.typing``) is not in flwr 1.21, the library's oldest Flower.
ClientAppCallable = Callable[[Message, Context], Message]

#: Where a node keeps its round's secrets between stages (``context.state``).
STATE_RECORD = "secure-aggregation-state"


class SecureStageError(RuntimeError):
    """A stage message this node cannot answer (out of order, or asking for too much)."""


def secure_aggregation_mod(
    message: Message, context: Context, call_next: ClientAppCallable
) -> Message:
    """Answer a secure-aggregation stage, or pass any other message to ``call_next``."""
    stage_record = message.content.config_records.get(SECURE_RECORD)
    if stage_record is None:
        return call_next(message, context)
    stage = str(stage_record[STAGE_KEY])
    node = int(message.metadata.dst_node_id)
    if stage == "setup":
        reply = _setup(stage_record, context)
    elif stage == "share-keys":
        reply = _share_keys(stage_record, context, node)
    elif stage == "collect":
        return _collect(message, stage_record, context, node, call_next)
    elif stage == "unmask":
        reply = _unmask(stage_record, context)
    else:
        raise SecureStageError(f"unknown secure-aggregation stage {stage!r}")
    reply[STAGE_KEY] = stage
    return Message(content=RecordDict({SECURE_RECORD: reply}), reply_to=message)


def _state(context: Context, stage: str, config: ConfigRecord) -> ConfigRecord:
    """The round's secrets, checked to be of the round the stage message names."""
    state = context.state.config_records.get(STATE_RECORD)
    if state is None:
        raise SecureStageError(
            f"secure-aggregation stage {stage!r} before 'setup': this node holds no keys for "
            "the round (a restarted node cannot rejoin a round already under way)"
        )
    if state.get("server-round") != config.get("server-round"):
        raise SecureStageError(
            f"secure-aggregation stage {stage!r} of round {config.get('server-round')!r} but "
            f"this node's keys are of round {state.get('server-round')!r}: a stale message"
        )
    return state


def _setup(config: ConfigRecord, context: Context) -> ConfigRecord:
    options = SecAggOptions.from_config(config)  # checked here: a bad option fails at once
    if not options.quantization_bits:
        raise SecureStageError(
            "the server sent quantization-bits = 0: the round's levels are resolved on the "
            "server (SecAggOptions.for_cohort) before setup"
        )
    channel_private, channel_public = new_key_pair()
    mask_private, mask_public = new_key_pair()
    context.state.config_records[STATE_RECORD] = ConfigRecord(
        {
            **options.to_config(),
            "server-round": int(cast(int, config["server-round"])),
            "channel-private": channel_private,
            "mask-private": mask_private,
        }
    )
    return ConfigRecord({"channel-public": channel_public, "mask-public": mask_public})


def _share_keys(config: ConfigRecord, context: Context, node: int) -> ConfigRecord:
    state = _state(context, "share-keys", config)
    ids = [int(i) for i in cast(list[int], config["ids"])]
    if node in ids:
        raise SecureStageError(f"node {node} is named among its own neighbours")
    if not ids:
        # Alone, its secrets would be shared with itself only: the server could unmask its
        # vector by itself.
        raise SecureStageError(f"node {node} is given no neighbour to mask with")
    holders = [node, *ids]
    needed = threshold(len(holders), float(cast(float, state["threshold"])))
    seed = new_seed()
    seed_shares = split_secret(seed, needed, len(holders))
    key_shares = split_secret(cast(bytes, state["mask-private"]), needed, len(holders))
    channel_private = cast(bytes, state["channel-private"])
    ciphertexts = [
        seal(
            shared_key(channel_private, public), node, other, seed_shares[i + 1], key_shares[i + 1]
        )
        for i, (other, public) in enumerate(
            zip(ids, cast(list[bytes], config["channel-publics"]), strict=True)
        )
    ]
    state["needed"] = needed
    state["self-seed"] = seed
    state["neighbour-ids"] = ids
    state["mask-publics"] = list(cast(list[bytes], config["mask-publics"]))
    state["channel-publics"] = list(cast(list[bytes], config["channel-publics"]))
    # This node's own share of its own secrets: it answers for itself in unmask, as a holder.
    state["share-ids"] = [node]
    state["seed-shares"] = [seed_shares[0]]
    state["key-shares"] = [key_shares[0]]
    return ConfigRecord({"ids": ids, "ciphertexts": ciphertexts})


def _collect(
    message: Message,
    config: ConfigRecord,
    context: Context,
    node: int,
    call_next: ClientAppCallable,
) -> Message:
    state = _state(context, "collect", config)
    neighbour_ids = [int(i) for i in cast(list[int], state["neighbour-ids"])]
    channel_publics = dict(
        zip(neighbour_ids, cast(list[bytes], state["channel-publics"]), strict=True)
    )
    channel_private = cast(bytes, state["channel-private"])
    share_ids = [int(i) for i in cast(list[int], state["share-ids"])]
    seed_shares = list(cast(list[bytes], state["seed-shares"]))
    key_shares = list(cast(list[bytes], state["key-shares"]))
    for src, ciphertext in zip(
        cast(list[int], config["src-ids"]), cast(list[bytes], config["ciphertexts"]), strict=True
    ):
        src = int(src)
        if src not in channel_publics:
            raise SecureStageError(f"node {node} got shares from node {src}, not its neighbour")
        seed_share, key_share = unseal(
            shared_key(channel_private, channel_publics[src]), ciphertext, src, node
        )
        share_ids.append(src)
        seed_shares.append(seed_share)
        key_shares.append(key_share)
    state["share-ids"], state["seed-shares"], state["key-shares"] = (
        share_ids,
        seed_shares,
        key_shares,
    )
    inner = RecordDict(
        {name: record for name, record in message.content.items() if name != SECURE_RECORD}
    )
    reply = call_next(_with_content(message, inner), context)
    if reply.has_error():
        return reply
    options = SecAggOptions.from_config(state)
    received = cast(ArrayRecord, message.content[ARRAYS_RECORD])
    content = reply.content
    trained = cast(ArrayRecord, content[ARRAYS_RECORD])
    metrics = dict(content.metric_records[METRICS_RECORD])
    extra = {
        name: {key: array.numpy() for key, array in record.items()}
        for name, record in content.array_records.items()
        if name != ARRAYS_RECORD
    }
    vector = client_vector(
        [str(entry) for entry in cast(list[str], config["layout"])],
        {key: array.numpy() for key, array in received.items()},
        {key: array.numpy() for key, array in trained.items()},
        extra,
        {
            key: float(cast(float, value))
            for key, value in metrics.items()
            if isinstance(value, int | float)
        },
        float(cast(float, metrics[NUM_EXAMPLES_KEY])),
        options,
    )
    mask_private = cast(bytes, state["mask-private"])
    # Masks only with the neighbours that shared their keys (those whose shares came): the
    # server can remove no mask with a node that left before sharing.
    sharing = set(share_ids[1:])
    pair_seeds = {
        other: shared_seed(mask_private, public)
        for other, public in zip(
            neighbour_ids, cast(list[bytes], state["mask-publics"]), strict=True
        )
        if other in sharing
    }
    masked = mask_vector(vector, cast(bytes, state["self-seed"]), pair_seeds, node)
    return Message(
        content=RecordDict(
            {
                MASKED_RECORD: ArrayRecord({MASKED_KEY: Array(np.ascontiguousarray(masked))}),
                SECURE_RECORD: ConfigRecord({STAGE_KEY: "collect"}),
            }
        ),
        reply_to=message,
    )


def _with_content(message: Message, content: RecordDict) -> Message:
    """``message`` as the wrapped train function should see it: without the stage record."""
    message.content = content
    return message


def _unmask(config: ConfigRecord, context: Context) -> ConfigRecord:
    state = _state(context, "unmask", config)
    alive = [int(i) for i in cast(list[int], config["alive"])]
    dropped = [int(i) for i in cast(list[int], config["dropped"])]
    check_unmask_request(alive, dropped)
    holders = {int(i) for i in cast(list[int], state["share-ids"])}
    needed = int(cast(int, state["needed"]))
    if len(holders & set(alive)) < needed:
        # Fewer survivors than the threshold among this node's holders: their sum would be
        # too small a crowd to hide in (SecAgg+'s rule); the round fails instead.
        raise SecureStageError(
            f"the server names {len(holders & set(alive))} surviving share holders of this "
            f"node's neighbourhood, fewer than the threshold {needed}: no share is sent"
        )
    held = {
        int(src): (seed, key)
        for src, seed, key in zip(
            cast(list[int], state["share-ids"]),
            cast(list[bytes], state["seed-shares"]),
            cast(list[bytes], state["key-shares"]),
            strict=True,
        )
    }
    ids: list[int] = []
    shares: list[bytes] = []
    for wanted, which in ((alive, 0), (dropped, 1)):
        for src in wanted:
            if src in held:
                ids.append(src)
                shares.append(held[src][which])
    del context.state.config_records[STATE_RECORD]  # the round's secrets are no longer needed
    return ConfigRecord({"ids": ids, "shares": shares})
