"""Colored digits: a spurious color feature that predicts the label in training and not in testing.

The out-of-distribution (OOD) task of FedGMA (Tenison et al., 2021), after the colored MNIST of
Arjovsky et al. (2019), built offline from scikit-learn's digits or from MNIST IDX files.

Data sets (names accepted by :class:`tasks.federation.DataSpec` and the run configuration):

- ``colored-digits-binary`` / ``colored-mnist-binary``: label 0 for digits < 5, 1 otherwise;
  label 0 is painted red and label 1 green;
- ``colored-digits`` / ``colored-mnist``: the 10 digits, each with its own color of a palette.

Coloring rule. An image of label y gets y's color with probability 1 - f and otherwise a color
drawn uniformly among the other ones (binary: the single other color, i.e. the colors are
swapped). Features are RGB ``(N, 3, H, W)``: the grey digit times the color. ``f`` is

- training, client k of K: ``f_k = 0.1 + 0.1 * k / (K - 1)``, evenly spread over the paper's
  range [0.1, 0.2] (0.15 for a single client), so the color is a strong but client-varying cue;
- server test set (OOD): ``f = 0.9``, the colors reversed with probability 0.9;
- server proxy set (FedLAW): ``f = 0.15``, the middle of the training range (in distribution).

How it fits the federation. Clients are partitions of one pool, so the environment of a sample is
the client it lands on. The pool therefore stays grey with the *digit* as its label: the
partitioner splits on the digit (``partition="classes"`` with ``classes-per-client=2`` gives each
client exactly two digits, as in the paper's non-IID split, also for the binary task), and
:func:`client_view` colors a client's partition with that client's ``f_k`` (and maps the digit to
the binary label) only after partitioning. :func:`server_view` does the same for the server's
splits. Both are the identity for other data sets, which is all :mod:`tasks.federation` calls.

Label noise. Arjovsky et al. also flip the binary label with probability 0.25 before coloring, so
that shape predicts the label only 75 % of the time and color (80-90 %) is the better training
cue. FedGMA's paper does not state it, and its Figure 2 peaks near 80 % binary OOD accuracy,
which a 25 % noisy test label would cap at 75 %; so the federation uses no label noise.
:func:`colorize` takes ``label_noise`` for users who want the IRM setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt

from .datasets import LabeledData

ColoredDatasetName = Literal[
    "colored-digits", "colored-digits-binary", "colored-mnist", "colored-mnist-binary"
]
COLORED_DATASET_NAMES: tuple[str, ...] = get_args(ColoredDatasetName)

#: Paper's training range of the per-client color-flip probability.
TRAIN_FLIP_RANGE = (0.1, 0.2)
#: Paper's OOD test set: colors reversed with this probability.
TEST_FLIP_PROBABILITY = 0.9
#: In-distribution proxy set: the middle of the training range.
PROXY_FLIP_PROBABILITY = 0.15
#: Digits below this are the binary task's label 0.
BINARY_DIGIT_SPLIT = 5

# Binary: IRM's red and green. Ten classes: ten distinct hues (RGB in [0, 1]).
BINARY_PALETTE = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=np.float32)
TEN_CLASS_PALETTE = np.array(
    [
        [1.0, 0.0, 0.0],  # red
        [0.0, 1.0, 0.0],  # green
        [0.0, 0.0, 1.0],  # blue
        [1.0, 1.0, 0.0],  # yellow
        [1.0, 0.0, 1.0],  # magenta
        [0.0, 1.0, 1.0],  # cyan
        [1.0, 0.5, 0.0],  # orange
        [0.5, 0.0, 1.0],  # violet
        [0.0, 1.0, 0.5],  # spring green
        [1.0, 1.0, 1.0],  # white
    ],
    dtype=np.float32,
)

# Stage tags for the coloring streams, apart from tasks.federation's (1 and 2).
_CLIENT_STAGE = 3
_TEST_STAGE = 4
_PROXY_STAGE = 5


@dataclass(frozen=True)
class ColoredVariant:
    """What a colored data set name means: the grey base data set and the label set."""

    base: str
    binary: bool


COLORED_VARIANTS: dict[str, ColoredVariant] = {
    "colored-digits": ColoredVariant("digits", binary=False),
    "colored-digits-binary": ColoredVariant("digits", binary=True),
    "colored-mnist": ColoredVariant("mnist", binary=False),
    "colored-mnist-binary": ColoredVariant("mnist", binary=True),
}


def is_colored(dataset: str) -> bool:
    """Whether ``dataset`` names a colored data set."""
    return dataset in COLORED_VARIANTS


def base_dataset(dataset: str) -> str:
    """The grey data set a colored one is built from (the name itself for other data sets)."""
    variant = COLORED_VARIANTS.get(dataset)
    return dataset if variant is None else variant.base


def client_flip_probability(partition_id: int, num_partitions: int) -> float:
    """Client k's color-flip probability, 0.1 + 0.1 k / (K - 1): evenly over [0.1, 0.2]."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id={partition_id} is out of range [0, {num_partitions - 1}]")
    low, high = TRAIN_FLIP_RANGE
    if num_partitions == 1:
        return (low + high) / 2
    return low + (high - low) * partition_id / (num_partitions - 1)


def colorize(
    grey: LabeledData,
    *,
    binary: bool,
    flip_probability: float,
    rng: np.random.Generator,
    label_noise: float = 0.0,
) -> LabeledData:
    """Paint grey digit images with a label-correlated color.

    Parameters
    ----------
    grey : LabeledData
        Images ``(N, 1, H, W)`` in [0, 1] with the digit (0-9) as label.
    binary : bool
        True: label 0 for digits < 5, 1 otherwise, two colors; False: 10 labels and colors.
    flip_probability : float
        f in [0, 1]: probability that an image gets a color other than its label's.
    rng : numpy.random.Generator
        Source of the flips (the same state gives the same images).
    label_noise : float
        Probability of replacing the label by a uniformly drawn other one before coloring
        (Arjovsky et al. use 0.25 in the binary task); 0 keeps the labels.

    Returns
    -------
    LabeledData
        Features ``(N, 3, H, W)`` float32 in [0, 1]; 2 or 10 classes.
    """
    if grey.features.ndim != 4 or grey.features.shape[1] != 1:
        raise ValueError(
            f"colorize needs grey images of shape (N, 1, H, W), got {grey.features.shape}"
        )
    if grey.num_classes != len(TEN_CLASS_PALETTE):
        raise ValueError(f"colorize needs the 10 digits as labels, got {grey.num_classes} classes")
    for name, value in (("flip_probability", flip_probability), ("label_noise", label_noise)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} = {value}: allowed is [0, 1]")
    palette = BINARY_PALETTE if binary else TEN_CLASS_PALETTE
    num_colors = len(palette)
    labels = (grey.labels >= BINARY_DIGIT_SPLIT).astype(np.int64) if binary else grey.labels
    labels = _replace_some(labels, label_noise, num_colors, rng)
    colors = _replace_some(labels, flip_probability, num_colors, rng)
    features = grey.features * palette[colors][:, :, None, None]
    return LabeledData(features.astype(np.float32, copy=False), labels, num_colors)


def _replace_some(
    values: npt.NDArray[np.int64], probability: float, num_values: int, rng: np.random.Generator
) -> npt.NDArray[np.int64]:
    """Replace each value, with ``probability``, by one drawn uniformly among the others."""
    replace = rng.random(values.shape[0]) < probability
    # An offset in 1..num_values-1 (mod num_values) never lands back on the value itself.
    offsets = rng.integers(1, num_values, size=values.shape[0]) if num_values > 1 else 0
    return np.where(replace, (values + offsets) % num_values, values).astype(np.int64)


def _stream(seed: int, stage: int, index: int = 0) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, stage, index]))


def client_view(
    dataset: str, grey_partition: LabeledData, partition_id: int, num_partitions: int, seed: int
) -> LabeledData:
    """A client's training data: its grey partition colored with its own flip probability.

    The identity for data sets that are not colored.
    """
    variant = COLORED_VARIANTS.get(dataset)
    if variant is None:
        return grey_partition
    return colorize(
        grey_partition,
        binary=variant.binary,
        flip_probability=client_flip_probability(partition_id, num_partitions),
        rng=_stream(seed, _CLIENT_STAGE, partition_id),
    )


def server_view(
    dataset: str, grey_test: LabeledData, grey_proxy: LabeledData, seed: int
) -> tuple[LabeledData, LabeledData]:
    """The server's splits: an OOD test set (colors reversed w.p. 0.9), an in-distribution proxy.

    The identity for data sets that are not colored.
    """
    variant = COLORED_VARIANTS.get(dataset)
    if variant is None:
        return grey_test, grey_proxy
    test = colorize(
        grey_test,
        binary=variant.binary,
        flip_probability=TEST_FLIP_PROBABILITY,
        rng=_stream(seed, _TEST_STAGE),
    )
    proxy = colorize(
        grey_proxy,
        binary=variant.binary,
        flip_probability=PROXY_FLIP_PROBABILITY,
        rng=_stream(seed, _PROXY_STAGE),
    )
    return test, proxy
