"""Aggregation helpers added for the systems targets: zero-copy unpacking and float64 means."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from flwr.app import Array

from strategies.aggregate import npy_view, pseudo_gradient, weighted_mean


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
