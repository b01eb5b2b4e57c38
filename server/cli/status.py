"""``ba-run``'s status lines and exit codes: a run's status (``ba-run --status``), the warnings
of its alarms, and the exit code each status gives."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from beyond_averaging.server.runs.folder import COMPLETED_WITH_ALARMS, SUMMARY_FILE

#: ``ba-run``'s exit code for a run that ran every round but raised an alarm.
ALARMS_EXIT_CODE = 4
#: ``ba-run`` and ``ba-run --status`` exit codes (any other status: 1).
STATUS_EXIT_CODES = {"completed": 0, COMPLETED_WITH_ALARMS: ALARMS_EXIT_CODE, "running": 3}


def print_alarms(summary: Mapping[str, Any], emit: Callable[[str], None] | None = None) -> None:
    """One warning line per alarm kind a run raised (see
    :func:`beyond_averaging.server.app.round_alarms`), to standard error or to ``emit``."""
    for kind, alarm in (summary.get("alarms") or {}).items():
        text = (
            f"ba-run: warning: {kind} in {alarm.get('rounds')} round(s), rounds "
            f"{alarm.get('first-round')}-{alarm.get('last-round')}: {alarm.get('message', '')}"
        )
        if emit is None:
            print(text, file=sys.stderr)
        else:
            emit(text)


def print_status(run_dir: Path) -> int:
    """``ba-run --status``: the run's status, checked against its owner; the exit code says it.

    A ``running`` summary whose writer is gone is reported and marked ``interrupted``.
    """
    from beyond_averaging.server.runs.recorder import mark_interrupted, run_status  # torch

    status = run_status(run_dir)
    if status.status == "missing" and any(Path(run_dir).glob(f"*/{SUMMARY_FILE}")):
        from beyond_averaging.server.runs.listing import list_command

        print(f"ba-run: {run_dir} is a folder of runs, not a run; its runs (ba-run --list):")
        return list_command(Path(run_dir), "text")
    if status.status == "interrupted":
        status = mark_interrupted(run_dir)
    summary = status.summary
    final = summary.get("final") or {}
    line = f"ba-run: {run_dir}: {status.status}"
    if summary:
        accuracy = final.get("test-accuracy")
        # four digits, as the progress bar and ba-run's closing line show it
        shown = f"{accuracy:.4f}" if isinstance(accuracy, int | float) else str(accuracy)
        line += (
            f", {summary.get('rounds-completed', 0)} of "
            f"{(summary.get('config') or {}).get('num-server-rounds', '?')} rounds, test accuracy "
            f"{shown}, updated {summary.get('updated-at', '?')}"
        )
    print(line)
    if status.reason:
        print(f"ba-run: {status.reason}")
    print_alarms(summary)
    return STATUS_EXIT_CODES.get(status.status, 1)
