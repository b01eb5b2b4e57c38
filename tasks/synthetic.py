"""FedProx's Synthetic(alpha, beta), generated per device from its id: populations of any size.

Li et al. (2020), "Federated optimization in heterogeneous networks" (FedProx), define the task
per device. Device ``k`` draws

- ``u_k ~ N(0, alpha)`` and ``B_k ~ N(0, beta)``,
- its model ``W_k ~ N(u_k, 1)`` (60 x 10) and ``b_k ~ N(u_k, 1)`` (10),
- its feature mean ``v_k ~ N(B_k, 1)`` (60),

and its samples ``x ~ N(v_k, Sigma)`` with ``Sigma = diag(j^-1.2)``, labelled
``y = argmax(softmax(W_k^T x + b_k))``. As in the authors' generator, ``alpha`` and ``beta`` are
used as standard deviations (the same as variances at the usual value 1).

Every draw of device ``k`` comes from a generator seeded by ``(run seed, k)`` alone, so any
process builds any device's data from its id, in microseconds to a millisecond, with no pool
shared by the population: a device's data exists only while someone asks for it, and a
population of 1,000,000 devices costs nothing until a device is sampled. The partition is the
device (no partitioner is involved).

Where this differs from the authors' code (``generate_niid.py`` of the FedProx repository, 30
devices): device sizes follow their ``lognormal(4, 2) + 50`` but are capped at
:data:`MAX_DEVICE_SAMPLES` (LEAF's cap for its synthetic task), because the uncapped tail grows
with the population (the largest of 10^6 draws is about 10^6 samples) and one device would then
cost more than the rest of its cohort; and the server's test and proxy data are held-out samples
of a seeded set of up to :data:`SERVER_DEVICES` devices (:func:`server_heldout`), where the
authors held out 10 % of each of their 30 devices.
"""

from __future__ import annotations

import numpy as np

from .datasets import LabeledData

#: Features of a sample and classes, as in the paper.
DIMENSION = 60
NUM_CLASSES = 10
#: Device sizes: ``min(int(lognormal(SIZE_LOG_MEAN, SIZE_LOG_SIGMA)) + MIN_DEVICE_SAMPLES,
#: MAX_DEVICE_SAMPLES)``; the first two numbers and the offset are the authors'.
SIZE_LOG_MEAN = 4.0
SIZE_LOG_SIGMA = 2.0
MIN_DEVICE_SAMPLES = 50
MAX_DEVICE_SAMPLES = 1_000
#: The server's held-out data: this many samples, evenly from up to this many devices.
SERVER_SAMPLES = 2_000
SERVER_DEVICES = 100

# Independent streams of one device (its model, its size, its own samples, the server's held-out
# samples of it) and of the server's choice of devices; the numbers only keep them apart.
_DEVICE_STREAM, _SERVER_STREAM = 0x5E1, 0x5E2
_MODEL, _SIZE, _SAMPLES, _HELD_OUT = 0, 1, 2, 3
# Sigma is diagonal: x = v_k + sqrt(Sigma_jj) * standard normal draws.
_FEATURE_STD = np.arange(1, DIMENSION + 1, dtype=np.float64) ** -0.6


def _check(alpha: float, beta: float, device: int = 0) -> None:
    if alpha < 0 or beta < 0:
        raise ValueError(
            f"synthetic-alpha = {alpha} and synthetic-beta = {beta}: both must be >= 0"
        )
    if device < 0:
        raise ValueError(f"device = {device}: device ids are >= 0")


def _rng(seed: int, device: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, _DEVICE_STREAM, device, stream])


def device_size(device: int, *, seed: int) -> int:
    """How many samples device ``device`` holds (see :data:`MAX_DEVICE_SAMPLES`)."""
    _check(0.0, 0.0, device)
    drawn = int(_rng(seed, device, _SIZE).lognormal(SIZE_LOG_MEAN, SIZE_LOG_SIGMA))
    return min(drawn + MIN_DEVICE_SAMPLES, MAX_DEVICE_SAMPLES)


def device_model(
    device: int, *, alpha: float, beta: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Device ``device``'s ``(W_k, b_k, v_k)``: its labelling model and its feature mean.

    Returns
    -------
    weights : np.ndarray
        ``(60, 10)`` float64, ``N(u_k, 1)``.
    bias : np.ndarray
        ``(10,)`` float64, ``N(u_k, 1)``.
    feature_mean : np.ndarray
        ``(60,)`` float64, ``N(B_k, 1)``.
    """
    _check(alpha, beta, device)
    rng = _rng(seed, device, _MODEL)
    model_mean = rng.normal(0.0, alpha)
    feature_centre = rng.normal(0.0, beta)
    weights = rng.normal(model_mean, 1.0, size=(DIMENSION, NUM_CLASSES))
    bias = rng.normal(model_mean, 1.0, size=NUM_CLASSES)
    feature_mean = rng.normal(feature_centre, 1.0, size=DIMENSION)
    return weights, bias, feature_mean


def _samples(
    device: int, count: int, stream: int, *, alpha: float, beta: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    weights, bias, feature_mean = device_model(device, alpha=alpha, beta=beta, seed=seed)
    noise = _rng(seed, device, stream).standard_normal((count, DIMENSION))
    features = feature_mean + noise * _FEATURE_STD
    # argmax(softmax(z)) == argmax(z): softmax is monotone.
    labels = np.argmax(features @ weights + bias, axis=1).astype(np.int64)
    return features.astype(np.float32), labels


def device_data(device: int, *, alpha: float, beta: float, seed: int) -> LabeledData:
    """Device ``device``'s own samples (its whole partition), built from its id.

    Parameters
    ----------
    device : int
        The device (the client's partition id), >= 0.
    alpha, beta : float
        Spread of the devices' model means and feature means (>= 0).
    seed : int
        The run's seed; the same ``(seed, device, alpha, beta)`` gives the same data.

    Returns
    -------
    LabeledData
        ``(device_size(device), 60)`` float32 features, 10 classes.
    """
    count = device_size(device, seed=seed)
    features, labels = _samples(device, count, _SAMPLES, alpha=alpha, beta=beta, seed=seed)
    return LabeledData(features, labels, NUM_CLASSES)


def server_devices(num_devices: int, *, seed: int) -> np.ndarray:
    """The devices the server's held-out data come from: all of a population of at most
    :data:`SERVER_DEVICES`, else that many of ``0 .. num_devices - 1``, seeded; sorted."""
    if num_devices < 1:
        raise ValueError(f"num_devices = {num_devices}: a population needs at least one device")
    if num_devices <= SERVER_DEVICES:
        return np.arange(num_devices, dtype=np.int64)
    chosen = np.random.default_rng([seed, _SERVER_STREAM]).choice(
        num_devices, size=SERVER_DEVICES, replace=False
    )
    return np.sort(chosen).astype(np.int64)


def server_heldout(num_devices: int, *, alpha: float, beta: float, seed: int) -> LabeledData:
    """The server's held-out data for a population of ``num_devices`` devices.

    :data:`SERVER_SAMPLES` samples of the devices of :func:`server_devices`, as evenly as
    possible per device, each from its device's own distribution (its ``v_k`` and ``W_k``) but
    from a stream the device's own data never use: held-out samples of those devices, as the
    authors' per-device test split is. Every chosen device weighs the same, whatever its size.
    The server cuts its test and proxy sets from them (``tasks.splits.split_server_data``).

    A small population may never label some class at all (each device labels most of its
    samples alike; of 10 devices, 1-3 classes were often missing here): then no class-balanced
    proxy set exists, and the split says which classes fall short.
    """
    _check(alpha, beta)
    devices = server_devices(num_devices, seed=seed)
    counts = np.full(devices.size, SERVER_SAMPLES // devices.size)
    counts[: SERVER_SAMPLES % devices.size] += 1
    parts = [
        _samples(int(device), int(count), _HELD_OUT, alpha=alpha, beta=beta, seed=seed)
        for device, count in zip(devices, counts, strict=True)
    ]
    return LabeledData(
        np.concatenate([features for features, _ in parts]),
        np.concatenate([labels for _, labels in parts]),
        NUM_CLASSES,
    )
