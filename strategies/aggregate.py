"""Pure aggregation helpers shared by every rule: weights, weighted means, pseudo-gradients.

All functions take dicts of arrays keyed by parameter name (numpy arrays or torch
tensors) and return dicts of numpy arrays. They hold at most one
accumulator per tensor beside the inputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
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


def normalise_weights(
    num_examples: Sequence[float] | npt.NDArray[Any], num_clients: int | None = None
) -> npt.NDArray[np.float64]:
    """Data-size weights p_k = n_k / sum_j n_j.

    Raises
    ------
    ValueError
        When a count is not finite or not positive, when there is none, or when
        ``num_clients`` is given and differs from the number of counts.
    """
    counts = np.asarray(num_examples, dtype=np.float64)
    if num_clients is not None and counts.size != num_clients:
        raise ValueError(f"{num_clients} clients but {counts.size} weights")
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"need a non-empty 1-D list of example counts, got shape {counts.shape}")
    if not np.all(np.isfinite(counts)) or np.any(counts <= 0):
        raise ValueError(f"example counts must be finite and > 0, got {counts.tolist()}")
    probabilities: npt.NDArray[np.float64] = counts / counts.sum()
    return probabilities


def _cast_like(value: npt.NDArray[Any], template: npt.NDArray[Any]) -> npt.NDArray[Any]:
    # Integer buffers (BatchNorm's num_batches_tracked) are averaged in float and rounded back.
    # np.rint of a 0-d array gives a NumPy scalar; asarray keeps it an array that torch.from_numpy
    # and Flower's Array both take.
    if np.issubdtype(template.dtype, np.integer):
        rounded: npt.NDArray[Any] = np.asarray(np.rint(value)).astype(template.dtype)
        return rounded
    return value.astype(template.dtype, copy=False)


#: Elements per block of :func:`blockwise_sum`: a float64 accumulator block and its scratch
#: (512 KiB each) stay in the CPU cache while all K clients are added into them, so main memory
#: sees each client's tensor read once instead of the accumulator read and written K times.
BLOCK_ELEMENTS = 1 << 16

#: Threads that share the blocks of one tensor in :func:`blockwise_sum` (NumPy releases the GIL
#: inside its loops, so they run in parallel); 1 turns threading off.
SUM_THREADS = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, 8)

#: ``term(block, weight, where, out)``: write one client's term for the elements ``where`` of the
#: flattened tensor into ``out`` (the sum's dtype), given that client's ``block`` of them and its
#: weight. It may run in several threads at once (on different blocks), so it keeps no shared
#: scratch.
BlockTerm = Callable[[npt.NDArray[Any], float, slice, npt.NDArray[Any]], None]


def weighted_term(
    block: npt.NDArray[Any], weight: float, where: slice, out: npt.NDArray[np.float64]
) -> None:
    """The default :data:`BlockTerm`: ``weight * block``."""
    np.multiply(block, weight, out=out, dtype=np.float64)


def blockwise_sum(
    client_arrays: Sequence[Mapping[str, ArrayLike]],
    weights: npt.NDArray[np.float64] | Sequence[float],
    key: str,
    shape: tuple[int, ...],
    term: BlockTerm = weighted_term,
    dtype: npt.DTypeLike = np.float64,
) -> npt.NDArray[Any]:
    """sum_k term(client_arrays[k][key], weights[k]) in ``dtype`` (zeros of ``shape``: no client).

    ``dtype`` is the accumulator's and the term's scratch's: float64 for weighted sums, a small
    integer type for integer terms (FedGMA's sign votes, several times faster than in float64).

    The sum runs block by block (``BLOCK_ELEMENTS``), each block over every client in turn, with
    one scratch buffer for the term, the blocks shared by ``SUM_THREADS`` threads; the values are
    bit for bit those of summing whole tensors client after client, about twice as fast on a
    10 M-parameter model, with no per-client temporary.

    Raises
    ------
    ValueError
        When a client's tensor ``key`` does not have ``shape``.
    """
    accumulator = np.zeros(shape, dtype=dtype)
    flats = []
    for index, arrays in enumerate(client_arrays):
        value = as_numpy(arrays[key])
        if value.shape != accumulator.shape:
            raise ValueError(
                f"client {index} tensor {key!r} has shape {value.shape}, expected {shape}"
            )
        flats.append(value.reshape(-1))
    total = accumulator.reshape(-1)
    starts = range(0, total.size, BLOCK_ELEMENTS)
    threads = min(SUM_THREADS, len(starts))
    if threads <= 1:
        _sum_blocks(flats, weights, total, term, starts)
        return accumulator
    # Each thread owns every threads-th block: disjoint slices of the accumulator, so the result
    # does not depend on the thread count or on scheduling.
    with ThreadPoolExecutor(threads) as pool:
        parts = [starts[first::threads] for first in range(threads)]
        running = [pool.submit(_sum_blocks, flats, weights, total, term, part) for part in parts]
        for finished in running:
            finished.result()  # re-raises a worker's exception here
    return accumulator


def _sum_blocks(
    flats: Sequence[npt.NDArray[Any]],
    weights: npt.NDArray[np.float64] | Sequence[float],
    total: npt.NDArray[Any],
    term: BlockTerm,
    starts: range,
) -> None:
    """Add every client's term into the blocks of ``total`` that begin at ``starts``."""
    scratch = np.empty(min(BLOCK_ELEMENTS, total.size), dtype=total.dtype)
    for start in starts:
        where = slice(start, start + BLOCK_ELEMENTS)
        block = total[where]
        out = scratch[: block.size]
        for weight, flat in zip(weights, flats, strict=True):
            term(flat[where], float(weight), where, out)
            block += out


def weighted_mean(
    client_arrays: Sequence[Mapping[str, ArrayLike]],
    weights: npt.NDArray[np.floating[Any]] | Sequence[float],
    keys: Sequence[str] | None = None,
    dtype: npt.DTypeLike | None = None,
) -> NDArrayDict:
    """sum_k weights[k] * client_arrays[k][key] for every key, accumulated in float64.

    ``weights`` are used as given (normalise them first for an average). The result has each
    key's original dtype, or ``dtype`` when given (e.g. ``np.float64`` keeps the full precision of
    float16 inputs without converting every client's tensors first).
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
        accumulator = blockwise_sum(client_arrays, weights_arr, key, template.shape)
        result[key] = (
            _cast_like(accumulator, template)
            if dtype is None
            else accumulator.astype(dtype, copy=False)
        )
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
    total = weights_arr.sum()
    for key in selected:
        current = as_numpy(global_arrays[key])
        mean = blockwise_sum(client_arrays, weights_arr, key, current.shape)
        # (sum_k p_k) w - mean, written into the mean's buffer: no further model-sized copy.
        np.subtract(np.multiply(current, total, dtype=np.float64), mean, out=mean)
        result[key] = mean
    return result


def is_floating(array: npt.NDArray[Any]) -> bool:
    """Whether a tensor takes part in gradient-like updates (integer counters never do)."""
    return bool(np.issubdtype(array.dtype, np.floating))


def scaled_weights(
    weights: npt.NDArray[np.floating[Any]] | Sequence[float],
    scales: npt.NDArray[np.floating[Any]] | Sequence[float] | None,
) -> npt.NDArray[np.float64]:
    """p_k * s_k: the weights under which a weighted sum of updates u_k sums s_k u_k instead.

    ``scales`` None (or all 1) gives the weights unchanged. With them
    :func:`pseudo_gradient` is sum_k p_k s_k (w - theta_k): the mean update of the clipped
    replies w + s_k u_k.
    """
    weights_arr = np.asarray(weights, dtype=np.float64)
    if scales is None:
        return weights_arr
    scales_arr = np.asarray(scales, dtype=np.float64)
    if scales_arr.shape != weights_arr.shape:
        raise ValueError(f"{weights_arr.size} weights but {scales_arr.size} scales")
    product: npt.NDArray[np.float64] = weights_arr * scales_arr
    return product


def scaled_mean(
    global_arrays: Mapping[str, ArrayLike],
    client_arrays: Sequence[Mapping[str, ArrayLike]],
    weights: npt.NDArray[np.floating[Any]] | Sequence[float],
    scales: npt.NDArray[np.floating[Any]] | Sequence[float] | None,
    keys: Sequence[str] | None = None,
) -> NDArrayDict:
    """sum_k p_k (w + s_k (theta_k - w)): the weighted mean of the clients' models after each
    update was scaled by s_k (``strategies.replies.influence.clip_scales``), in each tensor's dtype.

    Equal to sum_k p_k s_k theta_k + (sum_k p_k (1 - s_k)) w: one weighted sum over the K
    replies and the global model, no scaled copy of any reply. Only floating tensors are scaled
    (integer counters take the plain weighted mean). With every scale 1 this is
    :func:`weighted_mean` itself, bit for bit. A scale above 1 lengthens an update (FLTrust's
    rescaling to a common length).
    """
    selected = list(global_arrays.keys()) if keys is None else list(keys)
    weights_arr = np.asarray(weights, dtype=np.float64)
    if scales is None or bool(np.all(np.asarray(scales) == 1.0)):
        return weighted_mean(client_arrays, weights_arr, keys=selected)
    scaled = scaled_weights(weights_arr, scales)
    rest = float(weights_arr.sum() - scaled.sum())
    floating = [k for k in selected if is_floating(as_numpy(global_arrays[k]))]
    counters = [k for k in selected if k not in set(floating)]
    result = weighted_mean(client_arrays, weights_arr, keys=counters) if counters else {}
    if floating:
        with_global = [*client_arrays, global_arrays]
        result.update(weighted_mean(with_global, [*scaled, rest], keys=floating))
    return {key: result[key] for key in selected}
