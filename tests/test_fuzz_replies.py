"""Fuzz: random malformed replies mixed with honest ones never raise and never move the model.

For every strategy, hypothesis builds a round of 2-4 honest replies and 1-4 malformed ones, each
malformed reply broken in one or more random ways (raw bytes, dtypes, shapes, missing or extra
keys and records, weights, values, sizes), and shuffles them together. Honest replies also carry
junk that the strategy did not ask for (unrequested records of garbage bytes, odd metrics). The
assertion: ``aggregate_train`` does not raise, drops exactly the malformed replies, and returns
bit for bit the model that a fresh strategy of the same configuration computes from the clean
honest replies alone (the independent reference).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beyond_averaging.strategies import (
    ContractStrategy,
    ElasticAggregation,
    FedAvg,
    FedGMA,
    FedGMASoft,
    FedLAW,
)
from beyond_averaging.tasks.datasets import LabeledData
from tests.conftest import reply_message

#: Examples per strategy: each holds 1-4 malformed replies, so every defect kind is drawn many
#: times; a few seconds per strategy (FedLAW, which learns weights on every call, gets fewer).
EXAMPLES = 30
FEDLAW_EXAMPLES = 5


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


GLOBAL = {k: v.detach().numpy().copy() for k, v in tiny_model().state_dict().items()}
PARAMETERS = [name for name, _ in tiny_model().named_parameters()]
FLOATING = [k for k, v in GLOBAL.items() if np.issubdtype(v.dtype, np.floating)]


def proxy_set() -> LabeledData:
    rng = np.random.default_rng(0)
    return LabeledData(rng.normal(size=(6, 4)).astype(np.float32), np.array([0, 1, 2, 0, 1, 2]), 3)


STRATEGIES: dict[str, Callable[[], ContractStrategy]] = {
    "fedavg": lambda: FedAvg(min_train_replies=2),
    "fedavg-momentum": lambda: FedAvg(
        min_train_replies=2, server_optimizer="momentum", server_lr=0.5
    ),
    "fedadam": lambda: FedAvg(min_train_replies=2, server_optimizer="adam", server_lr=0.1),
    "fedavg-median": lambda: FedAvg(min_train_replies=2, robust_aggregation="median"),
    "elastic": lambda: ElasticAggregation(min_train_replies=2, parameter_keys=PARAMETERS),
    "fedlaw": lambda: FedLAW(
        model=tiny_model(),
        proxy_set=proxy_set(),
        device=torch.device("cpu"),
        epochs=3,
        batch_size=6,
        min_train_replies=2,
    ),
    "fedgma": lambda: FedGMA(min_train_replies=2, threshold=0.5, server_lr=0.5),
    "fedgma-soft": lambda: FedGMASoft(min_train_replies=2, threshold=0.5),
}


def fresh(name: str) -> ContractStrategy:
    strategy = STRATEGIES[name]()
    strategy.global_arrays = {k: v.copy() for k, v in GLOBAL.items()}  # as configure_train does
    strategy.reply_byte_limit = strategy.max_reply_bytes or (1 << 20)
    return strategy


# ----------------------------------------------------------------------------- honest replies
Payload = dict[str, Any]  # arrays, num-examples, records, metrics, unrequested


@st.composite
def honest_payload(draw: st.DrawFn, requested: tuple[str, ...]) -> Payload:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    arrays = {
        k: (v + rng.normal(0, 0.1, v.shape).astype(v.dtype)) if k in FLOATING else v + 1
        for k, v in GLOBAL.items()
    }
    arrays["1.running_var"] = np.abs(arrays["1.running_var"]) + 0.5
    records = {
        name: {
            k: (np.abs if name == "sensitivity" else np.asarray)(
                rng.normal(0, 1, GLOBAL[k].shape)
            ).astype(np.float32)
            for k in PARAMETERS
        }
        for name in requested
    }
    return {
        "arrays": arrays,
        "num-examples": draw(st.integers(1, 500)),
        "records": records,
        "metrics": {"train-loss": float(rng.random())},
        "unrequested": {},
    }


JUNK_METRIC = st.one_of(
    st.sampled_from([np.inf, -np.inf, np.nan, 1e308, -1e308]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.floats(allow_nan=True), max_size=3),
    st.integers(-(2**62), 2**62),
)


@st.composite
def decorated(draw: st.DrawFn, payload: Payload) -> Payload:
    """The same honest reply plus junk it may carry harmlessly: unrequested records, metrics."""
    junk_records = draw(
        st.dictionaries(
            st.sampled_from(["junk", "extra", "gradient", "sensitivity", "noise"]),
            st.binary(max_size=64),
            max_size=2,
        )
    )
    requested = set(payload["records"])
    unrequested = {name: data for name, data in junk_records.items() if name not in requested}
    metrics = {
        **payload["metrics"],
        **draw(st.dictionaries(st.sampled_from(["acc", "odd", "x"]), JUNK_METRIC, max_size=2)),
    }
    return {**payload, "unrequested": unrequested, "metrics": metrics}


def raw(data: bytes, dtype: str = "float32", shape: tuple[int, ...] = (3,)) -> Array:
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)


def npy(value: np.ndarray[Any, Any]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, value, allow_pickle=False)
    return buffer.getvalue()


def to_message(payload: Payload, node_id: int) -> Message:
    content = RecordDict()
    if payload.get("arrays") is not None:
        content["arrays"] = ArrayRecord(
            {
                k: v if isinstance(v, Array) else Array(np.asarray(v))
                for k, v in payload["arrays"].items()
            }
        )
    if payload.get("num-examples", "absent") != "absent":
        content["metrics"] = MetricRecord(
            {"num-examples": payload["num-examples"], **payload["metrics"]}
        )
    for name, record in payload["records"].items():
        content[name] = ArrayRecord(
            {k: v if isinstance(v, Array) else Array(np.asarray(v)) for k, v in record.items()}
        )
    for name, data in payload["unrequested"].items():
        content[name] = ArrayRecord({"x": raw(data)})
    return reply_message(content, node_id=node_id)


# ----------------------------------------------------------------------------- malformations
BAD_WEIGHTS = [0, -1, 0.5, 1.5, float("inf"), float("-inf"), float("nan"), 1e300, [1, 2], []]
BAD_WEIGHT = st.one_of(
    st.sampled_from(BAD_WEIGHTS),
    st.floats(0.0, 1e6).filter(lambda x: not x.is_integer()),  # fractions of an example
    st.floats(max_value=0.0),  # zero, negative, -inf
    st.floats(min_value=2.0**54),  # beyond 2**53, inf
    st.integers(2**53 + 1, 2**62),
    st.lists(st.integers(1, 9), max_size=3),
)
BAD_DTYPES: list[Any] = [
    np.bool_,
    np.complex64,
    np.complex128,
    "U3",
    "S2",
    [("a", "f4"), ("b", "i4")],
    np.int8,
    np.uint16,
    np.longdouble,
    np.dtype(("f4", (2,))),
]
BAD_VALUES = [np.nan, np.inf, -np.inf, 1e30, -1e20, 3e38]


@st.composite
def broken_tensor(draw: st.DrawFn, key: str, floating_only: bool) -> Array:
    """One tensor broken at the byte, dtype, shape or value level."""
    shape = GLOBAL[key].shape
    kind = draw(st.sampled_from(["bytes", "truncate", "pad", "dtype", "shape", "value"]))
    good = npy(np.ones(shape, np.float32))
    if kind == "bytes":
        return raw(draw(st.binary(max_size=120)))
    if kind == "truncate":
        return raw(good[: draw(st.integers(0, len(good) - 1))])
    if kind == "pad":
        return raw(good + draw(st.binary(min_size=1, max_size=16)))
    if kind == "dtype":
        return Array(np.zeros(shape, dtype=draw(st.sampled_from(BAD_DTYPES))))
    if kind == "shape":
        other = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        if other == shape:
            other = (*shape, 1)
        return Array(np.zeros(other, np.float32))
    value = np.zeros(shape if shape else (), np.float32 if floating_only else GLOBAL[key].dtype)
    if not np.issubdtype(value.dtype, np.floating):
        return Array(np.zeros(shape, np.complex64))
    value = np.asarray(value, np.float64)
    value.reshape(-1)[draw(st.integers(0, max(value.size - 1, 0)))] = draw(
        st.sampled_from(BAD_VALUES)
    )
    return Array(value)


@st.composite
def malformed_payload(draw: st.DrawFn, requested: tuple[str, ...]) -> Payload:
    """An honest payload with one to three defects, each enough on its own to have it dropped
    (whatever the order they are applied in: none undoes another)."""
    payload = draw(honest_payload(requested))
    payload = {**payload, "arrays": dict(payload["arrays"]), "records": dict(payload["records"])}
    kinds = ["weight", "no-arrays", "no-metrics", "tensor", "missing-key", "extra-key", "huge"]
    if requested:
        kinds += ["record-missing", "record-tensor", "record-unknown-key", "record-empty"]
    # Mostly a single defect: a check that lets one kind through is then caught on its own.
    count = draw(st.sampled_from([1, 1, 1, 2, 3]))
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=count, max_size=count, unique=True)):
        if kind == "weight":
            payload["num-examples"] = draw(BAD_WEIGHT)
        elif kind == "no-arrays":
            payload["arrays"] = None
        elif kind == "no-metrics":
            payload["num-examples"] = "absent"
        elif kind == "tensor" and payload["arrays"] is not None:
            key = draw(st.sampled_from(list(GLOBAL)))
            payload["arrays"][key] = draw(broken_tensor(key, floating_only=False))
        elif kind == "missing-key" and payload["arrays"] is not None:
            payload["arrays"].pop(draw(st.sampled_from(list(GLOBAL))), None)
        elif kind == "extra-key" and payload["arrays"] is not None:
            payload["arrays"]["not-a-parameter"] = np.zeros(2, np.float32)
        elif kind == "huge":
            payload["unrequested"] = {"junk": bytes(1 << 21)}  # over the 1 MiB byte limit
        elif kind == "record-missing":
            payload["records"].pop(draw(st.sampled_from(requested)))
        elif kind == "record-tensor":
            name = draw(st.sampled_from(requested))
            key = draw(st.sampled_from(PARAMETERS))
            record = dict(payload["records"].get(name, {}))
            record[key] = draw(broken_tensor(key, floating_only=True))
            payload["records"][name] = record
        elif kind == "record-unknown-key":
            name = draw(st.sampled_from(requested))
            key = draw(st.sampled_from(["nope", "1.num_batches_tracked"]))
            record = {**payload["records"].get(name, {}), key: np.ones(1, np.float32)}
            payload["records"][name] = record
        elif kind == "record-empty":
            payload["records"][draw(st.sampled_from(requested))] = {}
    return payload


def requested_records(name: str) -> tuple[str, ...]:
    return tuple(fresh(name).required_records)


def assert_same_model(got: ArrayRecord | None, expected: ArrayRecord | None) -> None:
    assert (got is None) == (expected is None)
    if got is not None and expected is not None:
        assert list(got) == list(expected)
        for key in expected:
            np.testing.assert_array_equal(got[key].numpy(), expected[key].numpy())


def check_round(name: str, data: st.DataObject) -> None:
    """One fuzzed round of strategy ``name`` against its honest-only reference."""
    requested = requested_records(name)
    honest = data.draw(st.lists(honest_payload(requested), min_size=2, max_size=4))
    malformed = data.draw(st.lists(malformed_payload(requested), min_size=1, max_size=4))
    shown = [data.draw(decorated(payload)) for payload in honest]
    order = data.draw(st.permutations(range(len(honest) + len(malformed))))
    everything = [*(to_message(p, i) for i, p in enumerate(shown, start=1))]
    everything += [to_message(p, 100 + i) for i, p in enumerate(malformed)]
    mixed = [everything[i] for i in order]
    # The honest replies keep their relative order, so the reference sees them in the same one.
    honest_order = [i for i in order if i < len(honest)]
    clean = [to_message(honest[i], i + 1) for i in honest_order]

    strategy = fresh(name)
    arrays, _ = strategy.aggregate_train(1, mixed)
    figures = strategy.aggregation_metrics[1]
    assert figures["replies-dropped"] == len(malformed), figures
    assert figures["replies-valid"] == len(honest), figures

    reference = fresh(name)
    expected, _ = reference.aggregate_train(1, clean)
    assert_same_model(arrays, expected)


FUZZ_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


@pytest.mark.parametrize("name", [name for name in STRATEGIES if name != "fedlaw"])
@settings(max_examples=EXAMPLES, **FUZZ_SETTINGS)  # type: ignore[arg-type]
@given(data=st.data())
def test_malformed_replies_never_raise_and_never_change_the_aggregate(
    name: str, data: st.DataObject
) -> None:
    check_round(name, data)


@settings(max_examples=FEDLAW_EXAMPLES, **FUZZ_SETTINGS)  # type: ignore[arg-type]
@given(data=st.data())
def test_malformed_replies_never_change_fedlaws_learned_aggregate(data: st.DataObject) -> None:
    check_round("fedlaw", data)
