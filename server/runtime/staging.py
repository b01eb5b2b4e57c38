"""FAB staging: the files of a Flower app that ``flwr run`` is given, copied to a folder of their
own (:func:`stage_app`), so that Flower never walks a checkout's git-ignored trees."""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path

import pathspec


def stage_app(app_dir: Path, destination: Path) -> Path:
    """Copy the files a FAB can hold to ``destination``: not git-ignored, not ``.git``, and, where
    ``[tool.flwr.app] fab-include`` lists patterns, only ``pyproject.toml`` and files they match.

    ``flwr run <dir>`` walks every file under ``<dir>``, git-ignored ones included, before it
    filters them; with a virtual environment in the repository that walk takes half a minute
    per run. The FAB built from the staged copy has the same content, because the same
    ``.gitignore`` and Flower's include/exclude rules apply to the same remaining files.
    """
    gitignore = app_dir / ".gitignore"
    lines = gitignore.read_text(encoding="utf-8").splitlines() if gitignore.is_file() else []
    ignored = pathspec.GitIgnoreSpec.from_lines([*lines, ".git/"])
    included = fab_include_spec(app_dir / "pyproject.toml")
    for directory, subdirectories, filenames in os.walk(app_dir):
        relative = Path(directory).relative_to(app_dir)
        subdirectories[:] = [
            name
            for name in subdirectories
            if not ignored.match_file(f"{(relative / name).as_posix()}/")
        ]
        for name in filenames:
            source = Path(directory) / name
            path = (relative / name).as_posix()
            if source.is_symlink() or ignored.match_file(path):
                continue
            if included is not None and path != "pyproject.toml" and not included.match_file(path):
                continue
            target = destination / relative / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def fab_include_spec(pyproject: Path) -> pathspec.GitIgnoreSpec | None:
    """The app's ``[tool.flwr.app] fab-include`` patterns (gitignore-style, as Flower reads
    them), or None where the app lists none (Flower then takes every file of its built-in
    kinds)."""
    if not pyproject.is_file():
        return None
    app = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("tool", {})
    patterns = app.get("flwr", {}).get("app", {}).get("fab-include")
    return None if patterns is None else pathspec.GitIgnoreSpec.from_lines(patterns)
