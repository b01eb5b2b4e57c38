"""FedLAW's proxy set from the run config: held-out split, proxy-dir, errors before round 1."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from beyond_averaging.server.config import ConfigError, parse_run_config
from beyond_averaging.server.proxy import load_proxy_dir
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.strategies import FedLAW
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.models import build_model

DIGITS_SHAPE = (1, 8, 8)


def write_idx(path: Path, array: np.ndarray, type_code: int) -> None:
    """An IDX file written from the format's definition: 0, 0, type, ndim, big-endian sizes."""
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.tobytes()
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)


def write_proxy_dir(folder: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / "proxy-images-idx3-ubyte.gz", images.astype(np.uint8), 0x08)
    write_idx(folder / "proxy-labels-idx1-ubyte", labels.astype(np.uint8), 0x08)
    return folder


def heldout_proxy(per_class: int = 10, classes: int = 10) -> LabeledData:
    labels = np.repeat(np.arange(classes), per_class).astype(np.int64)
    return LabeledData(np.zeros((labels.size, *DIGITS_SHAPE), np.float32), labels, classes)


def resources(proxy: LabeledData) -> ServerResources:
    model = build_model("mlp", DIGITS_SHAPE, 10, seed=0)
    return ServerResources(model, proxy, torch.device("cpu"))


def test_proxy_dir_pair_is_read_scaled_by_255_with_the_run_class_count(tmp_path: Path) -> None:
    images = np.arange(3 * 8 * 8, dtype=np.uint8).reshape(3, 8, 8)
    folder = write_proxy_dir(tmp_path / "p", images, np.array([0, 2, 1]))
    data = load_proxy_dir(folder, num_classes=10, input_shape=DIGITS_SHAPE)
    assert data.num_classes == 10
    assert data.labels.tolist() == [0, 2, 1]
    assert data.features.shape == (3, 1, 8, 8)
    assert data.features[1, 0, 0, 0] == pytest.approx(64 / 255)  # pixel 64 of image 1


@pytest.mark.parametrize(
    ("shape", "labels", "message"),
    [
        ((2, 28, 28), [0, 1], r"samples of shape \(1, 28, 28\) but .* \(1, 8, 8\)"),
        ((2, 8, 8), [0, 5], r"labels up to 5 but the run's data set has 3 classes"),
    ],
)
def test_proxy_dir_that_does_not_fit_the_data_set_is_a_config_error(
    tmp_path: Path, shape: tuple[int, ...], labels: list[int], message: str
) -> None:
    folder = write_proxy_dir(tmp_path / "p", np.zeros(shape, np.uint8), np.array(labels))
    with pytest.raises(ConfigError, match=message):
        load_proxy_dir(folder, num_classes=3, input_shape=DIGITS_SHAPE)


def test_proxy_dir_without_a_label_file_is_a_config_error(tmp_path: Path) -> None:
    folder = write_proxy_dir(tmp_path / "p", np.zeros((2, 8, 8), np.uint8), np.array([0, 1]))
    (folder / "proxy-labels-idx1-ubyte").unlink()
    with pytest.raises(ConfigError, match=r"exactly one IDX label file .* found 0"):
        load_proxy_dir(folder, num_classes=10, input_shape=DIGITS_SHAPE)


def test_factory_builds_fedlaw_with_the_run_config_values() -> None:
    config = parse_run_config(
        {"strategy": "fedlaw", "fedlaw-epochs": 7, "fedlaw-lr": 0.01, "fedlaw-learn": "shrink"}
    )
    strategy = build_strategy(config, resources(heldout_proxy()))
    assert isinstance(strategy, FedLAW)
    assert (strategy.epochs, strategy.lr, strategy.learn) == (7, 0.01, "shrink")
    assert strategy.batch_size == config.fedlaw_batch_size
    assert strategy.proxy_size == 100
    assert len(strategy.proxy_batches) == 1  # the paper's 100-sample proxy set is one batch


def test_proxy_set_smaller_than_a_batch_is_a_config_error_before_round_one() -> None:
    config = parse_run_config({"strategy": "fedlaw", "proxy-per-class": 5})
    with pytest.raises(
        ConfigError,
        match=r"proxy-per-class = 5\) holds 50 samples, fewer than one batch "
        r"\(batch_size = 100, run option fedlaw-batch-size\): set batch_size <= 50, "
        r".*proxy-per-class >= 10",
    ):
        build_strategy(config, resources(heldout_proxy(per_class=5)))


def test_swa_with_shrink_only_is_a_config_error() -> None:
    config = parse_run_config({"strategy": "fedlaw", "fedlaw-learn": "shrink", "fedlaw-swa": True})
    with pytest.raises(ConfigError, match=r"swa = True \(run option fedlaw-swa\) .* 'shrink'"):
        build_strategy(config, resources(heldout_proxy()))


def test_factory_uses_proxy_dir_and_names_it_when_a_class_is_missing(tmp_path: Path) -> None:
    labels = np.repeat(np.arange(9), 12)  # no sample of class 9
    images = np.random.default_rng(0).integers(0, 256, (labels.size, 8, 8), dtype=np.uint8)
    folder = write_proxy_dir(tmp_path / "proxy", images, labels)
    config = parse_run_config(
        {"strategy": "fedlaw", "proxy-dir": str(folder), "proxy-per-class": 0}
    )
    with pytest.raises(
        ConfigError, match=rf"proxy-dir = '{folder}'.*no sample of class\(es\) \[9\]"
    ):
        build_strategy(config, resources(heldout_proxy(per_class=0)))
    write_proxy_dir(folder, images[:100], np.arange(100) % 10)
    strategy = build_strategy(config, resources(heldout_proxy(per_class=0)))
    assert isinstance(strategy, FedLAW)
    assert strategy.proxy_size == 100
    np.testing.assert_allclose(  # pixels / 255, the scale of every image data set here
        np.sort(strategy.proxy_batches[0][0].numpy().ravel()),
        np.sort(images[:100].ravel() / 255.0),
        rtol=1e-6,
    )
