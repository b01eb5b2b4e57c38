"""Every malformed reply kind of the attacker probe is dropped with its reason; the round goes on.

Each case is one bad reply beside two honest ones; the round must aggregate exactly the honest
pair (their data-size-weighted mean, computed here by hand) and count the drop as
``dropped-<reason>``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from beyond_averaging.server.config import ConfigError, parse_run_config
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.strategies import ContractStrategy, ElasticAggregation, FedAvg, FedGMA
from beyond_averaging.strategies.aggregate import NDArrayDict
from beyond_averaging.strategies.replies.wire import (
    REPLY_VALUE_LIMIT,
    ClientReply,
    ReplyRejected,
    check_values,
    received_norms,
)
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.protocol import ARRAYS_RECORD
from tests.conftest import reply_message, train_reply

GLOBAL = {
    "w": np.zeros((2, 3), dtype=np.float32),
    "b": np.zeros(3, dtype=np.float32),
    "count": np.array(4, dtype=np.int64),
}


def client(value: float, count: int = 4) -> dict[str, np.ndarray[Any, Any]]:
    return {
        "w": np.full((2, 3), value, np.float32),
        "b": np.full(3, value, np.float32),
        "count": np.array(count, np.int64),
    }


def with_global(strategy: ContractStrategy) -> ContractStrategy:
    strategy.global_arrays = {k: v.copy() for k, v in GLOBAL.items()}
    strategy.reply_byte_limit = strategy.max_reply_bytes or 1 << 20
    return strategy


def raw_array(data: bytes) -> Array:
    return Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=data)


def npy_bytes(value: np.ndarray[Any, Any]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, value, allow_pickle=False)
    return buffer.getvalue()


def with_b(array: Array, num_examples: float = 10) -> Message:
    """A reply whose tensor 'b' is ``array`` (everything else honest)."""
    record = ArrayRecord({k: Array(v) for k, v in client(1.0).items() if k != "b"})
    record["b"] = array
    metrics = MetricRecord({"num-examples": num_examples})
    return reply_message(RecordDict({"arrays": record, "metrics": metrics}), node_id=9)


def object_npy() -> bytes:
    # A hand-written .npy header declaring Python objects ('|O'), followed by pickle-like bytes.
    header = "{'descr': '|O', 'fortran_order': False, 'shape': (3,), }"
    header += " " * (63 - len(header)) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + b"\x80" * 24


MALFORMED: dict[str, tuple[str, Callable[[], Message]]] = {
    # kind: (expected reason, reply)
    "num-examples 0.5": ("bad-num-examples", lambda: train_reply(client(1.0), 0.5)),
    "num-examples inf": ("bad-num-examples", lambda: train_reply(client(1.0), float("inf"))),
    "num-examples nan": ("bad-num-examples", lambda: train_reply(client(1.0), float("nan"))),
    "num-examples 1e300": ("bad-num-examples", lambda: train_reply(client(1.0), 1e300)),
    "num-examples negative": ("bad-num-examples", lambda: train_reply(client(1.0), -3)),
    "num-examples 2**53 + 1": ("bad-num-examples", lambda: train_reply(client(1.0), 2**53 + 1)),
    "num-examples list": ("bad-num-examples", lambda: train_reply(client(1.0), [1, 2])),  # type: ignore[arg-type]
    "bytes not .npy": ("bad-encoding", lambda: with_b(raw_array(b"not an npy file at all"))),
    "empty bytes": ("bad-encoding", lambda: with_b(raw_array(b""))),
    "npy of objects": ("bad-dtype", lambda: with_b(raw_array(object_npy()))),
    "truncated buffer": (
        "bad-encoding",
        lambda: with_b(raw_array(npy_bytes(np.ones(3, np.float32))[:-5])),
    ),
    "padded buffer": (
        "bad-encoding",
        lambda: with_b(raw_array(npy_bytes(np.ones(3, np.float32)) + b"\x00" * 8)),
    ),
    "header lies about shape": (
        "bad-encoding",
        lambda: with_b(raw_array(npy_bytes(np.ones(2, np.float32)).replace(b"(2,)", b"(3,)"))),
    ),
    "bool dtype": ("bad-dtype", lambda: with_b(Array(np.ones(3, np.bool_)))),
    "complex64 dtype": ("bad-dtype", lambda: with_b(Array(np.ones(3, np.complex64)))),
    "string dtype": ("bad-dtype", lambda: with_b(Array(np.array(["a", "b", "c"])))),
    "structured dtype": (
        "bad-dtype",
        lambda: with_b(Array(np.zeros(3, dtype=[("x", "f4"), ("y", "i4")]))),
    ),
    "int32 for a float tensor": ("bad-dtype", lambda: with_b(Array(np.ones(3, np.int32)))),
    "float128": ("bad-dtype", lambda: with_b(Array(np.ones(3, np.longdouble)))),
    "wrong shape": ("shape-mismatch", lambda: with_b(Array(np.ones(4, np.float32)))),
    "values 1e30": ("value-out-of-range", lambda: with_b(Array(np.full(3, 1e30, np.float32)))),
    "value nan": ("non-finite", lambda: with_b(Array(np.array([0, np.nan, 0], np.float32)))),
    "oversized unrequested record": (
        "oversized",
        lambda: train_reply(client(1.0), 10, extra={"junk": {"x": np.zeros(300_000, np.float32)}}),
    ),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_reply_is_dropped_with_its_reason_and_the_honest_pair_is_averaged(
    kind: str,
) -> None:
    reason, build = MALFORMED[kind]
    strategy = with_global(FedAvg(min_train_replies=2))
    honest = [train_reply(client(1.0), 10, node_id=1), train_reply(client(3.0, 8), 30, node_id=2)]
    arrays, _ = strategy.aggregate_train(1, [honest[0], build(), honest[1]])
    figures = strategy.aggregation_metrics[1]
    assert figures[f"dropped-{reason}"] == 1, figures
    assert figures["replies-valid"] == 2
    assert arrays is not None
    expected = 0.25 * 1.0 + 0.75 * 3.0
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), expected, np.float32))
    assert int(arrays["count"].numpy()) == 7  # rint(0.25 * 4 + 0.75 * 8)


def test_a_reply_cannot_claim_the_whole_weight_beyond_the_cap() -> None:
    strategy = with_global(FedAvg(min_train_replies=1, max_client_weight=0.5))
    replies = [
        train_reply(client(0.0), 1e12, node_id=1),  # claims a trillion examples
        train_reply(client(1.0), 10, node_id=2),
        train_reply(client(2.0), 30, node_id=3),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    # Capped at 0.5; the other half split 1:3 between the honest pair.
    expected = 0.5 * 0.0 + 0.125 * 1.0 + 0.375 * 2.0
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), expected), rtol=1e-6)


def test_an_update_far_above_the_round_median_norm_is_dropped() -> None:
    strategy = with_global(FedAvg(min_train_replies=1, update_norm_factor=3.0))
    replies = [train_reply(client(v), 10, node_id=i) for i, v in enumerate([1.0, 1.2, 0.8, 50.0])]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert strategy.aggregation_metrics[1]["dropped-norm-outlier"] == 1
    assert arrays is not None
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 1.0), rtol=1e-6)


def test_every_round_logs_its_largest_update_norm_over_the_median_filter_on_or_off() -> None:
    # Updates from the zero model: ||client(v) - 0|| = |v| sqrt(9) on the 9 floating entries
    # (the int64 count is not a floating tensor), so the ratio is max |v| / median |v|.
    values = [1.0, 2.0, 4.0, 40.0]
    expected = 40.0 / float(np.median(values))  # 40 / 3
    for factor in (0.0, 100.0):
        strategy = with_global(FedAvg(min_train_replies=1, update_norm_factor=factor))
        replies = [train_reply(client(v), 10, node_id=i) for i, v in enumerate(values)]
        strategy.aggregate_train(1, replies)
        assert strategy.aggregation_metrics[1]["update-norm-ratio"] == pytest.approx(expected)
        assert "dropped-norm-outlier" not in strategy.aggregation_metrics[1]


def test_a_huge_gradient_record_is_dropped_by_fedgma() -> None:
    strategy = with_global(FedGMA(min_train_replies=1, threshold=0.0, server_lr=1.0))
    floats = {k: np.ones_like(v) for k, v in GLOBAL.items() if k != "count"}
    huge = {k: np.full_like(v, 1e6) for k, v in floats.items()}
    replies = [
        train_reply(client(1.0), 10, node_id=1, extra={"gradient": floats}),
        train_reply(client(1.0), 10, node_id=2, extra={"gradient": floats}),
        train_reply(client(1.0), 10, node_id=3, extra={"gradient": floats}),
        train_reply(client(1.0), 10, node_id=4, extra={"gradient": huge}),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert strategy.aggregation_metrics[1]["dropped-norm-outlier-gradient"] == 1
    assert arrays is not None
    np.testing.assert_allclose(arrays["w"].numpy(), np.zeros((2, 3)), atol=1e-6)  # 1 - 1 * 1


def test_the_value_checks_give_a_records_norm_and_still_name_every_fault() -> None:
    # float32/64 tensors are checked by their sum of squares, which the influence bounds reuse;
    # a sum that does not prove the range is checked again by value, naming the fault.
    rng = np.random.default_rng(0)
    value = rng.standard_normal(100_000).astype(np.float32)
    squares = check_values("gradient", "g", value)
    assert squares == pytest.approx(float(np.sum(value.astype(np.float64) ** 2)), rel=1e-5)
    near_limit = np.full(4, 0.9 * REPLY_VALUE_LIMIT)  # allowed, though its squares prove nothing
    assert check_values("gradient", "g", near_limit) is None
    for bad, reason in [
        (np.inf, "bad-gradient"),
        (-np.inf, "bad-gradient"),
        (np.nan, "bad-gradient"),
        (2 * REPLY_VALUE_LIMIT, "bad-gradient"),
    ]:
        for dtype in (np.float16, np.float32, np.float64):
            faulty = value.astype(dtype)
            with np.errstate(over="ignore"):  # 2e15 is inf in float16: a fault all the same
                faulty[7] = bad
            with pytest.raises(ReplyRejected) as raised:
                check_values("gradient", "g", faulty)
            assert raised.value.reason == reason, (bad, dtype)
    with pytest.raises(ReplyRejected, match="below 0"):
        check_values("sensitivity", "g", np.array([1.0, -1.0]), minimum=0.0)
    with pytest.raises(ReplyRejected) as raised:
        check_values(ARRAYS_RECORD, "w", np.array([0.0, np.nan], np.float32))
    assert raised.value.reason == "non-finite"

    strategy = with_global(FedGMA(min_train_replies=1))
    gradients = {
        k: rng.standard_normal(v.shape).astype(np.float32)
        for k, v in GLOBAL.items()
        if k != "count"
    }
    reply = strategy.validate_reply(train_reply(client(1.0), 10, extra={"gradient": gradients}))
    expected = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in gradients.values()))
    assert reply.record_norms["gradient"] == pytest.approx(expected, rel=1e-6)
    halves = {k: v.astype(np.float16) for k, v in gradients.items()}  # checked by range: no norm
    half = strategy.validate_reply(train_reply(client(1.0), 10, extra={"gradient": halves}))
    assert "gradient" not in half.record_norms
    expected_half = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in halves.values()))
    np.testing.assert_allclose(
        received_norms("gradient", [reply, half]), [expected, expected_half], rtol=1e-6
    )


@pytest.mark.parametrize("rule", ["elastic", "fedgma"])
def test_big_endian_replies_aggregate_as_their_native_twins(rule: str) -> None:
    # A reply may send either byte order (float16 records included): the checks, the norms and
    # the rule read them as the same numbers.
    rng = np.random.default_rng(2)
    name = "sensitivity" if rule == "elastic" else "gradient"

    def replies(order: str) -> list[Message]:
        out = []
        for node in range(1, 5):
            model = {k: v + rng.normal(size=v.shape).astype(v.dtype) for k, v in GLOBAL.items()}
            model["count"] = GLOBAL["count"].copy()
            record = {
                k: np.abs(rng.normal(size=v.shape)).astype(np.dtype(np.float16).newbyteorder(order))
                for k, v in GLOBAL.items()
                if k != "count"
            }
            swapped = {k: v.astype(v.dtype.newbyteorder(order)) for k, v in model.items()}
            out.append(train_reply(swapped, 10, node_id=node, extra={name: record}))
        return out

    results = []
    for order in ("=", ">"):
        rng = np.random.default_rng(2)
        strategy = ElasticAggregation() if rule == "elastic" else FedGMA(threshold=0.0)
        arrays, _ = with_global(strategy).aggregate_train(1, replies(order))
        assert arrays is not None, order
        results.append({k: v.numpy() for k, v in arrays.items()})
    for key in GLOBAL:
        np.testing.assert_array_equal(results[0][key], results[1][key])


def test_gradient_records_that_share_no_tensor_keep_the_most_common_key_set() -> None:
    strategy = with_global(FedGMA(min_train_replies=1, threshold=0.0, server_lr=1.0))
    only_w = {"w": np.ones((2, 3), np.float32)}
    only_b = {"b": np.ones(3, np.float32)}
    replies = [
        train_reply(client(1.0), 10, node_id=1, extra={"gradient": only_w}),
        train_reply(client(1.0), 10, node_id=2, extra={"gradient": only_w}),
        train_reply(client(1.0), 10, node_id=3, extra={"gradient": only_b}),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert strategy.aggregation_metrics[1]["dropped-bad-gradient"] == 1
    assert arrays is not None


def test_a_gradient_for_an_integer_buffer_is_dropped() -> None:
    strategy = with_global(FedGMA(min_train_replies=1))
    bad = {"count": np.array(1.0, np.float32)}
    replies = [
        train_reply(client(1.0), 10, node_id=1, extra={"gradient": {"w": np.ones((2, 3))}}),
        train_reply(client(1.0), 10, node_id=2, extra={"gradient": bad}),
    ]
    strategy.aggregate_train(1, replies)
    assert strategy.aggregation_metrics[1]["dropped-bad-gradient"] == 1


def test_records_the_strategy_did_not_request_are_never_decoded() -> None:
    strategy = with_global(FedAvg(min_train_replies=2))
    garbage = {"sensitivity": {"w": np.ones(2, np.complex64)}}
    replies = [
        train_reply(client(1.0), 10, node_id=1, extra=garbage),
        train_reply(client(3.0), 10, node_id=2),
    ]
    content = replies[0].content
    content.array_records["junk"] = ArrayRecord({"x": raw_array(b"not npy")})
    arrays, _ = strategy.aggregate_train(1, replies)
    assert strategy.aggregation_metrics[1]["replies-valid"] == 2
    assert arrays is not None


class TwoNodeGrid:
    """The one Grid method configure_train uses."""

    def get_node_ids(self) -> list[int]:
        return [1, 2]


def test_the_default_byte_limit_follows_the_model_and_the_requested_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # configure_train builds instruction Messages, which read the ServerApp's task identity.
    for attribute in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attribute, 1 if attribute == "_run_id" else 0)
    model = ArrayRecord({"w": Array(np.zeros(1000, np.float32))})
    limits = {}
    for name, strategy in [
        ("fedavg", FedAvg()),
        ("elastic", ElasticAggregation()),
        ("fixed", FedAvg(max_reply_bytes=123)),
    ]:
        strategy.configure_train(1, model, ConfigRecord({}), TwoNodeGrid())  # type: ignore[arg-type]
        limits[name] = strategy.reply_byte_limit
    # 4 x the model's 4000 bytes per record sent back (arrays, + sensitivity), + 1 MiB.
    assert limits == {
        "fedavg": 4 * 4000 + 2**20,
        "elastic": 4 * 4000 * 2 + 2**20,
        "fixed": 123,
    }


class _Exploding(ContractStrategy):
    """Returns what it is told to: stands for any rule whose arithmetic blows up."""

    def __init__(self, result: float) -> None:
        super().__init__(min_train_replies=1)
        self.result = result

    def aggregate(
        self, server_round: int, global_arrays: NDArrayDict, replies: list[ClientReply]
    ) -> NDArrayDict:
        return {
            k: np.full(v.shape, self.result, v.dtype)
            for k, v in global_arrays.items()
            if k != "count"
        } | {"count": global_arrays["count"]}


@pytest.mark.parametrize("result", [np.nan, np.inf, 1e20, 1e6])
def test_a_non_finite_or_exploding_model_is_not_committed(
    result: float, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = with_global(_Exploding(result))
    arrays, _ = strategy.aggregate_train(1, [train_reply(client(1.0), 10)])
    assert arrays is None  # the previous global model stays
    assert strategy.aggregation_metrics[1]["model-rejected"] == 1
    assert strategy.aggregation_metrics[1]["aggregated"] == 0
    assert "not committed" in caplog.text


def test_fltrust_is_refused_without_a_root_set_naming_what_to_pass() -> None:
    with pytest.raises(ValueError, match=r"fltrust' in ElasticAggregation .* pass model= .*"):
        ElasticAggregation(robust_aggregation="fltrust")
    with pytest.raises(ValueError, match=r"fltrust' in FedGMA .*proxy_set="):
        FedGMA(robust_aggregation="fltrust")
    with pytest.raises(ConfigError, match="proxy-per-class = 0 with no proxy-dir"):
        parse_run_config(
            {"strategy": "fedavg", "robust-aggregation": "fltrust", "proxy-per-class": 0}
        )
    parse_run_config({"strategy": "fedavg", "robust-aggregation": "fltrust"})
    # every other robust form composes with every rule
    for method in ("median", "trimmed-mean", "krum", "multi-krum", "flame"):
        assert ElasticAggregation(robust_aggregation=method).robust_aggregation == method
        assert FedGMA(robust_aggregation=method).robust_aggregation == method
        parse_run_config({"strategy": "elastic", "robust-aggregation": method})


def test_run_options_reach_the_strategy() -> None:
    config = parse_run_config(
        {
            "robust-aggregation": "trimmed-mean",
            "trim-fraction": 0.2,
            "max-client-weight": 0.4,
            "update-norm-factor": 5.0,
            "update-clip-factor": 3.0,
            "direction-outlier-factor": 1.5,
            "max-claim-factor": 4.0,
            "max-reply-bytes": 4096,
        }
    )
    proxy = LabeledData(np.zeros((1, 2), np.float32), np.zeros(1, np.int64), 2)
    strategy = build_strategy(
        config, ServerResources(torch.nn.Linear(2, 2), proxy, torch.device("cpu"))
    )
    assert (strategy.robust_aggregation, strategy.trim_fraction) == ("trimmed-mean", 0.2)
    assert (strategy.max_client_weight, strategy.update_norm_factor) == (0.4, 5.0)
    assert strategy.max_reply_bytes == 4096
    assert (strategy.update_clip_factor, strategy.direction_outlier_factor) == (3.0, 1.5)
    assert strategy.max_claim_factor == 4.0


def test_robust_fedavg_strategy_ignores_one_wild_client() -> None:
    strategy = with_global(
        FedAvg(min_train_replies=1, robust_aggregation="median", update_norm_factor=0.0)
    )
    replies = [train_reply(client(v), 10, node_id=i) for i, v in enumerate([1.0, 2.0, 3.0, 1e9])]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 2.5))


def test_metrics_that_cannot_be_averaged_do_not_end_the_round() -> None:
    strategy = with_global(FedAvg(min_train_replies=2))
    replies = [
        train_reply(client(1.0), 10, node_id=1, metrics={"acc": float("inf")}),
        train_reply(client(3.0), 10, node_id=2, metrics={"acc": float("-inf")}),
    ]
    arrays, client_metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None  # the model is aggregated; only the metrics are left out
    assert client_metrics is None
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 2.0))


def test_evaluate_metrics_that_cannot_be_averaged_give_no_metrics_instead_of_an_error() -> None:
    strategy = with_global(FedAvg())
    replies = [
        reply_message(RecordDict({"metrics": MetricRecord({"num-examples": 5, "acc": v})}))
        for v in (float("inf"), float("-inf"))
    ]
    assert strategy.aggregate_evaluate(1, replies) is None


def test_records_get_twice_the_update_factor_before_they_count_as_outliers() -> None:
    strategy = with_global(FedGMA(min_train_replies=1, update_norm_factor=10.0))
    ones = {k: np.ones_like(v) for k, v in GLOBAL.items() if k != "count"}
    scaled = {k: 15.0 * v for k, v in ones.items()}  # 15 x the median: an update outlier only
    replies = [
        train_reply(client(1.0), 10, node_id=i, extra={"gradient": g})
        for i, g in enumerate([ones, ones, ones, scaled])
    ]
    strategy.aggregate_train(1, replies)
    assert strategy.aggregation_metrics[1]["replies-valid"] == 4
