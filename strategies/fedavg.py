"""FedAvg (McMahan et al., 2017) on the project's strategy base, with an optional server optimizer.

With ``server_lr = 1`` and the ``sgd`` server optimizer the new global model is exactly the
data-size-weighted average of the client models; otherwise the mean update D = w - avg goes through
the server optimizer (FedAvgM with ``momentum``, FedAdam with ``adam``). :class:`FedAvgM` and
:class:`FedAdam` are the same under the argument names of Flower's strategies of those names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import INFO
from typing import Any, Generic, Literal, Self, TypeVar, Unpack, overload

import numpy as np
import numpy.typing as npt
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.common import log

from beyond_averaging.strategies.defences.robust import COORDINATE_WISE, aggregate_robust
from beyond_averaging.strategies.replies.metrics import MetricsAggregationFn
from beyond_averaging.strategies.replies.validation import default_reply_byte_limit
from beyond_averaging.strategies.replies.wire import ClientReply, record_arrays
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
from .defended import DefendedStrategy, RootSetOptions
from .server_optimizer import ServerOptimizer, ServerOptimizerName

_Value = TypeVar("_Value")


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
        (:func:`strategies.replies.influence.clip_scales`); None is all ones.
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

    def _server_step(self) -> ServerOptimizer | None:
        """The server optimizer the mean update goes through; None: the weighted mean itself
        (plain SGD with step 1 is that mean)."""
        plain = self.optimizer.name == "sgd" and self.optimizer.lr == 1.0
        return None if plain else self.optimizer

    def _needs_global_model(self) -> str | None:
        """None for the plain weighted mean, which Flower's FedAvg computes without it too."""
        if self._server_step() is not None:
            return "the server step (learning rate, momentum or Adam) starts from it"
        defences = {
            "robust_aggregation": self.robust_aggregation != "none",
            "pre_aggregation": self.pre_aggregation != "none",
            "trigger_unlearning": self.trigger_unlearning is not None,
            "server_noise_std": self.server_noise_std > 0.0,
        }
        if any(defences.values()):
            on = ", ".join(name for name, used in defences.items() if used)
            return f"{on} work on the updates theta_k - w (or on clipped ones)"
        return None

    def privacy_noise_gap(self) -> str | None:
        """None for the plain mean with a server step <= 1 (see :mod:`strategies.privacy`)."""
        if self.robust_aggregation != "none":
            return (
                f"robust_aggregation = {self.robust_aggregation!r} replaces the mean with a "
                "coordinate-wise order statistic, a selection of the replies made from all of "
                "them, or trust weights, which one client's clipped update can move by more "
                "than clipping_norm / num_sampled_clients"
            )
        step = self._server_step()
        if step is None:
            return None
        if step.name == "adam":
            return (
                "Adam divides each coordinate of the mean update by the root of its second "
                "moment, so a step's size does not scale with clipping_norm: one client's "
                "clipped update can move each coordinate by about the server learning rate"
            )
        if step.name == "momentum" and step.momentum != 0.0:
            return (
                "server momentum replays every round's noise-free mean update in all later "
                "models (v <- momentum * v + D), so one client's update is released again in "
                "each later round, scaled by momentum^j: about 1 / (1 - momentum^2) times "
                "FedAvg's privacy loss (5.3 at momentum 0.9)"
            )
        if step.lr > 1.0:
            return (
                f"the server step {step.lr:g} > 1 scales the mean, and so one "
                "client's clipped update, by that factor"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        """The server optimizer's moments."""
        return {"optimizer": self.optimizer.state_dict(), **self._carried_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue with a checkpoint's server-optimizer moments."""
        self.optimizer.load_state_dict(self._load_carried_state(state)["optimizer"])

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
                self._server_step(),
                scales,
            )
        return aggregate_fedavg(
            global_arrays,
            [reply.arrays for reply in replies],
            np.array([reply.num_examples for reply in replies], dtype=np.float64),
            self._server_step(),
            scales,
        )


class _FlowerAttribute(Generic[_Value]):
    """One of the attributes of Flower's FedAvgM or FedAdam, held in this strategy's own state.

    Flower's classes keep them as plain attributes that a user reads and sets between rounds
    (``strategy.current_arrays = ...`` before ``aggregate_train``, as Flower's tests do); here the
    server optimizer and the global model hold them, and each attribute reads and writes there,
    so that setting one changes the next step as in Flower.

    Parameters
    ----------
    read : callable
        ``read(strategy)``: the value under Flower's name and in Flower's form.
    write : callable
        ``write(strategy, value)``: what setting Flower's attribute to ``value`` means here.
    """

    def __init__(
        self, read: Callable[[FedAvg], _Value], write: Callable[[FedAvg, _Value], None]
    ) -> None:
        self._read, self._write = read, write

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> Self: ...

    @overload
    def __get__(self, instance: FedAvg, owner: type[Any]) -> _Value: ...

    def __get__(self, instance: FedAvg | None, owner: type[Any]) -> Self | _Value:
        return self if instance is None else self._read(instance)

    def __set__(self, instance: FedAvg, value: _Value) -> None:
        self._write(instance, value)


def _optimizer_number(
    field: Literal["lr", "momentum", "beta1", "beta2", "eps"],
) -> _FlowerAttribute[float]:
    """A hyper-parameter of the server optimizer under Flower's name."""

    def write(strategy: FedAvg, value: float) -> None:
        setattr(strategy.optimizer, field, value)
        if field == "momentum":
            # As Flower's FedAvgM: a momentum buffer only while the momentum is > 0; set > 0
            # again, the step goes on from the buffer it had.
            strategy.optimizer.name = "momentum" if value > 0.0 else "sgd"

    return _FlowerAttribute(lambda strategy: float(getattr(strategy.optimizer, field)), write)


def _moment(
    which: Literal["first-moment", "second-moment"], sign: float
) -> _FlowerAttribute[dict[str, npt.NDArray[Any]] | None]:
    """FedAdam's ``m_t`` / ``v_t``: a moment of the server optimizer by tensor name, times
    ``sign`` (this project keeps the first moment of w - mean, Flower of mean - w)."""

    def read(strategy: FedAvg) -> dict[str, npt.NDArray[Any]] | None:
        moments = strategy.optimizer.state_dict()[which]
        return {key: sign * value for key, value in moments.items()} or None

    def write(strategy: FedAvg, value: dict[str, npt.NDArray[Any]] | None) -> None:
        state = strategy.optimizer.state_dict()
        state[which] = {key: sign * np.asarray(array) for key, array in (value or {}).items()}
        strategy.optimizer.load_state_dict(state)  # None or {}: the moment starts at 0 again

    return _FlowerAttribute(read, write)


def _momentum_vector(strategy: FedAvg) -> list[npt.NDArray[Any]] | None:
    moments = strategy.optimizer.state_dict()["first-moment"]
    return list(moments.values()) if moments else None


def _set_momentum_vector(strategy: FedAvg, value: list[npt.NDArray[Any]] | None) -> None:
    keys = [key for key, array in strategy.global_arrays.items() if is_floating(array)]
    vectors = list(value or [])
    if vectors and len(vectors) != len(keys):
        raise ValueError(
            f"momentum_vector holds {len(vectors)} arrays, but the global model has {len(keys)} "
            "floating tensors (integer buffers have no momentum here): set it after "
            "configure_train or current_arrays has given the global model"
        )
    state = strategy.optimizer.state_dict()
    state["first-moment"] = dict(zip(keys, vectors, strict=True))  # empty: starts at v = D
    strategy.optimizer.load_state_dict(state)


def _give_global_model(strategy: FedAvg, arrays: NDArrayDict) -> None:
    """Make ``arrays`` the global model, as ``configure_train`` does: the reply bounds measure
    updates against it, the server step starts from it, and the default reply-size limit is
    sized by it. Empty: no global model (``aggregate_train`` then averages as Flower's FedAvg)."""
    strategy.global_arrays = arrays
    strategy.reply_byte_limit = strategy.max_reply_bytes or (
        default_reply_byte_limit(arrays, len(strategy.required_records)) if arrays else 0
    )


def _record_model(strategy: FedAvg) -> ArrayRecord | None:
    if not strategy.global_arrays:
        return None
    return ArrayRecord({key: Array(value) for key, value in strategy.global_arrays.items()})


def _set_record_model(strategy: FedAvg, value: ArrayRecord | None) -> None:
    if value is not None and not isinstance(value, ArrayRecord):
        raise TypeError(
            f"{type(strategy).__name__}.current_arrays is an ArrayRecord or None, as in Flower; "
            f"got {type(value).__name__}"
        )
    _give_global_model(strategy, {} if value is None else record_arrays(value))


def _dict_model(strategy: FedAvg) -> dict[str, npt.NDArray[Any]] | None:
    return dict(strategy.global_arrays) if strategy.global_arrays else None


def _set_dict_model(strategy: FedAvg, value: dict[str, npt.NDArray[Any]] | None) -> None:
    if value is not None and (isinstance(value, ArrayRecord) or not isinstance(value, Mapping)):
        raise TypeError(
            f"{type(strategy).__name__}.current_arrays is a dict of arrays or None, as in "
            f"Flower; got {type(value).__name__}"
        )
    _give_global_model(strategy, {key: np.asarray(array) for key, array in (value or {}).items()})


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
    extras (:class:`~strategies.arguments.ProjectOptions`) are keyword-only. Flower's attributes
    are there too, and set as in Flower: ``server_learning_rate``, ``server_momentum``,
    ``server_opt`` (Flower's flag, fixed at construction unless set: while it is False the new
    model is the weighted mean, whatever the two say), ``current_arrays`` (the global model the
    step starts from; after a step, the new model) and ``momentum_vector``.
    """

    #: Server step size (Flower's ``server_learning_rate``).
    server_learning_rate = _optimizer_number("lr")
    #: Server momentum (Flower's ``server_momentum``); momentum only while it is > 0.
    server_momentum = _optimizer_number("momentum")
    #: The global model the step starts from, an ArrayRecord as in Flower's FedAvgM (None before
    #: configure_train); setting it gives the global model, as ``configure_train`` does.
    current_arrays = _FlowerAttribute(_record_model, _set_record_model)
    #: The momentum buffer v, one array per floating tensor of the global model (None before).
    momentum_vector = _FlowerAttribute(_momentum_vector, _set_momentum_vector)

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
            server_optimizer="momentum" if server_momentum > 0.0 else "sgd",
            server_momentum=server_momentum,
            **options,
        )
        #: Flower's flag, computed as Flower computes it and only here: a strategy built with the
        #: defaults averages until it is set, even if the learning rate or momentum change.
        self.server_opt: bool = server_momentum != 0.0 or server_learning_rate != 1.0

    def _server_step(self) -> ServerOptimizer | None:
        return super()._server_step() if self.server_opt else None

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg's; after a server step the new model is where the next one starts, as Flower's
        FedAvgM keeps it in ``current_arrays`` (``configure_train`` gives the model sent)."""
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None and self.server_opt:
            self.current_arrays = arrays
        return arrays, metrics


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
    (:class:`~strategies.arguments.ProjectOptions`) are keyword-only. Flower's attributes are
    there too, and set as in Flower: ``eta`` to ``tau``, ``current_arrays`` (the global model
    the step starts from), ``m_t`` and ``v_t`` (over the floating tensors).
    """

    #: Decay of the first moment.
    beta_1 = _optimizer_number("beta1")
    #: Decay of the second moment.
    beta_2 = _optimizer_number("beta2")
    #: Adaptivity, added to sqrt(v) in the denominator.
    tau = _optimizer_number("eps")
    #: The global model the step starts from, a dict of arrays as in Flower's FedOpt (None
    #: before configure_train); setting it gives the global model, as ``configure_train`` does.
    current_arrays = _FlowerAttribute(_dict_model, _set_dict_model)
    #: Flower's first moment of delta = mean - w, by floating tensor (None before the first step).
    m_t = _moment("first-moment", -1.0)
    #: Flower's second moment of delta, by floating tensor (None before the first step).
    v_t = _moment("second-moment", 1.0)

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
