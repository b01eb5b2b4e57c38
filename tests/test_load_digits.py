"""The digits loader reads scikit-learn's table without importing scikit-learn.

Every ClientApp process of a deployment loads its data afresh; importing scikit-learn there
pulled in SciPy, pandas and pyarrow (~140 MB per node, see docs/results/load.md). The loader
must still give exactly scikit-learn's data.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from beyond_averaging.tasks import datasets
from beyond_averaging.tasks.datasets import DatasetNotFoundError, digits_csv_path
from beyond_averaging.tasks.partition_cache import CACHE_ENV


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


def test_a_client_partition_of_digits_imports_no_scikit_learn_scipy_or_pandas(
    tmp_path: Path,
) -> None:
    # What a deployment's ClientApp process does per message. The first process of a
    # federation partitions with Flower Datasets (which imports pandas and pyarrow) and fills
    # the disk cache; every later one must read data and partition without those imports.
    script = (
        "import sys\n"
        "from beyond_averaging.tasks.federation import DataSpec, load_client_partition\n"
        "spec = DataSpec(dataset='digits', data_dir='', partition='dirichlet',\n"
        "                dirichlet_alpha=0.5, classes_per_partition=2, num_partitions=4,\n"
        "                seed=0, proxy_per_class=0)\n"
        "load_client_partition(spec, 1)\n"
        "print(sorted(m for m in ('sklearn', 'scipy', 'pandas', 'pyarrow') if m in sys.modules))\n"
    )
    environment = {**os.environ, CACHE_ENV: str(tmp_path)}
    imported = [
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
            env=environment,
        )
        .stdout.strip()
        .splitlines()[-1]
        for _ in range(2)
    ]
    assert list(tmp_path.glob("*.npz")), "the first process did not fill the partition cache"
    assert imported[1] == "[]"


def test_digits_table_is_found_inside_the_installed_scikit_learn() -> None:
    import sklearn

    path = digits_csv_path()
    assert path.name == "digits.csv.gz"
    assert path.resolve().is_relative_to(Path(sklearn.__file__).resolve().parent)


def test_missing_digits_table_names_the_package_and_the_install_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(datasets, "_DIGITS_CSV", ("datasets", "data", "no-such-table.csv.gz"))
    with pytest.raises(DatasetNotFoundError, match=r"no-such-table\.csv\.gz.*pip install"):
        datasets.load_dataset("digits")


def test_a_table_of_the_wrong_width_is_refused_with_its_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another of scikit-learn's bundled tables: one column per row instead of 65.
    monkeypatch.setattr(datasets, "_DIGITS_CSV", ("datasets", "data", "diabetes_target.csv.gz"))
    with pytest.raises(ValueError, match=r"diabetes_target\.csv\.gz: expected a table of 65"):
        datasets.load_dataset("digits")
