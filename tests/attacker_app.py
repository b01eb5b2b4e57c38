"""A ClientApp that misbehaves on purpose: the attacker of the deployment tests.

The deployment tests point a staged copy of the app at this ClientApp
(``clientapp = "tests.attacker_app:app"``); every node runs it, and a node behaves as the
project's own ClientApp unless its ``--node-config`` says otherwise:

- ``attack-kinds = "k1,k2,..."``: in round r the node trains honestly, then replaces its reply
  by the malformed or poisoned one of kind ``k[(r - 1) % len]`` (:data:`ATTACKS`);
- ``extra-megabytes = M``: with the kind ``extra-record``, the size of the unrequested record;
- ``hang-seconds = S``: the node sleeps S seconds before it answers (a node that hangs).

Every kind is one that was seen to crash or poison a run before the reply checks (issue 14).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from beyond_averaging.client.app import evaluate_local as honest_evaluate
from beyond_averaging.client.app import train as honest_train
from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    GRADIENT_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
    SENSITIVITY_RECORD,
    SERVER_ROUND_KEY,
)

app = ClientApp()

Attack = Callable[[RecordDict, Context], RecordDict]


def _replace_arrays(content: RecordDict, make: Callable[[Array], Array]) -> RecordDict:
    """The reply with every tensor of ``arrays`` replaced by ``make(tensor)``."""
    arrays = content.array_records[ARRAYS_RECORD]
    content[ARRAYS_RECORD] = ArrayRecord({key: make(value) for key, value in arrays.items()})
    return content


def _set_num_examples(value: float) -> Attack:
    def attack(content: RecordDict, context: Context) -> RecordDict:
        metrics = content.metric_records[METRICS_RECORD]
        content[METRICS_RECORD] = MetricRecord({**dict(metrics), NUM_EXAMPLES_KEY: value})
        return content

    return attack


def _raw(data: Callable[[Array], bytes]) -> Attack:
    """Arrays whose declared dtype and shape are the model's but whose bytes are ``data``."""

    def attack(content: RecordDict, context: Context) -> RecordDict:
        return _replace_arrays(
            content,
            lambda a: Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=data(a)),
        )

    return attack


def _object_npy(array: Array) -> bytes:
    stream = io.BytesIO()
    np.save(stream, np.full(array.shape, None, dtype=object), allow_pickle=True)
    return stream.getvalue()


def _as_dtype(dtype: np.dtype[np.generic] | str | list[tuple[str, str]]) -> Attack:
    def attack(content: RecordDict, context: Context) -> RecordDict:
        return _replace_arrays(content, lambda a: Array(np.zeros(a.shape, dtype=dtype)))

    return attack


def _zero_model_claiming_everything(content: RecordDict, context: Context) -> RecordDict:
    content = _replace_arrays(content, lambda a: Array(np.zeros(a.shape, dtype=a.numpy().dtype)))
    return _set_num_examples(1e12)(content, context)


def _values(value: float) -> Attack:
    def attack(content: RecordDict, context: Context) -> RecordDict:
        return _replace_arrays(
            content, lambda a: Array(np.full(a.shape, value, dtype=a.numpy().dtype))
        )

    return attack


def _huge_record(name: str) -> Attack:
    """A requested extra record (FedGMA's gradient, Elastic's sensitivity) scaled to 1e30."""

    def attack(content: RecordDict, context: Context) -> RecordDict:
        record = content.array_records.get(name)
        if record is not None:
            content[name] = ArrayRecord(
                {k: Array(np.full(v.shape, 1e30, dtype=np.float32)) for k, v in record.items()}
            )
        return content

    return attack


def _extra_record(content: RecordDict, context: Context) -> RecordDict:
    """An unrequested record of ``extra-megabytes`` MB (default 64)."""
    megabytes = int(context.node_config.get("extra-megabytes", 64))
    content["unrequested"] = ArrayRecord(
        {"payload": Array(np.ones(megabytes * 2**20 // 4, dtype=np.float32))}
    )
    return content


#: Each kind and how it corrupts an honest reply.
ATTACKS: dict[str, Attack] = {
    # crashed a run before the reply checks
    "num-examples-half": _set_num_examples(0.5),
    "num-examples-inf": _set_num_examples(float("inf")),
    "not-npy-bytes": _raw(lambda a: b"\x00not an npy file" * max(1, len(a.data) // 16)),
    "object-npy": _raw(_object_npy),
    "truncated-buffer": _raw(lambda a: a.data[: len(a.data) // 2]),
    "complex64": _as_dtype(np.dtype(np.complex64)),
    "string-dtype": _as_dtype("<U4"),
    "structured-dtype": _as_dtype([("a", "<f4"), ("b", "<i4")]),
    # silently poisoned a run before the influence bounds
    "bool-arrays": _as_dtype(np.dtype(np.bool_)),
    "zero-model-claiming-1e12-examples": _zero_model_claiming_everything,
    "values-1e30": _values(1e30),
    "huge-gradient": _huge_record(GRADIENT_RECORD),
    "huge-sensitivity": _huge_record(SENSITIVITY_RECORD),
    # exhausted the server's memory
    "extra-record": _extra_record,
}


@app.train()
def train(message: Message, context: Context) -> Message:
    """Honest training, then the configured attack of this round, if any."""
    hang = float(context.node_config.get("hang-seconds", 0.0))
    if hang > 0:
        time.sleep(hang)
    reply = honest_train(message, context)
    kinds = [k for k in str(context.node_config.get("attack-kinds", "")).split(",") if k]
    if not kinds:
        return reply
    server_round = int(message.content[CONFIG_RECORD][SERVER_ROUND_KEY])  # type: ignore[arg-type]
    kind = kinds[(server_round - 1) % len(kinds)]
    return Message(content=ATTACKS[kind](reply.content, context), reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Honest evaluation."""
    return honest_evaluate(message, context)
