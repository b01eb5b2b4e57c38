"""Server optimizers that apply a pseudo-gradient D (w - mean client model) to the global model.

- ``sgd``: w <- w - lr * D (lr = 1 is plain averaging);
- ``momentum``: FedAvgM (Hsu et al., 2019): v <- beta * v + D ; w <- w - lr * v;
- ``adam``: FedAdam (Reddi et al., 2021, Algorithm 2, no bias correction):
  m <- b1 m + (1 - b1) D ; v <- b2 v + (1 - b2) D^2 ; w <- w - lr * m / (sqrt(v) + eps).

Elastic aggregation passes its zeta-scaled D here, which is how the paper combines it with other
federated optimizers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from strategies.aggregate import NDArrayDict, as_numpy

ServerOptimizerName = Literal["sgd", "momentum", "adam"]


@dataclass
class ServerOptimizer:
    """A stateful server optimizer over dicts of arrays (state persists across rounds)."""

    name: ServerOptimizerName = "sgd"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3
    _first_moment: NDArrayDict = field(default_factory=dict, repr=False)
    _second_moment: NDArrayDict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "momentum", "adam"):
            raise ValueError(
                f"server optimizer {self.name!r} is unknown: use 'sgd', 'momentum' or 'adam'"
            )
        if not self.lr >= 0:
            raise ValueError(f"server learning rate must be >= 0, got {self.lr}")

    def step(
        self, global_arrays: Mapping[str, Any], pseudo_gradient: Mapping[str, npt.NDArray[Any]]
    ) -> NDArrayDict:
        """New values for the keys of ``pseudo_gradient``, in the global arrays' dtypes."""
        updated: NDArrayDict = {}
        for key, grad in pseudo_gradient.items():
            current = as_numpy(global_arrays[key])
            direction = self._direction(key, np.asarray(grad, dtype=np.float64))
            updated[key] = (current.astype(np.float64) - self.lr * direction).astype(current.dtype)
        return updated

    def _direction(self, key: str, grad: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        if self.name == "sgd":
            return grad
        if self.name == "momentum":
            velocity = self._first_moment.get(key)
            velocity = grad.copy() if velocity is None else self.momentum * velocity + grad
            self._first_moment[key] = velocity
            return velocity
        first = self._first_moment.get(key, np.zeros_like(grad))
        second = self._second_moment.get(key, np.zeros_like(grad))
        first = self.beta1 * first + (1.0 - self.beta1) * grad
        second = self.beta2 * second + (1.0 - self.beta2) * np.square(grad)
        self._first_moment[key], self._second_moment[key] = first, second
        return first / (np.sqrt(second) + self.eps)
