"""Server-side split of the held-out data into a test set and a small labelled proxy set."""

from __future__ import annotations

import numpy as np

from ._sampling import select_per_class
from .datasets import LabeledData


def split_server_data(
    heldout: LabeledData, *, proxy_per_class: int, seed: int = 0
) -> tuple[LabeledData, LabeledData]:
    """Return ``(test, proxy)`` drawn from the held-out data.

    Parameters
    ----------
    heldout : LabeledData
        Data the clients never see.
    proxy_per_class : int
        Exact number of proxy samples of every class ``0 .. num_classes - 1`` (>= 0).
        0 gives an empty proxy with the same input shape.
    seed : int
        The same seed gives the same split.

    Returns
    -------
    test : LabeledData
        Every held-out sample not in the proxy set, in held-out order.
    proxy : LabeledData
        ``proxy_per_class * num_classes`` samples, in held-out order; disjoint from
        ``test``, and together they are exactly ``heldout``.

    Raises
    ------
    ValueError
        ``proxy_per_class`` is negative, or some class has fewer held-out samples than
        ``proxy_per_class`` (the message names those classes and their counts).
    """
    if proxy_per_class < 0:
        raise ValueError(f"proxy_per_class must be >= 0, got {proxy_per_class}")
    class_counts = np.bincount(heldout.labels, minlength=heldout.num_classes)
    short_classes = np.flatnonzero(class_counts < proxy_per_class)
    if short_classes.size:
        shortfalls = ", ".join(
            f"class {label} has {class_counts[label]}" for label in short_classes.tolist()
        )
        raise ValueError(
            f"proxy_per_class={proxy_per_class} needs that many held-out samples of every "
            f"class, but {shortfalls}"
        )
    take_per_class = np.full(heldout.num_classes, proxy_per_class, dtype=np.int64)
    proxy_indices, test_indices = select_per_class(
        heldout.labels, take_per_class, np.random.default_rng(seed)
    )
    return heldout.subset(test_indices), heldout.subset(proxy_indices)
