"""The model as one array per message (tasks/packing.py, server/packed_grid.py): the format's
parts worked by hand, its refusals, the ServerApp's packing Grid, and a round whose model and
replies travel packed ending exactly where the same round per tensor ends."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from hypothesis import given, settings
from hypothesis import strategies as st

from beyond_averaging.client.app import evaluate_local, train
from beyond_averaging.server.app import client_task
from beyond_averaging.server.config import RunConfig, parse_run_config
from beyond_averaging.server.packed_grid import PackedGrid, packed_content
from beyond_averaging.server.pull import DelegatingGrid
from beyond_averaging.strategies import ElasticAggregation, FedAvg
from beyond_averaging.strategies.replies.wire import ReplyRejected, decode_record
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.packing import (
    PackingError,
    array_layout,
    is_packed,
    mask_hex,
    pack,
    parse_mask,
    unpack,
)
from tests.conftest import instruction_message

F32 = np.float32


def small_model_arrays() -> dict[str, np.ndarray]:
    """A state dict's shapes and dtypes: two layers, an integer counter between them."""
    return {
        "a.weight": np.arange(6, dtype=F32).reshape(2, 3),
        "a.bias": np.array([-1.0, 2.5], dtype=F32),
        "bn.num_batches_tracked": np.array(7, dtype=np.int64),
        "b.weight": np.array([[0.25, -0.5]], dtype=F32),
    }


LAYOUT = array_layout(small_model_arrays())


@pytest.fixture
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ServerApp's identity, which Flower needs to build the messages it sends."""
    for attribute in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attribute, 1 if attribute == "_run_id" else 0)


# ----------------------------------------------------------------------------- the format
def test_the_mask_is_four_tensors_a_hex_digit_the_first_tensor_its_lowest_bit() -> None:
    # Tensors 0, 2, 3 on, 4 off: 1 + 4 + 8 = 13 -> "d"; the fifth alone in the next digit.
    assert mask_hex([True, False, True, True, False]) == "d0"
    assert mask_hex([False, False, False, False, True]) == "01"
    assert parse_mask("d0", 5) == [True, False, True, True, False]
    with pytest.raises(PackingError, match="2 hex digits"):
        parse_mask("d", 5)
    with pytest.raises(PackingError, match="past the model"):
        parse_mask("d4", 5)  # bit 6 of a 5-tensor model


def test_the_key_names_the_floating_tensors_layout_and_the_mask() -> None:
    packed = pack(small_model_arrays(), LAYOUT)
    names = "a.weight:2x3;a.bias:2;b.weight:1x2"  # the floating tensors, in order
    digest = hashlib.sha256(names.encode()).hexdigest()[:16]
    assert set(packed) == {f"packed/{digest}/7", "bn.num_batches_tracked"}
    flat = packed[f"packed/{digest}/7"]
    assert flat.dtype == F32
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, -1.0, 2.5, 0.25, -0.5]


def test_unpacking_returns_views_of_the_packed_array_in_the_models_order() -> None:
    arrays = small_model_arrays()
    packed = pack(arrays, LAYOUT)
    unpacked = unpack(packed, LAYOUT, whole=True)
    assert list(unpacked) == list(arrays)
    for key, value in arrays.items():
        assert unpacked[key].dtype == value.dtype
        assert np.array_equal(unpacked[key], value)
    flat = next(v for k, v in packed.items() if k.startswith("packed/"))
    assert np.shares_memory(unpacked["a.weight"], flat)  # no copy


def test_a_subset_record_keeps_its_own_dtype_and_names_only_its_tensors() -> None:
    sensitivity = {"b.weight": np.array([[1.0, 2.0]], np.float16)}
    packed = pack(sensitivity, LAYOUT)
    (key,) = packed
    assert key.endswith("/4")  # the third floating tensor: bit 2
    assert packed[key].dtype == np.float16
    assert unpack(packed, LAYOUT, whole=False)["b.weight"].tolist() == [[1.0, 2.0]]
    with pytest.raises(PackingError, match="every floating tensor"):
        unpack(packed, LAYOUT, whole=True)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p, k: {**p, k: p[k][:-1]}, "holds 9 values, its 3 tensors 10"),
        (lambda p, k: {**p, k: p[k].reshape(2, 5)}, "1-D floating"),
        (lambda p, k: {**p, k: p[k].astype(np.int32)}, "1-D floating"),
        (lambda p, k: {**p, "extra": p[k]}, "beside the packed array"),
        (lambda p, k: {k: p[k]}, "beside the packed array"),  # the counter left out
        (lambda p, k: {**p, k + "x": p[k]}, "one packed array, this one 2"),
        (
            lambda p, k: {
                k.replace("/7", "/f"): p[k],
                "bn.num_batches_tracked": p["bn.num_batches_tracked"],
            },
            "past the model",
        ),
        (
            lambda p, k: {
                k.replace("/7", "/77"): p[k],
                "bn.num_batches_tracked": p["bn.num_batches_tracked"],
            },
            "1 hex digits",
        ),
    ],
)
def test_a_packed_record_that_does_not_fit_the_model_is_refused(corrupt: Any, message: str) -> None:
    packed = pack(small_model_arrays(), LAYOUT)
    key = next(k for k in packed if k.startswith("packed/"))
    with pytest.raises(PackingError, match=message):
        unpack(corrupt(dict(packed), key), LAYOUT, whole=True)


def test_a_record_packed_for_another_model_is_refused_naming_the_layouts() -> None:
    other = {**small_model_arrays(), "b.weight": np.zeros((2, 1), F32)}  # same size, transposed
    packed = pack(other, array_layout(other))
    with pytest.raises(PackingError, match="another model"):
        unpack(packed, LAYOUT, whole=True)


# ----------------------------------------------------------------------------- the server's side
def as_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({key: Array(value) for key, value in arrays.items()})


def test_the_wire_decoding_reads_a_packed_reply_as_the_same_reply_per_tensor() -> None:
    reference = small_model_arrays()
    trained = {k: np.asarray(v + 1, dtype=v.dtype) for k, v in reference.items()}
    plain = decode_record("arrays", as_record(trained), reference, subset=False)
    packed = decode_record("arrays", as_record(pack(trained, LAYOUT)), reference, subset=False)
    assert list(packed.arrays) == list(plain.arrays)
    for key in reference:
        assert np.array_equal(packed.arrays[key], plain.arrays[key])
    assert packed.norm == pytest.approx(plain.norm)


@pytest.mark.parametrize(
    ("name", "record", "reason"),
    [
        ("arrays", {"packed/0000000000000000/7": np.zeros(10, F32)}, "bad-packing"),
        (
            "arrays",
            {**pack(small_model_arrays(), LAYOUT), "a.bias": np.zeros(2, F32)},
            "bad-packing",
        ),
        ("sensitivity", pack({"b.weight": -np.ones((1, 2), F32)}, LAYOUT), "bad-sensitivity"),
        ("arrays", {**pack(small_model_arrays(), LAYOUT), "x": np.zeros(1, F32)}, "bad-packing"),
    ],
)
def test_the_wire_decoding_drops_a_packed_reply_that_does_not_fit(
    name: str, record: dict[str, np.ndarray], reason: str
) -> None:
    with pytest.raises(ReplyRejected) as rejected:
        decode_record(
            name,
            as_record(record),
            small_model_arrays(),
            subset=name != "arrays",
            minimum=0.0 if name == "sensitivity" else -np.inf,
        )
    assert rejected.value.reason == reason


def test_a_packed_reply_of_the_wrong_length_is_a_shape_mismatch() -> None:
    packed = pack(small_model_arrays(), LAYOUT)
    key = next(k for k in packed if k.startswith("packed/"))
    with pytest.raises(ReplyRejected) as rejected:
        decode_record(
            "arrays",
            as_record({**packed, key: packed[key][:-1]}),
            small_model_arrays(),
            subset=False,
        )
    assert rejected.value.reason == "shape-mismatch"


class Recorder(DelegatingGrid):
    """A Grid that keeps what it is asked to send and answers nothing."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        self.sent.extend(messages)
        return []


@pytest.mark.usefixtures("server_identity")
def test_the_packing_grid_packs_a_rounds_model_once_and_keeps_every_message_s_address() -> None:
    content = RecordDict(
        {"arrays": as_record(small_model_arrays()), "config": ConfigRecord({"server-round": 3})}
    )
    messages = [Message(content=content, message_type="train", dst_node_id=n) for n in (4, 9)]
    inner = Recorder()
    PackedGrid(inner).send_and_receive(messages)
    assert [m.metadata.dst_node_id for m in inner.sent] == [4, 9]
    assert {m.metadata.message_type for m in inner.sent} == {"train"}
    assert inner.sent[0].content is inner.sent[1].content  # packed once
    sent = inner.sent[0].content
    assert is_packed(sent["arrays"])
    assert sent["config"]["server-round"] == 3
    arrays = {k: a.numpy() for k, a in sent["arrays"].items()}
    for key, value in unpack(arrays, LAYOUT, whole=True).items():
        assert np.array_equal(value, small_model_arrays()[key])
    assert packed_content(sent) is sent  # packed already


# ----------------------------------------------------------------------------- a whole round
CONFIG = RunConfig(num_clients=3, local_epochs=1, batch_size=16, device="cpu")


def node_context(partition_id: int) -> Context:
    return Context(
        run_id=1,
        node_id=10 + partition_id,
        node_config={"partition-id": partition_id, "num-partitions": CONFIG.num_clients},
        state=RecordDict(),
        run_config={},
    )


class ClientGrid(Recorder):
    """Every message answered by this project's ClientApp, in this process."""

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = []
        for message in messages:
            self.sent.append(message)
            node = message.metadata.dst_node_id
            reply = train(instruction_message(message.content), node_context(node))
            reply.metadata.__dict__["_src_node_id"] = node
            replies.append(reply)
        return replies

    def get_node_ids(self) -> Iterable[int]:
        return [0, 1, 2]


@pytest.mark.usefixtures("server_identity")
@pytest.mark.parametrize("rule", ["fedavg", "elastic"])
def test_a_round_sent_packed_ends_exactly_where_the_same_round_per_tensor_ends(rule: str) -> None:
    model = build_model(CONFIG.model, (1, 8, 8), 10, seed=0)
    arrays = ArrayRecord({k: v.detach() for k, v in model.state_dict().items()})
    config = ConfigRecord(dict(client_task(CONFIG).to_config()))
    results = []
    for packing in (False, True):
        strategy = (
            FedAvg(log_rounds=False)
            if rule == "fedavg"
            else ElasticAggregation(
                log_rounds=False,
                parameter_keys=[n for n, p in model.named_parameters() if p.requires_grad],
            )
        )
        inner = ClientGrid()
        grid = PackedGrid(inner) if packing else inner
        messages = strategy.configure_train(1, arrays, ConfigRecord(dict(config)), grid)
        replies = list(grid.send_and_receive(messages))
        assert all(is_packed(r.content["arrays"]) is packing for r in replies)
        if rule == "elastic":
            assert all(is_packed(r.content["sensitivity"]) is packing for r in replies)
        new, _ = strategy.aggregate_train(1, replies)
        assert new is not None
        assert strategy.aggregation_metrics[1]["replies-valid"] == 3
        results.append({k: a.numpy() for k, a in new.items()})
    assert list(results[0]) == list(results[1])
    for key in results[0]:
        assert np.array_equal(results[0][key], results[1][key]), key


def test_the_client_refuses_a_model_packed_for_another_architecture() -> None:
    other = {"w": np.zeros(10, F32)}
    content = RecordDict(
        {
            "arrays": as_record(pack(other, array_layout(other))),
            "config": ConfigRecord({**client_task(CONFIG).to_config(), "server-round": 1}),
        }
    )
    with pytest.raises(PackingError, match="another model"):
        evaluate_local(instruction_message(content), node_context(0))


def test_pack_model_is_a_run_option_refused_when_not_a_boolean() -> None:
    assert RunConfig().pack_model is True
    assert parse_run_config({"pack-model": False}).pack_model is False
    with pytest.raises(ValueError, match="pack-model"):
        parse_run_config({"pack-model": "yes"})


def test_packing_a_tensor_the_layout_does_not_name_is_refused() -> None:
    with pytest.raises(PackingError, match="not in the model"):
        pack({"c.weight": np.zeros(2, F32)}, LAYOUT)
    with pytest.raises(PackingError, match="shaped"):
        pack({"a.bias": np.zeros(3, F32)}, LAYOUT)
    torch_layout = array_layout({"w": torch.zeros(2, 3), "n": torch.tensor(1)})
    assert torch_layout == [("w", (2, 3), True), ("n", (), False)]


@settings(max_examples=200, deadline=None)
@given(
    suffix=st.text(alphabet="0123456789abcdef/xyz", max_size=40),
    length=st.integers(min_value=0, max_value=14),
    dtype=st.sampled_from(["<f2", "<f4", ">f8", "<i4", "|b1", "<c8"]),
    extra=st.sampled_from(
        [{}, {"bn.num_batches_tracked": np.array(1, np.int64)}, {"z": np.ones(2, F32)}]
    ),
)
def test_no_packed_record_raises_anything_but_a_dropped_reply(
    suffix: str, length: int, dtype: str, extra: dict[str, np.ndarray]
) -> None:
    """Whatever the key, length, dtype and company of a packed array, decoding either reads it
    or drops the reply with a reason: nothing else escapes to the round."""
    record = {f"packed/{suffix}": np.zeros(length, dtype=dtype), **extra}
    allowed = {"bad-packing", "shape-mismatch", "bad-dtype", "bad-encoding", "bad-sensitivity"}
    for name, subset in (("arrays", False), ("sensitivity", True)):
        reason, keys = decoded_or_reason(name, record, subset)
        assert (reason in allowed) if reason else (keys <= set(small_model_arrays()))


def decoded_or_reason(
    name: str, record: dict[str, np.ndarray], subset: bool
) -> tuple[str, set[str]]:
    """The drop reason of ``record`` decoded against the small model, or "" and its keys."""
    try:
        decoded = decode_record(name, as_record(record), small_model_arrays(), subset=subset)
    except ReplyRejected as rejected:
        return rejected.reason, set()
    return "", set(decoded.arrays)
