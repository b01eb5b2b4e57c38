"""The repository's specs (``benchmarks/specs/*.toml``) as ``ba-sweep`` reads them
(:mod:`server.sweep.spec`), with the repository's folders: the runs of ``<spec>.toml`` under
``benchmarks/results/<spec>/runs``, its published page ``docs/results/<spec>.md``."""

from __future__ import annotations

from pathlib import Path

from beyond_averaging.server.sweep.spec import Layout, Spec, SpecError
from beyond_averaging.server.sweep.spec import load_spec as load_any_spec

REPO = Path(__file__).resolve().parents[1]
LAYOUT = Layout(REPO, "benchmarks/results/{stem}/runs", "docs/results/{stem}.md")
__all__ = ["LAYOUT", "REPO", "Spec", "SpecError", "load_spec"]


def load_spec(path: Path | str, runs_dir: Path | None = None) -> Spec:
    """A spec of the repository's, its folders by :data:`LAYOUT`."""
    return load_any_spec(path, runs_dir, LAYOUT)
