"""Lay out ``build/typing/beyond_averaging`` as the wheel lays it out, for mypy.

mypy finds modules by folder and does not run ``beyond_averaging/__init__.py``, which puts the four
top-level folders on the package's search path at import time. This tree gives mypy the wheel's
layout (``beyond_averaging/strategies/...``) with links back to the sources, so that it checks the
files in place; ``[tool.mypy] mypy_path`` points at it. scripts/setup.sh runs it; it is idempotent
and the tree is git-ignored (``build/``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from beyond_averaging import SUBPACKAGES  # noqa: E402 - the one list of the four folders

TREE = REPO / "build" / "typing" / "beyond_averaging"


def main() -> None:
    shutil.rmtree(TREE, ignore_errors=True)
    TREE.mkdir(parents=True)
    for name in ("__init__.py", *SUBPACKAGES):
        source = REPO / "beyond_averaging" / name if name.endswith(".py") else REPO / name
        (TREE / name).symlink_to(source, target_is_directory=source.is_dir())


if __name__ == "__main__":
    main()
