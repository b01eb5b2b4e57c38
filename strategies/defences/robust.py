"""Byzantine-robust aggregation: coordinate-wise trimmed mean and median, Krum, Multi-Krum, FLAME.

With K client values x_1..x_K of one coordinate, sorted, and t = floor(trim_fraction * K):

- ``trimmed-mean``: the mean of x_(t+1) .. x_(K-t) (the t smallest and t largest left out);
- ``median``: the middle value (the mean of the two middle ones for even K);
- ``krum`` / ``multi-krum`` (Blanchard et al., NeurIPS 2017; El Mhamdi et al., ICML 2018): with
  f = floor(trim_fraction * K) assumed Byzantine, each client's score is the sum of its squared
  distances to its max(1, K - f - 2) nearest other clients (as Flower's ``Krum``); ``krum`` keeps
  the client of lowest score, ``multi-krum`` the K - f of lowest scores. The rule then aggregates
  the kept replies as usual (their data-size weights included, as Flower's ``MultiKrum``);
- ``flame`` (Nguyen et al., USENIX Security 2022), a backdoor defence without server data: the
  replies whose updates form the majority cluster by cosine distance (:func:`flame_selection`,
  the clustering HDBSCAN gives with FLAME's settings, written out in NumPy) are kept, clipped at
  the median norm and aggregated by the rule, and Gaussian noise of standard deviation
  ``FLAME_NOISE_LAMBDA`` x that median is added to the new model (:func:`flame_noise`);
- ``fltrust`` (Cao et al., NDSS 2021): trust scores against the server's own update on a root
  data set (:func:`fltrust_scores`; the rules' side is :mod:`strategies.defended`).

The coordinate-wise rules ignore the data-size weights: a client that claims many examples gets no
more say than one that claims few, and up to t (trimmed mean) or fewer than half (median)
arbitrary clients move a coordinate only within the honest clients' range. The price: data-size
weighting is lost (with unequal data the result is not the FedAvg optimum's average), and some
efficiency on honest data. Because the trimmed mean and the median commute with shifting and
negating all values, the robust mean update w - robust(theta_k) equals robust(w - theta_k)
coordinate by coordinate, so a rule that works on updates (Elastic's zeta, FedGMA's mask, a
server optimizer) takes it exactly where it took the weighted mean update.

Memory: every function streams over the clients block by block (:func:`client_blocks`): K slices
of at most ``ROBUST_BLOCK_ELEMENTS / K`` elements of one tensor at a time, never a stacked copy
of a tensor, let alone of the model, per client.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

from beyond_averaging.strategies.aggregate import NDArrayDict, as_numpy, as_numpy_dict, is_floating
from beyond_averaging.strategies.server_optimizer import ServerOptimizer

RobustAggregation = Literal[
    "none", "trimmed-mean", "median", "krum", "multi-krum", "flame", "fltrust", "proxy-weights"
]
ROBUST_CHOICES: tuple[str, ...] = get_args(RobustAggregation)
#: The methods every rule has a robust form for from the replies alone; ``fltrust`` and
#: ``proxy-weights`` need a server data set and the model's architecture
#: (:mod:`strategies.defended`).
GENERIC_METHODS: tuple[str, ...] = ("none", "trimmed-mean", "median", "krum", "multi-krum", "flame")
#: Rules that replace the mean coordinate by coordinate.
COORDINATE_WISE: tuple[str, ...] = ("trimmed-mean", "median")
#: Rules that keep a subset of the replies, which the rule then aggregates as usual.
SELECTIONS: tuple[str, ...] = ("krum", "multi-krum", "flame")
#: The reason a reply left out by a selection is counted under (``dropped-<reason>``).
SELECTION_REASONS: dict[str, str] = {
    "krum": "krum-rejected",
    "multi-krum": "krum-rejected",
    "flame": "flame-rejected",
}
SELECTION_DROPS: tuple[str, ...] = tuple(dict.fromkeys(SELECTION_REASONS.values()))
#: FLAME clips every kept update at the median norm of the round: this clip factor.
FLAME_CLIP_FACTOR = 1.0
#: FLAME's noise level for image classification (Nguyen et al. 2022, section 6): the noise added
#: to the new model has standard deviation lambda x the median update norm.
FLAME_NOISE_LAMBDA = 0.001

#: Elements of the (K, block) float64 stack one robust step holds at a time (32 MiB): K slices of
#: one tensor, whatever the model's size.
ROBUST_BLOCK_ELEMENTS = 1 << 22


def check_robust(method: str, trim_fraction: float) -> None:
    """Raise a ValueError naming the value when the method or the trim fraction is not allowed."""
    if method not in ROBUST_CHOICES:
        raise ValueError(f"robust_aggregation = {method!r}: use one of {ROBUST_CHOICES}")
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(
            f"trim_fraction = {trim_fraction}: allowed is [0, 0.5) (the share of clients left "
            "out at each end of every coordinate, and Krum's assumed Byzantine share)"
        )


def byzantine_count(trim_fraction: float, count: int) -> int:
    """f = floor(trim_fraction * K): the clients a robust rule is built to withstand."""
    return math.floor(trim_fraction * count)


def trimmed_mean(stacked: npt.NDArray[Any], trim_fraction: float) -> npt.NDArray[np.float64]:
    """Mean over axis 0 after leaving out the floor(trim_fraction * K) smallest and largest."""
    count = stacked.shape[0]
    trimmed = byzantine_count(trim_fraction, count)
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


def client_blocks(
    client_arrays: Sequence[Mapping[str, Any]],
    key: str,
    reference: Any = None,
    scales: npt.NDArray[np.float64] | Sequence[float] | None = None,
) -> Iterator[tuple[slice, npt.NDArray[np.float64]]]:
    """(where, stack): the clients' tensor ``key``, flattened, as (K, block) float64 stacks.

    ``where`` is the block's slice of the flattened tensor. With ``reference`` (the global
    tensor w) the rows are the updates theta_k - w, times ``scales[k]`` when given. Blocks hold
    at most ``ROBUST_BLOCK_ELEMENTS`` values in all, so the memory is flat in the model's size.

    Raises
    ------
    ValueError
        When the clients' tensors ``key`` differ in size.
    """
    flats = [as_numpy(arrays[key]).reshape(-1) for arrays in client_arrays]
    size = flats[0].size
    if any(flat.size != size for flat in flats):
        raise ValueError(f"the clients' tensors {key!r} differ in size")
    origin = None if reference is None else as_numpy(reference).reshape(-1)
    factors = None if scales is None else np.asarray(scales, dtype=np.float64)[:, None]
    step = max(1, ROBUST_BLOCK_ELEMENTS // len(flats))
    stack = np.empty((len(flats), min(step, size)), dtype=np.float64)
    for start in range(0, size, step):
        where = slice(start, min(start + step, size))
        block = stack[:, : where.stop - where.start]
        for row, flat in enumerate(flats):
            block[row] = flat[where]
        if origin is not None:
            block -= origin[where]
            if factors is not None:
                block *= factors
        yield where, block


def _robust_of(stack: npt.NDArray[np.float64], method: str, trim_fraction: float) -> Any:
    return coordinate_median(stack) if method == "median" else trimmed_mean(stack, trim_fraction)


def robust_mean(
    client_arrays: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    method: RobustAggregation,
    trim_fraction: float = 0.1,
) -> NDArrayDict:
    """The coordinate-wise trimmed mean or median of the clients' tensors ``keys``, in float64."""
    _check_coordinate_wise(method, trim_fraction, client_arrays)
    result: NDArrayDict = {}
    for key in keys:
        out = np.empty(as_numpy(client_arrays[0][key]).shape, dtype=np.float64)
        flat = out.reshape(-1)
        for where, stack in client_blocks(client_arrays, key):
            flat[where] = _robust_of(stack, method, trim_fraction)
        result[key] = out
    return result


def robust_update(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    method: RobustAggregation,
    trim_fraction: float = 0.1,
    scales: npt.NDArray[np.float64] | Sequence[float] | None = None,
) -> NDArrayDict:
    """D = robust_k(w - theta_k) per key, in float64: the robust mean update (a pseudo-gradient).

    With ``scales`` the updates are s_k (w - theta_k), the clipped replies'
    (``strategies.replies.influence.clip_scales``). Equal to w - robust(theta) without them (see the
    module docstring).
    """
    _check_coordinate_wise(method, trim_fraction, client_arrays)
    result: NDArrayDict = {}
    for key in keys:
        current = as_numpy(global_arrays[key])
        out = np.empty(current.shape, dtype=np.float64)
        flat = out.reshape(-1)
        for where, stack in client_blocks(client_arrays, key, current, scales):
            # rows are s_k (theta_k - w): the robust mean update is minus their robust mean
            flat[where] = _robust_of(stack, method, trim_fraction)
        np.negative(out, out=out)
        result[key] = out
    return result


def _check_coordinate_wise(
    method: str, trim_fraction: float, client_arrays: Sequence[Mapping[str, Any]]
) -> None:
    check_robust(method, trim_fraction)
    if method not in COORDINATE_WISE or not client_arrays:
        raise ValueError(
            f"a coordinate-wise robust mean needs {COORDINATE_WISE} and clients, got {method!r}"
        )


def update_gram(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    keys: Sequence[str] | None = None,
) -> npt.NDArray[np.float64]:
    """G[i, j] = <theta_i - w, theta_j - w> over ``keys`` (default: the floating tensors).

    On updates rather than models: squared distances G_ii + G_jj - 2 G_ij of models of a large
    norm would lose their digits to cancellation.
    """
    global_np = as_numpy_dict(global_arrays)
    selected = [k for k, v in global_np.items() if is_floating(v)] if keys is None else list(keys)
    gram = np.zeros((len(client_arrays), len(client_arrays)), dtype=np.float64)
    for key in selected:
        for _, stack in client_blocks(client_arrays, key, global_np[key]):
            gram += stack @ stack.T
    return gram


def krum_scores(gram: npt.NDArray[np.float64], byzantine: int) -> npt.NDArray[np.float64]:
    """Each client's sum of squared distances to its max(1, K - f - 2) nearest other clients."""
    count = gram.shape[0]
    diagonal = np.diag(gram)
    distances = np.maximum(diagonal[:, None] + diagonal[None, :] - 2.0 * gram, 0.0)
    np.fill_diagonal(distances, np.inf)  # a client is not its own neighbour
    nearest = min(max(1, count - byzantine - 2), max(count - 1, 1))
    if count == 1:
        return np.zeros(1)
    scores: npt.NDArray[np.float64] = np.sort(distances, axis=1)[:, :nearest].sum(axis=1)
    return scores


def krum_selection(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    method: RobustAggregation,
    trim_fraction: float = 0.1,
) -> list[int]:
    """Indices of the replies Krum (one) or Multi-Krum (K - f) keeps, in reply order.

    Ties go to the earlier reply (a stable sort), as Flower's ``argsort`` gives them.
    """
    check_robust(method, trim_fraction)
    if method not in SELECTIONS:
        raise ValueError(f"krum_selection needs 'krum' or 'multi-krum', got {method!r}")
    count = len(client_arrays)
    byzantine = byzantine_count(trim_fraction, count)
    scores = krum_scores(update_gram(global_arrays, client_arrays), byzantine)
    keep = 1 if method == "krum" else max(1, count - byzantine)
    return sorted(int(i) for i in np.argsort(scores, kind="stable")[:keep])


def select_replies(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    method: RobustAggregation,
    trim_fraction: float = 0.1,
) -> list[int]:
    """Indices of the replies a selection (:data:`SELECTIONS`) keeps, in reply order."""
    if method == "flame":
        return flame_selection(global_arrays, client_arrays)
    return krum_selection(global_arrays, client_arrays, method, trim_fraction)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Krum / Multi-Krum / FLAME as the reply bounds' selection step
    (:class:`strategies.replies.bounds.SelectionRule`): the replies it leaves out are dropped
    before the rule aggregates the rest."""

    method: RobustAggregation
    trim_fraction: float

    @property
    def reason(self) -> str:
        """``dropped-<reason>`` of a reply left out."""
        return SELECTION_REASONS[self.method]

    def choose(
        self, global_arrays: Mapping[str, Any], client_arrays: Sequence[Mapping[str, Any]]
    ) -> list[int]:
        """:func:`select_replies` by this method."""
        return select_replies(global_arrays, client_arrays, self.method, self.trim_fraction)

    def detail(self, kept: int, candidates: int) -> str:
        """The log line's reason for a reply left out."""
        return (
            f"not among the {kept} replies {self.method} keeps of {candidates} "
            f"(trim-fraction = {self.trim_fraction:g})"
        )


def selection_rule(method: RobustAggregation, trim_fraction: float) -> Selection | None:
    """The selection step of ``method``; None for the methods that select nothing."""
    return Selection(method, trim_fraction) if method in SELECTIONS else None


def majority_cluster(distances: npt.NDArray[np.float64]) -> list[int]:
    """The points HDBSCAN(min_cluster_size = floor(K / 2) + 1, min_samples = 1,
    allow_single_cluster = True) labels as its one cluster, from a (K, K) distance matrix.

    With min_samples 1 the mutual reachability distance is the distance itself, so HDBSCAN's
    hierarchy is single linkage. No two disjoint groups can both hold a majority, so the
    condensed tree has one cluster, the root, from which points fall out as the distance
    threshold shrinks; a point is labelled part of it when it stays in until the densest
    level, which is the first component to reach min_cluster_size when the points are merged
    in order of increasing distance (Kruskal's order on the minimum spanning tree). That
    component is returned, sorted. Fewer than 3 points: all of them (no majority to find).
    """
    count = distances.shape[0]
    if count < 3:
        return list(range(count))
    wanted = count // 2 + 1
    parent = list(range(count))
    members: dict[int, list[int]] = {index: [index] for index in range(count)}

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    rows, columns = np.triu_indices(count, k=1)
    for edge in np.argsort(distances[rows, columns], kind="stable"):
        first, second = root(int(rows[edge])), root(int(columns[edge]))
        if first == second:
            continue
        parent[second] = first
        members[first].extend(members.pop(second))
        if len(members[first]) >= wanted:
            return sorted(members[first])
    return list(range(count))  # pragma: no cover - K points always merge into one


def flame_selection(
    global_arrays: Mapping[str, Any], client_arrays: Sequence[Mapping[str, Any]]
) -> list[int]:
    """FLAME's filtering: the replies whose updates form the majority cluster by cosine distance.

    Distances 1 - cos(u_i, u_j) between the updates u_k = theta_k - w (floating tensors, from
    one Gram matrix, :func:`update_gram`); a zero update is at distance 1 from every other.
    Clustered by :func:`majority_cluster`, FLAME's HDBSCAN with min_cluster_size K / 2 + 1.
    """
    gram = update_gram(global_arrays, client_arrays)
    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    outer = np.outer(norms, norms)
    cosines = np.divide(gram, outer, out=np.zeros_like(gram), where=outer > 0.0)
    return majority_cluster(1.0 - np.clip(cosines, -1.0, 1.0))


def flame_noise(arrays: Mapping[str, Any], std: float, seed: Sequence[int]) -> NDArrayDict:
    """FLAME's last step: the new model plus Gaussian noise of standard deviation ``std`` on
    every floating tensor, drawn from ``seed`` (the run's seed and the round: a resumed round
    draws the same noise). Integer tensors are left as they are; dtypes are kept."""
    rng = np.random.default_rng(list(seed))
    noisy: NDArrayDict = {}
    for key, value in arrays.items():
        array = as_numpy(value)
        if is_floating(array) and std > 0.0:
            noisy[key] = (array + rng.normal(0.0, std, array.shape)).astype(array.dtype)
        else:
            noisy[key] = np.array(array)
    return noisy


def aggregate_robust(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    method: RobustAggregation,
    trim_fraction: float = 0.1,
    optimizer: ServerOptimizer | None = None,
    scales: npt.NDArray[np.float64] | Sequence[float] | None = None,
) -> NDArrayDict:
    """FedAvg with the robust mean: w_new = robust(theta), or a server step along the robust
    mean update D (:func:`robust_update`).

    Integer buffers (BatchNorm's counter) take the robust mean rounded back; floating tensors the
    robust mean itself (``optimizer`` None or SGD with lr 1, no clipping) or w - D, or the
    optimizer's step along D. ``scales`` clip the updates first. The result has the global
    model's keys, order and dtypes.
    """
    global_np = as_numpy_dict(global_arrays)
    floating = [key for key, value in global_np.items() if is_floating(value)]
    counters = [key for key in global_np if key not in set(floating)]
    plain = optimizer is None or (optimizer.name == "sgd" and optimizer.lr == 1.0)
    unscaled = scales is None or bool(np.all(np.asarray(scales) == 1.0))
    result: NDArrayDict = {}
    if counters:
        averaged = robust_mean(client_arrays, counters, method, trim_fraction)
        result.update({k: np.rint(averaged[k]).astype(global_np[k].dtype) for k in counters})
    if plain and unscaled:  # robust(theta) itself, not w - robust(w - theta): no round-off
        robust = robust_mean(client_arrays, floating, method, trim_fraction)
        result.update({k: robust[k].astype(global_np[k].dtype) for k in floating})
    elif floating:
        update = robust_update(global_np, client_arrays, floating, method, trim_fraction, scales)
        step = optimizer if optimizer is not None else ServerOptimizer("sgd", 1.0)
        result.update(step.step(global_np, update))
    return {key: result[key] for key in global_np}


def fltrust_scores(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    server_update: Mapping[str, Any],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """FLTrust's trust and rescaling (Cao et al., NDSS 2021) of each reply against g_0.

    With u_k = theta_k - w over the keys of ``server_update`` (g_0, the server's own update on
    its root data): trust TS_k = ReLU(cos(u_k, g_0)) and scale s_k = ||g_0|| / ||u_k||, so that
    w + s_k u_k has the server update's length. FLTrust's aggregate is then
    w + sum_k TS_k s_k u_k / sum_k TS_k. A zero update gets trust 0 and scale 1; a zero g_0 gives
    every reply trust 0. One streaming pass over the replies (:func:`client_blocks`).
    """
    count = len(client_arrays)
    dots, squares = np.zeros(count), np.zeros(count)
    reference_squares = 0.0
    for key, value in server_update.items():
        direction = as_numpy(value).reshape(-1).astype(np.float64, copy=False)
        reference_squares += float(direction @ direction)
        for where, stack in client_blocks(client_arrays, key, global_arrays[key]):
            dots += stack @ direction[where]
            squares += np.einsum("ij,ij->i", stack, stack)
    norms, reference = np.sqrt(squares), math.sqrt(reference_squares)
    denominator = norms * reference
    cosines = np.divide(dots, denominator, out=np.zeros(count), where=denominator > 0.0)
    trust: npt.NDArray[np.float64] = np.maximum(cosines, 0.0)
    scales: npt.NDArray[np.float64] = np.divide(
        reference, norms, out=np.ones(count), where=norms > 0.0
    )
    return trust, scales


def median_length_scales(
    norms: npt.NDArray[np.float64], trusted: npt.NDArray[np.bool_]
) -> npt.NDArray[np.float64]:
    """s_k = median_{j trusted} ||v_j|| / ||v_k||: each vector rescaled to the median length of
    the ``trusted`` ones (a zero vector, or no trusted vector: 1).

    FLTrust rescales every update to the server update's length; here the trusted updates are
    rescaled to their own median length instead (docs/reliability.md says why), and a rule's
    records (sensitivities, gradients) the same way.
    """
    scales = np.ones(norms.shape)
    if not np.any(trusted):
        return scales
    target = float(np.median(norms[trusted]))
    np.divide(target, norms, out=scales, where=norms > 0.0)
    return scales
