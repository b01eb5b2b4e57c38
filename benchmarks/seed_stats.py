"""Mean and spread over seeds: one definition for every benchmark's tables and bands.

The spread is the sample standard deviation (``ddof=1``); docs/benchmarks.md ("The spec file")
says why.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


def seed_sd(values: npt.ArrayLike, axis: int = 0) -> FloatArray:
    """Sample standard deviation of ``values`` over the seeds along ``axis``: float64 of the shape
    without ``axis`` (0-d for a 1-d input); NaN for one seed."""
    array = np.asarray(values, dtype=np.float64)
    if array.shape[axis] < 2:
        return np.full(np.delete(np.array(array.shape), axis), np.nan)
    spread: FloatArray = array.std(axis=axis, ddof=1)
    return spread


def band(values: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
    """Per-round mean and sample sd of curves stacked ``(seeds, rounds)``; sd 0 for one seed."""
    curves = np.asarray(values, dtype=np.float64)
    return curves.mean(axis=0), np.nan_to_num(seed_sd(curves, axis=0), nan=0.0)


def mean_sd(values: Any, digits: int = 1) -> str:
    """``"m ± s"`` over seeds (sample sd), or ``"m"`` alone when there is one seed."""
    array = np.asarray(values, dtype=np.float64).ravel()
    mean = f"{array.mean():.{digits}f}"
    return mean if array.size < 2 else f"{mean} ± {float(seed_sd(array)):.{digits}f}"
