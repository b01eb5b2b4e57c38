"""Influence bounds: how far one reply may move the round, judged by the round's other replies.

The math of stage 3 of a reply's path (the map: :mod:`strategies.replies`; the component that
applies it: :mod:`strategies.replies.bounds`): after decoding, before the rule aggregates.
Every function is pure and vectorised over the round's replies; with u_k = theta_k - w the k-th
update (floating tensors) and n_k its claimed number of examples:

- **norms**: :func:`update_norms` ||u_k||, :func:`record_norms` (a ``sensitivity`` or
  ``gradient`` record), :func:`max_over_median` (the ratio the norm filter compares);
- **drop**: :func:`norm_outliers` (a norm above ``factor`` x the round's median),
  :func:`direction_outliers` on :func:`direction_cosines` (an update pointing against the
  others' mean far more than the round's updates do among themselves);
- **bound**: :func:`clip_scales` (each update scaled to at most ``factor`` x the round's median
  norm, its direction kept: norm bounding, Sun et al. 2019), :func:`bound_claims` (no claim above
  ``factor`` x the round's median claim), :func:`cap_weights` (no weight share above a cap).

Why bounds relative to the round: a Byzantine reply that passes every check of stages 1-2 (finite,
in range, of the right shapes) can still be any vector; its influence on a mean is its weight
times its size in its direction. The round's median norm and median claim are set by the honest
majority (fewer than half of the replies cannot move a median beyond the honest range), so a
bound at a multiple of them holds whatever the attackers send, and it moves with training (update
norms shrink by orders of magnitude over a run, so no absolute bound fits all rounds).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from beyond_averaging.strategies.aggregate import SUM_THREADS, NDArrayDict, as_numpy, is_floating

#: A ``sensitivity`` or ``gradient`` record is an outlier at this many times the update factor:
#: one batch's last-step gradient spreads more between honest clients than their updates do
#: (max/median up to 6.7 against 4.4 for updates on digits, docs/reliability.md).
RECORD_NORM_FACTOR_SCALE = 2.0

#: :func:`direction_outliers`: an update is dropped only when its cosine with the others' mean is
#: below minus this, whatever the round's spread: an update at right angles to the rest is left
#: to the clipping. 0.1, not 0.3: late in a run honest updates are mostly noise (cosines near 0)
#: and a sign-flipped one sits at -0.2 to -0.3, still the rest's opposite; on Elastic's evidence
#: setting (digits, Dirichlet 0.1, 5 of 10 clients) 0.1 and 0.3 both left the honest accuracy
#: where the check off left it (docs/reliability.md, "Byzantine clients").
DIRECTION_FLOOR = 0.1

#: Scale of the median absolute deviation to the standard deviation of a normal distribution.
MAD_TO_SD = 1.4826


# ----------------------------------------------------------------------------- norms
def squared_norm(array: npt.NDArray[Any]) -> float:
    """sum(x^2) of a floating array, in float32 or wider (BLAS dot product, no float64 copy).

    Float32's relative error (about 1e-6 per element, 1e-4 on a million) is far below what a norm
    comparison by a factor needs, and it is several times faster than converting to float64.
    A sum that overflows float32 gives inf: such a norm is an outlier by any measure.
    """
    flat = array.reshape(-1)
    with np.errstate(over="ignore"):
        if flat.dtype.itemsize >= 4:
            return float(np.dot(flat, flat))
        # float16 would overflow at 65504: squared in float32, one cached block at a time, the
        # block converted by torch (vectorised; NumPy converts float16 element by element, 4x
        # slower). A tensor-sized float32 copy cost more in fresh memory pages than the
        # conversion itself: float16 sensitivities took 1.6 s of Elastic's 100-reply round.
        block = np.empty(min(NORM_BLOCK, flat.size), np.float32)
        source, target = read_only_tensor(flat), torch.from_numpy(block)
        total = 0.0
        for start in range(0, flat.size, NORM_BLOCK):
            size = min(NORM_BLOCK, flat.size - start)
            target[:size].copy_(source[start : start + size])
            total += float(np.dot(block[:size], block[:size]))
        return total


def read_only_tensor(array: npt.NDArray[Any]) -> torch.Tensor:
    """A torch view of a NumPy array (a reply's read-only bytes, say) that is only ever read.

    A reply may send either byte order and torch reads only the machine's: an array in the other
    one comes back as a native copy, so it reads as the same numbers.
    """
    native = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    with warnings.catch_warnings():  # torch warns that it could write to a read-only buffer
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(native)


#: Values per block in :func:`update_norms`: the global block stays in the cache while every
#: reply's block is subtracted from it into one reused buffer (about 2x faster than a
#: tensor-sized temporary per reply and tensor on the 11M-parameter benchmark model).
NORM_BLOCK = 1 << 16


def update_norms(
    global_arrays: NDArrayDict, client_arrays: Sequence[Mapping[str, npt.NDArray[Any]]]
) -> npt.NDArray[np.float64]:
    """||theta_k - w||_2 per client, over the floating tensors (see :func:`squared_norm`)."""
    squares = np.zeros(len(client_arrays))
    buffers: dict[np.dtype[Any], npt.NDArray[Any]] = {}
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is an inf norm: an outlier
        for key, current in global_arrays.items():
            if not is_floating(current):
                continue
            origin = as_numpy(current).reshape(-1)
            flats = [as_numpy(arrays[key]).reshape(-1) for arrays in client_arrays]
            # float32 or wider: a float16 difference would overflow (60000 - -60000)
            wides = [np.promote_types(np.result_type(f, origin), np.float32) for f in flats]
            for wide in set(wides) - set(buffers):
                buffers[wide] = np.empty(NORM_BLOCK, dtype=wide)
            for start in range(0, origin.size, NORM_BLOCK):
                part = origin[start : start + NORM_BLOCK]
                for index, (flat, wide) in enumerate(zip(flats, wides, strict=True)):
                    difference = buffers[wide][: part.size]
                    np.subtract(flat[start : start + NORM_BLOCK], part, out=difference, dtype=wide)
                    squares[index] += squared_norm(difference)
    return np.sqrt(squares)


def record_norms(records: Sequence[Mapping[str, npt.NDArray[Any]]]) -> npt.NDArray[np.float64]:
    """||r_k||_2 per client's record, over all its tensors (see :func:`squared_norm`)."""
    return np.array(
        [math.sqrt(sum(squared_norm(value) for value in record.values())) for record in records],
        dtype=np.float64,
    )


def max_over_median(norms: npt.NDArray[np.float64] | Sequence[float]) -> float | None:
    """The largest norm over the median: what :func:`norm_outliers` compares with its factor.

    None without norms or with a median of 0 (no ratio to speak of).
    """
    values = np.asarray(norms, dtype=np.float64)
    median = float(np.median(values)) if values.size else 0.0
    return float(values.max()) / median if median > 0.0 else None


def norm_outliers(norms: npt.NDArray[np.float64], factor: float) -> npt.NDArray[np.bool_]:
    """True where a norm exceeds ``factor`` x the median of ``norms`` (factor 0: none is).

    With two replies the median is their mean, so no factor >= 2 can single one out; with a
    median of 0 (most clients did not move) nothing is flagged.
    """
    outliers = np.zeros(norms.shape, dtype=np.bool_)
    if factor <= 0.0 or norms.size == 0:
        return outliers
    median = float(np.median(norms))
    if median > 0.0:
        outliers = norms > factor * median
    return outliers


# ----------------------------------------------------------------------------- directions
#: Bytes of the (K, block) float32 stack :func:`direction_cosines` holds per thread: small
#: enough to stay in the CPU cache between the two sweeps over a block (the sum T, then the
#: dot products with it), so each reply is read from memory once.
DIRECTION_STACK_BYTES = 4 << 20

#: Coordinates of each update that :func:`direction_cosines` compares at most. A larger model is
#: compared on blocks drawn at random (about this many coordinates): the cosine of two updates
#: whose direction is spread over many coordinates is estimated to about 1/sqrt(2^20) = 0.001
#: from them, far finer than the check's threshold, while the check's cost stays that of a
#: 1M-parameter model (on an 11M-parameter MLP with 100 replies a full pass cost about 0.4 x
#: Flower's whole FedAvg round, docs/results/systems.md). The strategy draws the blocks from a
#: per-run secret and the round, so a client cannot know which coordinates are compared.
DIRECTION_COORDINATES = 1 << 20

#: One block of one tensor in the direction sweep: (the replies' flattened tensors, the global
#: tensor flattened, start, stop).
Segment = tuple[Sequence[npt.NDArray[Any]], npt.NDArray[Any], int, int]


def direction_cosines(
    global_arrays: NDArrayDict,
    client_arrays: Sequence[Mapping[str, Any]],
    norms: npt.NDArray[np.float64],
    *,
    coordinates: int = DIRECTION_COORDINATES,
    seed: Sequence[int] = (0,),
) -> npt.NDArray[np.float64]:
    """cos(u_k, R_-k) per reply: R_-k the equal-weight mean of the *other* updates, each first
    scaled down to at most the round's median norm.

    The reference leaves claimed weights out (a client claiming 1e12 examples must not set the
    direction the others are judged by) and bounds every update at the median (a reply 5x the
    median counts as one median-sized vote). With m_j = min(1, median / ||u_j||) and
    T = sum_j m_j u_j, (K - 1) R_-k = T - m_k u_k, so every cosine follows from <u_k, T>,
    ||u_k||^2 and ||T||^2, gathered block by block in one streaming pass
    (:func:`_direction_sums`). A model of more than ``coordinates`` floating values is compared
    on blocks drawn by ``seed`` (:func:`direction_segments`), the m_j still from the full norms.
    0 for a zero update or a zero reference; fewer than 2 replies give zeros.

    Parameters
    ----------
    global_arrays : dict of arrays
        The global model w of the round.
    client_arrays : Sequence[Mapping[str, array]]
        Each reply's model theta_k (floating tensors are compared).
    norms : array
        ||u_k|| per reply over the whole model (:func:`update_norms`).
    coordinates : int
        Compare at most about this many coordinates of each update.
    seed : Sequence[int]
        Draws the compared blocks when the model is larger than ``coordinates``.
    """
    count = len(client_arrays)
    cosines = np.zeros(count)
    if count < 2:
        return cosines
    median = float(np.median(norms))
    scales = np.minimum(1.0, np.divide(median, norms, out=np.ones(count), where=norms > 0.0))
    segments = direction_segments(global_arrays, client_arrays, coordinates, seed)
    dots, squares, total_squares = _direction_sums(segments, scales)
    sampled = np.sqrt(squares)  # ||u_k|| over the compared coordinates
    numerator = dots - scales * squares
    others = np.sqrt(np.maximum(total_squares - 2.0 * scales * dots + scales**2 * squares, 0.0))
    denominator = sampled * others
    np.divide(numerator, denominator, out=cosines, where=denominator > 0.0)
    clipped: npt.NDArray[np.float64] = np.clip(cosines, -1.0, 1.0)
    return clipped


def direction_segments(
    global_arrays: NDArrayDict,
    client_arrays: Sequence[Mapping[str, Any]],
    coordinates: int,
    seed: Sequence[int],
) -> list[Segment]:
    """The blocks :func:`direction_cosines` compares: every block of every floating tensor, or,
    for a model of more than ``coordinates`` values, blocks drawn without replacement by
    ``seed`` until they hold ``coordinates`` values (each block as wide as the sweep's stack)."""
    width = max(1, DIRECTION_STACK_BYTES // (4 * max(len(client_arrays), 1)))
    segments: list[Segment] = []
    for key, value in global_arrays.items():
        if is_floating(value):
            origin = as_numpy(value).reshape(-1)
            flats = [as_numpy(arrays[key]).reshape(-1) for arrays in client_arrays]
            for start in range(0, origin.size, width):
                segments.append((flats, origin, start, min(start + width, origin.size)))
    if sum(stop - start for _, _, start, stop in segments) <= coordinates:
        return segments
    chosen, total = [], 0
    for index in np.random.default_rng(list(seed)).permutation(len(segments)):
        chosen.append(segments[int(index)])
        total += chosen[-1][3] - chosen[-1][2]
        if total >= coordinates:
            break
    return chosen


def _direction_sums(
    segments: Sequence[Segment], scales: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], float]:
    """(<u_k, T> per reply, ||u_k||^2 per reply, ||T||^2) over ``segments``,
    T = sum_j scales_j u_j.

    Segment by segment: the K updates of a block go into a float32 (K, block) stack (one read
    of each reply), T's block is scales @ stack and the dot products stack @ T, while the stack
    is still in the cache. Segments are shared by ``SUM_THREADS`` threads, each with its own
    stack; float32 sums are far finer than the cosine threshold needs.
    """
    count = scales.size
    factors = scales.astype(np.float32)
    width = max((stop - start for _, _, start, stop in segments), default=1)

    def sweep(
        part: Sequence[Segment],
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], float]:
        stack = np.empty((count, width), dtype=np.float32)
        dots, squares, total_squares = np.zeros(count), np.zeros(count), 0.0
        for flats, origin, start, stop in part:
            block = stack[:, : stop - start]
            for row, flat in enumerate(flats):
                np.subtract(flat[start:stop], origin[start:stop], out=block[row], casting="unsafe")
            # einsum, not BLAS: OpenBLAS's own threads on these small products cost 5-10x on a
            # loaded 2-core machine; the blocks are threaded here instead.
            total = np.einsum("i,ij->j", factors, block)
            dots += np.einsum("ij,j->i", block, total)
            squares += np.einsum("ij,ij->i", block, block)
            total_squares += float(np.einsum("j,j->", total, total))
        return dots, squares, total_squares

    threads = min(SUM_THREADS, len(segments))
    if threads <= 1:
        return sweep(segments)
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(sweep, [segments[first::threads] for first in range(threads)]))
    return (
        sum((part[0] for part in parts), np.zeros(count)),
        sum((part[1] for part in parts), np.zeros(count)),
        sum(part[2] for part in parts),
    )


def direction_outliers(cosines: npt.NDArray[np.float64], factor: float) -> npt.NDArray[np.bool_]:
    """True where a cosine is below both -``DIRECTION_FLOOR`` and median - factor x MAD-sd.

    The spread is the round's own (the median absolute deviation, scaled to a standard
    deviation): under IID data honest updates agree (cosines 0.1-0.9 on digits) and a
    sign-flipped one sits far below them; under strong label skew honest updates disagree among
    themselves (cosines down to -0.7) and the wide spread keeps them. Factor 0, or fewer than 3
    replies (with two, either could be the one against the other), flags nothing.
    """
    flagged = np.zeros(cosines.shape, dtype=np.bool_)
    if factor <= 0.0 or cosines.size < 3:
        return flagged
    median = float(np.median(cosines))
    spread = MAD_TO_SD * float(np.median(np.abs(cosines - median)))
    flagged = (cosines < median - factor * spread) & (cosines < -DIRECTION_FLOOR)
    return flagged


# ----------------------------------------------------------------------------- bounds
def clip_scales(norms: npt.NDArray[np.float64], factor: float) -> npt.NDArray[np.float64]:
    """s_k = min(1, factor x median(norms) / norm_k): each update scaled to the bound, or kept.

    The rule then aggregates w + s_k u_k in place of theta_k (``strategies.aggregate``'s
    ``scales``). Factor 0, a median of 0 or no norms: all ones (nothing to compare with).
    """
    scales = np.ones(norms.shape)
    if factor <= 0.0 or norms.size == 0:
        return scales
    bound = factor * float(np.median(norms))
    if bound > 0.0:
        np.divide(bound, norms, out=scales, where=norms > bound)
    return scales


def bound_claims(
    claims: Sequence[float] | npt.NDArray[Any], factor: float
) -> npt.NDArray[np.float64]:
    """min(n_k, factor x median(n)): no reply claims more than ``factor`` x the median claim.

    Factor 0 returns the claims unchanged.
    """
    values = np.asarray(claims, dtype=np.float64)
    if factor <= 0.0 or values.size == 0:
        return values
    bounded: npt.NDArray[np.float64] = np.minimum(values, factor * float(np.median(values)))
    return bounded


def cap_weights(
    weights: Sequence[float] | npt.NDArray[Any], max_share: float
) -> npt.NDArray[np.float64]:
    """Data-size weights with no share above ``max_share``, the excess spread proportionally.

    With p = weights / sum(weights) sorted in decreasing order, the m largest are set to the cap
    c = max(max_share, 1 / K) and the others scaled by (1 - m c) / sum_{j >= m} p_j, for the
    smallest m that leaves every scaled weight <= c (water-filling: the result is the weight
    vector closest to p, in the proportional sense, whose entries are all <= c). ``max_share`` >= 1
    returns p unchanged.

    Raises
    ------
    ValueError
        When a weight is not finite or not positive, or ``max_share`` is not positive.
    """
    counts = np.asarray(weights, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0 or not np.all(np.isfinite(counts)):
        raise ValueError(f"need finite weights, got {counts.tolist()}")
    if np.any(counts <= 0.0) or not max_share > 0.0:
        raise ValueError(f"weights {counts.tolist()} and max_share {max_share} must be > 0")
    shares: npt.NDArray[np.float64] = counts / counts.sum()
    cap = max(float(max_share), 1.0 / shares.size)
    if shares.max() <= cap:
        return shares
    order = np.argsort(-shares, kind="stable")
    ranked = shares[order]
    tail = np.cumsum(ranked[::-1])[::-1]  # tail[m] = sum of the weights from rank m on
    capped = np.arange(ranked.size)
    # Rank m fits under the cap once the m above it are capped: p_m (1 - m c) <= c tail_m.
    # At m = K - 1 this reads 1 - (K - 1) c <= c, true because c >= 1 / K.
    first = int(np.argmax(ranked * (1.0 - capped * cap) <= cap * tail))
    result = ranked * ((1.0 - first * cap) / tail[first])
    result[:first] = cap
    out: npt.NDArray[np.float64] = np.empty_like(result)
    out[order] = result
    return out
