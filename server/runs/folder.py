"""A run folder's format: the name of each file ``<output-dir>/<run-name>/`` holds, the statuses
its summary can say, and how its summary and metrics are read.

Written by :mod:`beyond_averaging.server.runs.recorder` (and the checkpoint, the partitions, the
figures and the console log), read by ``ba-run --status/--list/--compare``, ``ba-sweep`` and the
launchers. This module imports nothing but the standard library.

:func:`read_summary` is the one reader of ``summary.json``: the summary as a dict, or ``{}``
when the folder holds none that reads and parses as a JSON object (no run was started there, the
ServerApp never got as far as writing it, or a copy of the folder lost it). It never raises.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

#: The run's status, configuration, final metrics, alarms and provenance (rewritten as it goes).
SUMMARY_FILE = "summary.json"
#: One JSON line per round (round 0: the initial model).
METRICS_FILE = "metrics.jsonl"
#: One JSON line per train reply.
CLIENTS_FILE = "clients.jsonl"
#: Everything needed to continue the run (:mod:`beyond_averaging.server.runs.checkpoint`).
CHECKPOINT_FILE = "checkpoint.pt"
#: The global model after the last round (a torch state dict).
MODEL_FILE = "final_model.pt"
#: Each client's partition: label counts (:mod:`beyond_averaging.server.runs.partitions`).
PARTITIONS_FILE = "partitions.json"
#: The partitions' label counts as a figure.
PARTITIONS_PLOT = "partitions.png"
#: The run's own figure, written beside its metrics when it ran every round.
RUN_PLOT_FILE = "curves.png"
#: The console log of a run started with ``ba-run``.
LOG_FILE = "log.txt"
#: Held (``flock``) by the process writing the run, for as long as it lives.
OWNER_LOCK_FILE = ".owner.lock"

#: ``metrics.jsonl``'s test accuracy and test loss of the global model.
ACCURACY_KEY = "test-accuracy"
LOSS_KEY = "test-loss"

#: A run that ran every round but raised an alarm: not ``completed`` (ba-run exits 4).
COMPLETED_WITH_ALARMS = "completed-with-alarms"
#: Statuses a summary can hold; ``running`` only while its writer holds the owner lock.
FINAL_STATUSES = ("completed", COMPLETED_WITH_ALARMS, "failed", "interrupted")
#: Statuses of a run that ran all its rounds.
FINISHED_STATUSES = ("completed", COMPLETED_WITH_ALARMS)


class RunsError(RuntimeError):
    """A run folder cannot be read, or a figure cannot be drawn; the message says what to do."""


# --- reading ---------------------------------------------------------------------------------
def read_rounds(path: Path) -> list[dict[str, Any]]:
    """The rounds of a ``metrics.jsonl``, one dict per line; a line that does not parse (a torn
    line an older version left on a full disk) is skipped."""
    rounds = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        with suppress(ValueError):
            if line.strip():
                rounds.append(json.loads(line))
    return rounds


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    """:func:`read_rounds` of a run folder's ``metrics.jsonl``.

    Raises
    ------
    FileNotFoundError
        The folder holds no ``metrics.jsonl``.
    """
    path = Path(folder) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the folder of a run (runs/<name>)")
    return read_rounds(path)


def curve(rounds: Sequence[Mapping[str, Any]], key: str, first: int = 1) -> dict[int, float]:
    """Round -> value of ``key`` from round ``first`` on (rounds without a finite number left
    out: a metric a round did not log, or NaN)."""
    return {
        int(entry["round"]): float(entry[key])
        for entry in rounds
        if entry.get("round", 0) >= first
        and isinstance(entry.get(key), int | float)
        and math.isfinite(entry[key])
    }


def read_summary(folder: Path) -> dict[str, Any]:
    """The ``summary.json`` of the run folder ``folder``, or ``{}`` where there is none that
    reads and parses as a JSON object (see the module docstring); never raises."""
    try:
        summary = json.loads((Path(folder) / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def rule_of(config: Mapping[str, Any]) -> str:
    """The aggregation rule of a run's configuration: the strategy, ``+`` a robust rule."""
    rule = str(config.get("strategy", "?"))
    robust = config.get("robust-aggregation")
    return f"{rule}+{robust}" if robust and robust != "none" else rule
