"""The library imports with its core dependencies only (flwr, numpy, torch).

`pip install beyond-averaging` brings no pydantic, Hugging Face datasets, Flower Datasets,
scikit-learn, pathspec, matplotlib or Ray: those belong to the `app` and `bench` extras. A fresh
interpreter whose import system refuses those modules must still import the package and every
public name of it (strategies, client helpers), so no module on that path may import them at
module level.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

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
)

_BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys
    BLOCKED = set(sys.argv[1].split(","))

    class RefuseExtras(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is not a core dependency (blocked by the test)")
            return None

    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    sys.meta_path.insert(0, RefuseExtras())
    """
)


def _run_with_extras_blocked(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER + textwrap.dedent(code), ",".join(EXTRA_ONLY_MODULES)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
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
    assert "pydantic is not a core dependency" in result.stderr


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
