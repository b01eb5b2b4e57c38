"""FedAvg (McMahan et al., 2017) on the project's strategy base, with an optional server optimizer.

With ``server_lr = 1`` and the ``sgd`` server optimizer the new global model is exactly the
data-size-weighted average of the client models; otherwise the mean update D = w - avg goes through
the server optimizer (FedAvgM with ``momentum``, FedAdam with ``adam``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Unpack

import numpy as np
import numpy.typing as npt

from .aggregate import (
    NDArrayDict,
    as_numpy_dict,
    is_floating,
    normalise_weights,
    pseudo_gradient,
    weighted_mean,
)
from .base import ClientReply, ContractStrategy, StrategyOptions
from .server_optimizer import ServerOptimizer, ServerOptimizerName


def aggregate_fedavg(
    global_arrays: Mapping[str, Any],
    client_arrays: Sequence[Mapping[str, Any]],
    weights: Sequence[float] | npt.NDArray[Any],
    optimizer: ServerOptimizer | None = None,
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
    """
    probabilities = normalise_weights(weights)
    if optimizer is None or (optimizer.name == "sgd" and optimizer.lr == 1.0):
        return weighted_mean(client_arrays, probabilities, keys=list(global_arrays))
    global_np = as_numpy_dict(global_arrays)
    float_keys = [key for key, value in global_np.items() if is_floating(value)]
    # Integer buffers (BatchNorm's counter) are averaged; only floating tensors take the step.
    counters = [key for key in global_np if key not in set(float_keys)]
    average = weighted_mean(client_arrays, probabilities, keys=counters) if counters else {}
    update = pseudo_gradient(global_np, client_arrays, probabilities, keys=float_keys)
    stepped = {**average, **optimizer.step(global_np, update)}
    return {key: stepped[key] for key in global_np}  # the model's tensor order


class FedAvg(ContractStrategy):
    """Federated Averaging with data-size weights and an optional server learning rate/optimizer.

    Parameters
    ----------
    server_lr : float
        Step along the mean update; 1.0 with ``sgd`` is plain averaging.
    server_optimizer : {"sgd", "momentum", "adam"}
        How the mean update is applied (FedAvg / FedAvgM / FedAdam).
    server_momentum, server_beta1, server_beta2, server_eps : float
        The server optimizer's hyper-parameters.
    **base : Any
        Sampling and contract options of :class:`~strategies.base.ContractStrategy`.
    """

    def __init__(
        self,
        *,
        server_lr: float = 1.0,
        server_optimizer: ServerOptimizerName = "sgd",
        server_momentum: float = 0.9,
        server_beta1: float = 0.9,
        server_beta2: float = 0.99,
        server_eps: float = 1e-3,
        **base: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(**base)
        self.optimizer = ServerOptimizer(
            server_optimizer, server_lr, server_momentum, server_beta1, server_beta2, server_eps
        )

    def aggregate(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        """Weighted mean (or server-optimizer step) over the valid replies."""
        return aggregate_fedavg(
            global_arrays,
            [reply.arrays for reply in replies],
            np.array([reply.num_examples for reply in replies], dtype=np.float64),
            self.optimizer,
        )
