"""Class-stratified sampling shared by the held-out split and the proxy split."""

from __future__ import annotations

import numpy as np


def select_per_class(
    labels: np.ndarray, take_per_class: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Randomly pick ``take_per_class[c]`` samples of every class ``c``.

    Parameters
    ----------
    labels : np.ndarray
        Integer class labels, shape ``(N,)``, values in ``[0, len(take_per_class))``.
    take_per_class : np.ndarray
        Integer array, shape ``(num_classes,)``: how many samples of each class to pick.
        Each entry must not exceed that class's count (the caller checks, so that it can
        word the error for its own context).
    rng : np.random.Generator
        Source of randomness; the same generator state gives the same selection.

    Returns
    -------
    selected : np.ndarray
        Sorted int64 indices of the picked samples.
    rest : np.ndarray
        Sorted int64 indices of every other sample (disjoint from ``selected``).
    """
    num_samples = labels.shape[0]
    # A random permutation followed by a *stable* sort by label groups the samples by
    # class while keeping a uniformly random order inside each class; taking the first
    # ``take_per_class[c]`` of each group is then a uniform draw without replacement.
    shuffled = rng.permutation(num_samples)
    grouped = shuffled[np.argsort(labels[shuffled], kind="stable")]
    grouped_labels = labels[grouped]
    class_counts = np.bincount(labels, minlength=take_per_class.shape[0])
    class_starts = np.concatenate(([0], np.cumsum(class_counts)[:-1]))
    rank_within_class = np.arange(num_samples) - class_starts[grouped_labels]
    is_selected = rank_within_class < take_per_class[grouped_labels]
    selected = np.sort(grouped[is_selected]).astype(np.int64)
    rest = np.sort(grouped[~is_selected]).astype(np.int64)
    return selected, rest
