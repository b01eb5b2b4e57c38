"""Aggregation helpers added for the systems targets: zero-copy unpacking and float64 means."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array

from beyond_averaging.strategies import aggregate
from beyond_averaging.strategies.aggregate import (
    blockwise_sum,
    pseudo_gradient,
    weighted_mean,
)
from beyond_averaging.strategies.replies.wire import npy_view, value_range


def npy_bytes(array: np.ndarray[Any, Any], version: tuple[int, int] | None = None) -> bytes:
    stream = io.BytesIO()
    np.lib.format.write_array(stream, array, version=version, allow_pickle=True)
    return stream.getvalue()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array(7, dtype=np.int64),  # 0-d: BatchNorm's counter
        np.linspace(0, 1, 5).astype(np.float16),
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        np.zeros((0, 3), dtype=np.float32),
        np.arange(4, dtype=">f8"),  # big-endian data stays correct
    ],
)
def test_npy_view_reads_what_np_load_reads(array: np.ndarray[Any, Any]) -> None:
    data = npy_bytes(array)
    view = npy_view(data)
    loaded = np.load(io.BytesIO(data))
    assert view.shape == loaded.shape
    assert view.dtype == loaded.dtype
    np.testing.assert_array_equal(view, loaded)


def test_npy_view_of_a_flower_array_is_a_read_only_view_not_a_copy() -> None:
    array = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    flower_array = Array(array)
    view = npy_view(flower_array.data)
    np.testing.assert_array_equal(view, array)
    assert not view.flags.owndata
    assert not view.flags.writeable


def test_npy_view_reads_format_version_2() -> None:
    array = np.arange(5, dtype=np.int32)
    np.testing.assert_array_equal(npy_view(npy_bytes(array, version=(2, 0))), array)


def test_npy_view_refuses_python_objects() -> None:
    with pytest.raises(ValueError, match="objects"):
        npy_view(npy_bytes(np.array([{"a": 1}], dtype=object)))


def test_npy_view_refuses_bytes_that_are_not_npy() -> None:
    with pytest.raises(ValueError, match="magic"):
        npy_view(b"not an npy file at all")


def test_weighted_mean_can_keep_float64_for_float16_inputs() -> None:
    clients = [{"s": np.array([0.1, 3.0], np.float16)}, {"s": np.array([0.2, 5.0], np.float16)}]
    weights = [0.25, 0.75]
    exact = 0.25 * np.float64(np.float16(0.1)) + 0.75 * np.float64(np.float16(0.2))
    full = weighted_mean(clients, weights, dtype=np.float64)
    assert full["s"].dtype == np.float64
    assert full["s"][0] == exact
    assert full["s"][1] == 4.5
    assert weighted_mean(clients, weights)["s"].dtype == np.float16  # default: input dtype


def test_weighted_mean_keeps_a_0d_integer_buffer_a_0d_array_that_torch_reads() -> None:
    # BatchNorm's num_batches_tracked: averaged in float, rounded back to int64, still an ndarray.
    clients = [{"count": np.array(7, np.int64)}, {"count": np.array(10, np.int64)}]
    mean = weighted_mean(clients, [0.5, 0.5])["count"]
    assert isinstance(mean, np.ndarray)
    assert mean.shape == ()
    assert mean.dtype == np.int64
    assert int(torch.from_numpy(mean)) == 8  # rint(8.5) rounds half to even


def test_pseudo_gradient_matches_a_per_element_loop() -> None:
    rng = np.random.default_rng(3)
    global_arrays = {"w": rng.normal(size=(2, 3)).astype(np.float32)}
    clients = [{"w": rng.normal(size=(2, 3)).astype(np.float32)} for _ in range(3)]
    weights = [0.2, 0.3, 0.4]  # deliberately not summing to 1
    result = pseudo_gradient(global_arrays, clients, weights)["w"]
    for i in range(2):
        for j in range(3):
            expected = sum(
                p * (float(global_arrays["w"][i, j]) - float(c["w"][i, j]))
                for p, c in zip(weights, clients, strict=True)
            )
            assert result[i, j] == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert result.dtype == np.float64


@pytest.mark.parametrize("threads", [1, 3])
def test_blockwise_sum_equals_whole_tensor_sums_bit_for_bit_across_blocks(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aggregate, "BLOCK_ELEMENTS", 4)  # 3 x 5 = 15 elements: 3 blocks + 3
    monkeypatch.setattr(aggregate, "SUM_THREADS", threads)
    rng = np.random.default_rng(5)
    clients = [{"w": rng.normal(size=(3, 5)).astype(np.float32)} for _ in range(4)]
    weights = np.array([0.1, 0.2, 0.3, 0.4])
    reference = np.zeros((3, 5))
    for weight, client in zip(weights, clients, strict=True):  # client after client
        reference += weight * client["w"].astype(np.float64)
    result = blockwise_sum(clients, weights, "w", (3, 5))
    assert result.dtype == np.float64
    np.testing.assert_array_equal(result, reference)


def test_blockwise_sum_applies_a_custom_term_to_every_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(aggregate, "BLOCK_ELEMENTS", 2)
    clients = [{"g": np.array([-2.0, 0.0, 3.0])}, {"g": np.array([1.0, -1.0, 5.0])}]

    def sign_votes(block: Any, weight: float, where: slice, out: Any) -> None:
        np.sign(block, out=out)
        out *= weight

    result = blockwise_sum(clients, [1.0, 1.0], "g", (3,), sign_votes)
    np.testing.assert_array_equal(result, [0.0, -1.0, 2.0])  # by hand: -1+1, 0-1, 1+1


def test_blockwise_sum_counts_integer_terms_in_the_integer_dtype_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # FedGMA's hard mask counts sign votes in int16: the count must not pass through floats.
    monkeypatch.setattr(aggregate, "BLOCK_ELEMENTS", 2)
    clients = [{"g": np.array([-2.0, 0.0, 3.0])}, {"g": np.array([1.0, -1.0, 5.0])}] * 300

    def sign_votes(block: Any, weight: float, where: slice, out: Any) -> None:
        np.sign(block, out=out, casting="unsafe")

    result = blockwise_sum(clients, np.ones(600), "g", (3,), sign_votes, np.int16)
    assert result.dtype == np.int16
    np.testing.assert_array_equal(result, [0, -300, 600])  # 300 x (-1+1, 0-1, 1+1)


def test_blockwise_sum_names_a_client_tensor_of_the_wrong_shape() -> None:
    clients = [{"w": np.zeros((2, 3))}, {"w": np.zeros((3, 2))}]
    with pytest.raises(ValueError, match=r"client 1 tensor 'w' has shape \(3, 2\)"):
        blockwise_sum(clients, [0.5, 0.5], "w", (2, 3))


@pytest.mark.parametrize(
    ("array", "expected_low", "expected_high"),
    [
        (np.array([3.0, -2.0, 7.5], np.float32), -2.0, 7.5),
        (np.array([0.5, np.inf, 1.0], np.float16), 0.5, np.inf),
        (np.array([-np.inf, 0.0]), -np.inf, 0.0),
        (np.arange(4, dtype=">f8"), 0.0, 3.0),  # not native byte order
        (np.array([2.0, 5.0], np.longdouble), 2.0, 5.0),  # not a torch dtype
        (np.asfortranarray(np.array([[1.0, -4.0], [9.0, 2.0]])), -4.0, 9.0),
    ],
)
def test_value_range_is_the_min_and_max(
    array: np.ndarray[Any, Any], expected_low: float, expected_high: float
) -> None:
    assert value_range(array) == (expected_low, expected_high)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_value_range_reports_a_single_nan_at_both_ends(dtype: Any) -> None:
    array = np.ones(100_003, dtype=dtype)
    array[77_777] = np.nan
    array.flags.writeable = False  # like a view of a reply
    low, high = value_range(array)
    assert np.isnan(low)
    assert np.isnan(high)


def test_blockwise_sum_raises_a_term_error_from_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(aggregate, "BLOCK_ELEMENTS", 2)
    monkeypatch.setattr(aggregate, "SUM_THREADS", 2)

    def failing(block: Any, weight: float, where: slice, out: Any) -> None:
        if where.start == 2:
            raise RuntimeError("term failed on block 2")
        out[...] = block

    with pytest.raises(RuntimeError, match="term failed on block 2"):
        blockwise_sum([{"w": np.zeros(6)}], [1.0], "w", (6,), failing)
