"""Heterogeneity-aware pre-aggregation: what a robust rule sees in place of the raw replies.

Under label skew honest updates differ so much that a robust rule cannot tell them from a
Byzantine one: the coordinate-wise median and trimmed mean, Krum and FLTrust all throw away
honest information, and the attackers hide in the spread. The papers below reduce the spread
before the rule runs. With K replies, u_k = theta_k - w the k-th update (after the default
clipping), f = floor(trim_fraction x K) assumed Byzantine:

- **nearest-neighbour mixing** (:func:`nnm_mixing`; Allouah et al., "Fixing by Mixing: A
  Recipe for Optimal Byzantine ML under Heterogeneity", AISTATS 2023, Algorithm 1): each u_k is
  replaced by the mean of its K - f nearest updates (itself included, Euclidean distance);
  the robust rule then runs on the K mixed vectors;
- **bucketing** (:func:`bucket_means`; Karimireddy, He and Jaggi, "Byzantine-Robust Learning on
  Heterogeneous Datasets via Bucketing", ICLR 2022, Algorithm 1): the replies are shuffled by a
  seeded permutation and cut into ceil(K / s) buckets of s; each bucket's mean is one input of
  the robust rule;
- **centered clipping** (:func:`centered_clipping`; Karimireddy, He and Jaggi, "Learning from
  History for Byzantine Robust Optimization", ICML 2021, eq. (CC)): from a centre v_0,
  v_{l+1} = v_l + (1/K) sum_k (u_k - v_l) min(1, tau / ||u_k - v_l||), L times; here each
  reply's update is replaced by its clipped form v_L + (u_k - v_L) min(1, tau / ||u_k - v_L||),
  so that every rule (not only a mean) aggregates clipped updates.

Every function is pure and vectorised over the replies through their Gram matrix
(:func:`strategies.defences.robust.update_gram`) or one (K, block) stack at a time
(:func:`strategies.defences.robust.client_blocks`): a mixture is a (K', K) matrix M applied to the
updates, so the mixed models w + M U never need more than one stacked block in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

from beyond_averaging.strategies.aggregate import NDArrayDict, as_numpy, is_floating
from beyond_averaging.strategies.replies.wire import ClientReply

from .robust import byzantine_count, client_blocks, update_gram

PreAggregation = Literal["none", "nnm", "bucketing", "centered-clipping"]
PRE_AGGREGATION_CHOICES: tuple[str, ...] = get_args(PreAggregation)


def pairwise_distances(gram: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """||u_i - u_j|| from the Gram matrix G_ij = <u_i, u_j> (rounding below 0 set to 0)."""
    diagonal = np.diag(gram)
    squared = np.maximum(diagonal[:, None] + diagonal[None, :] - 2.0 * gram, 0.0)
    return np.sqrt(squared)


def nnm_mixing(gram: npt.NDArray[np.float64], byzantine: int) -> npt.NDArray[np.float64]:
    """Nearest-neighbour mixing's matrix M (K x K): row k averages the K - f updates nearest to
    u_k, u_k itself included (Allouah et al. 2023, Algorithm 1); ties go to the earlier reply.

    With f = 0 every row averages all K updates (the mean, K times).
    """
    count = gram.shape[0]
    keep = max(1, count - byzantine)
    distances = pairwise_distances(gram)
    np.fill_diagonal(distances, -1.0)  # itself first, whatever the rounding
    nearest = np.argsort(distances, axis=1, kind="stable")[:, :keep]
    mixing = np.zeros((count, count))
    np.put_along_axis(mixing, nearest, 1.0 / keep, axis=1)
    return mixing


def bucket_mixing(count: int, bucket_size: int, seed: Sequence[int]) -> npt.NDArray[np.float64]:
    """Bucketing's matrix M (ceil(K / s) x K): the replies shuffled by a permutation drawn from
    ``seed``, cut into buckets of ``bucket_size`` (the last one may be smaller); row b averages
    bucket b (Karimireddy, He and Jaggi 2022, Algorithm 1).

    Raises
    ------
    ValueError
        When ``bucket_size`` < 1.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size = {bucket_size}: allowed is >= 1")
    order = np.random.default_rng(list(seed)).permutation(count)
    buckets = [order[start : start + bucket_size] for start in range(0, count, bucket_size)]
    mixing = np.zeros((len(buckets), count))
    for row, members in enumerate(buckets):
        mixing[row, members] = 1.0 / len(members)
    return mixing


def centered_clipping(
    gram: npt.NDArray[np.float64],
    radius: float | None = None,
    iterations: int = 3,
) -> npt.NDArray[np.float64]:
    """Centered clipping's matrix M (K x K): row k is u_k clipped to ``radius`` around the
    centre v_L (Karimireddy, He and Jaggi 2021), all in the span of the updates.

    From v_0 = 0 (the global model: no update), each of ``iterations`` steps sets
    v_{l+1} = v_l + (1/K) sum_k (u_k - v_l) c_k, c_k = min(1, tau / ||u_k - v_l||); the rows are
    then v_L + (u_k - v_L) c_k with the c_k of v_L. Every vector is a combination of the updates,
    v = a^T U, so the distances come from the Gram matrix: ||u_k - v||^2 = G_kk - 2 (G a)_k +
    a^T G a. ``radius`` None: tau is the median of ||u_k - v_l|| at each step (at most half the
    replies are clipped, and tau follows the round's scale as the default clipping does).
    """
    count = gram.shape[0]
    centre = np.zeros(count)  # v = centre @ U
    identity = np.eye(count)

    def clip_factors(centre: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        offsets = identity - centre[None, :]  # row k: u_k - v, as coefficients on U
        squared = np.einsum("ki,ij,kj->k", offsets, gram, offsets)
        distances = np.sqrt(np.maximum(squared, 0.0))
        tau = float(np.median(distances)) if radius is None else radius
        factors = np.ones(count)
        np.divide(tau, distances, out=factors, where=distances > tau)
        return factors

    for _ in range(iterations):
        factors = clip_factors(centre)
        centre = centre + ((identity - centre[None, :]) * factors[:, None]).mean(axis=0)
    factors = clip_factors(centre)
    mixing: npt.NDArray[np.float64] = (
        centre[None, :] + (identity - centre[None, :]) * factors[:, None]
    )
    return mixing


def mixing_matrix(
    gram: npt.NDArray[np.float64],
    method: PreAggregation,
    *,
    trim_fraction: float,
    bucket_size: int,
    seed: Sequence[int],
) -> npt.NDArray[np.float64]:
    """The matrix of ``method`` for the replies of Gram matrix ``gram`` (``none``: identity)."""
    count = gram.shape[0]
    if method == "nnm":
        return nnm_mixing(gram, byzantine_count(trim_fraction, count))
    if method == "bucketing":
        return bucket_mixing(count, bucket_size, seed)
    if method == "centered-clipping":
        return centered_clipping(gram)
    if method == "none":
        return np.eye(count)
    raise ValueError(f"pre_aggregation = {method!r}: use one of {PRE_AGGREGATION_CHOICES}")


def mixed_models(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    mixing: npt.NDArray[np.float64],
    keys: Sequence[str],
    scales: Sequence[float] | npt.NDArray[np.float64] | None = None,
) -> list[NDArrayDict]:
    """w + sum_k M_bk s_k (theta_k - w) per row b of ``mixing``, over ``keys`` (float64), the
    other tensors of ``global_arrays`` taken from the first reply of each row's largest weight
    (integer buffers are not mixed). With ``global_arrays`` empty for a key the rows mix the
    values themselves (records: gradients, sensitivities)."""
    rows = mixing.shape[0]
    # s_k folded into the matrix: the same for updates (around w) and for records (around 0)
    scaled = mixing if scales is None else mixing * np.asarray(scales, dtype=np.float64)[None, :]
    out: list[NDArrayDict] = [{} for _ in range(rows)]
    for key in keys:
        reference = global_arrays.get(key)
        shape = as_numpy(client_arrays[0][key]).shape
        flats = [np.empty(int(np.prod(shape)), dtype=np.float64) for _ in range(rows)]
        for where, stack in client_blocks(client_arrays, key, reference):
            block = scaled @ stack
            for row in range(rows):
                flats[row][where] = block[row]
        origin = None if reference is None else as_numpy(reference).reshape(-1)
        for row in range(rows):
            if origin is not None:
                flats[row] += origin
            out[row][key] = flats[row].reshape(shape)
    for key in client_arrays[0]:
        if key not in keys:
            for row in range(rows):
                out[row][key] = np.array(as_numpy(client_arrays[int(np.argmax(mixing[row]))][key]))
    return out


def mix(
    global_arrays: Mapping[str, Any],
    replies: Sequence[ClientReply],
    method: PreAggregation,
    *,
    trim_fraction: float,
    bucket_size: int,
    seed: Sequence[int],
) -> list[ClientReply]:
    """The replies a rule aggregates after ``method``: one reply per row of the mixing matrix
    (:func:`mixing_matrix`, from the Gram matrix of the clipped updates s_k u_k), its model
    w + sum_k M_bk s_k u_k and each record sum_k M_bk s'_k r_k, scales then 1.

    Weights: under ``bucketing`` a bucket weighs the sum of its members' weights (their claims,
    already bounded); otherwise row k keeps reply k's weight. A row's node id and metrics are
    those of the reply of its largest entry (its own, for ``nnm`` and ``centered-clipping``).
    """
    arrays = [reply.arrays for reply in replies]
    scales = np.array([reply.update_scale for reply in replies], dtype=np.float64)
    floating = [key for key, value in global_arrays.items() if is_floating(as_numpy(value))]
    gram = update_gram(global_arrays, arrays, floating) * np.outer(scales, scales)
    mixing = mixing_matrix(
        gram, method, trim_fraction=trim_fraction, bucket_size=bucket_size, seed=seed
    )
    models = mixed_models(global_arrays, arrays, mixing, floating, scales)
    records: dict[str, list[NDArrayDict]] = {}
    for name in replies[0].records:
        values = [reply.records[name] for reply in replies]
        record_scales = [reply.record_scales.get(name, 1.0) for reply in replies]
        shared = [key for key in values[0] if all(key in value for value in values)]
        records[name] = mixed_models({}, values, mixing, shared, record_scales)
    claims = np.array([reply.num_examples for reply in replies], dtype=np.float64)
    weights = (mixing > 0.0) @ claims if method == "bucketing" else claims
    mixed = []
    for row in range(mixing.shape[0]):
        source = replies[int(np.argmax(mixing[row]))] if method == "bucketing" else replies[row]
        mixed.append(
            dataclasses.replace(
                source,
                arrays={
                    key: models[row][key].astype(as_numpy(global_arrays[key]).dtype)
                    for key in global_arrays
                },
                num_examples=float(weights[row]),
                records={name: rows[row] for name, rows in records.items()},
                update_scale=1.0,
                record_scales=dict.fromkeys(records, 1.0),
            )
        )
    return mixed


def check_pre_aggregation(method: str, bucket_size: int) -> None:
    """Raise a ValueError naming the value when the method or the bucket size is not allowed."""
    if method not in PRE_AGGREGATION_CHOICES:
        raise ValueError(f"pre_aggregation = {method!r}: use one of {PRE_AGGREGATION_CHOICES}")
    if not (isinstance(bucket_size, int) and 1 <= bucket_size <= 1_000_000):
        raise ValueError(f"bucket_size = {bucket_size!r}: allowed is a whole number >= 1")


__all__ = [
    "PRE_AGGREGATION_CHOICES",
    "PreAggregation",
    "bucket_mixing",
    "centered_clipping",
    "check_pre_aggregation",
    "mix",
    "mixed_models",
    "mixing_matrix",
    "nnm_mixing",
    "pairwise_distances",
]
