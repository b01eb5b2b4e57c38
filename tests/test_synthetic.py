"""FedProx's Synthetic(alpha, beta) per device (tasks/synthetic.py): each client's data is built
from its id by the paper's definition, with no pool shared by the population, and the server's
held-out data are samples of a seeded set of the population's devices.

Reference values come from the definition, computed here: the moments of the paper's
distributions, FedProx's lognormal(4, 2) + 50 sizes (with LEAF's cap of 1,000) through the
normal CDF, and the labels from a softmax written here.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from beyond_averaging.tasks.datasets import load_dataset
from beyond_averaging.tasks.federation import (
    DataSpec,
    check_federation_size,
    load_client_partition,
    load_server_splits,
)
from beyond_averaging.tasks.synthetic import (
    MAX_DEVICE_SAMPLES,
    SERVER_DEVICES,
    SERVER_SAMPLES,
    device_data,
    device_model,
    device_size,
    server_devices,
    server_heldout,
)

MILLION = 1_000_000


def spec(num_partitions: int, *, seed: int = 0, proxy_per_class: int = 0) -> DataSpec:
    """A synthetic federation; the partition settings are the defaults, which do not apply."""
    return DataSpec(
        dataset="synthetic",
        data_dir="",
        partition="dirichlet",
        dirichlet_alpha=0.5,
        classes_per_partition=2,
        num_partitions=num_partitions,
        seed=seed,
        proxy_per_class=proxy_per_class,
    )


def test_a_device_is_built_from_its_id_seed_and_parameters_alone() -> None:
    first = device_data(7, alpha=1.0, beta=1.0, seed=3)
    again = device_data(7, alpha=1.0, beta=1.0, seed=3)
    np.testing.assert_array_equal(first.features, again.features)
    np.testing.assert_array_equal(first.labels, again.labels)
    assert first.input_shape == (60,)
    assert first.num_classes == 10
    assert first.features.dtype == np.float32
    for other in (
        device_data(8, alpha=1.0, beta=1.0, seed=3),
        device_data(7, alpha=1.0, beta=1.0, seed=4),
        device_data(7, alpha=1.0, beta=0.5, seed=3),
    ):
        assert not np.array_equal(first.features[:5], other.features[:5])


def test_a_clients_partition_is_its_device_whatever_the_population_size() -> None:
    small = load_client_partition(spec(10), 5)
    huge = load_client_partition(spec(MILLION), 5)
    own = device_data(5, alpha=1.0, beta=1.0, seed=0)
    np.testing.assert_array_equal(small.features, own.features)
    np.testing.assert_array_equal(huge.features, own.features)
    np.testing.assert_array_equal(huge.labels, own.labels)
    last = load_client_partition(spec(MILLION), MILLION - 1)
    assert len(last) == device_size(MILLION - 1, seed=0)


def test_the_last_of_a_million_devices_allocates_only_its_own_data() -> None:
    # A per-population array (1,000,000 int64 positions: 8 MB) would show in the peak; a device
    # holds at most 1,000 x 60 features (0.48 MB in float64, the generator's precision).
    load_client_partition(spec(MILLION), 0)  # imports and first-call caches outside the count
    tracemalloc.start()
    try:
        load_client_partition(spec(MILLION), MILLION - 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_DEVICE_SAMPLES * 60 * 8, peak


def test_labels_are_the_argmax_of_the_devices_softmax_model() -> None:
    for device in (0, 11, 123_456):
        data = device_data(device, alpha=1.0, beta=1.0, seed=2)
        weights, bias, _ = device_model(device, alpha=1.0, beta=1.0, seed=2)
        logits = data.features.astype(np.float64) @ weights + bias
        softmax = np.exp(logits - logits.max(axis=1, keepdims=True))
        softmax /= softmax.sum(axis=1, keepdims=True)
        agree = np.mean(np.argmax(softmax, axis=1) == data.labels)
        assert agree > 0.999  # float32 features may flip a near-tie


def test_features_scatter_around_the_devices_mean_with_sigma_j_to_the_minus_1_2() -> None:
    residuals = []
    for device in range(300):
        data = device_data(device, alpha=1.0, beta=1.0, seed=0)
        _, _, feature_mean = device_model(device, alpha=1.0, beta=1.0, seed=0)
        residuals.append(data.features.astype(np.float64) - feature_mean)
    pooled = np.concatenate(residuals)
    sigma = np.arange(1, 61, dtype=np.float64) ** -1.2
    assert len(pooled) > 30_000
    np.testing.assert_allclose(pooled.mean(axis=0), 0.0, atol=0.03)
    np.testing.assert_allclose(pooled.var(axis=0) / sigma, 1.0, atol=0.05)


@pytest.mark.parametrize(("alpha", "beta"), [(0.0, 0.0), (1.0, 1.0), (2.0, 0.5)])
def test_model_and_feature_means_spread_by_alpha_and_beta(alpha: float, beta: float) -> None:
    # W_k, b_k ~ N(u_k, 1) with u_k ~ N(0, alpha): the mean of W_k's 600 entries has variance
    # alpha^2 + 1/600 and b_k's 10 entries alpha^2 + 1/10; v_k ~ N(B_k, 1), B_k ~ N(0, beta):
    # the mean of its 60 entries has variance beta^2 + 1/60.
    models = [device_model(k, alpha=alpha, beta=beta, seed=1) for k in range(3000)]
    weight_means = np.array([weights.mean() for weights, _, _ in models])
    bias_means = np.array([bias.mean() for _, bias, _ in models])
    feature_means = np.array([mean.mean() for _, _, mean in models])
    assert weight_means.var() == pytest.approx(alpha**2 + 1 / 600, rel=0.1)
    assert bias_means.var() == pytest.approx(alpha**2 + 1 / 10, rel=0.1)
    assert feature_means.var() == pytest.approx(beta**2 + 1 / 60, rel=0.1)
    # W_k and b_k share u_k: their means are correlated exactly when alpha > 0.
    correlation = np.corrcoef(weight_means, bias_means)[0, 1]
    expected = alpha**2 / math.sqrt((alpha**2 + 1 / 600) * (alpha**2 + 1 / 10))
    assert correlation == pytest.approx(expected, abs=0.06)


def test_device_sizes_are_fedprox_lognormal_plus_50_capped_at_1000() -> None:
    sizes = np.array([device_size(k, seed=0) for k in range(20_000)])
    assert sizes.min() >= 50
    assert sizes.max() == MAX_DEVICE_SAMPLES
    # int(lognormal(4, 2)) + 50: median e^4 + 50; P(size = 1000) = P(lognormal >= 950).
    assert np.median(sizes) == pytest.approx(math.exp(4) + 50, abs=5)
    z = (math.log(950) - 4) / 2
    at_cap = 0.5 * math.erfc(z / math.sqrt(2))
    assert np.mean(sizes == MAX_DEVICE_SAMPLES) == pytest.approx(at_cap, abs=0.01)


def test_each_device_labels_most_of_its_samples_alike() -> None:
    # What makes Synthetic heterogeneous: the share of a device's majority label is far above
    # the share of the population's majority label.
    labels = [device_data(k, alpha=1.0, beta=1.0, seed=0).labels for k in range(200)]
    majority = np.mean([np.bincount(own).max() / own.size for own in labels])
    pooled = np.concatenate(labels)
    assert majority > np.bincount(pooled).max() / pooled.size + 0.3


def test_the_server_holds_out_samples_of_a_seeded_set_of_the_populations_devices() -> None:
    assert server_devices(10, seed=0).tolist() == list(range(10))
    chosen = server_devices(MILLION, seed=4)
    assert chosen.size == SERVER_DEVICES
    assert np.all(np.diff(chosen) > 0)
    assert chosen[0] >= 0
    assert chosen[-1] < MILLION
    np.testing.assert_array_equal(chosen, server_devices(MILLION, seed=4))
    assert not np.array_equal(chosen, server_devices(MILLION, seed=5))
    heldout = server_heldout(10, alpha=1.0, beta=1.0, seed=0)
    assert len(heldout) == SERVER_SAMPLES
    # Device 3's 200 held-out samples (the fourth block) follow its model, but are not its own.
    block = heldout.features[600:800].astype(np.float64)
    weights, bias, _ = device_model(3, alpha=1.0, beta=1.0, seed=0)
    assert np.mean(np.argmax(block @ weights + bias, axis=1) == heldout.labels[600:800]) > 0.999
    own = device_data(3, alpha=1.0, beta=1.0, seed=0).features
    assert not np.isin(heldout.features[600:800, 0], own[:, 0]).any()


def test_a_million_clients_pass_the_servers_checks_and_get_a_test_and_proxy_set() -> None:
    check_federation_size(spec(MILLION))
    test, proxy = load_server_splits(spec(MILLION, proxy_per_class=10))
    assert len(test) + len(proxy) == SERVER_SAMPLES
    np.testing.assert_array_equal(np.bincount(proxy.labels), np.full(10, 10))


def test_a_small_population_without_some_class_names_the_fix_for_the_proxy_set() -> None:
    short = next(
        seed
        for seed in range(50)
        if np.bincount(
            server_heldout(10, alpha=1.0, beta=1.0, seed=seed).labels, minlength=10
        ).min()
        < 10
    )
    with pytest.raises(ValueError, match=r"10 synthetic devices .* proxy-per-class = 0"):
        load_server_splits(spec(10, seed=short, proxy_per_class=10))


def test_loading_synthetic_as_a_pool_is_refused_naming_the_per_device_generator() -> None:
    with pytest.raises(ValueError, match=r"no pool .* generated from its id"):
        load_dataset("synthetic")
