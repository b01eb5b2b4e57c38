"""FedGMA: Federated Gradient Masked Averaging (Tenison, Francis and Rish, 2021), two mask variants.

Notation: K clients, p_k = n_k / sum_j n_j, w = the global model sent this round, theta_k = client
k's trained model, g_k = client k's loss gradient at its *last local step*.

Hard AND-mask (the seed paper, ``mask="hard"``)::

    w_avg = sum_k p_k theta_k
    keep  = |sum_k sign(g_k)| >= threshold * K          (per coordinate; sign(0) = 0)
    grad  = sum_k p_k keep * g_k = keep * sum_k p_k g_k
    w_new = w_avg - server_lr * grad

``server_lr = 0`` is FedAvg exactly. With ``threshold = 0.8`` a coordinate survives when
|#positive - #negative| >= 0.8 K, i.e. when at least 90 % of K non-zero votes agree.

Soft mask (the later "Gradient Masked Averaging", Tenison et al., TMLR 2023, ``mask="soft"``)::

    D_k   = w - theta_k                                 (pseudo-gradients, no gradient record)
    A     = |sum_k p_k sign(D_k)|                       (weighted sign agreement, in [0, 1])
    m     = 1 where A >= threshold, else A
    w_new = w - server_lr * m * sum_k p_k D_k

``threshold = 0`` with ``server_lr = 1`` is FedAvg exactly. Note the two variants give
``server_lr`` different roles: the hard variant adds a step to the average (0 turns it off), the
soft variant scales the masked mean update itself (1 is a full averaging step).

**Ties.** An agreement exactly at the threshold keeps the full update (``A >= threshold``,
within a 1e-9 slack for the rounding of sums of p_k): the TMLR paper's rule and the docstring of
Inria's declearn (``GradientMaskedAveraging``). declearn's code compares strictly
(``A > threshold``) and so damps a tie to ``A`` itself; the two differ only at exact ties, and
not at all at declearn's default threshold 1.0 (there m = A = 1 either way).

**Buffers.** Only parameters are masked and stepped. Normalisation buffers (tensors named like
torch's ``running_mean``, ``running_var``, ``num_batches_tracked``) and integer tensors are the
p-weighted average of the clients' values, as in every other rule here; declearn aggregates
trainable parameters only. (Running statistics are not gradients: stepping them by a masked
"update" would give statistics of no model.) The hard variant's gradient record covers
parameters only, so there too buffers are only averaged.

**Client weights.** p_k is proportional to the example count each client reports
(``num-examples``), as in the seed paper (McMahan et al.'s weighting); declearn weights by the
clients' local step counts by default, which is the same up to a per-client batch rounding
when every client runs the same epochs with the same batch size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from logging import INFO, WARNING
from typing import Any, ClassVar, Literal, NamedTuple, Unpack

import numpy as np
import numpy.typing as npt
from flwr.common import log

from beyond_averaging.strategies.defences.robust import (
    COORDINATE_WISE,
    RobustAggregation,
    aggregate_robust,
    robust_mean,
    robust_update,
)
from beyond_averaging.strategies.replies.metrics import MetricsAggregationFn
from beyond_averaging.strategies.replies.reporting import RoundLogFields
from beyond_averaging.strategies.replies.wire import ClientReply
from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    GRADIENT_RECORD,
    NUM_EXAMPLES_KEY,
)

from .aggregate import (
    NDArrayDict,
    as_numpy,
    as_numpy_dict,
    blockwise_sum,
    is_floating,
    normalise_weights,
    pseudo_gradient,
    scaled_mean,
    scaled_weights,
    weighted_mean,
)
from .defended import DefendedStrategy, RootSetOptions
from .server_optimizer import ServerOptimizer

MaskVariant = Literal["hard", "soft"]
MASK_VARIANTS: tuple[MaskVariant, ...] = ("hard", "soft")

#: Slack in the agreement comparisons: threshold * K (e.g. 0.7 * 10 = 7.000000000000001) and sums
#: of the weights p_k carry rounding errors far above this, and a true agreement gap is at least
#: 1 vote (hard) or the smallest p_k (soft), far above it too.
_AGREEMENT_TOLERANCE = 1e-9

#: Names of normalisation-layer buffers (torch's ``_NormBase``): averaged, never masked/stepped.
NORM_BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")

GRADIENT_HINT = (
    "Hard FedGMA needs each client's loss gradient at its last local step, sent as the "
    "ArrayRecord 'gradient' keyed like 'arrays'. In a Flower ClientApp, wrap the training loop: "
    "`with beyond_averaging.last_step_gradient(model) as gradient: <your training loop>`, then "
    "`content['gradient'] = gradient.record()` (docs/fedgma.md, 'Use in an existing Flower app'). "
    "This project's own ClientApp sends it when asked. Or use FedGMASoft, the soft mask on "
    "pseudo-gradients w - theta_k, which needs no gradient record."
)


class GMAStep(NamedTuple):
    """Result of one FedGMA aggregation.

    Attributes
    ----------
    arrays : dict of numpy arrays
        The new global model, keyed and typed like the global model.
    mask_mean : float
        Mean of the mask over all masked coordinates: the share of coordinates kept (hard) or the
        mean soft-mask value (soft); 1.0 means no coordinate was damped.
    """

    arrays: NDArrayDict
    mask_mean: float


class TrustVote(NamedTuple):
    """The votes of the mask under root-set trust (:func:`trusted_agreement`).

    Attributes
    ----------
    trust : array
        TS_k per trusted reply, in reply order.
    root : dict of arrays, optional
        The root set's vote, w - theta_0 (the server's pseudo-gradient).
    root_trust : float
        The root set's weight (FedGMA: the trusted replies' median trust, one typical client).
    abstaining : float
        Weight of the replies dropped as suspects (FedGMA: their count x the median trust).
    """

    trust: npt.NDArray[np.float64]
    root: Mapping[str, Any] | None = None
    root_trust: float = 1.0
    abstaining: float = 0.0


def _check_threshold(threshold: float) -> None:
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold = {threshold}: allowed is [0, 1] (the paper uses 0.8)")


def _check_same_keys(name: str, dicts: Sequence[Mapping[str, Any]]) -> list[str]:
    if not dicts:
        raise ValueError(f"need at least one client's {name}, got none")
    keys = list(dicts[0])
    for index, other in enumerate(dicts[1:], start=1):
        if set(other) != set(keys):
            raise ValueError(
                f"client {index}'s {name} keys {sorted(other)[:5]} differ from client 0's "
                f"{sorted(keys)[:5]}: pass every client's {name} over the same keys"
            )
    return keys


def hard_mask(
    gradients: Sequence[Mapping[str, Any]], threshold: float = 0.8, abstentions: int = 0
) -> dict[str, npt.NDArray[np.bool_]]:
    """The AND-mask: True where |sum_k sign(g_k)| >= threshold * (K + abstentions).

    Parameters
    ----------
    gradients : Sequence[Mapping[str, array]]
        One dict per client (numpy arrays or torch tensors), all over the same keys.
    threshold : float
        p in [0, 1]: the share of the K clients whose net sign vote must agree.
    abstentions : int
        Replies of the round that vote for no sign: those the influence bounds dropped as
        Byzantine suspects (``norm-outlier``, ``direction-outlier``). They still count in the
        quorum, so that leaving a dissenting reply out never makes agreement easier.

    Returns
    -------
    dict of bool arrays
        One mask per key; a zero gradient entry votes for neither sign.
    """
    _check_threshold(threshold)
    keys = _check_same_keys("gradient", gradients)
    voters = len(gradients) + abstentions
    ones = np.ones(len(gradients))
    # Votes are counted in integers, one int8 vote per client added into an int16 count (int32
    # beyond 32767 clients): about 5x faster than weighting each vote into float64.
    count = np.int16 if len(gradients) < np.iinfo(np.int16).max else np.int32
    return {
        key: vote_mask(
            blockwise_sum(gradients, ones, key, _shape(gradients, key), _SignVote(), count),
            voters,
            threshold,
        )
        for key in keys
    }


def vote_mask(votes: npt.NDArray[Any], voters: int, threshold: float) -> npt.NDArray[np.bool_]:
    """The AND-mask from the vote sums sum_k sign(g_k): True where |votes| >= threshold * voters.

    What :func:`hard_mask` computes from the clients' gradients, here from their summed signs
    alone (secure aggregation sums the signs under the mask, :mod:`strategies.secure`).
    """
    # Vote counts are integers, so ">= threshold * K" is ">= ceil(threshold * K)"; sums of
    # +-1 and 0 are exact in float64.
    votes_needed = math.ceil(threshold * voters - _AGREEMENT_TOLERANCE)
    kept: npt.NDArray[np.bool_] = np.abs(votes) >= votes_needed
    return kept


def soft_mask(
    updates: Sequence[Mapping[str, Any]],
    weights: Sequence[float] | npt.NDArray[Any],
    threshold: float = 0.8,
) -> dict[str, npt.NDArray[np.float64]]:
    """The soft mask: A = |sum_k p_k sign(D_k)|; 1 where A >= threshold, A elsewhere.

    Parameters
    ----------
    updates : Sequence[Mapping[str, array]]
        One dict per client (pseudo-gradients w - theta_k), all over the same keys.
    weights : Sequence[float]
        Client example counts n_k (normalised here to p_k).
    threshold : float
        tau in [0, 1]; 0 gives a mask of ones (FedAvg).

    Returns
    -------
    dict of float64 arrays
        One mask per key, values in [0, 1].
    """
    _check_threshold(threshold)
    keys = _check_same_keys("update", updates)
    probabilities = normalise_weights(weights, num_clients=len(updates))
    return {
        key: agreement_mask(
            blockwise_sum(updates, probabilities, key, _shape(updates, key), _SignVote()),
            threshold,
        )
        for key in keys
    }


def trusted_agreement(
    votes: Sequence[Mapping[str, Any]],
    trust: Sequence[float] | npt.NDArray[Any],
    key: str,
    *,
    reference: Any = None,
    root: Mapping[str, Any] | None = None,
    root_trust: float = 1.0,
    abstaining: float = 0.0,
) -> npt.NDArray[np.float64]:
    """A = (sum_k TS_k sign(v_k) + TS_0 sign(v_0)) / (sum_k TS_k + TS_0 + a) for tensor
    ``key``: the sign agreement under root-set trust, in [-1, 1] (signed; sign(0) = 0).

    Each trusted reply votes with its trust TS_k (FLTrust's ReLU(cos(u_k, g_0))), not one vote
    per reply, so a reply that keeps a small positive trust moves the agreement by at most
    TS_k / (the total weight): it cannot cancel the honest majority's agreement alone. The root
    set votes too, with ``root`` its vote v_0 (the server's own pseudo-gradient w - theta_0, whose
    sign is its loss gradient's) and ``root_trust`` its weight TS_0; None leaves it out.
    ``abstaining`` (a) is the weight of the replies left out as suspects: they vote for no sign
    but count in the quorum, so that leaving a dissenting reply out never makes agreement
    easier (as :func:`hard_mask`'s abstentions).

    Parameters
    ----------
    votes : Sequence[Mapping[str, array]]
        The replies' gradients (hard mask) or models (soft mask, with ``reference``).
    trust : Sequence[float]
        TS_k >= 0 per reply.
    key : str
        The tensor.
    reference : array, optional
        The global tensor w: the votes are then sign(w - theta_k) (the soft mask's).
    root : Mapping[str, array], optional
        The root set's vote v_0, keyed like the votes.
    root_trust : float
        TS_0.
    abstaining : float
        a >= 0.

    Returns
    -------
    float64 array
        The signed agreement, shaped like the tensor; 0 where no vote has weight.
    """
    weights = np.asarray(trust, dtype=np.float64)
    if weights.shape != (len(votes),) or np.any(weights < 0.0) or not np.all(np.isfinite(weights)):
        raise ValueError(f"need one finite trust >= 0 per vote, got {weights.tolist()}")
    term = _SignVote(None if reference is None else as_numpy(reference))
    total = blockwise_sum(votes, weights, key, _shape(votes, key), term)
    weight = float(weights.sum())
    if root is not None and root_trust > 0.0:
        total += root_trust * np.sign(as_numpy(root[key]).astype(np.float64)).reshape(total.shape)
        weight += root_trust
    weight += abstaining
    if weight > 0.0:
        total /= weight
    return total


def _shape(dicts: Sequence[Mapping[str, Any]], key: str) -> tuple[int, ...]:
    return tuple(as_numpy(dicts[0][key]).shape)


class _SignVote:
    """``weight * sign(reference - block)`` for one block (a :data:`BlockTerm`); sign(0) = 0.

    Into an integer ``out`` it writes the unweighted sign (a vote to count; ``weight`` must be 1).

    With ``reference`` w this is a client's soft-mask vote sign(w - theta_k); without one it is
    ``weight * sign(block)`` (a gradient's or an update's own sign). The sign is taken as
    ``(a > b) - (a < b)``: exact for any float dtype, and about five times faster than
    ``np.sign`` of a difference (comparisons are vectorised, ``np.sign`` is not).
    """

    def __init__(self, reference: npt.NDArray[Any] | None = None) -> None:
        self.reference = None if reference is None else reference.reshape(-1)

    def __call__(
        self, block: npt.NDArray[Any], weight: float, where: slice, out: npt.NDArray[Any]
    ) -> None:
        # Block-sized scratch per call (from the allocator's pool): blocks may be summed in
        # several threads at once.
        above, below = np.empty(block.size, np.bool_), np.empty(block.size, np.bool_)
        if self.reference is None:
            np.greater(block, 0, out=above)
            np.less(block, 0, out=below)
        else:
            np.greater(self.reference[where], block, out=above)
            np.less(self.reference[where], block, out=below)
        if out.dtype.kind == "i":  # an unweighted count (hard_mask): the vote itself
            np.subtract(above.view(np.int8), below.view(np.int8), out=out)
            return
        vote = np.empty(block.size, np.int8)
        np.subtract(above.view(np.int8), below.view(np.int8), out=vote)
        np.multiply(vote, weight, out=out)


def is_stepped(key: str, value: npt.NDArray[Any]) -> bool:
    """Whether FedGMA masks and steps a tensor: floating and not a normalisation buffer."""
    return is_floating(value) and key.rsplit(".", 1)[-1] not in NORM_BUFFER_NAMES


def agreement_mask(
    signed_agreement: npt.NDArray[np.float64], threshold: float
) -> npt.NDArray[np.float64]:
    """m = 1 where A = |sum_k p_k sign(D_k)| >= threshold, A elsewhere (in the input's buffer):
    the soft mask from the weighted sign agreement, however it was summed."""
    agreement = np.abs(signed_agreement, out=signed_agreement)
    agreement[agreement >= threshold - _AGREEMENT_TOLERANCE] = 1.0
    return agreement


def _masked_gradient_mean(
    gradients: Sequence[Mapping[str, Any]],
    probabilities: npt.NDArray[np.float64],
    threshold: float,
    robust: RobustAggregation = "none",
    trim_fraction: float = 0.1,
    abstentions: int = 0,
    trust: TrustVote | None = None,
) -> tuple[dict[str, npt.NDArray[np.float64]], float]:
    if trust is None:
        masks = hard_mask(gradients, threshold, abstentions)
    else:
        masks = {
            key: np.abs(
                trusted_agreement(
                    gradients,
                    trust.trust,
                    key,
                    root=trust.root,
                    root_trust=trust.root_trust,
                    abstaining=trust.abstaining,
                )
            )
            >= threshold - _AGREEMENT_TOLERANCE
            for key in _check_same_keys("gradient", gradients)
        }
    # The mask is one per coordinate, shared by all clients, so sum_k p_k mask(g_k) equals
    # mask * sum_k p_k g_k: one weighted mean, then one multiplication.
    masked = (
        robust_mean(gradients, list(masks), robust, trim_fraction)
        if robust in COORDINATE_WISE
        else weighted_mean(gradients, probabilities, keys=list(masks), dtype=np.float64)
    )
    for key, mask in masks.items():
        masked[key] *= mask
    kept = sum(int(mask.sum()) for mask in masks.values())
    total = sum(mask.size for mask in masks.values())
    return masked, kept / max(total, 1)


def and_mask(
    gradients: Sequence[Mapping[str, Any]],
    weights: Sequence[float] | npt.NDArray[Any],
    threshold: float = 0.8,
) -> NDArrayDict:
    """The data-size-weighted mean of the AND-masked client gradients, sum_k p_k mask(g_k).

    Parameters
    ----------
    gradients : Sequence[Mapping[str, array]]
        One dict per client (numpy arrays or torch tensors), all over the same keys.
    weights : Sequence[float]
        Client example counts n_k (normalised here to p_k).
    threshold : float
        p in [0, 1]: a coordinate is kept where |sum_k sign(g_k)| >= p * K, zeroed elsewhere.

    Returns
    -------
    dict of numpy arrays
        The masked mean gradient per key, in the dtype of the first client's gradient.
    """
    probabilities = normalise_weights(weights, num_clients=len(gradients))
    masked, _ = _masked_gradient_mean(gradients, probabilities, threshold)
    return {
        key: value.astype(as_numpy(gradients[0][key]).dtype, copy=False)
        for key, value in masked.items()
    }


def fedgma_step(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    client_gradients: Sequence[Mapping[str, Any]] | None,
    weights: Sequence[float] | npt.NDArray[Any],
    *,
    threshold: float = 0.8,
    server_lr: float = 1.0,
    mask: MaskVariant = "hard",
    scales: Sequence[float] | npt.NDArray[Any] | None = None,
    gradient_scales: Sequence[float] | npt.NDArray[Any] | None = None,
    robust: RobustAggregation = "none",
    trim_fraction: float = 0.1,
    abstentions: int = 0,
    trust: TrustVote | None = None,
) -> GMAStep:
    """One FedGMA aggregation, with the mean mask value (see :func:`aggregate_fedgma`).

    ``scales`` / ``gradient_scales`` clip the updates and the gradients
    (:func:`strategies.replies.influence.clip_scales`): client k's model counts as
    w + s_k (theta_k - w), its gradient as s'_k g_k. ``robust`` ("trimmed-mean" or "median")
    is FedGMA's robust form: the robust mean of the (clipped) models (hard) or updates (soft),
    and, hard, of the gradients, in place of the weighted means; the masks are the sign votes
    as usual (one vote per client, whatever it claims or sends). ``abstentions`` (hard): the
    round's replies dropped as Byzantine suspects, counted in the quorum (:func:`hard_mask`).
    ``trust`` (root-set trust): both masks' agreement is :func:`trusted_agreement`, each reply
    voting with its trust, the root set and the abstentions with the weights ``trust`` gives,
    in place of one vote per reply (hard) or the weights p_k (soft); ``abstentions`` is then
    not used (``trust.abstaining`` counts them).
    """
    if mask not in MASK_VARIANTS:
        raise ValueError(f"mask = {mask!r}: allowed is 'hard' or 'soft'")
    if not (math.isfinite(server_lr) and server_lr >= 0.0):
        raise ValueError(f"server_lr = {server_lr}: allowed is a finite value >= 0")
    probabilities = normalise_weights(weights, num_clients=len(client_arrays))
    global_np = as_numpy_dict(global_arrays)
    float_keys = [key for key, value in global_np.items() if is_stepped(key, value)]
    # The hard variant steps from the average; the soft one steps its parameters from w, so
    # only its buffers (normalisation statistics, counters) need the average.
    averaged = list(global_np) if mask == "hard" else [k for k in global_np if k not in float_keys]
    kept = {key: global_np[key] for key in averaged}
    if not averaged:
        average: NDArrayDict = {}
    elif robust in COORDINATE_WISE:
        average = aggregate_robust(kept, client_arrays, robust, trim_fraction, None, scales)
    else:
        average = scaled_mean(kept, client_arrays, probabilities, scales)
    if mask == "hard":
        if client_gradients is None or len(client_gradients) != len(client_arrays):
            raise ValueError(
                "mask = 'hard' needs one gradient dict per client "
                f"(got {0 if client_gradients is None else len(client_gradients)} for "
                f"{len(client_arrays)} clients); mask = 'soft' needs none"
            )
        step_keys = _check_same_keys("gradient", client_gradients)
        not_float = sorted(set(step_keys) - set(float_keys))
        if not_float:
            raise ValueError(
                f"gradient keys {not_float[:5]} are not floating parameters of the global model "
                "(normalisation buffers and integer tensors are averaged, never stepped)"
            )
        grad, mask_mean = _masked_gradient_mean(
            client_gradients,
            scaled_weights(probabilities, gradient_scales),
            threshold,
            robust,
            trim_fraction,
            abstentions,
            trust,
        )
        stepped = ServerOptimizer("sgd", server_lr).step(average, grad)
        return GMAStep({**average, **stepped}, mask_mean)
    # The soft mask and the mean update straight from the models: D_k = w - theta_k is never
    # materialised per client (K float64 models), each sum reads the client tensors once.
    mean_update = (
        robust_update(global_np, client_arrays, float_keys, robust, trim_fraction, scales)
        if robust in COORDINATE_WISE
        else pseudo_gradient(
            global_np, client_arrays, scaled_weights(probabilities, scales), keys=float_keys
        )
    )
    masks = {
        key: agreement_mask(
            blockwise_sum(
                client_arrays,
                probabilities,
                key,
                global_np[key].shape,
                _SignVote(global_np[key]),
            )
            if trust is None
            else trusted_agreement(
                client_arrays,
                trust.trust,
                key,
                reference=global_np[key],
                root=trust.root,
                root_trust=trust.root_trust,
                abstaining=trust.abstaining,
            ),
            threshold,
        )
        for key in float_keys
    }
    for key, soft in masks.items():
        mean_update[key] *= soft
    stepped = {**average, **ServerOptimizer("sgd", server_lr).step(global_np, mean_update)}
    total = sum(m.size for m in masks.values())
    mask_mean = sum(float(m.sum()) for m in masks.values()) / max(total, 1)
    return GMAStep({key: stepped[key] for key in global_np}, mask_mean)


def aggregate_fedgma(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    client_gradients: Sequence[Mapping[str, Any]] | None,
    weights: Sequence[float] | npt.NDArray[Any],
    threshold: float = 0.8,
    server_lr: float = 1.0,
    mask: MaskVariant = "hard",
) -> NDArrayDict:
    """FedGMA's new global model (formulas in the module docstring).

    Parameters
    ----------
    global_arrays : Mapping[str, array]
        The global model w sent this round (numpy arrays or torch tensors).
    client_arrays : Sequence[Mapping[str, array]]
        Each client's trained model theta_k, keyed like ``global_arrays``.
    client_gradients : Sequence[Mapping[str, array]] or None
        ``mask="hard"``: each client's last-step gradient g_k, all over the same floating keys of
        the model (keys without a gradient are only averaged). Unused (may be None) for ``soft``.
    weights : Sequence[float]
        Client example counts n_k (normalised here to p_k).
    threshold : float
        Hard: p, keep where |sum_k sign(g_k)| >= p K. Soft: tau, mask 1 where A >= tau.
    server_lr : float
        Hard: step along the masked gradient after averaging (0 = FedAvg). Soft: step along the
        masked mean pseudo-gradient from w (1 with tau = 0 = FedAvg).
    mask : {"hard", "soft"}
        The seed paper's AND-mask on gradients, or the later soft mask on pseudo-gradients.

    Returns
    -------
    dict of numpy arrays
        Same keys, shapes and dtypes as ``global_arrays``.
    """
    return fedgma_step(
        global_arrays,
        client_arrays,
        client_gradients,
        weights,
        threshold=threshold,
        server_lr=server_lr,
        mask=mask,
    ).arrays


class FedGMA(DefendedStrategy):
    """FedGMA with the seed paper's hard AND-mask on the clients' last-step gradients.

    Every train reply must carry the ArrayRecord ``gradient`` (requested through the train
    config); use :class:`FedGMASoft` for the pseudo-gradient variant that needs none.

    Parameters
    ----------
    threshold : float
        AND-mask threshold p in [0, 1] (paper: 0.8).
    server_lr : float
        Server step along the masked mean gradient (paper tried 0.01, 0.1 and 1).
    model, proxy_set, device
        The root set of ``robust_aggregation = "fltrust"``
        (:class:`~strategies.defended.DefendedStrategy`).

    Flower's ``FedAvg`` arguments come first, positionally or by name, in its order
    (:class:`~strategies.arguments.FlowerOptions`); the arguments above and this project's extras
    (:class:`~strategies.arguments.ProjectOptions`) are keyword-only.
    """

    required_records: ClassVar[Mapping[str, str]] = {GRADIENT_RECORD: GRADIENT_HINT}
    mask_variant: ClassVar[MaskVariant] = "hard"
    round_log_fields: ClassVar[RoundLogFields] = {"gma-mask-mean": ("coordinates kept", ".1%")}

    def __init__(
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = NUM_EXAMPLES_KEY,
        arrayrecord_key: str = ARRAYS_RECORD,
        configrecord_key: str = CONFIG_RECORD,
        train_metrics_aggr_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregationFn | None = None,
        *,
        threshold: float = 0.8,
        server_lr: float = 1.0,
        **options: Unpack[RootSetOptions],
    ) -> None:
        super().__init__(
            fraction_train,
            fraction_evaluate,
            min_train_nodes,
            min_evaluate_nodes,
            min_available_nodes,
            weighted_by_key,
            arrayrecord_key,
            configrecord_key,
            train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn,
            **options,
        )
        _check_threshold(threshold)
        if not (math.isfinite(server_lr) and server_lr >= 0.0):
            raise ValueError(f"server_lr = {server_lr}: allowed is a finite value >= 0")
        self.threshold = threshold
        self.server_lr = server_lr
        self.last_mask_mean = math.nan

    def privacy_noise_gap(self) -> str | None:
        """The mask comes from the replies (see :mod:`strategies.privacy`)."""
        return (
            "the mask scales each coordinate of the mean update by a value in [0, 1] computed "
            "from the signs of all clients' updates (or gradients): one client's signs can move "
            "a coordinate's mask from its agreement to 1, moving the model by up to about "
            "server_lr x clipping_norm, not clipping_norm / num_sampled_clients"
        )

    def _gradients(self, replies: Sequence[ClientReply]) -> list[NDArrayDict] | None:
        if not self.required_records:
            return None
        gradients = [reply.records[GRADIENT_RECORD] for reply in replies]
        # The contract allows each reply a subset of the model's keys; the AND-mask needs every
        # client's vote, so only keys that all replies carry get the server step.
        common = set.intersection(*(set(g) for g in gradients))
        left_out = sorted(set().union(*gradients) - common)
        if left_out:
            log(
                WARNING,
                "FedGMA: gradient tensors %s are missing from some replies: they are averaged "
                "without a masked server step this round",
                left_out[:5],
            )
        if not common:
            raise ValueError(
                "the replies' 'gradient' records share no tensor name, so no coordinate can be "
                "masked: every client must send the gradient of the same parameters"
            )
        return [{key: g[key] for key in sorted(common)} for g in gradients]

    def aggregate_rule(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        """Weighted model average plus the masked server step, over the valid replies.

        Robust form (``robust_aggregation``): see :func:`fedgma_step`; Krum / Multi-Krum /
        FLAME left only their selection in ``replies`` (FLAME's noise is added to the new
        model). FLTrust: the trusted replies only, weighted by their trust in place of p_k,
        each update rescaled to the trusted updates' median norm; the hard mask counts the trusted
        replies' gradient signs, one vote each, and the masked gradient mean is their
        trust-weighted mean; both masks' sign agreement is weighted by trust, the root set's own
        pseudo-gradient votes as one typical trusted reply (the median trust), and the replies
        left out as suspects (trust 0 among them) count in the quorum with that weight each
        (:func:`trusted_agreement`).
        """
        trust = None
        # Byzantine suspects abstain: the bounds' outliers and, under fltrust, replies of trust 0.
        suspects = self.round_bounds.suspects + self.round_defence.distrusted
        root_update = self.round_defence.root_update
        if self.robust_aggregation == "fltrust" and root_update is not None:
            scores = np.array([reply.num_examples for reply in replies], dtype=np.float64)
            typical = float(np.median(scores))
            trust = TrustVote(
                scores,
                {key: -value for key, value in root_update.items()},
                root_trust=typical,
                abstaining=suspects * typical,
            )
        result = fedgma_step(
            global_arrays,
            [reply.arrays for reply in replies],
            self._gradients(replies),
            np.array([reply.num_examples for reply in replies], dtype=np.float64),
            threshold=self.threshold,
            server_lr=self.server_lr,
            mask=self.mask_variant,
            scales=[reply.update_scale for reply in replies],
            gradient_scales=[reply.record_scales.get(GRADIENT_RECORD, 1.0) for reply in replies],
            robust=self.robust_aggregation
            if self.robust_aggregation in COORDINATE_WISE
            else "none",
            trim_fraction=self.trim_fraction,
            abstentions=suspects,
            trust=trust,
        )
        self.last_mask_mean = result.mask_mean
        return result.arrays

    def round_metrics(self) -> dict[str, float | int | list[float]]:
        """``gma-mask-mean``: share of coordinates kept (hard) or mean soft-mask value (soft)."""
        return {**super().round_metrics(), "gma-mask-mean": self.last_mask_mean}

    def summary(self) -> None:
        """Log the configuration, mask variant included."""
        super().summary()
        turned_off = self.mask_variant == "hard" and self.server_lr == 0.0
        log(
            INFO,
            "\t│\t└── mask %s, threshold %s, server lr %s%s",
            self.mask_variant,
            self.threshold,
            self.server_lr,
            " (server lr 0: this is FedAvg)" if turned_off else "",
        )


class FedGMASoft(FedGMA):
    """Gradient Masked Averaging with the soft mask on pseudo-gradients (TMLR 2023 variant).

    Needs no extra record: D_k = w - theta_k comes from the models themselves.

    Parameters
    ----------
    threshold : float
        tau in [0, 1]: mask 1 where the weighted sign agreement reaches it (0 gives FedAvg at
        ``server_lr = 1``; Inria's declearn defaults to 1.0, this project to the paper's 0.8).
    server_lr : float
        Step along the masked mean pseudo-gradient (1 is a full averaging step).

    Flower's ``FedAvg`` arguments come first, positionally or by name, in its order
    (:class:`~strategies.arguments.FlowerOptions`); the arguments above and this project's extras
    (:class:`~strategies.arguments.ProjectOptions`) are keyword-only.
    """

    required_records: ClassVar[Mapping[str, str]] = {}
    mask_variant: ClassVar[MaskVariant] = "soft"
    round_log_fields: ClassVar[RoundLogFields] = {"gma-mask-mean": ("mean mask", ".3f")}
