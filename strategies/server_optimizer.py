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

from .aggregate import NDArrayDict, as_numpy

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

    def state_dict(self) -> dict[str, NDArrayDict]:
        """Copies of the moments (empty for ``sgd``, and before the first step)."""
        return {
            "first-moment": {key: value.copy() for key, value in self._first_moment.items()},
            "second-moment": {key: value.copy() for key, value in self._second_moment.items()},
        }

    def load_state_dict(self, state: Mapping[str, Mapping[str, npt.NDArray[Any]]]) -> None:
        """Continue with the moments of a :meth:`state_dict`."""
        self._first_moment = {
            key: np.array(value, dtype=np.float64) for key, value in state["first-moment"].items()
        }
        self._second_moment = {
            key: np.array(value, dtype=np.float64) for key, value in state["second-moment"].items()
        }

    def step(
        self, global_arrays: Mapping[str, Any], pseudo_gradient: Mapping[str, npt.NDArray[Any]]
    ) -> NDArrayDict:
        """New values for the keys of ``pseudo_gradient``, in the global arrays' dtypes."""
        updated: NDArrayDict = {}
        for key, grad in pseudo_gradient.items():
            current = as_numpy(global_arrays[key])
            direction = self._direction(key, np.asarray(grad, dtype=np.float64))
            # w - lr * direction in float64, one buffer: the direction may be the caller's array
            # or the optimizer's state, so it is never scaled in place.
            new = np.multiply(direction, -self.lr)
            new += current
            updated[key] = new.astype(current.dtype, copy=False)
        return updated

    def _direction(self, key: str, grad: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        if self.name == "sgd":
            return grad
        if self.name == "momentum":
            velocity = self._first_moment.get(key)
            if velocity is None:
                velocity = self._first_moment[key] = grad.copy()
            else:
                velocity *= self.momentum
                velocity += grad
            return velocity
        # The moments are this optimizer's own buffers, so they are updated in place; each line
        # below allocates at most one model-sized temporary.
        if key not in self._first_moment:
            self._first_moment[key] = np.zeros_like(grad)
            self._second_moment[key] = np.zeros_like(grad)
        first, second = self._first_moment[key], self._second_moment[key]
        first *= self.beta1
        first += (1.0 - self.beta1) * grad
        second *= self.beta2
        second += (1.0 - self.beta2) * np.square(grad)
        # out= keeps an array for a 0-d tensor too, where np.sqrt alone returns a NumPy scalar.
        denominator = np.sqrt(second, out=np.empty_like(second))
        denominator += self.eps
        return np.divide(first, denominator, out=denominator)
