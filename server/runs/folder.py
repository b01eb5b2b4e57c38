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

import csv
import io
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
#: The same rounds as a table (:func:`metrics_csv`): what a spreadsheet or ``pandas.read_csv``
#: opens.
METRICS_CSV_FILE = "metrics.csv"
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
    """The rounds of a run folder: :func:`read_rounds` of its ``metrics.jsonl``, or, in a folder
    that kept only the table (a copy that lost the JSON lines), :func:`read_csv_rounds` of its
    ``metrics.csv``.

    Raises
    ------
    FileNotFoundError
        The folder holds neither ``metrics.jsonl`` nor ``metrics.csv``.
    """
    path = Path(folder) / METRICS_FILE
    if path.is_file():
        return read_rounds(path)
    table = Path(folder) / METRICS_CSV_FILE
    if table.is_file():
        return read_csv_rounds(table)
    raise FileNotFoundError(
        f"{path} does not exist (nor {METRICS_CSV_FILE}): pass the folder of a run (runs/<name>)"
    )


# --- metrics.csv ---------------------------------------------------------------------------
def csv_columns(rounds: Sequence[Mapping[str, Any]], first: Sequence[str] = ()) -> list[str]:
    """The columns of a ``metrics.csv``: ``first`` (an existing table's header), then every
    other key of ``rounds`` in the order first seen."""
    columns = dict.fromkeys(first)
    for entry in rounds:
        columns.update(dict.fromkeys(key for key in entry if key not in columns))
    return list(columns)


def csv_cell(value: Any) -> str:
    """A metric as a CSV cell: text as it is, anything else (numbers, booleans, null, lists such
    as FedLAW's per-client weights) as JSON text."""
    return value if isinstance(value, str) else json.dumps(value)


def csv_rows(rounds: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """``rounds`` as CSV lines under ``columns`` (no header); a key a round lacks is empty."""
    stream = io.StringIO()
    writer = csv.writer(stream, lineterminator="\n")
    for entry in rounds:
        writer.writerow([csv_cell(entry[key]) if key in entry else "" for key in columns])
    return stream.getvalue()


def metrics_csv(rounds: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A whole ``metrics.csv``: the header ``columns``, then one line per round."""
    return csv_rows([{key: key for key in columns}], columns) + csv_rows(rounds, columns)


def _parse_cell(cell: str) -> Any:
    # JSON's NaN/Infinity are not taken: the JSON lines hold non-finite numbers as text
    # ("nan", "inf"), so the table's cell stays that text too.
    def refuse(constant: str) -> Any:
        raise ValueError(constant)

    try:
        return json.loads(cell, parse_constant=refuse)
    except ValueError:
        return cell


def read_csv_header(path: Path) -> list[str]:
    """The columns of the ``metrics.csv`` at ``path``; [] when it is missing or empty."""
    with (
        suppress(OSError, StopIteration, csv.Error),
        Path(path).open(encoding="utf-8", newline="") as stream,
    ):
        return next(csv.reader(stream))
    return []


def read_csv_rounds(path: Path) -> list[dict[str, Any]]:
    """The rounds of a ``metrics.csv``, one dict per row as ``metrics.jsonl`` holds it: an
    empty cell is a key the round lacks, a JSON cell its value, any other its text."""
    with Path(path).open(encoding="utf-8", newline="") as stream:
        return [
            {key: _parse_cell(cell) for key, cell in row.items() if cell and key}
            for row in csv.DictReader(stream)
        ]


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
