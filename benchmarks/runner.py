"""The benchmarks' runner: ``ba-sweep`` (:mod:`server.sweep.run`) on the repository's specs, its
runs under ``benchmarks/results/<spec>/runs`` and, with ``--publish``, the page in
``docs/results/``::

    .venv/bin/python -m benchmarks.runner benchmarks/specs/elastic-vs-fedavg.toml --dry-run
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.harness import command
from benchmarks.spec import LAYOUT
from beyond_averaging.server.sweep import run as sweep


def main(argv: Sequence[str] | None = None) -> int:
    """``ba-sweep`` with the repository's folders; the page names this command."""
    prog = "python -m benchmarks.runner"
    return sweep.main(argv, prog=prog, layout=LAYOUT, typed=lambda args: command("runner", args))


if __name__ == "__main__":
    raise SystemExit(main())
