"""Pure aggregation helpers shared by every rule: weights, weighted means, pseudo-gradients.

All functions take dicts of arrays keyed by parameter name (numpy arrays or torch
tensors) and return dicts of numpy arrays. They hold at most one
accumulator per tensor beside the inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

NDArrayDict = dict[str, npt.NDArray[Any]]
ArrayLike = Any  # numpy array or torch tensor; converted with as_numpy


def as_numpy(value: ArrayLike) -> npt.NDArray[Any]:
    """A numpy view of a numpy array or a (CPU or CUDA) torch tensor."""
    if isinstance(value, np.ndarray):
        return value
    detach = getattr(value, "detach", None)
    if detach is not None:  # torch.Tensor, without importing torch here
        return np.asarray(detach().cpu().numpy())
    return np.asarray(value)


def as_numpy_dict(arrays: Mapping[str, ArrayLike]) -> NDArrayDict:
    """Convert every value of a dict to numpy."""
    return {key: as_numpy(value) for key, value in arrays.items()}


def normalise_weights(num_examples: Sequence[float] | npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Data-size weights p_k = n_k / sum_j n_j.

    Raises
    ------
    ValueError
        When a count is not finite or not positive, or when there is none.
    """
    counts = np.asarray(num_examples, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"need a non-empty 1-D list of example counts, got shape {counts.shape}")
    if not np.all(np.isfinite(counts)) or np.any(counts <= 0):
        raise ValueError(f"example counts must be finite and > 0, got {counts.tolist()}")
    probabilities: npt.NDArray[np.float64] = counts / counts.sum()
    return probabilities


def _cast_like(value: npt.NDArray[Any], template: npt.NDArray[Any]) -> npt.NDArray[Any]:
    # Integer buffers (BatchNorm's num_batches_tracked) are averaged in float and rounded back.
    if np.issubdtype(template.dtype, np.integer):
        rounded: npt.NDArray[Any] = np.rint(value).astype(template.dtype)
        return rounded
    return value.astype(template.dtype, copy=False)


def weighted_mean(
    client_arrays: Sequence[Mapping[str, ArrayLike]],
    weights: npt.NDArray[np.floating[Any]] | Sequence[float],
    keys: Sequence[str] | None = None,
) -> NDArrayDict:
    """sum_k weights[k] * client_arrays[k][key] for every key, in each key's original dtype.

    ``weights`` are used as given (normalise them first for an average).
    """
    weights_arr = np.asarray(weights, dtype=np.float64)
    if len(client_arrays) != weights_arr.size:
        raise ValueError(f"{len(client_arrays)} clients but {weights_arr.size} weights")
    if not client_arrays:
        raise ValueError("cannot average zero clients")
    selected = list(client_arrays[0].keys()) if keys is None else list(keys)
    result: NDArrayDict = {}
    for key in selected:
        template = as_numpy(client_arrays[0][key])
        accumulator = np.zeros(template.shape, dtype=np.float64)
        for weight, arrays in zip(weights_arr, client_arrays, strict=True):
            accumulator += weight * as_numpy(arrays[key])
        result[key] = _cast_like(accumulator, template)
    return result


def pseudo_gradient(
    global_arrays: Mapping[str, ArrayLike],
    client_arrays: Sequence[Mapping[str, ArrayLike]],
    weights: npt.NDArray[np.floating[Any]] | Sequence[float],
    keys: Sequence[str] | None = None,
) -> NDArrayDict:
    """The mean update D = sum_k p_k (w - theta_k) = w - sum_k p_k theta_k, in float64 per key."""
    selected = list(global_arrays.keys()) if keys is None else list(keys)
    weights_arr = np.asarray(weights, dtype=np.float64)
    result: NDArrayDict = {}
    for key in selected:
        mean = np.zeros(as_numpy(global_arrays[key]).shape, dtype=np.float64)
        for weight, arrays in zip(weights_arr, client_arrays, strict=True):
            mean += weight * as_numpy(arrays[key])
        result[key] = weights_arr.sum() * as_numpy(global_arrays[key]).astype(np.float64) - mean
    return result


def is_floating(array: npt.NDArray[Any]) -> bool:
    """Whether a tensor takes part in gradient-like updates (integer counters never do)."""
    return bool(np.issubdtype(array.dtype, np.floating))
