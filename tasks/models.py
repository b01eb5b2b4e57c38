"""Model zoo: logistic regression, FedLAW's MLP, LeNet-5 and a small CNN with BatchNorm."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, get_args

import torch
from torch import nn

ModelName = Literal["logreg", "mlp", "lenet5", "cnn"]
MODEL_NAMES: tuple[str, ...] = get_args(ModelName)

_IMAGE_MODELS = ("lenet5", "cnn")
_MLP_HIDDEN = 200
# LeNet-5 was designed for 32x32 inputs; 28x28 images get 2 pixels of padding so that the
# first convolution keeps 28x28, as in the usual MNIST variant. Smaller inputs would shrink
# below the 5x5 kernels.
_LENET_MIN_SIDE = 28
_LENET_NATIVE_SIDE = 32
# The CNN halves the image once and then pools adaptively, so it needs at least 2x2 pixels.
_CNN_MIN_SIDE = 2


def build_model(
    name: ModelName, input_shape: tuple[int, ...], num_classes: int, *, seed: int | None = None
) -> nn.Module:
    """Build a freshly initialised classifier that outputs logits ``(batch, num_classes)``.

    Parameters
    ----------
    name : {"logreg", "mlp", "lenet5", "cnn"}
        - ``logreg``: ``Flatten`` + ``Linear``; any input shape.
        - ``mlp``: FedLAW's MLP, ``Flatten``, ``Linear(in, 200)``, ReLU,
          ``Linear(200, 200)``, ReLU, ``Linear(200, num_classes)``; any input shape.
        - ``lenet5``: LeNet-5 (ReLU, max-pooling) for ``(C, H, W)`` images with
          ``H, W >= 28``: conv 6@5x5 (padding 2 for sides below 32), pool, conv 16@5x5,
          pool, fc 120, fc 84, fc ``num_classes``.
        - ``cnn``: conv 32@3x3, ReLU, max-pool 2, conv 64@3x3, BatchNorm2d(64), ReLU,
          adaptive average pool to 2x2, ``Linear(256, num_classes)``; ``(C, H, W)`` images
          with ``H, W >= 2`` (so every image data set here, 8x8 digits included).
    input_shape : tuple of int
        Shape of one sample: ``(C, H, W)`` for images, ``(D,)`` for vectors.
    num_classes : int
        Number of output logits (>= 1).
    seed : int, optional
        When given, the initial weights depend only on it; the global torch random state
        is left untouched.

    Returns
    -------
    torch.nn.Module
        An ``nn.Sequential`` in training mode, on the CPU.

    Raises
    ------
    ValueError
        Unknown name, an image model with non-image input, an image too small for the
        model, or a non-positive size.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; allowed names are {', '.join(MODEL_NAMES)}")
    if not input_shape or any(size < 1 for size in input_shape):
        raise ValueError(f"input_shape must be non-empty with positive sizes, got {input_shape}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if name in _IMAGE_MODELS and len(input_shape) != 3:
        raise ValueError(
            f"model {name!r} needs image input of shape (C, H, W), got {input_shape}; "
            "use 'logreg' or 'mlp' for vector data"
        )
    constructors: dict[str, Callable[[], nn.Module]] = {
        "logreg": lambda: _logreg(input_shape, num_classes),
        "mlp": lambda: _mlp(input_shape, num_classes),
        "lenet5": lambda: _lenet5(input_shape, num_classes),
        "cnn": lambda: _cnn(input_shape, num_classes),
    }
    if seed is None:
        return constructors[name]()
    # fork_rng restores the global generator afterwards, so seeding a model does not
    # change the random stream of the code around it. devices=[] leaves CUDA alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return constructors[name]()


def _logreg(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def _mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), _MLP_HIDDEN),
        nn.ReLU(),
        nn.Linear(_MLP_HIDDEN, _MLP_HIDDEN),
        nn.ReLU(),
        nn.Linear(_MLP_HIDDEN, num_classes),
    )


def _lenet5(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels, height, width = input_shape
    if min(height, width) < _LENET_MIN_SIDE:
        raise ValueError(
            f"lenet5 needs images of at least {_LENET_MIN_SIDE}x{_LENET_MIN_SIDE}, got input "
            f"shape {input_shape}; use 'cnn', 'mlp' or 'logreg' for smaller images"
        )
    pad_height, pad_width = (2 if side < _LENET_NATIVE_SIDE else 0 for side in (height, width))
    feature_height = _lenet_feature_side(height, pad_height)
    feature_width = _lenet_feature_side(width, pad_width)
    return nn.Sequential(
        nn.Conv2d(channels, 6, kernel_size=5, padding=(pad_height, pad_width)),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, kernel_size=5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * feature_height * feature_width, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


def _lenet_feature_side(side: int, padding: int) -> int:
    """Side length after conv 5x5 (padded), max-pool 2, conv 5x5, max-pool 2."""
    # Floor division matches MaxPool2d's default (ceil_mode=False).
    return ((side + 2 * padding - 4) // 2 - 4) // 2


def _cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels, height, width = input_shape
    if min(height, width) < _CNN_MIN_SIDE:
        raise ValueError(
            f"cnn needs images of at least {_CNN_MIN_SIDE}x{_CNN_MIN_SIDE}, got input shape "
            f"{input_shape}; use 'mlp' or 'logreg'"
        )
    return nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        # The only BatchNorm in the zoo: it gives the federated code running-statistics
        # buffers (and num_batches_tracked) to handle.
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 2 * 2, num_classes),
    )
