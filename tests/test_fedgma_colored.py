"""The colored-digits task of FedGMA's out-of-distribution benchmark (tasks/colored.py)."""

from __future__ import annotations

import numpy as np
import pytest

from beyond_averaging.server.config import parse_run_config
from beyond_averaging.tasks.colored import (
    BINARY_PALETTE,
    TEN_CLASS_PALETTE,
    client_flip_probability,
    colorize,
)
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.federation import DataSpec, load_client_partition, load_server_splits


def grey_digits(count: int, seed: int = 0) -> LabeledData:
    """Random grey 'images' with every digit equally often (enough samples for rates)."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(0.1, 1.0, size=(count, 1, 2, 2)).astype(np.float32)
    return LabeledData(images, (np.arange(count) % 10).astype(np.int64), 10)


def color_index(data: LabeledData, palette: np.ndarray) -> np.ndarray:
    """Which palette color each image was painted with (the channel pattern of a pixel)."""
    pixel = data.features[:, :, 0, 0] / data.features[:, :, 0, 0].max(axis=1, keepdims=True)
    distances = np.abs(pixel[:, None, :] - palette[None, :, :]).sum(axis=2)
    return np.argmin(distances, axis=1)


def spec(dataset: str, partition: str = "iid", clients: int = 5) -> DataSpec:
    return DataSpec(
        dataset=dataset,
        data_dir="",
        partition=partition,
        dirichlet_alpha=0.5,
        classes_per_partition=2,
        num_partitions=clients,
        seed=0,
        proxy_per_class=2,
    )


def test_binary_labels_are_digit_at_least_5_and_colors_follow_them_at_one_minus_f() -> None:
    grey = grey_digits(20_000)
    colored = colorize(grey, binary=True, flip_probability=0.15, rng=np.random.default_rng(1))
    np.testing.assert_array_equal(colored.labels, (grey.labels >= 5).astype(np.int64))
    assert colored.num_classes == 2
    assert colored.input_shape == (3, 2, 2)
    agreement = np.mean(color_index(colored, BINARY_PALETTE) == colored.labels)
    assert agreement == pytest.approx(0.85, abs=0.01)  # std of the rate is 0.0025
    # The digit's shape survives: the brightest channel is the grey image itself.
    np.testing.assert_allclose(colored.features.max(axis=1), grey.features[:, 0])


def test_ten_class_flips_go_to_a_uniformly_drawn_other_color() -> None:
    grey = grey_digits(20_000)
    colored = colorize(grey, binary=False, flip_probability=1.0, rng=np.random.default_rng(2))
    colors = color_index(colored, TEN_CLASS_PALETTE)
    np.testing.assert_array_equal(colored.labels, grey.labels)
    assert not np.any(colors == colored.labels)  # always another color
    offsets = np.bincount((colors - colored.labels) % 10, minlength=10)[1:]
    assert offsets.min() > 0.8 * offsets.mean()  # the 9 others about equally often


def test_label_noise_replaces_labels_before_coloring() -> None:
    grey = grey_digits(1000)
    noisy = colorize(
        grey, binary=True, flip_probability=0.0, rng=np.random.default_rng(3), label_noise=1.0
    )
    np.testing.assert_array_equal(noisy.labels, (grey.labels < 5).astype(np.int64))
    # colors follow the (noisy) label, as in Arjovsky et al.
    np.testing.assert_array_equal(color_index(noisy, BINARY_PALETTE), noisy.labels)


def test_client_flip_probabilities_spread_evenly_over_0_1_to_0_2() -> None:
    np.testing.assert_allclose(
        [client_flip_probability(k, 5) for k in range(5)], [0.1, 0.125, 0.15, 0.175, 0.2]
    )
    assert client_flip_probability(0, 1) == pytest.approx(0.15)
    with pytest.raises(ValueError, match=r"partition_id=5 is out of range"):
        client_flip_probability(5, 5)


def test_colorize_rejects_images_that_are_not_grey() -> None:
    rgb = LabeledData(np.zeros((2, 3, 2, 2), np.float32), np.zeros(2, np.int64), 10)
    with pytest.raises(ValueError, match=r"grey images of shape \(N, 1, H, W\)"):
        colorize(rgb, binary=True, flip_probability=0.1, rng=np.random.default_rng(0))


def test_federated_clients_see_their_own_flip_rate_and_the_server_the_reversed_colors() -> None:
    data_spec = spec("colored-digits-binary", clients=2)
    rates = []
    for client in range(2):
        data = load_client_partition(data_spec, client)
        assert data.input_shape == (3, 8, 8)
        assert data.num_classes == 2
        rates.append(np.mean(color_index_images(data, BINARY_PALETTE) != data.labels))
    # ~675 samples per client: f = 0.1 and 0.2 each within 4 standard deviations
    assert rates[0] == pytest.approx(0.1, abs=0.05)
    assert rates[1] == pytest.approx(0.2, abs=0.065)
    test, proxy = load_server_splits(data_spec)
    assert np.mean(color_index_images(test, BINARY_PALETTE) != test.labels) == pytest.approx(
        0.9, abs=0.06
    )
    assert len(proxy) == 2 * 10  # proxy-per-class counts digits: 2 per digit


def color_index_images(data: LabeledData, palette: np.ndarray) -> np.ndarray:
    """The color of each whole image: its per-channel ink, matched to the palette."""
    ink = data.features.sum(axis=(2, 3))
    ink = ink / ink.max(axis=1, keepdims=True)
    return np.argmin(np.abs(ink[:, None, :] - palette[None, :, :]).sum(axis=2), axis=1)


def test_non_iid_split_gives_each_client_two_digits_also_for_the_binary_task() -> None:
    for client in range(10):  # 10 clients: every digit is held by some client
        ten = load_client_partition(spec("colored-digits", "classes", 10), client)
        binary = load_client_partition(spec("colored-digits-binary", "classes", 10), client)
        assert len(np.unique(ten.labels)) == 2  # partitioned on the digit
        # Same images (brightest channel = the grey digit), binary label = digit >= 5.
        np.testing.assert_array_equal(ten.features.max(axis=1), binary.features.max(axis=1))
        np.testing.assert_array_equal(binary.labels, (ten.labels >= 5).astype(np.int64))


def test_run_config_accepts_the_colored_dataset_names() -> None:
    for name in (
        "colored-digits",
        "colored-digits-binary",
        "colored-mnist",
        "colored-mnist-binary",
    ):
        assert parse_run_config({"dataset": name}).dataset == name
