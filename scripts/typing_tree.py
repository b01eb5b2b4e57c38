"""Lay out ``build/typing/beyond_averaging`` as the wheel lays it out, for mypy.

mypy finds modules by folder and does not run ``beyond_averaging/__init__.py``, which puts the four
top-level folders on the package's search path at import time. This tree gives mypy the wheel's
layout (``beyond_averaging/strategies/...``) with links back to the sources, so that it checks the
files in place; ``[tool.mypy] mypy_path`` points at it. scripts/setup.sh runs it; it is idempotent
and the tree is git-ignored (``build/``). Where links cannot be made (Windows without developer
mode) only this tree, and so mypy, fails; the package itself needs no link.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from beyond_averaging import SUBPACKAGES  # noqa: E402 - the one list of the four folders

TREE = REPO / "build" / "typing" / "beyond_averaging"


def main() -> None:
    # Links are made or replaced one by one, never by removing the tree: a mypy run of another shell
    # may be reading it. They are relative, so the tree survives a move of the checkout.
    TREE.mkdir(parents=True, exist_ok=True)
    sources = {
        name: REPO / "beyond_averaging" / name if name.endswith(".py") else REPO / name
        for name in ("__init__.py", *SUBPACKAGES)
    }
    for entry in TREE.iterdir():
        if entry.name not in sources:
            _remove(entry)
    for name, source in sources.items():
        link = TREE / name
        target = Path(os.path.relpath(source, TREE))
        if link.is_symlink() and link.readlink() == target:
            continue
        _remove(link)
        link.symlink_to(target, target_is_directory=source.is_dir())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
