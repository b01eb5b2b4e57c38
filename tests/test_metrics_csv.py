"""``metrics.csv``: every run's rounds as a table beside ``metrics.jsonl``.

The table is read back with the standard library's csv module (and pandas, which is what a user
opens it with), never with this project's reader, and compared with the JSON lines: the same
rows, one column per key in the order the run first logged it, a round's missing keys empty,
lists as JSON text. A key first logged mid-run widens the header; a resumed run's table holds the
rounds it keeps, its columns in the order they had. The sweep report reads a folder that kept
only the table.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from beyond_averaging.server.runs.folder import read_metrics
from beyond_averaging.server.runs.recorder import RunRecorder
from beyond_averaging.server.runtime.inprocess import run_inprocess
from beyond_averaging.server.sweep.report import read_run
from beyond_averaging.server.sweep.spec import Run
from tests.test_inprocess import REPO
from tests.test_inprocess import SETTINGS as INPROCESS


def jsonl_rounds(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def csv_table(run: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and the raw rows (cell text) of the run's metrics.csv, by the csv module."""
    with (run / "metrics.csv").open(encoding="utf-8", newline="") as stream:
        reader = csv.DictReader(stream)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def decoded(row: dict[str, str]) -> dict[str, Any]:
    """A CSV row as a round: empty cells left out, JSON cells decoded, other cells as text."""
    entry: dict[str, Any] = {}
    for key, cell in row.items():
        if cell == "":
            continue
        try:
            entry[key] = json.loads(cell)
        except ValueError:
            entry[key] = cell
    return entry


def test_a_run_writes_metrics_csv_holding_the_same_rows_as_metrics_jsonl(tmp_path: Path) -> None:
    run_inprocess(REPO, {**INPROCESS, "output-dir": str(tmp_path), "run-name": "r"})
    run = tmp_path / "r"
    rounds = jsonl_rounds(run)
    header, rows = csv_table(run)
    assert [decoded(row) for row in rows] == rounds
    assert [int(row["round"]) for row in rows] == [0, 1, 2]
    assert header[0] == "round"  # the run logs the round first: the first column
    assert set(header) == {key for entry in rounds for key in entry}
    assert len(header) == len(set(header))


def test_pandas_reads_the_table_with_one_numeric_column_per_metric(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    run_inprocess(REPO, {**INPROCESS, "output-dir": str(tmp_path), "run-name": "r"})
    rounds = jsonl_rounds(tmp_path / "r")
    frame = pandas.read_csv(tmp_path / "r" / "metrics.csv")
    assert list(frame["round"]) == [0, 1, 2]
    assert list(frame["test-accuracy"]) == pytest.approx([r["test-accuracy"] for r in rounds])
    assert list(frame["test-loss"]) == pytest.approx([r["test-loss"] for r in rounds])


def test_a_key_first_logged_mid_run_widens_the_header_and_earlier_rows_leave_it_empty(
    tmp_path: Path,
) -> None:
    recorder = RunRecorder(tmp_path, "r", {"strategy": "fedavg"})
    recorder.log_round({"round": 0, "test-loss": 2.5, "test-accuracy": 0.1})
    recorder.log_round({"round": 1, "test-loss": 1.5, "weights": [0.25, 0.75]})
    recorder.log_round({"round": 2, "test-loss": 1.0, "test-accuracy": 0.5, "note": "a, b"})
    recorder.write_summary("completed")
    header, rows = csv_table(tmp_path / "r")
    assert header == ["round", "test-loss", "test-accuracy", "weights", "note"]
    assert rows == [
        {"round": "0", "test-loss": "2.5", "test-accuracy": "0.1", "weights": "", "note": ""},
        {"round": "1", "test-loss": "1.5", "test-accuracy": "", "weights": "[0.25, 0.75]",
         "note": ""},
        {"round": "2", "test-loss": "1.0", "test-accuracy": "0.5", "weights": "",
         "note": "a, b"},
    ]  # fmt: skip
    assert [decoded(row) for row in rows] == jsonl_rounds(tmp_path / "r")


def test_alarms_and_non_finite_numbers_read_as_the_json_lines_hold_them(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, "r", {})
    recorder.log_round({"round": 1, "test-loss": float("nan")}, alarms={"loss-exploded": "big"})
    recorder.write_summary("completed")
    header, rows = csv_table(tmp_path / "r")
    assert header == ["round", "test-loss", "alarm-loss-exploded"]
    assert rows == [{"round": "1", "test-loss": "nan", "alarm-loss-exploded": "1"}]
    assert [decoded(row) for row in rows] == jsonl_rounds(tmp_path / "r")


def test_a_resumed_run_rewrites_the_table_from_the_rounds_it_keeps_in_the_same_column_order(
    tmp_path: Path,
) -> None:
    first = RunRecorder(tmp_path, "r", {})
    first.log_round({"round": 0, "test-loss": 2.0})
    first.log_round({"round": 1, "test-loss": 1.0, "b-metric": 3})
    first.log_round({"round": 2, "test-loss": 0.5, "a-metric": 4})  # not checkpointed
    first.close()  # the process died after round 2 without a final status

    resumed = RunRecorder(tmp_path, "r", {}, resume_round=1)
    header, rows = csv_table(tmp_path / "r")
    assert header == ["round", "test-loss", "b-metric"]  # not the JSON lines' sorted order
    assert [row["round"] for row in rows] == ["0", "1"]
    resumed.log_round({"round": 2, "test-loss": 0.4})
    resumed.log_round({"round": 3, "test-loss": 0.3, "a-metric": 5})
    resumed.write_summary("completed")
    header, rows = csv_table(tmp_path / "r")
    assert header == ["round", "test-loss", "b-metric", "a-metric"]
    assert [decoded(row) for row in rows] == jsonl_rounds(tmp_path / "r")
    assert [row["round"] for row in rows] == ["0", "1", "2", "3"]


def test_resuming_a_run_written_before_the_table_existed_writes_it_from_the_json_lines(
    tmp_path: Path,
) -> None:
    recorder = RunRecorder(tmp_path, "r", {})
    recorder.log_round({"round": 0, "test-loss": 2.0})
    recorder.log_round({"round": 1, "test-loss": 1.0})
    recorder.close()
    (tmp_path / "r" / "metrics.csv").unlink()

    RunRecorder(tmp_path, "r", {}, resume_round=1).close()
    _, rows = csv_table(tmp_path / "r")
    assert [decoded(row) for row in rows] == [
        {"round": 0, "test-loss": 2.0},
        {"round": 1, "test-loss": 1.0},
    ]


def test_the_sweep_report_reads_a_run_folder_that_kept_only_metrics_csv(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, "r", {"strategy": "fedavg"})
    recorder.log_round({"round": 0, "test-accuracy": 0.1})
    recorder.log_round({"round": 1, "test-accuracy": 0.6, "weights": [0.5, 0.5]})
    recorder.write_summary("completed")
    (tmp_path / "r" / "metrics.jsonl").unlink()

    expected = [{"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": 0.6,
                "weights": [0.5, 0.5]}]  # fmt: skip
    assert read_metrics(tmp_path / "r") == expected
    data = read_run(Run("r", {}, {}, tmp_path / "r"))
    assert data is not None
    assert data.curve("test-accuracy") == {1: 0.6}


def test_a_folder_with_neither_file_names_both(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl.*metrics\.csv"):
        read_metrics(tmp_path)
