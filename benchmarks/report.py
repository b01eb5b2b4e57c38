"""What the attack benchmarks read runs and write tables with: the sweep reporter's
(:mod:`server.sweep.report`)."""

from beyond_averaging.server.sweep.report import RunData, markdown_table, read_run

__all__ = ["RunData", "markdown_table", "read_run"]
