"""What the systems benchmarks share: the command as typed, time, and where a page is written
(memory is read by the product's :mod:`server.deploy.resources`; the in-process federation they
drive is the product's, :mod:`server.interactive`, named here for the attack benchmarks). Targets
and ratios are each benchmark's own; docs/benchmarks.md is the manual.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.spec import REPO
from beyond_averaging.server.interactive import Federation as Federation
from beyond_averaging.server.interactive import federation as federation


def interpreter() -> str:
    """This interpreter as a published command names it: relative to the checkout that holds its
    virtual environment (``.venv/bin/python``, ``.venvs/fleet-http/bin/python``), else in full."""
    path = Path(sys.executable)
    for folder in Path(sys.prefix).parents:
        if (folder / "pyproject.toml").is_file() and path.is_relative_to(folder):
            return str(path.relative_to(folder))
    return str(path)


def command(module: str, argv: Sequence[str] | None = None) -> str:
    """This invocation as typed in the checkout, with its ``OMP_NUM_THREADS`` and ``nice``."""
    words = [interpreter(), "-m", f"benchmarks.{module}"]
    words += sys.argv[1:] if argv is None else argv
    niceness = os.nice(0)
    words = ["nice", "-n", str(niceness), *words] if niceness else words
    threads = os.environ.get("OMP_NUM_THREADS")
    return shlex.join([f"OMP_NUM_THREADS={threads}", *words] if threads else words)


def save(module: str, name: str, page: str, raw: Any, publish: bool) -> None:
    """Print ``page``; write it and ``raw`` (JSON) to ``benchmarks/results/<module>/<name>``, and
    the page to ``docs/results/<name>.md`` with ``publish``."""
    print(page)
    folder = REPO / "benchmarks" / "results" / module
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(raw, indent=1), encoding="utf-8")
    for where in [folder, REPO / "docs" / "results"][: 1 + publish]:
        (where / f"{name}.md").write_text(page, encoding="utf-8")


class Stopwatch:
    """Wall, process-CPU and children's CPU seconds of a ``with`` block (``wall``, ``cpu``,
    ``children_cpu`` once it is left; children: the subprocesses it waited for)."""

    def __enter__(self) -> Stopwatch:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.children_cpu = sum(os.times()[2:4])
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        self.children_cpu = sum(os.times()[2:4]) - self.children_cpu
