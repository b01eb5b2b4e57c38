"""Client diagnostics of a round: update coherence, model distances and mutual information.

Notation: K clients whose replies were aggregated this round, w = the global model sent this round,
theta_k = client k's trained model, g_k = w - theta_k its update (FedLAW's "local gradient"),
lambda_k = the clients' data-size weights p_k = n_k / sum_j n_j. Only the model's *trainable
parameters* enter (the ServerApp passes their names); buffers such as BatchNorm statistics and
counters are no gradients and are left out.

- **Local gradient coherence** (FedLAW, Li et al. ICML 2023, section 5, Definition 5.1): the
  pairwise cosine similarity c_ij = <g_i, g_j> / (||g_i|| ||g_j||) and the cohort coherence
  c_cohort = (1/m) sum_{i != j} lambda_i lambda_j c_ij with m = K (the paper's cohort size). A
  client whose update is exactly zero has no direction: its cosines are taken as 0.
- **Distances between client models** ("Averaging is probably not the optimum way", Xiao et al.):
  Euclidean ||theta_i - theta_j||_2, Manhattan ||theta_i - theta_j||_1 and Chebyshev
  ||theta_i - theta_j||_inf. They are computed as g_j - g_i (the same vector, since both models
  start from w), which avoids subtracting two large, nearly equal parameter vectors.
- **Gaussian mutual information** between client parameter vectors. The paper draws many samples of
  each client's parameter vector by retraining; a federated round gives one model per client. So,
  for each pair of clients (i, j), the S coordinates of a *fixed random subset* (drawn once per
  run, seeded) are treated as S samples (x_s, y_s) = (theta_i[s], theta_j[s]) of one 2-D Gaussian
  (X, Y). With Sigma the 2 x 2 sample covariance of those pairs::

      I(X; Y) = H(X) + H(Y) - H(X, Y)
              = 1/2 [log det Sigma_X + log det Sigma_Y - log det Sigma_XY]   (the 2 pi e cancel)
              = -1/2 log(1 - rho^2)                                          (in nats)

  where rho is the Pearson correlation of the sampled coordinates of the two clients. The same
  estimate over the updates g_k (``update`` MI) is reported too: the parameters of all clients
  share w, which dominates their correlation; the updates show what the clients learned.

Every function is vectorised over coordinates; loops run over tensors and over clients only.
Work on a tensor is cut into column chunks of ``CHUNK_ELEMENTS`` coordinates so that the working
set stays K x CHUNK_ELEMENTS float64 values whatever the model size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from beyond_averaging.strategies.replies.wire import ClientReply

from .aggregate import NDArrayDict, as_numpy, is_floating

FloatMatrix = npt.NDArray[np.float64]

#: Coordinates per client processed at once: bounds the working set to K x 2^20 float64 values
#: (8 MiB per client) however large a tensor is.
CHUNK_ELEMENTS = 1 << 20

#: 1 - rho^2 is floored here, so that two identical sampled vectors (rho = 1) give a large, finite
#: mutual information (-1/2 log 1e-12 = 13.8 nats) instead of infinity in the metrics file.
MIN_ONE_MINUS_RHO_SQUARED = 1e-12

#: Prefix of every metric this module writes into a round's metrics.
METRIC_PREFIX = "diag-"


@dataclass(frozen=True)
class PairwiseStatistics:
    """Pairwise quantities of K clients' updates (all K x K, symmetric, float64).

    Attributes
    ----------
    gram : ndarray
        Inner products <g_i, g_j>.
    euclidean, manhattan, chebyshev : ndarray
        L2, L1 and L-infinity distances between client models (zero diagonal).
    """

    gram: FloatMatrix
    euclidean: FloatMatrix
    manhattan: FloatMatrix
    chebyshev: FloatMatrix


def _update_chunks(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
) -> Any:
    """Yield (K, c) float64 blocks of the updates g_k = w - theta_k, tensor by tensor."""
    for key in keys:
        reference = as_numpy(global_arrays[key]).reshape(-1)
        flat = [as_numpy(arrays[key]).reshape(-1) for arrays in client_arrays]
        for start in range(0, reference.size, CHUNK_ELEMENTS):
            stop = min(start + CHUNK_ELEMENTS, reference.size)
            block = np.stack([theta[start:stop] for theta in flat]).astype(np.float64)
            yield reference[start:stop].astype(np.float64) - block


def pairwise_statistics(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
) -> PairwiseStatistics:
    """Gram matrix of the updates and the three distances between client models.

    Parameters
    ----------
    global_arrays : Mapping[str, array]
        The global model w sent this round.
    client_arrays : Sequence[Mapping[str, array]]
        Each client's trained model theta_k (at least the tensors named in ``keys``).
    keys : Sequence[str]
        The tensors that enter (the model's trainable parameters).

    Returns
    -------
    PairwiseStatistics
        K x K matrices; distances are over the concatenation of the ``keys`` tensors.
    """
    count = len(client_arrays)
    gram = torch.zeros((count, count), dtype=torch.float64)
    squared, manhattan, chebyshev = torch.zeros_like(gram), torch.zeros_like(gram), gram.clone()
    for block in _update_chunks(global_arrays, client_arrays, keys):
        # torch.cdist runs each pairwise reduction in one pass without (K, K, c) temporaries;
        # the Euclidean one without the Gram-matrix shortcut, whose cancellation loses digits.
        updates = torch.from_numpy(block)
        gram += updates @ updates.T
        exact = "donot_use_mm_for_euclid_dist"
        squared += torch.cdist(updates, updates, p=2.0, compute_mode=exact).square()
        manhattan += torch.cdist(updates, updates, p=1.0)
        torch.maximum(chebyshev, torch.cdist(updates, updates, p=math.inf), out=chebyshev)
    return PairwiseStatistics(
        gram.numpy(), squared.sqrt().numpy(), manhattan.numpy(), chebyshev.numpy()
    )


def cosine_matrix(gram: FloatMatrix) -> FloatMatrix:
    """Pairwise cosine similarities from a Gram matrix; 0 for a client whose update is zero."""
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    denominator = np.outer(norms, norms)
    cosine: FloatMatrix = np.zeros_like(gram)
    np.divide(gram, denominator, out=cosine, where=denominator > 0.0)
    np.clip(cosine, -1.0, 1.0, out=cosine)  # rounding may step just past +-1
    return cosine


def cohort_coherence(cosine: FloatMatrix, weights: Sequence[float] | npt.NDArray[Any]) -> float:
    """FedLAW's c_cohort = (1/m) sum_{i != j} lambda_i lambda_j cos(g_i, g_j), m = cohort size."""
    lambdas = np.asarray(weights, dtype=np.float64)
    if cosine.shape != (lambdas.size, lambdas.size):
        raise ValueError(f"cosine matrix {cosine.shape} does not match {lambdas.size} weights")
    off_diagonal = cosine - np.diag(np.diag(cosine))
    return float(lambdas @ off_diagonal @ lambdas) / lambdas.size


def gaussian_mutual_information(samples_x: npt.ArrayLike, samples_y: npt.ArrayLike) -> float:
    """I(X; Y) = H(X) + H(Y) - H(X, Y) of jointly Gaussian X, Y from their sample covariance.

    Parameters
    ----------
    samples_x : array of shape (N,) or (N, dx)
        N samples of X (one row per sample).
    samples_y : array of shape (N,) or (N, dy)
        The N paired samples of Y.

    Returns
    -------
    float
        The mutual information in nats: 1/2 (log det S_X + log det S_Y - log det S_XY), the
        Gaussian entropies' 2 pi e factors cancelling. ``inf`` when S_XY is singular while S_X and
        S_Y are not (a deterministic relation), ``nan`` when S_X or S_Y is singular.
    """
    x = np.asarray(samples_x, dtype=np.float64)
    y = np.asarray(samples_y, dtype=np.float64)
    x, y = x.reshape(len(x), -1), y.reshape(len(y), -1)
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need at least 2 paired samples, got {len(x)} and {len(y)}")
    joint = np.cov(np.hstack([x, y]), rowvar=False).reshape(x.shape[1] + y.shape[1], -1)
    dx = x.shape[1]
    sign_x, logdet_x = np.linalg.slogdet(joint[:dx, :dx])
    sign_y, logdet_y = np.linalg.slogdet(joint[dx:, dx:])
    sign_xy, logdet_xy = np.linalg.slogdet(joint)
    if sign_x <= 0 or sign_y <= 0:
        return math.nan
    if sign_xy <= 0:
        return math.inf
    return 0.5 * float(logdet_x + logdet_y - logdet_xy)


def pairwise_gaussian_mutual_information(samples: npt.ArrayLike) -> FloatMatrix:
    """Pairwise 2-D Gaussian MI between the rows of ``samples`` (K clients x S coordinates).

    For every pair (i, j) the S columns are S samples of (X, Y) = (row i, row j):
    I_ij = 1/2 (log var_i + log var_j - log(var_i var_j - cov_ij^2)) = -1/2 log(1 - rho_ij^2),
    with 1 - rho^2 floored at ``MIN_ONE_MINUS_RHO_SQUARED``. The diagonal and the pairs involving
    a constant row (zero variance: no correlation is defined) are NaN.
    """
    matrix = np.asarray(samples, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[1] < 2:
        raise ValueError(f"need a (clients, coordinates >= 2) matrix, got shape {matrix.shape}")
    covariance = np.atleast_2d(np.cov(matrix))
    variance = np.diag(covariance)
    product = np.outer(variance, variance)
    with np.errstate(divide="ignore", invalid="ignore"):
        one_minus_rho_squared = 1.0 - covariance**2 / product
        information = -0.5 * np.log(np.maximum(one_minus_rho_squared, MIN_ONE_MINUS_RHO_SQUARED))
    information[~(product > 0.0)] = np.nan
    np.fill_diagonal(information, np.nan)
    return information


def sample_coordinates(
    sizes: Mapping[str, int], count: int, seed: int
) -> dict[str, npt.NDArray[np.int64]]:
    """A fixed random subset of ``count`` coordinates over the concatenated tensors.

    Parameters
    ----------
    sizes : Mapping[str, int]
        Number of elements of each tensor, in concatenation order.
    count : int
        Coordinates wanted (all of them when the tensors hold fewer).
    seed : int
        Seeds the draw: the same seed and sizes give the same coordinates.

    Returns
    -------
    dict
        Per tensor, the sorted flat indices drawn inside it (tensors with none are left out).
    """
    if count < 2:
        raise ValueError(f"mutual information needs at least 2 coordinates, got {count}")
    names = list(sizes)
    offsets = np.cumsum([0, *(int(sizes[name]) for name in names)])
    total = int(offsets[-1])
    drawn = np.sort(
        np.random.default_rng(seed).choice(total, size=min(count, total), replace=False)
    )
    owner = np.searchsorted(offsets, drawn, side="right") - 1
    return {
        names[index]: (drawn[owner == index] - offsets[index]).astype(np.int64)
        for index in np.unique(owner)
    }


def gather_coordinates(
    client_arrays: Sequence[Mapping[str, Any]],
    coordinates: Mapping[str, npt.NDArray[np.int64]],
    reference: Mapping[str, Any] | None = None,
) -> FloatMatrix:
    """The (K, S) matrix of the chosen coordinates of each client (minus ``reference`` if given)."""
    columns = []
    for key, flat_indices in coordinates.items():
        rows = np.stack(
            [as_numpy(arrays[key]).reshape(-1)[flat_indices] for arrays in client_arrays]
        )
        if reference is not None:
            rows = as_numpy(reference[key]).reshape(-1)[flat_indices].astype(np.float64) - rows
        columns.append(rows.astype(np.float64))
    return np.hstack(columns) if columns else np.zeros((len(client_arrays), 0))


def _pair_mean(matrix: FloatMatrix) -> float:
    upper = matrix[np.triu_indices(matrix.shape[0], k=1)]
    finite = upper[np.isfinite(upper)]
    return float(finite.mean()) if finite.size else math.nan


def round_diagnostics(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    weights: Sequence[float] | npt.NDArray[Any],
    keys: Sequence[str],
    coordinates: Mapping[str, npt.NDArray[np.int64]],
) -> dict[str, float | int]:
    """All diagnostics of one round, as metrics (``diag-`` prefix; means are over pairs i < j).

    Returns
    -------
    dict
        ``diag-clients`` (K); with K >= 2 also ``diag-coherence`` (cohort value),
        ``diag-cosine-mean``, ``diag-euclidean-mean``, ``diag-manhattan-mean``,
        ``diag-chebyshev-mean``, ``diag-mi-mean`` (parameters) and ``diag-update-mi-mean``
        (updates), the MI in nats over the sampled coordinates.
    """
    metrics: dict[str, float | int] = {f"{METRIC_PREFIX}clients": len(client_arrays)}
    if len(client_arrays) < 2:
        return metrics
    statistics = pairwise_statistics(global_arrays, client_arrays, keys)
    cosine = cosine_matrix(statistics.gram)
    parameters = gather_coordinates(client_arrays, coordinates)
    updates = gather_coordinates(client_arrays, coordinates, reference=global_arrays)
    metrics.update(
        {
            f"{METRIC_PREFIX}coherence": cohort_coherence(cosine, weights),
            f"{METRIC_PREFIX}cosine-mean": _pair_mean(cosine),
            f"{METRIC_PREFIX}euclidean-mean": _pair_mean(statistics.euclidean),
            f"{METRIC_PREFIX}manhattan-mean": _pair_mean(statistics.manhattan),
            f"{METRIC_PREFIX}chebyshev-mean": _pair_mean(statistics.chebyshev),
        }
    )
    if parameters.shape[1] >= 2:
        metrics[f"{METRIC_PREFIX}mi-mean"] = _pair_mean(
            pairwise_gaussian_mutual_information(parameters)
        )
        metrics[f"{METRIC_PREFIX}update-mi-mean"] = _pair_mean(
            pairwise_gaussian_mutual_information(updates)
        )
    return metrics


class ClientDiagnostics:
    """A reply observer (see ``ContractStrategy.add_reply_observer``) writing the diagnostics.

    Parameters
    ----------
    parameter_keys : Sequence[str], optional
        The model's trainable parameters; None takes every floating tensor of the global model.
    mi_coordinates : int
        Size S of the random coordinate subset of the mutual-information estimate.
    seed : int
        Seeds that subset, drawn once (first round) and kept for the whole run.
    """

    def __init__(
        self,
        parameter_keys: Sequence[str] | None = None,
        *,
        mi_coordinates: int = 256,
        seed: int = 0,
    ) -> None:
        if mi_coordinates < 2:
            raise ValueError(f"mi_coordinates = {mi_coordinates}: allowed is >= 2")
        self.parameter_keys = list(parameter_keys) if parameter_keys is not None else None
        self.mi_coordinates = mi_coordinates
        self.seed = seed
        self.coordinates: dict[str, npt.NDArray[np.int64]] | None = None
        self._sizes: dict[str, int] = {}

    def _keys(self, global_arrays: NDArrayDict) -> list[str]:
        if self.parameter_keys is None:
            return [key for key, value in global_arrays.items() if is_floating(value)]
        unknown = sorted(set(self.parameter_keys) - set(global_arrays))
        if unknown:
            raise ValueError(
                f"diagnostics parameter keys {unknown[:5]} are not tensors of the global model"
            )
        return self.parameter_keys

    def __call__(
        self,
        server_round: int,
        global_arrays: NDArrayDict,
        replies: Sequence[ClientReply],
        weights: npt.NDArray[np.float64],
    ) -> dict[str, float | int]:
        """The round's diagnostics, with ``diag-seconds``: the time they took."""
        started = time.perf_counter()
        keys = self._keys(global_arrays)
        sizes = {key: int(global_arrays[key].size) for key in keys}
        if self.coordinates is None:
            self.coordinates = sample_coordinates(sizes, self.mi_coordinates, self.seed)
            self._sizes = sizes
        elif sizes != self._sizes:
            raise ValueError("the model's tensor sizes changed between rounds: cannot diagnose")
        metrics = round_diagnostics(
            global_arrays, [reply.arrays for reply in replies], weights, keys, self.coordinates
        )
        metrics[f"{METRIC_PREFIX}seconds"] = time.perf_counter() - started
        return metrics
