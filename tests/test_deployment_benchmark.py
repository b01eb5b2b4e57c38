"""The deployment benchmark's bookkeeping: rounds from the SuperNodes' logs, the quickstart copy
and the published page (its /proc accounting is the product's: tests/test_resources.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.deployment import (
    HIDDEN,
    QUICKSTART,
    QUICKSTART_TASK,
    LogWatch,
    final_accuracy,
    markdown,
    quickstart_task,
    round_intervals,
    secure_figures,
    secure_table,
    summarize,
    user_app,
)
from beyond_averaging.tasks.models import build_model


def test_a_round_runs_from_its_first_train_instruction_to_the_next_round_s() -> None:
    starts = {20: [100.0, 112.5, 130.0], 30: [101.0, 112.0, 131.5]}
    assert round_intervals(starts, rounds=3) == pytest.approx([12.0, 18.0])
    # A node with an instruction more than rounds: the rounds cannot be told apart.
    assert round_intervals({**starts, 40: [1.0, 2.0, 3.0, 4.0]}, rounds=3) is None
    assert round_intervals({}, rounds=3) is None


def test_the_quickstart_copy_trains_this_project_s_mlp_on_the_saved_partitions(
    tmp_path: Path,
) -> None:
    original = (QUICKSTART / QUICKSTART_TASK).read_text(encoding="utf-8")
    data_file = tmp_path / "digits.npz"
    rng = np.random.default_rng(0)
    np.savez(
        data_file,
        num_partitions=np.array(2),
        features_0=rng.random((7, 1, 8, 8), dtype=np.float32),
        labels_0=np.arange(7, dtype=np.int64),
        features_1=rng.random((3, 1, 8, 8), dtype=np.float32),
        labels_1=np.arange(3, dtype=np.int64),
        test_features=rng.random((5, 1, 8, 8), dtype=np.float32),
        test_labels=np.arange(5, dtype=np.int64),
    )
    changed = quickstart_task(original, data_file, features=64, hidden=HIDDEN)
    # Flower's training and test loops are kept as they are.
    assert changed[changed.index("def train(") :] == original[original.index("def train(") :]
    assert changed[: changed.index("import numpy")] == original[: original.index("class Net")]
    path = tmp_path / "task.py"
    path.write_text(changed)
    spec = importlib.util.spec_from_file_location("quickstart_task_copy", path)
    assert spec is not None
    assert spec.loader is not None
    task: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    shapes = [tuple(p.shape) for p in task.Net().parameters()]
    ours = [tuple(p.shape) for p in build_model("mlp", (1, 8, 8), 10).parameters()]
    assert shapes == ours == [(200, 64), (200,), (200, 200), (200,), (10, 200), (10,)]
    trainloader, _ = task.load_data(0, 2, batch_size=4)
    assert len(trainloader.dataset) == 7
    assert [len(batch["label"]) for batch in trainloader] == [4, 3]
    assert len(task.load_centralized_dataset().dataset) == 5
    with pytest.raises(AssertionError, match="another N"):
        task.load_data(0, 3, batch_size=4)


def row(app: str, repeat: int, cpu: dict[str, float], rounds_s: list[float]) -> dict[str, Any]:
    return {
        "app": app,
        "repeat": repeat,
        "nodes": 5,
        "rounds": 2,
        "status": "completed",
        "round-seconds": rounds_s,
        "run-seconds": 40.0,
        "cpu-seconds": cpu,
        "clientapp-processes": 12 if app == "project" and repeat == 2 else 10,
        "clientapp-cpu-seconds-each": [1.0, 3.0, 4.0] if app == "project" else [5.0],
        "peak-rss-mb": {"clientapp": 300.0, "supernode": 100.0},
        "node-peak-rss-mb": 520.0,
        "load-average": [1.0, 2.0, 3.0],
        "final-accuracy": 0.9,
    }


ROWS = [
    row("project", 1, {"clientapp": 20.0, "serverapp": 4.0, "benchmark": 9.0}, [10.0]),
    row("quickstart", 1, {"clientapp": 30.0, "serverapp": 2.0}, [16.0]),
    row("quickstart", 2, {"clientapp": 36.0, "serverapp": 4.0}, [24.0]),
    row("project", 2, {"clientapp": 24.0, "serverapp": 6.0}, [13.0]),
    {"app": "project", "repeat": 3, "rounds": 2, "status": "failed", "error": "LaunchError: x"},
]


def test_ratios_are_paired_within_a_repeat_then_their_median() -> None:
    summary = summarize(ROWS)
    # The benchmark's own 9 s stay out. Repeat 1: CPU (20 + 4) / (30 + 2) = 0.75, seconds
    # 10 / 16 = 0.625;
    # repeat 2: (24 + 6) / (36 + 4) = 0.75, seconds 13 / 24 = 0.5417.
    assert summary["ratios"] == {"seconds-per-round": [0.625, 0.542], "cpu-per-round": [0.75, 0.75]}
    assert summary["ratio-medians"] == {"seconds-per-round": 0.583, "cpu-per-round": 0.75}
    project = summary["apps"]["project"]
    assert project["runs"] == 2  # the failed run is not in the figures
    assert project["cpu-per-round"] == pytest.approx(13.5)  # median of 12 and 15
    # 20 and 24 s over 5 nodes x 2 rounds = 10 train instructions; in repeat 2 two ClientApps
    # were started again (12 processes), and their CPU counts for their instructions.
    assert project["cpu-per-message"] == pytest.approx(2.2)
    assert project["clientapps-per-round"] == 5.5
    assert project["cpu-per-clientapp-median"] == 3.0


META = {
    "date": "2026-11-27 10:00 UTC",
    "command": "nice -n 10 .venv/bin/python -m benchmarks.deployment",
    "flwr": "1.39.0",
    "transport": "gRPC",
    "machine": "Linux",
    "cpus": 2,
    "load": "mean 2.0 to 2.0 per run",
    "nodes": 5,
    "rounds": 2,
    "repeats": 3,
    "order": "A B, B A, A B",
    "threads": 1,
    "interval": 0.1,
    "model": "64-200-200-10",
    "parameters": 55210,
    "quickstart-diff": "--- a\n+++ b\n-old\n+new\n",
    "executor": "warm",
}


def test_the_page_names_the_release_the_command_the_ratios_and_each_run() -> None:
    page = markdown(ROWS, META)
    assert "flwr 1.39.0, gRPC Fleet API" in page
    assert META["command"] in page
    assert "| CPU seconds per round, the deployment's processes | 13.5 | 18.0 | 0.75 |" in page
    assert "| seconds per round (median) | 11.5 | 20.0 | 0.58 |" in page
    assert page.count("| completed |") == 4
    assert "failed: LaunchError: x" in page
    assert "```diff\n--- a\n+++ b\n-old\n+new\n```" in page
    assert "under `ba-supernode` with the warm executor" in page


def test_a_log_watch_times_each_marked_line_once_complete(tmp_path: Path) -> None:
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text("before the window: Receiving: train message (ID: 0)\n")
    second.write_text("")
    watch = LogWatch({1: first, 2: second}, "Receiving: train message")
    with first.open("a") as log:
        log.write("INFO : Receiving: train message (ID: 1)\nINFO : Start `flwr-clientapp`\n")
        log.write("INFO : Receiving: train mess")  # half a line: not yet
    watch.read()
    assert [len(watch.seen[1]), len(watch.seen[2])] == [1, 0]
    with first.open("a") as log:
        log.write("age (ID: 2)\n")
    with second.open("a") as log:
        log.write("\x1b[92mINFO \x1b[0m: Receiving: train message (ID: 3)\n")
    watch.read()
    assert [len(watch.seen[1]), len(watch.seen[2])] == [2, 1]
    assert watch.seen[1][0] <= watch.seen[1][1]


def test_the_quickstart_s_final_accuracy_is_its_last_server_side_evaluation() -> None:
    from tests.test_user_apps import RECORDED_LOG  # a recorded Flower run, colour codes and all

    assert final_accuracy(RECORDED_LOG) == 0.101  # round 2 of 0..2: '1.0100e-01'
    assert final_accuracy(RECORDED_LOG.replace("ServerApp-side", "Server-side")) is None


def test_a_secure_leg_s_figures_are_per_round_from_the_end_of_round_0_to_the_last() -> None:
    marks = [  # round ends 0, 1 and 2 of two nodes: CPU seconds and (sent, received) bytes
        {"serverapp": 5.0, "clientapp": [1.0, 2.0], "bytes": [(1000, 500), (2000, 900)]},
        {"serverapp": 5.5, "clientapp": [2.0, 3.0], "bytes": [(60_000, 20_500), (61_000, 30_900)]},
        {
            "serverapp": 6.0,
            "clientapp": [4.0, 4.0],
            "bytes": [(121_000, 40_500), (123_000, 60_900)],
        },
    ]
    metrics = [
        {"round": 0, "test-accuracy": 0.1},
        {"round": 1, "round-seconds": 4.0, "test-accuracy": 0.8},
        {"round": 2, "round-seconds": 6.0, "test-accuracy": 0.9},
    ]
    figures = secure_figures(marks, metrics)
    assert figures["serverapp-cpu-s"] == pytest.approx(0.5)  # (6 - 5) / 2 rounds
    assert figures["clientapp-cpu-s"] == pytest.approx(1.25)  # node 0: 3 / 2, node 1: 2 / 2
    assert figures["node-up-kB"] == pytest.approx(60.25)  # (120,000 + 121,000) / 2 / 2 / 1,000
    assert figures["node-down-kB"] == pytest.approx(25.0)  # (40,000 + 60,000) / 2 / 2 / 1,000
    assert figures["round-s"] == pytest.approx(5.0)
    assert figures["test-accuracy"] == 0.9
    with pytest.raises(ValueError, match="2 round ends read for 2 rounds"):
        secure_figures(marks[1:], metrics)  # a round end missed: the rounds cannot be told apart


def test_the_secure_table_shows_each_leg_s_medians_and_a_failed_leg_s_error() -> None:
    def leg(app: str, server: float, accuracy: float) -> dict[str, object]:
        figures = {"serverapp-cpu-s": server, "clientapp-cpu-s": 1.0, "node-up-kB": 487.4}
        figures |= {"node-down-kB": 238.0, "round-s": 5.06, "test-accuracy": accuracy}
        return {"app": app, "status": "completed", **figures}

    rows = [leg("plain", 0.2, 0.92), leg("plain", 0.3, 0.93), leg("plain", 0.7, 0.94)]
    rows.append({"app": "secure", "status": "failed", "error": "LaunchError: no\nmore"})
    table = secure_table(rows).splitlines()
    assert table[0].startswith("| secure aggregation | ServerApp CPU s |")
    assert table[2] == "| no | 0.30 | 1.00 | 487 | 238 | 5.1 | 0.9400 |"
    assert table[3] == "| secaggplus | failed: LaunchError: no more |"


def test_the_user_leg_s_app_is_the_quickstart_as_the_user_tests_patch_it(tmp_path: Path) -> None:
    # The benchmark's own reading of the docs' recipes, checked against the user tests' parser
    # (tests/test_user_apps.py), which applies each hunk by whole lines.
    from tests.test_user_apps import POLLED_ELASTIC, SHAPES, patched_files

    app = user_app(QUICKSTART, tmp_path / "user", "elastic", *POLLED_ELASTIC.server_extras)
    for module, (_, patched) in patched_files(SHAPES[0], POLLED_ELASTIC).items():
        assert (app / module).read_text(encoding="utf-8") == patched, module
    assert "grid = polling(grid)" in (app / SHAPES[0].server_module).read_text(encoding="utf-8")
    assert "def warm(node_config):" in (app / QUICKSTART_TASK).read_text(encoding="utf-8")
