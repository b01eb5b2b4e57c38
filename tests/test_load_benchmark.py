"""The load benchmark's bookkeeping: process trees, SuperLink lock errors, the published table."""

from __future__ import annotations

from benchmarks.load import load_markdown as markdown
from benchmarks.load import superlink_errors

RUN = {
    "date": "2026-11-23 15:00 UTC",
    "command": "nice -n 10 .venv/bin/python -m benchmarks.load --sizes 10 20 --state file",
}
META = {
    **RUN,
    "machine": "Linux",
    "cpus": 2,
    "memory-gib": 23.5,
    "superlink-state": "an SQLite file",
    "cold-cache": False,
    "flwr": "1.42.0",
    "transport": "HTTP",
}


def test_superlink_lock_errors_are_counted_with_the_calls_that_hit_them() -> None:
    log = "\n".join(
        [
            "ERROR :     [/flwr.proto.Fleet/PushMessages][UnexpectedError:OperationalError] "
            "(sqlite3.OperationalError) database is locked",
            "ERROR :     Failed to store object ab12: (sqlite3.OperationalError) "
            "database is locked",
            "ERROR :     [/v1/runtime/pull-messages][UnexpectedError:OperationalError] "
            "(sqlite3.OperationalError) database is locked",
            "ERROR :     [/flwr.proto.Fleet/PushMessages][UnexpectedError:OperationalError] "
            "(sqlite3.OperationalError) database is locked",
            "ERROR :     [/flwr.proto.Fleet/PushObject][ApiError:2007] Run is finished.",
            "INFO :      all good",
        ]
    )
    assert superlink_errors(log) == {
        "superlink-database-locked": 4,
        "superlink-locked-calls": ["/flwr.proto.Fleet/PushMessages", "/v1/runtime/pull-messages"],
    }
    assert superlink_errors("INFO : fine\n") == {
        "superlink-database-locked": 0,
        "superlink-locked-calls": [],
    }


def test_a_failed_size_stays_one_table_row_and_names_the_lock_errors() -> None:
    rows = [
        {
            "supernodes": 20,
            "status": "failed",
            "seconds-to-online": 36.5,
            "error": "LaunchError: run did not complete | status failed\nTraceback line two",
            "superlink-database-locked": 2,
            "superlink-locked-calls": ["/flwr.proto.Fleet/PullObject"],
        },
        {"supernodes": 50, "status": "skipped", "why": "needs about 28.8 GiB"},
    ]
    table = [line for line in markdown(rows, META).splitlines() if line.startswith("| 20 ")]
    assert len(table) == 1
    row = table[0]
    assert "Traceback line two" not in row
    assert row.count("|") == 11  # 10 columns: the error's own "|" must not open an eleventh
    assert '"database is locked" 2 times, on /flwr.proto.Fleet/PullObject' in row


def completed_row(size: int) -> dict[str, object]:
    return {
        "supernodes": size,
        "status": "completed",
        "seconds-to-online": 10.0,
        "round-seconds": [20.0],
        "load-average": [1.0, 2.0, 3.0],
        "serverapp-peak-rss-mb": 330.0,
        "superlink-peak-rss-mb": 150.0,
        "node-peak-rss-mb-per-node": 590.0,
        "supernode-peak-rss-mb-per-node": 141.0,
        "superexec-peak-rss-mb-per-node": 122.0,
        "clientapp-peak-rss-mb-per-node": 327.0,
        "replies-valid": [size],
        "superlink-cpu-s-per-round": 0.8,
    }


def test_a_completed_size_shows_the_superlink_s_cpu_per_round_beside_its_memory() -> None:
    lines = markdown([completed_row(30)], META).splitlines()
    header = next(line for line in lines if line.startswith("| SuperNodes"))
    row = next(line for line in lines if line.startswith("| 30 "))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells) == len(columns) == 10
    assert cells[columns.index("SuperLink CPU s per round")] == "0.8"
    assert cells[columns.index("SuperLink peak RSS (MB)")] == "150.0"
