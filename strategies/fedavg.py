"""FedAvg (McMahan et al., 2017) on the project's strategy base, with an optional server optimizer.

With ``server_lr = 1`` and the ``sgd`` server optimizer the new global model is exactly the
data-size-weighted average of the client models; otherwise the mean update D = w - avg goes through
the server optimizer (FedAvgM with ``momentum``, FedAdam with ``adam``). :class:`FedAvgM` and
:class:`FedAdam` are the same under the argument names of Flower's strategies of those names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from logging import INFO
from typing import Any, Unpack

import numpy as np
import numpy.typing as npt
from flwr.app import Array, ArrayRecord
from flwr.common import log

from beyond_averaging.tasks.protocol import ARRAYS_RECORD, CONFIG_RECORD, NUM_EXAMPLES_KEY

from .aggregate import (
    NDArrayDict,
    as_numpy_dict,
    is_floating,
    normalise_weights,
    pseudo_gradient,
    scaled_mean,
    scaled_weights,
    weighted_mean,
)
from .base import ClientReply
from .defended import DefendedStrategy, RootSetOptions
from .metrics import MetricsAggregationFn
from .robust import COORDINATE_WISE, aggregate_robust
from .server_optimizer import ServerOptimizer, ServerOptimizerName


def aggregate_fedavg(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    weights: Sequence[float] | npt.NDArray[Any],
    optimizer: ServerOptimizer | None = None,
    scales: Sequence[float] | npt.NDArray[Any] | None = None,
) -> NDArrayDict:
    """FedAvg: p-weighted mean of client models, or a server-optimizer step along w - mean.

    Parameters
    ----------
    global_arrays : Mapping[str, array]
        The global model w sent this round (numpy arrays or torch tensors).
    client_arrays : Sequence[Mapping[str, array]]
        Each client's trained model theta_k, keyed like ``global_arrays``.
    weights : Sequence[float]
        Client example counts n_k (normalised here to p_k).
    optimizer : ServerOptimizer, optional
        None, or plain SGD with lr 1, returns the weighted mean itself.
    scales : Sequence[float], optional
        s_k in (0, 1]: client k counts as w + s_k (theta_k - w), its update clipped
        (:func:`strategies.influence.clip_scales`); None is all ones.
    """
    probabilities = normalise_weights(weights)
    if optimizer is None or (optimizer.name == "sgd" and optimizer.lr == 1.0):
        return scaled_mean(global_arrays, client_arrays, probabilities, scales)
    global_np = as_numpy_dict(global_arrays)
    float_keys = [key for key, value in global_np.items() if is_floating(value)]
    # Integer buffers (BatchNorm's counter) are averaged; only floating tensors take the step.
    counters = [key for key in global_np if key not in set(float_keys)]
    average = weighted_mean(client_arrays, probabilities, keys=counters) if counters else {}
    update = pseudo_gradient(
        global_np, client_arrays, scaled_weights(probabilities, scales), keys=float_keys
    )
    stepped = {**average, **optimizer.step(global_np, update)}
    return {key: stepped[key] for key in global_np}  # the model's tensor order


class FedAvg(DefendedStrategy):
    """Federated Averaging with data-size weights and an optional server learning rate/optimizer.

    Parameters
    ----------
    server_lr : float
        Step along the mean update; 1.0 with ``sgd`` is plain averaging.
    server_optimizer : {"sgd", "momentum", "adam"}
        How the mean update is applied (FedAvg / FedAvgM / FedAdam).
    server_momentum, server_beta1, server_beta2, server_eps : float
        The server optimizer's hyper-parameters.
    model, proxy_set, device
        The root set of ``robust_aggregation = "fltrust"``
        (:class:`~strategies.defended.DefendedStrategy`).

    Flower's ``FedAvg`` arguments come first, positionally or by name, in its order
    (:class:`~strategies.arguments.FlowerOptions`); the arguments above and this project's extras
    (:class:`~strategies.arguments.ProjectOptions`) are keyword-only.
    """

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
        self.optimizer = ServerOptimizer(
            server_optimizer, server_lr, server_momentum, server_beta1, server_beta2, server_eps
        )

    def privacy_noise_gap(self) -> str | None:
        """None for the plain mean with a server step <= 1 (see :mod:`strategies.privacy`)."""
        if self.robust_aggregation != "none":
            return (
                f"robust_aggregation = {self.robust_aggregation!r} replaces the mean with a "
                "coordinate-wise order statistic, a selection of the replies made from all of "
                "them, or trust weights, which one client's clipped update can move by more "
                "than clipping_norm / num_sampled_clients"
            )
        if self.optimizer.name == "adam":
            return (
                "Adam divides each coordinate of the mean update by the root of its second "
                "moment, so a step's size does not scale with clipping_norm: one client's "
                "clipped update can move each coordinate by about the server learning rate"
            )
        if self.optimizer.name == "momentum" and self.optimizer.momentum != 0.0:
            return (
                "server momentum replays every round's noise-free mean update in all later "
                "models (v <- momentum * v + D), so one client's update is released again in "
                "each later round, scaled by momentum^j: about 1 / (1 - momentum^2) times "
                "FedAvg's privacy loss (5.3 at momentum 0.9)"
            )
        if self.optimizer.lr > 1.0:
            return (
                f"the server step {self.optimizer.lr:g} > 1 scales the mean, and so one "
                "client's clipped update, by that factor"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        """The server optimizer's moments."""
        return {"optimizer": self.optimizer.state_dict(), **self._bounds_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue with a checkpoint's server-optimizer moments."""
        self.optimizer.load_state_dict(self._load_bounds_state(state)["optimizer"])

    def aggregate_rule(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        """Weighted mean (or server-optimizer step) over the valid replies, their updates clipped.

        Robust form: with ``robust_aggregation`` "trimmed-mean" or "median" the coordinate-wise
        robust mean of the (clipped) updates replaces their weighted mean, and the server
        optimizer steps along it; "krum" / "multi-krum" / "flame" left only their selection in
        ``replies`` (:class:`~strategies.base.ContractStrategy`), averaged as usual (FLAME's
        noise added); "fltrust" averages the trusted replies with their trust as weights, each
        update rescaled to the trusted updates' median norm (FLTrust's aggregate but for that
        length), and the server optimizer steps along that
        (:class:`~strategies.defended.DefendedStrategy`).
        """
        scales = [reply.update_scale for reply in replies]
        if self.robust_aggregation in COORDINATE_WISE:
            return aggregate_robust(
                global_arrays,
                [reply.arrays for reply in replies],
                self.robust_aggregation,
                self.trim_fraction,
                self.optimizer,
                scales,
            )
        return aggregate_fedavg(
            global_arrays,
            [reply.arrays for reply in replies],
            np.array([reply.num_examples for reply in replies], dtype=np.float64),
            self.optimizer,
            scales,
        )


class FedAvgM(FedAvg):
    """FedAvg with server momentum under the names of Flower's ``FedAvgM`` (Hsu et al., 2019).

    Same arguments, defaults and update as ``flwr.serverapp.strategy.FedAvgM``: with the mean
    update D = w - sum_k p_k theta_k, ``v <- server_momentum * v + D`` (v = D in the first round)
    and ``w <- w - server_learning_rate * v``; the defaults (1.0, 0.0) are plain FedAvg. It is
    :class:`FedAvg` with ``server_optimizer="momentum"``. One difference: integer buffers
    (BatchNorm's counter) are averaged, not stepped.

    Parameters
    ----------
    server_learning_rate : float
        Server step size (Flower's ``server_learning_rate``).
    server_momentum : float
        Server momentum (Flower's ``server_momentum``); 0 turns momentum off.

    All of Flower's arguments are taken positionally or by name in its order; this project's
    extras (:class:`~strategies.arguments.ProjectOptions`) are keyword-only. Flower's attributes are
    there too: ``server_opt``, ``current_arrays`` and ``momentum_vector`` (read-only views of the
    server optimizer's state).
    """

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
        server_learning_rate: float = 1.0,
        server_momentum: float = 0.0,
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
            server_lr=server_learning_rate,
            server_optimizer="momentum" if server_momentum != 0.0 else "sgd",
            server_momentum=server_momentum,
            **options,
        )

    # Flower's attribute names, read and written through to the server optimizer, so that
    # changing one between rounds (as Flower's FedAvgM allows) changes the next step.
    @property
    def server_learning_rate(self) -> float:
        """Server step size (Flower's ``server_learning_rate``)."""
        return self.optimizer.lr

    @server_learning_rate.setter
    def server_learning_rate(self, value: float) -> None:
        self.optimizer.lr = value

    @property
    def server_momentum(self) -> float:
        """Server momentum (Flower's ``server_momentum``); 0 steps without a momentum buffer."""
        return self.optimizer.momentum

    @server_momentum.setter
    def server_momentum(self, value: float) -> None:
        self.optimizer.momentum = value
        # As Flower: no momentum buffer while the momentum is 0; one starts at v = D when set.
        self.optimizer.name = "momentum" if value != 0.0 else "sgd"

    @property
    def server_opt(self) -> bool:
        """Flower's flag: whether the step differs from plain averaging."""
        return self.server_momentum != 0.0 or self.server_learning_rate != 1.0

    @property
    def current_arrays(self) -> ArrayRecord | None:
        """Flower's name for the global model the round's step starts from (None before)."""
        if not self.global_arrays:
            return None
        return ArrayRecord({key: Array(value) for key, value in self.global_arrays.items()})

    @property
    def momentum_vector(self) -> list[npt.NDArray[Any]] | None:
        """Flower's name for the momentum buffer v, one array per floating tensor (None before).

        Integer buffers (BatchNorm's counter) are averaged, not stepped, so they have none.
        """
        moments = self.optimizer.state_dict()["first-moment"]
        return list(moments.values()) if moments else None


class FedAdam(FedAvg):
    """FedAdam (Reddi et al., 2021) under the names of Flower's ``FedAdam``.

    Same arguments and defaults as ``flwr.serverapp.strategy.FedAdam``. With
    delta = sum_k p_k theta_k - w: ``m <- beta_1 m + (1 - beta_1) delta``,
    ``v <- beta_2 v + (1 - beta_2) delta^2``, ``w <- w + eta * m / (sqrt(v) + tau)``. It is
    :class:`FedAvg` with ``server_optimizer="adam"`` (``eta`` = ``server_lr``, ``beta_1`` /
    ``beta_2`` = ``server_beta1`` / ``server_beta2``, ``tau`` = ``server_eps``).

    As in Flower, the step of server round t is ``eta`` times Adam's bias correction
    sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1)) (0.74 in round 1 at the defaults, tending to 1),
    so it gives Flower's numbers; ``FedAvg(server_optimizer="adam")`` is the paper's Algorithm 2
    without that factor. Where the meaning differs from Flower's:

    - ``eta_l`` (the clients' learning rate) is stored and logged but, as in Flower, not sent to
      the clients: their learning rate is the ClientApp's own;
    - integer buffers (BatchNorm's counter) are averaged, not stepped.

    Parameters
    ----------
    eta : float
        Server learning rate.
    eta_l : float
        Client learning rate, informational (see above).
    beta_1, beta_2 : float
        Decay of the first and second moments.
    tau : float
        Adaptivity: added to sqrt(v) in the denominator.

    Flower's ``FedAvg`` arguments come first, positionally or by name (Flower's ``FedAdam``
    takes them by name only); ``eta`` to ``tau`` and this project's extras
    (:class:`~strategies.arguments.ProjectOptions`) are keyword-only. Flower's attributes are there
    too: ``current_arrays``, ``m_t`` and ``v_t`` (read-only views of the server optimizer's
    state, over the floating tensors).
    """

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
        eta: float = 1e-1,
        eta_l: float = 1e-1,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-3,
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
            server_lr=eta,
            server_optimizer="adam",
            server_beta1=beta_1,
            server_beta2=beta_2,
            server_eps=tau,
            **options,
        )
        self.eta, self.eta_l = eta, eta_l

    # Flower's attribute names; beta_1, beta_2 and tau write through to the server optimizer,
    # so that changing one between rounds (as Flower's FedAdam allows) changes the next step.
    @property
    def beta_1(self) -> float:
        """Decay of the first moment."""
        return self.optimizer.beta1

    @beta_1.setter
    def beta_1(self, value: float) -> None:
        self.optimizer.beta1 = value

    @property
    def beta_2(self) -> float:
        """Decay of the second moment."""
        return self.optimizer.beta2

    @beta_2.setter
    def beta_2(self, value: float) -> None:
        self.optimizer.beta2 = value

    @property
    def tau(self) -> float:
        """Adaptivity, added to sqrt(v) in the denominator."""
        return self.optimizer.eps

    @tau.setter
    def tau(self, value: float) -> None:
        self.optimizer.eps = value

    @property
    def current_arrays(self) -> dict[str, npt.NDArray[Any]] | None:
        """Flower's name for the global model the round's step starts from (None before)."""
        return dict(self.global_arrays) if self.global_arrays else None

    @property
    def m_t(self) -> dict[str, npt.NDArray[Any]] | None:
        """Flower's first moment of delta = mean - w (this project keeps it of w - mean)."""
        moments = self.optimizer.state_dict()["first-moment"]
        return {key: -value for key, value in moments.items()} if moments else None

    @property
    def v_t(self) -> dict[str, npt.NDArray[Any]] | None:
        """Flower's second moment of delta."""
        return self.optimizer.state_dict()["second-moment"] or None

    def aggregate(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        """FedAvg's server-optimizer step with Flower's bias-corrected step size for this round."""
        self.optimizer.lr = (
            self.eta
            * math.sqrt(1.0 - self.beta_2 ** (server_round + 1))
            / (1.0 - self.beta_1 ** (server_round + 1))
        )
        return super().aggregate(server_round, global_arrays, replies)

    def summary(self) -> None:
        """Log the configuration, Flower's FedAdam names included."""
        super().summary()
        log(
            INFO,
            "\t│\t└── FedAdam: eta %s, eta_l %s (client side), beta_1 %s, beta_2 %s, tau %s",
            self.eta,
            self.eta_l,
            self.beta_1,
            self.beta_2,
            self.tau,
        )
