"""Coordinate-wise robust averaging of client models: trimmed mean and median.

With K client values x_1..x_K of one coordinate, sorted, and t = floor(trim_fraction * K):

- ``trimmed-mean``: the mean of x_(t+1) .. x_(K-t) (the t smallest and t largest left out);
- ``median``: the middle value (the mean of the two middle ones for even K).

Both ignore the data-size weights: a client that claims many examples gets no more say than one
that claims few, and up to t (trimmed mean) or fewer than half (median) arbitrary clients move a
coordinate only within the honest clients' range. The price: data-size weighting is lost (with
unequal data the result is not the FedAvg optimum's average), and statistically some efficiency on
honest data. Because the trimmed mean and the median commute with shifting and negating all
values, the robust mean update w - robust(theta_k) equals robust(w - theta_k) coordinate by
coordinate, so it composes with a server optimizer exactly as the weighted mean update does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

from .aggregate import NDArrayDict, as_numpy, as_numpy_dict, is_floating
from .server_optimizer import ServerOptimizer

RobustAggregation = Literal["none", "trimmed-mean", "median"]
ROBUST_CHOICES: tuple[str, ...] = get_args(RobustAggregation)


def check_robust(method: str, trim_fraction: float) -> None:
    """Raise a ValueError naming the value when the method or the trim fraction is not allowed."""
    if method not in ROBUST_CHOICES:
        raise ValueError(f"robust_aggregation = {method!r}: use one of {ROBUST_CHOICES}")
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(
            f"trim_fraction = {trim_fraction}: allowed is [0, 0.5) (the share of clients left "
            "out at each end of every coordinate)"
        )


def trimmed_mean(stacked: npt.NDArray[Any], trim_fraction: float) -> npt.NDArray[np.float64]:
    """Mean over axis 0 after leaving out the floor(trim_fraction * K) smallest and largest."""
    count = stacked.shape[0]
    trimmed = math.floor(trim_fraction * count)
    if count - 2 * trimmed < 1:
        raise ValueError(f"trim_fraction = {trim_fraction} leaves no value of {count}")
    values = np.asarray(stacked, dtype=np.float64)
    if trimmed:
        # partition, not sort: only the two cut points need to be in place.
        values = np.partition(values, (trimmed, count - trimmed - 1), axis=0)
    mean: npt.NDArray[np.float64] = np.mean(values[trimmed : count - trimmed], axis=0)
    return mean


def coordinate_median(stacked: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Median over axis 0 (mean of the two middle values for an even count), in float64."""
    median: npt.NDArray[np.float64] = np.median(np.asarray(stacked, dtype=np.float64), axis=0)
    return median


def robust_mean(
    client_arrays: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    method: RobustAggregation,
    trim_fraction: float = 0.1,
) -> NDArrayDict:
    """The coordinate-wise trimmed mean or median of the clients' tensors ``keys``, in float64.

    One key at a time: K stacked float64 copies of one tensor, never of the whole model.
    """
    check_robust(method, trim_fraction)
    if method == "none" or not client_arrays:
        raise ValueError(f"robust_mean needs a robust method and clients, got {method!r}")
    result: NDArrayDict = {}
    for key in keys:
        stacked = np.stack([as_numpy(arrays[key]) for arrays in client_arrays]).astype(
            np.float64, copy=False
        )
        result[key] = (
            coordinate_median(stacked)
            if method == "median"
            else trimmed_mean(stacked, trim_fraction)
        )
    return result


def aggregate_robust(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    method: RobustAggregation,
    trim_fraction: float = 0.1,
    optimizer: ServerOptimizer | None = None,
) -> NDArrayDict:
    """FedAvg with the robust mean: w_new = robust(theta), or a server step along w - robust(theta).

    Integer buffers (BatchNorm's counter) take the robust mean rounded back; floating tensors the
    robust mean itself (``optimizer`` None or SGD with lr 1) or the optimizer's step along the
    robust mean update. The result has the global model's keys, order and dtypes.
    """
    global_np = as_numpy_dict(global_arrays)
    robust = robust_mean(client_arrays, list(global_np), method, trim_fraction)
    plain = optimizer is None or (optimizer.name == "sgd" and optimizer.lr == 1.0)
    result: NDArrayDict = {}
    update: NDArrayDict = {}
    for key, current in global_np.items():
        if is_floating(current) and not plain:
            update[key] = np.subtract(current, robust[key], dtype=np.float64)
        elif is_floating(current):
            result[key] = robust[key].astype(current.dtype)
        else:
            result[key] = np.rint(robust[key]).astype(current.dtype)
    if update and optimizer is not None:
        result.update(optimizer.step(global_np, update))
    return {key: result[key] for key in global_np}
