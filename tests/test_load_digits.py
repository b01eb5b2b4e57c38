"""The digits loader reads scikit-learn's table without importing scikit-learn.

Every ClientApp process of a deployment loads its data afresh; importing scikit-learn there
pulled in SciPy, pandas and pyarrow (~140 MB per node, see docs/results/load.md). The loader
must still give exactly scikit-learn's data, from the installed scikit-learn or, where it is
not installed (the edge image), from a copy of its table named by ``$BA_DIGITS_CSV``. That the
whole runtime path then imports none of those packages: tests/test_light_dependencies.py.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.datasets import load_digits

from beyond_averaging.tasks import datasets
from beyond_averaging.tasks.datasets import DIGITS_CSV_ENV, DatasetNotFoundError, digits_csv_path


def test_digits_are_bit_identical_to_scikit_learns_load_digits() -> None:
    reference = load_digits()
    loaded = datasets._load_digits()
    expected_features = np.asarray(reference.images, dtype=np.float32)[:, None, :, :] / np.float32(
        16.0
    )
    assert loaded.features.dtype == np.float32
    assert loaded.features.shape == (1797, 1, 8, 8)
    assert loaded.features.tobytes() == expected_features.tobytes()
    assert loaded.labels.dtype == np.int64
    assert loaded.labels.tobytes() == np.asarray(reference.target, dtype=np.int64).tobytes()
    assert loaded.num_classes == 10


def test_digits_table_is_found_inside_the_installed_scikit_learn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sklearn

    monkeypatch.delenv(DIGITS_CSV_ENV, raising=False)
    path = digits_csv_path()
    assert path.name == "digits.csv.gz"
    assert path.resolve().is_relative_to(Path(sklearn.__file__).resolve().parent)


def test_missing_digits_table_names_the_package_and_the_install_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(DIGITS_CSV_ENV, raising=False)
    monkeypatch.setattr(datasets, "_DIGITS_CSV", ("datasets", "data", "no-such-table.csv.gz"))
    with pytest.raises(DatasetNotFoundError, match=r"no-such-table\.csv\.gz.*pip install"):
        datasets.load_dataset("digits")


def test_a_table_of_the_wrong_width_is_refused_with_its_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another of scikit-learn's bundled tables: one column per row instead of 65.
    monkeypatch.delenv(DIGITS_CSV_ENV, raising=False)
    monkeypatch.setattr(datasets, "_DIGITS_CSV", ("datasets", "data", "diabetes_target.csv.gz"))
    with pytest.raises(ValueError, match=r"diabetes_target\.csv\.gz: expected a table of 65"):
        datasets.load_dataset("digits")


@pytest.fixture
def copied_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of scikit-learn's digits table, named by ``$BA_DIGITS_CSV``."""
    import sklearn

    copy = tmp_path / "digits.csv.gz"
    shutil.copyfile(Path(sklearn.__file__).parent / "datasets" / "data" / "digits.csv.gz", copy)
    monkeypatch.setenv(DIGITS_CSV_ENV, str(copy))
    return copy


def test_a_table_named_by_the_environment_variable_is_read_first_and_gives_scikit_learns_digits(
    copied_table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = copied_table
    # scikit-learn's own table can no longer be found: only the copy can give the data.
    monkeypatch.setattr(datasets, "_DIGITS_CSV", ("datasets", "data", "no-such-table.csv.gz"))
    assert digits_csv_path() == copy
    loaded = datasets._load_digits()
    reference = load_digits()
    assert loaded.labels.tobytes() == np.asarray(reference.target, dtype=np.int64).tobytes()
    expected = np.asarray(reference.images, dtype=np.float32)[:, None, :, :] / np.float32(16.0)
    assert loaded.features.tobytes() == expected.tobytes()


def test_an_environment_variable_naming_no_file_is_an_error_giving_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nowhere" / "digits.csv.gz"
    monkeypatch.setenv(DIGITS_CSV_ENV, str(missing))
    with pytest.raises(DatasetNotFoundError) as raised:
        datasets.load_dataset("digits")
    message = str(raised.value)
    assert f"{DIGITS_CSV_ENV}='{missing}' is not a file" in message
    assert "sklearn/datasets/data/digits.csv.gz" in message
    assert "pip install 'scikit-learn>=1.4'" in message


def test_without_scikit_learn_or_the_variable_the_error_gives_both_ways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(DIGITS_CSV_ENV, raising=False)
    real_find_spec = importlib.util.find_spec

    def find_spec_without_sklearn(name: str, package: str | None = None) -> Any:
        return None if name == "sklearn" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec_without_sklearn)
    with pytest.raises(DatasetNotFoundError) as raised:
        datasets.load_dataset("digits")
    message = str(raised.value)
    assert "scikit-learn is not installed" in message
    assert f"set {DIGITS_CSV_ENV} to a copy of sklearn/datasets/data/digits.csv.gz" in message
    assert "pip install 'scikit-learn>=1.4'" in message


def test_the_table_is_parsed_once_per_file_version_and_cannot_be_written_through(
    copied_table: Path,
) -> None:
    # Each ClientApp the warm executor forks inherits the parent's parse (client.app.warm);
    # a second parse per message is what the cache is there to avoid, and a changed file must
    # not be served from it.
    import os

    copy = copied_table
    first = datasets._load_digits()
    assert datasets._load_digits() is first
    with pytest.raises(ValueError, match="read-only"):
        first.features[0, 0, 0, 0] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        first.labels[0] = 1
    # The splits a run trains on are copies: writable, and not views of the shared table.
    train_pool, _ = datasets.load_dataset("digits")
    train_pool.features[0, 0, 0, 0] = 2.0
    assert not np.shares_memory(train_pool.features, first.features)
    assert first.features.max() <= 1.0
    # The same path rewritten (a later modification time): parsed again.
    status = copy.stat()
    os.utime(copy, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))
    again = datasets._load_digits()
    assert again is not first
    assert again.features.tobytes() == first.features.tobytes()


def test_the_clientapps_warm_up_parses_the_table_its_forked_clientapps_inherit() -> None:
    from beyond_averaging.client.app import warm

    datasets._parsed_digits.cache_clear()
    warm({"partition-id": 0, "num-partitions": 2})
    assert datasets._parsed_digits.cache_info().currsize == 1
    hits = datasets._parsed_digits.cache_info().hits
    datasets._load_digits()  # what a forked ClientApp's load_dataset("digits") calls
    assert datasets._parsed_digits.cache_info().hits == hits + 1


def test_the_warm_up_leaves_a_missing_table_to_the_clientapp_to_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from beyond_averaging.client.app import warm

    monkeypatch.setenv(DIGITS_CSV_ENV, str(tmp_path / "nowhere.csv.gz"))
    warm({})  # no error here: the message's ClientApp names the missing table
    with pytest.raises(DatasetNotFoundError):
        datasets.load_dataset("digits")
