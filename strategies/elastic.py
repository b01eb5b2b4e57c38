"""Elastic aggregation (Chen et al., CVPR 2023) on the project's strategy base.

Every participating client k sends its trained model theta_k and its parameter sensitivity Omega_k
(an exponential moving average of |d mean ||f(x)||^2 / d theta| over its batches, computed on the
received global model w before local training; see :mod:`client.sensitivity`). The server computes,
with data-size weights p_k = n_k / sum_j n_j,

- Omega = sum_k p_k Omega_k and the mean update D = sum_k p_k (w - theta_k);
- per parameter tensor: zeta = 1 + tau - Omega / (max(Omega) + 1e-13), the max taken over that
  tensor's elements only, so zeta lies in [tau, 1 + tau];
- w_new = w - server_lr * zeta * D.

Sensitive elements (large Omega) move less, insensitive ones are boosted. Tensors without a
sensitivity (BatchNorm running statistics, counters) are the p-weighted average, unscaled. The
zeta-scaled D is a pseudo-gradient: :class:`ElasticAggregation` can feed it to a server optimizer
(momentum as in FedAvgM, Adam as in FedAdam), the paper's "elastic aggregation combined with other
federated optimizers".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any, ClassVar, Literal, Unpack

import numpy as np
import numpy.typing as npt
from flwr.app import Message
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
from beyond_averaging.strategies.replies.wire import ClientReply, ReplyRejected
from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    NUM_EXAMPLES_KEY,
    SENSITIVITY_DECAY_KEY,
    SENSITIVITY_DTYPE_KEY,
    SENSITIVITY_RECORD,
)

from .aggregate import (
    NDArrayDict,
    as_numpy,
    as_numpy_dict,
    normalise_weights,
    pseudo_gradient,
    scaled_mean,
    scaled_weights,
    weighted_mean,
)
from .defended import DefendedStrategy, RootSetOptions
from .server_optimizer import ServerOptimizer, ServerOptimizerName

#: The authors' older code adds this to the per-tensor max, so that an all-zero sensitivity tensor
#: gets zeta = 1 + tau instead of 0 / 0.
MAX_GUARD = 1e-13

SensitivityDtype = Literal["float32", "float16"]

#: Shown when a reply lacks the record, and in the error that stops a round where none has it.
SENSITIVITY_HINT = (
    "ElasticAggregation needs each client's parameter sensitivity, sent as the ArrayRecord "
    "'sensitivity' keyed like 'arrays' (trainable parameters). This project's ClientApp sends it "
    "when asked; to add it to another Flower ClientApp call "
    "beyond_averaging.sensitivity_record(model, batches, message, context) on the received model "
    "before local training and put the result in the reply as content['sensitivity'] "
    "(docs/elastic.md, 'Use in an existing Flower app')."
)


def check_tau(tau: float) -> None:
    """Raise a ValueError naming ``tau`` when it lies outside [0, 1]."""
    if not 0.0 <= tau <= 1.0:
        raise ValueError(
            f"elastic tau = {tau}: allowed is [0, 1] (zeta then lies in [tau, 1 + tau]; the paper "
            "uses 0.5)"
        )


def elastic_zeta(sensitivity: npt.NDArray[Any], tau: float) -> npt.NDArray[np.float64]:
    """zeta = 1 + tau - Omega / (max(Omega) + 1e-13), the max over this one tensor's elements."""
    omega = np.asarray(sensitivity, dtype=np.float64)
    largest = float(omega.max(initial=0.0))
    zeta: npt.NDArray[np.float64] = np.divide(omega, -(largest + MAX_GUARD))
    zeta += 1.0 + tau  # in place: one model-sized buffer for zeta, not three temporaries
    return zeta


def _check_sensitivities(
    global_arrays: NDArrayDict, client_sensitivities: Sequence[Mapping[str, Any]]
) -> list[str]:
    keys = list(client_sensitivities[0])
    for index, sensitivity in enumerate(client_sensitivities):
        if set(sensitivity) != set(keys):
            raise ValueError(
                f"client {index} has sensitivity keys {sorted(sensitivity)}, client 0 has "
                f"{sorted(keys)}: every client must send the same tensors"
            )
        for key in keys:
            if key not in global_arrays:
                raise ValueError(f"sensitivity key {key!r} is not a tensor of the global model")
            if as_numpy(sensitivity[key]).shape != global_arrays[key].shape:
                raise ValueError(
                    f"client {index} sensitivity {key!r} has shape "
                    f"{as_numpy(sensitivity[key]).shape}, the global tensor "
                    f"{global_arrays[key].shape}"
                )
    return keys


def elastic_update(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    client_sensitivities: Sequence[Mapping[str, Any]],
    weights: Sequence[float] | npt.NDArray[Any],
    tau: float = 0.5,
    *,
    scales: Sequence[float] | npt.NDArray[Any] | None = None,
    sensitivity_scales: Sequence[float] | npt.NDArray[Any] | None = None,
    robust: RobustAggregation = "none",
    trim_fraction: float = 0.1,
) -> tuple[NDArrayDict, NDArrayDict, NDArrayDict]:
    """The pieces of an elastic step: zeta * D, the average of the other tensors, and zeta.

    Parameters
    ----------
    global_arrays : Mapping[str, array]
        The global model w sent this round (numpy arrays or torch tensors).
    client_arrays : Sequence[Mapping[str, array]]
        Each client's trained model theta_k, keyed like ``global_arrays``.
    client_sensitivities : Sequence[Mapping[str, array]]
        Each client's Omega_k; all with the same keys (the tensors to scale), shaped like the
        global tensors. Any float dtype (float16 included); the math runs in float64.
    weights : Sequence[float]
        Client example counts n_k (normalised here to p_k).
    tau : float
        Elasticity in [0, 1]; zeta lies in [tau, 1 + tau].
    scales, sensitivity_scales : Sequence[float], optional
        Clipping (:func:`strategies.replies.influence.clip_scales`): client k's update counts as
        s_k (theta_k - w) and its sensitivity as s'_k Omega_k. None: all ones.
    robust : {"none", "trimmed-mean", "median"}
        The robust form: D is the coordinate-wise robust mean of the (clipped) updates, Omega
        the robust mean of the sensitivities, the other tensors the robust mean of the models;
        zeta is then computed from Omega as usual. Data-size weights are not used.
    trim_fraction : float
        Share left out at each end by ``trimmed-mean``.

    Returns
    -------
    scaled_update : dict
        zeta * D in float64, for the keys that have a sensitivity.
    average : dict
        The p-weighted average of the tensors without sensitivity, in each tensor's dtype (their
        new value).
    zeta : dict
        zeta per key that has a sensitivity.
    """
    check_tau(tau)
    if len(client_sensitivities) != len(client_arrays):
        raise ValueError(
            f"{len(client_arrays)} client models but {len(client_sensitivities)} sensitivities"
        )
    global_np = as_numpy_dict(global_arrays)
    probabilities = normalise_weights(weights)
    keys = _check_sensitivities(global_np, client_sensitivities)
    scaled = set(keys)
    unscaled = [key for key in global_np if key not in scaled]
    if robust in COORDINATE_WISE:
        others = {key: global_np[key] for key in unscaled}
        average = (
            aggregate_robust(others, client_arrays, robust, trim_fraction, None, scales)
            if unscaled
            else {}
        )
        omega = robust_mean(client_sensitivities, keys, robust, trim_fraction)
        update = robust_update(global_np, client_arrays, keys, robust, trim_fraction, scales)
    else:
        average = (
            scaled_mean(global_np, client_arrays, probabilities, scales, keys=unscaled)
            if unscaled
            else {}
        )
        # float64 accumulation of any input dtype (float16 included), without a converted copy
        # of every client's sensitivity.
        omega = weighted_mean(
            client_sensitivities,
            scaled_weights(probabilities, sensitivity_scales),
            keys=keys,
            dtype=np.float64,
        )
        update = pseudo_gradient(
            global_np, client_arrays, scaled_weights(probabilities, scales), keys=keys
        )
    zeta: NDArrayDict = {}
    for key in keys:
        zeta[key] = elastic_zeta(omega.pop(key), tau)
        update[key] *= zeta[key]  # zeta * D in D's own buffer
    return update, average, zeta


def aggregate_elastic(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    client_sensitivities: Sequence[Mapping[str, Any]],
    weights: Sequence[float] | npt.NDArray[Any],
    tau: float = 0.5,
    server_lr: float = 1.0,
) -> NDArrayDict:
    """Elastic aggregation: w_new = w - server_lr * zeta * D on tensors with a sensitivity.

    Tensors without a sensitivity (BatchNorm buffers, counters) get the p-weighted average.
    Parameters as in :func:`elastic_update`; ``server_lr`` >= 0 is the server step size.

    Raises
    ------
    ValueError
        For tau outside [0, 1], a negative server_lr, sensitivities whose keys differ between
        clients or whose shapes differ from the global model, or bad example counts.
    """
    if not server_lr >= 0.0:
        raise ValueError(f"server_lr = {server_lr}: allowed is >= 0 (1.0 in the paper)")
    scaled_update, average, _ = elastic_update(
        global_arrays, client_arrays, client_sensitivities, weights, tau
    )
    stepped = {**average, **ServerOptimizer("sgd", server_lr).step(global_arrays, scaled_update)}
    return {key: stepped[key] for key in global_arrays}  # the model's tensor order


class ElasticAggregation(DefendedStrategy):
    """Elastic aggregation, optionally through a server optimizer (FedAvgM / FedAdam + Elastic).

    Parameters
    ----------
    tau : float
        Elasticity in [0, 1] (paper: 0.5).
    sensitivity_decay : float
        Decay of the clients' sensitivity moving average, sent to them each round (paper: 0.9).
    sensitivity_dtype : {"float32", "float16"}
        Dtype in which clients upload the sensitivity; float16 halves its bytes.
    parameter_keys : Collection[str], optional
        Names of the model's trainable parameters. When given, a reply whose sensitivity keys
        differ from them is dropped (``dropped-bad-sensitivity``). When None, any non-empty subset
        of the model's keys is accepted and only the keys that every valid reply of the round
        carries are zeta-scaled (the others are averaged, with a warning).
    server_lr : float
        Server step along zeta * D; 1.0 with ``sgd`` is the paper's rule.
    server_optimizer : {"sgd", "momentum", "adam"}
        How zeta * D is applied (plain step / FedAvgM momentum / FedAdam).
    server_momentum, server_beta1, server_beta2, server_eps : float
        The server optimizer's hyper-parameters.
    model, proxy_set, device
        The root set of ``robust_aggregation = "fltrust"``
        (:class:`~strategies.defended.DefendedStrategy`).

    Flower's ``FedAvg`` arguments come first, positionally or by name, in its order
    (:class:`~strategies.arguments.FlowerOptions`); the arguments above and this project's extras
    (:class:`~strategies.arguments.ProjectOptions`) are keyword-only.
    """

    required_records: ClassVar[Mapping[str, str]] = {SENSITIVITY_RECORD: SENSITIVITY_HINT}
    #: A sensitivity is a moving average of |gradient|: a negative value is a broken client.
    record_minimums: ClassVar[Mapping[str, float]] = {SENSITIVITY_RECORD: 0.0}
    #: zeta over the scaled coordinates, and on how many tensors the sensitivity was used (0:
    #: no reply carried one in common, the round was a plain average).
    round_log_fields: ClassVar[RoundLogFields] = {
        "elastic-zeta-mean": ("zeta mean", ".4f"),
        "elastic-zeta-min": ("min", ".4f"),
        "elastic-scaled-tensors": ("sensitivity on {} tensors", "d"),
    }

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
        tau: float = 0.5,
        sensitivity_decay: float = 0.9,
        sensitivity_dtype: SensitivityDtype = "float32",
        parameter_keys: Collection[str] | None = None,
        server_lr: float = 1.0,
        server_optimizer: ServerOptimizerName = "sgd",
        server_momentum: float = 0.9,
        server_beta1: float = 0.9,
        server_beta2: float = 0.99,
        server_eps: float = 1e-3,
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
        check_tau(tau)
        if not 0.0 <= sensitivity_decay < 1.0:
            raise ValueError(
                f"sensitivity_decay = {sensitivity_decay}: allowed is [0, 1) (the paper uses 0.9)"
            )
        if sensitivity_dtype not in ("float32", "float16"):
            raise ValueError(
                f"sensitivity_dtype = {sensitivity_dtype!r}: use 'float32' or 'float16'"
            )
        self.tau = tau
        self.sensitivity_decay = sensitivity_decay
        self.sensitivity_dtype: SensitivityDtype = sensitivity_dtype
        self.parameter_keys = frozenset(parameter_keys) if parameter_keys is not None else None
        self.optimizer = ServerOptimizer(
            server_optimizer, server_lr, server_momentum, server_beta1, server_beta2, server_eps
        )
        self._zeta_metrics: dict[str, float | int | list[float]] = {}

    def privacy_noise_gap(self) -> str | None:
        """Zeta comes from the replies (see :mod:`strategies.privacy`)."""
        return (
            "zeta rescales each coordinate of the mean update by a factor in [tau, 1 + tau] "
            "computed from all clients' sensitivities, each tensor normalised by its maximum: "
            "one client's sensitivity can change zeta on every coordinate, moving the model by "
            "up to about clipping_norm, not clipping_norm / num_sampled_clients"
        )

    def state_dict(self) -> dict[str, Any]:
        """The server optimizer's moments."""
        return {"optimizer": self.optimizer.state_dict(), **self._carried_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue with a checkpoint's server-optimizer moments."""
        self.optimizer.load_state_dict(self._load_carried_state(state)["optimizer"])

    def summary(self) -> None:
        """Log the configuration."""
        super().summary()
        log(
            INFO,
            "\t│\t└── tau %s, sensitivity decay %s (%s), server %s lr %s, parameter keys: %s",
            self.tau,
            self.sensitivity_decay,
            self.sensitivity_dtype,
            self.optimizer.name,
            self.optimizer.lr,
            "any subset" if self.parameter_keys is None else len(self.parameter_keys),
        )

    def train_config_entries(self) -> dict[str, int | float | str | bool]:
        """Clients need the moving-average decay and the upload dtype of the sensitivity."""
        return {
            SENSITIVITY_DECAY_KEY: self.sensitivity_decay,
            SENSITIVITY_DTYPE_KEY: self.sensitivity_dtype,
        }

    def validate_reply(self, message: Message) -> ClientReply:
        """The base contract (sensitivity finite and >= 0), plus, if known, one per parameter."""
        reply = super().validate_reply(message)
        sensitivity = reply.records[SENSITIVITY_RECORD]
        if self.parameter_keys is not None and set(sensitivity) != self.parameter_keys:
            missing = sorted(self.parameter_keys - set(sensitivity))
            extra = sorted(set(sensitivity) - self.parameter_keys)
            raise ReplyRejected(
                f"bad-{SENSITIVITY_RECORD}",
                f"record '{SENSITIVITY_RECORD}' must have one tensor per trainable parameter "
                f"(missing: {missing[:5]}, not parameters: {extra[:5]}). {SENSITIVITY_HINT}",
            )
        return reply

    def aggregate_rule(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        """Zeta-scale the mean update with the replies' sensitivities, then take a server step.

        Robust form (``robust_aggregation``): the coordinate-wise robust mean update and
        sensitivity in place of the weighted ones, then zeta as usual (:func:`elastic_update`);
        Krum / Multi-Krum / FLAME left only their selection in ``replies`` (FLAME's noise is
        added to the new model); FLTrust weighs the trusted replies' updates, rescaled to the
        trusted updates' median norm, and their (clipped) sensitivities by their trust, so D is
        FLTrust's aggregate update and Omega the trust-weighted mean sensitivity, and zeta comes
        from it.
        """
        carried = Counter(key for reply in replies for key in reply.records[SENSITIVITY_RECORD])
        keys = sorted(key for key, count in carried.items() if count == len(replies))
        partial = sorted(key for key, count in carried.items() if count < len(replies))
        if partial:
            log(
                WARNING,
                "round %d: sensitivity of %s is missing from some replies: those tensors are "
                "averaged without elastic scaling",
                server_round,
                partial[:5],
            )
        scaled_update, average, zeta = elastic_update(
            global_arrays,
            [reply.arrays for reply in replies],
            [{key: reply.records[SENSITIVITY_RECORD][key] for key in keys} for reply in replies],
            np.array([reply.num_examples for reply in replies], dtype=np.float64),
            self.tau,
            scales=[reply.update_scale for reply in replies],
            sensitivity_scales=[
                reply.record_scales.get(SENSITIVITY_RECORD, 1.0) for reply in replies
            ],
            robust=self.robust_aggregation
            if self.robust_aggregation in COORDINATE_WISE
            else "none",
            trim_fraction=self.trim_fraction,
        )
        self._zeta_metrics = _zeta_summary(zeta)
        stepped = {**average, **self.optimizer.step(global_arrays, scaled_update)}
        return {key: stepped[key] for key in global_arrays}  # the model's tensor order

    def round_metrics(self) -> dict[str, float | int | list[float]]:
        """Mean and minimum zeta over all scaled elements of the last round (and the defences')."""
        return {**super().round_metrics(), **self._zeta_metrics}


def _zeta_summary(
    zeta: Mapping[str, npt.NDArray[np.float64]],
) -> dict[str, float | int | list[float]]:
    if not zeta:
        return {"elastic-scaled-tensors": 0}
    total = sum(float(value.sum()) for value in zeta.values())
    count = sum(value.size for value in zeta.values())
    return {
        "elastic-scaled-tensors": len(zeta),
        "elastic-zeta-mean": total / max(count, 1),
        "elastic-zeta-min": min(float(value.min(initial=np.inf)) for value in zeta.values()),
    }
