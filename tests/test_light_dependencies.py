"""The library imports with its core dependencies only (flwr, numpy, torch); the app runs without
the data-science stack.

`pip install beyond-averaging` brings no pydantic, Hugging Face datasets, Flower Datasets,
scikit-learn, pathspec, matplotlib or Ray: those belong to the `app` and `bench` extras. A fresh
interpreter whose import system refuses those modules must still import the package and every
public name of it (strategies, client helpers), so no module on that path may import them at
module level.

The edge image goes further: its ServerApp and ClientApps run with no pandas, pyarrow, SciPy,
scikit-learn, Hugging Face datasets or Flower Datasets at all (digits from ``$BA_DIGITS_CSV``,
partitions from tasks/partition.py's NumPy code). The same blocker refuses those modules while
the apps are imported and their data loaded and partitioned with an empty partition cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from beyond_averaging.tasks.datasets import DEFAULT_DATA_DIRS, DIGITS_CSV_ENV, digits_csv_path
from beyond_averaging.tasks.partition_cache import CACHE_ENV

REPO = Path(__file__).resolve().parent.parent

#: Top-level modules the extras bring, which the library's public names must not need.
EXTRA_ONLY_MODULES = (
    "pydantic",
    "datasets",
    "flwr_datasets",
    "sklearn",
    "pathspec",
    "matplotlib",
    "ray",
    "hypothesis",
    # the experiment trackers' extras (strategies/tracking.py imports them when chosen)
    "tensorboard",
    "mlflow",
    "wandb",
)

#: What a SuperNode's image leaves out (issue 27, "a lean edge image"): the ServerApp's and the
#: ClientApp's runtime path, data and partitions included, must not need them.
EDGE_ABSENT_MODULES = ("pandas", "pyarrow", "scipy", "sklearn", "datasets", "flwr_datasets")

_BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys
    BLOCKED = set(sys.argv[1].split(","))

    class RefuseExtras(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked by the test")
            return None

    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    sys.meta_path.insert(0, RefuseExtras())
    """
)


def _run_with_extras_blocked(
    code: str,
    blocked: tuple[str, ...] = EXTRA_ONLY_MODULES,
    environment: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER + textwrap.dedent(code), ",".join(blocked)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
        env=None if environment is None else {**os.environ, **environment},
    )


def test_every_public_name_imports_without_the_extras() -> None:
    result = _run_with_extras_blocked(
        """
        import beyond_averaging
        for name in beyond_averaging.__all__:
            getattr(beyond_averaging, name)
        import beyond_averaging.strategies
        print(len(beyond_averaging.__all__), "names")
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "names" in result.stdout


def test_the_blocker_refuses_an_app_module_that_needs_pydantic() -> None:
    result = _run_with_extras_blocked("import beyond_averaging.server.config")
    assert result.returncode != 0
    assert "pydantic is blocked by the test" in result.stderr


def test_core_dependencies_are_flwr_numpy_and_torch_as_ranges() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"]
    core = project["dependencies"]
    assert sorted(requirement.split(">")[0].split("<")[0] for requirement in core) == [
        "flwr",
        "numpy",
        "torch",
    ]
    assert not any("==" in requirement for requirement in core)
    extras = project["optional-dependencies"]
    blocked_distributions = {"pydantic", "datasets", "flwr-datasets", "scikit-learn", "pathspec"}
    in_extras = {
        requirement.split(">")[0].split("[")[0]
        for requirements in extras.values()
        for requirement in requirements
    }
    assert blocked_distributions <= in_extras


#: The apps' runtime path for one data set: what the ServerApp (its test and proxy splits) and a
#: ClientApp (its partition) load, built from the run configuration as the apps build it, for
#: every partition scheme. Every module of EDGE_ABSENT_MODULES is refused; none may be loaded.
_APP_DATA_PATH = """
    import sys
    import beyond_averaging.client.app
    import beyond_averaging.server.app
    from beyond_averaging.server.app import client_task, data_spec
    from beyond_averaging.server.config import parse_run_config
    from beyond_averaging.tasks.federation import (
        DataSpec, load_client_partition, load_server_splits,
    )

    for dataset in DATASETS:
        for partition in ("iid", "dirichlet", "classes"):
            config = parse_run_config(
                {"dataset": dataset, "partition": partition, "num-clients": 50,
                 "proxy-per-class": 5}
            )
            test, proxy = load_server_splits(data_spec(config))
            client = load_client_partition(DataSpec.from_task(client_task(config), 50), 3)
            assert len(test) and len(proxy) and len(client), (dataset, partition)
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
    print("loaded:", loaded)
"""


def _run_app_data_path(datasets: list[str], cache: Path, digits_table: Path) -> None:
    """The apps' data path for ``datasets`` with EDGE_ABSENT_MODULES refused, in a fresh
    interpreter with an empty partition cache and digits read from ``digits_table``."""
    result = _run_with_extras_blocked(
        f"DATASETS = {datasets!r}\n" + textwrap.dedent(_APP_DATA_PATH),
        EDGE_ABSENT_MODULES,
        {CACHE_ENV: str(cache), DIGITS_CSV_ENV: str(digits_table)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "loaded: []"
    # Started empty: each scheme's partitions were computed here (colored data sets share their
    # base set's partitions), not read from an earlier run's cache.
    assert len(list(cache.glob("*.npz"))) >= 3


@pytest.fixture
def digits_table(tmp_path: Path) -> Path:
    """A copy of scikit-learn's digits table, as the edge image carries it."""
    copy = tmp_path / "digits.csv.gz"
    shutil.copyfile(digits_csv_path(), copy)
    return copy


def test_the_apps_load_and_partition_digits_and_synthetic_data_without_the_data_science_stack(
    tmp_path: Path, digits_table: Path
) -> None:
    _run_app_data_path(
        ["digits", "synthetic", "colored-digits", "colored-digits-binary"],
        tmp_path / "partitions",
        digits_table,
    )


@pytest.mark.parametrize(
    "datasets",
    [["fashion-mnist"], ["mnist", "colored-mnist"]],
    ids=["fashion-mnist", "mnist"],
)
def test_the_apps_load_and_partition_idx_data_without_the_data_science_stack(
    tmp_path: Path, digits_table: Path, datasets: list[str]
) -> None:
    folder = DEFAULT_DATA_DIRS[datasets[0]]
    if (
        not (folder / "train-labels-idx1-ubyte.gz").is_file()
        and not (folder / "train-labels-idx1-ubyte").is_file()
    ):
        pytest.skip(f"{datasets[0]}'s IDX files are not in {folder} (offline machine)")
    _run_app_data_path(datasets, tmp_path / "partitions", digits_table)
