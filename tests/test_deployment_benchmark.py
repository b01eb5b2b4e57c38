"""The deployment benchmark's bookkeeping: /proc stat lines, CPU per kind of process (reaped
children included), rounds from ClientApp starts, the quickstart copy and the published page."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.deployment import (
    QUICKSTART,
    QUICKSTART_TASK,
    LogWatch,
    ProcessWatch,
    ProcStat,
    Tracked,
    cpu_seconds_by_kind,
    kinds_of,
    markdown,
    parse_stat,
    quickstart_task,
    round_intervals,
    summarize,
)
from beyond_averaging.tasks.models import build_model

# A stat line as proc(5) lays it out, with a comm that holds a space and a parenthesis.
# pid 4242, comm "flwr (x", state S, ppid 17, utime 250, stime 30, cutime 1200, cstime 45,
# starttime 98765, rss 3000 pages.
LINE = (
    "4242 (flwr (x) S 17 4242 4242 0 -1 4194560 1000 0 0 0 250 30 1200 45 20 0 3 0 98765 "
    "123456789 3000 18446744073709551615 1 1 0 0 0 0 0 16781312 16386 0 0 0 17 1 0 0 0 0 0"
)


def test_a_stat_line_is_read_from_the_last_parenthesis() -> None:
    assert parse_stat(LINE) == ProcStat(
        pid=4242,
        comm="flwr (x",
        state="S",
        ppid=17,
        cpu_ticks=280,
        children_ticks=1245,
        start_ticks=98765,
        rss_pages=3000,
    )


def test_this_process_s_own_stat_line_reads_back() -> None:
    path = Path("/proc/self/stat")
    if not path.is_file():
        pytest.skip("no /proc on this system")
    stat = parse_stat(path.read_text())
    assert stat.state in "RS"
    assert stat.rss_pages > 0


def stat(pid: int, comm: str, ppid: int, cpu: int, children: int = 0, start: int = 0) -> ProcStat:
    return ProcStat(pid, comm, "S", ppid, cpu, children, start, 100)


def tracked(
    first: ProcStat, last: ProcStat | None = None, at_start: bool = False, ended: bool = False
) -> Tracked:
    return Tracked(first, last or first, at_start, first.rss_pages, ended)


def deployment_table() -> dict[int, Tracked]:
    """A benchmark (1) with a SuperLink (10) -> SuperExec (11) -> ServerApp (12) and a
    SuperNode (20) -> SuperExec (21) -> ClientApps 22 (reaped, read 30 ticks before its end),
    23 (reaped, read at its end) and 24 (a zombie, not reaped)."""
    return {
        1: tracked(stat(1, "python", 0, 100), stat(1, "python", 0, 130), at_start=True),
        10: tracked(stat(10, "flower-superlin", 1, 500), stat(10, "flower-superlin", 1, 900), True),
        11: tracked(stat(11, "flower-superexe", 10, 50), stat(11, "flower-superexe", 10, 60), True),
        12: tracked(stat(12, "flwr-serverapp", 11, 10), stat(12, "flwr-serverapp", 11, 700)),
        20: tracked(stat(20, "flower-supernod", 1, 80), stat(20, "flower-supernod", 1, 120), True),
        # The SuperExec reaped 22 (300 ticks in all) and 23 (250) in the window: 550 more.
        21: tracked(
            stat(21, "flower-superexe", 20, 40, children=5000),
            stat(21, "flower-superexe", 20, 55, children=5550),
            at_start=True,
        ),
        22: tracked(
            stat(22, "flwr-clientapp", 21, 5), stat(22, "flwr-clientapp", 21, 270), ended=True
        ),
        23: tracked(
            stat(23, "flwr-clientapp", 21, 3), stat(23, "flwr-clientapp", 21, 250), ended=True
        ),
        24: tracked(stat(24, "flwr-clientapp", 21, 9), stat(24, "flwr-clientapp", 21, 260)),
        30: tracked(stat(30, "flwr", 1, 70)),
    }


def test_each_process_has_its_kind_and_a_superexec_the_kind_of_whom_it_serves() -> None:
    kinds = kinds_of(deployment_table(), root=1)
    assert kinds == {
        1: "benchmark",
        10: "superlink",
        11: "superexec-server",
        12: "serverapp",
        20: "supernode",
        21: "superexec-node",
        22: "clientapp",
        23: "clientapp",
        24: "clientapp",
        30: "flwr-run",
    }


def warm_node_table() -> dict[int, Tracked]:
    """A benchmark (1) with ``ba-supernode`` (40) running a SuperNode (41) and the warm executor
    (42), which forked ClientApp 43 (still named as its parent when first read) and 44."""
    return {
        1: tracked(stat(1, "python", 0, 0)),
        40: tracked(stat(40, "ba-supernode", 1, 1)),
        41: tracked(stat(41, "flower-supernod", 40, 2)),
        42: tracked(stat(42, "ba-warm-exec", 40, 3)),
        43: tracked(stat(43, "ba-warm-exec", 42, 4), stat(43, "ba-clientapp", 42, 9)),
        44: tracked(stat(44, "ba-clientapp", 42, 5)),
    }


def test_a_warm_node_s_supervisor_executor_and_forked_clientapps_have_their_kinds() -> None:
    kinds = kinds_of(warm_node_table(), root=1)
    assert kinds == {
        1: "benchmark",
        40: "supervisor",
        41: "supernode",
        42: "warm-executor",
        43: "clientapp",
        44: "clientapp",
    }


def test_a_node_s_memory_sums_every_process_below_the_process_started_for_it() -> None:
    watch = ProcessWatch(1)
    watch.processes = warm_node_table()
    watch.node_roots = {40}
    watch.pss_read = float("inf")  # no PSS reading (the pids are made up)
    memory = watch.node_memory()
    # ba-supernode, the SuperNode, the warm executor and both ClientApps: 5 x 100 pages.
    assert memory == {"rss-40": 5 * 100 * watch.page}
    assert watch.node_of(44) == 40
    assert watch.node_of(1) is None


def test_cpu_per_kind_counts_the_window_and_what_reaped_children_ran_after_their_last_reading() -> (
    None
):
    seconds, recovered = cpu_seconds_by_kind(deployment_table(), ticks_per_second=100.0, root=1)
    # Alive at the start: last minus first; born in the window: all of it.
    assert seconds["benchmark"] == pytest.approx(0.30)
    assert seconds["superlink"] == pytest.approx(4.00)
    assert seconds["superexec-server"] == pytest.approx(0.10)
    assert seconds["serverapp"] == pytest.approx(7.00)
    assert seconds["supernode"] == pytest.approx(0.40)
    assert seconds["superexec-node"] == pytest.approx(0.15)
    assert seconds["flwr-run"] == pytest.approx(0.70)
    # ClientApps: 270 + 250 + 260 read, and 550 - (270 + 250) = 30 only the reaped times show.
    assert seconds["clientapp"] == pytest.approx(8.10)
    assert recovered["clientapp"] == pytest.approx(0.30)
    assert sum(recovered.values()) == pytest.approx(0.30)
    assert seconds["unseen"] == 0.0


def test_reaped_time_of_children_never_seen_is_counted_as_unseen() -> None:
    table = {
        1: tracked(stat(1, "python", 0, 0, children=100), stat(1, "python", 0, 0, children=340)),
    }
    table[1].at_start = True
    seconds, recovered = cpu_seconds_by_kind(table, ticks_per_second=100.0, root=1)
    assert seconds["unseen"] == pytest.approx(2.40)
    assert recovered["unseen"] == pytest.approx(2.40)


def test_a_child_that_ends_between_two_samples_is_counted_from_its_parent() -> None:
    if not Path("/proc/self/stat").is_file():
        pytest.skip("no /proc on this system")
    watch = ProcessWatch(int(parse_stat(Path("/proc/self/stat").read_text()).pid))
    watch.open_window()
    burn = (
        "import time\nend = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\nprint(time.process_time())"
    )
    child = subprocess.run([sys.executable, "-c", burn], capture_output=True, text=True, check=True)
    watch.sample()  # the child was started and reaped between two samples
    seconds, recovered = cpu_seconds_by_kind(watch.processes, 100.0, watch.root)
    own = float(child.stdout)  # what the child measured of itself, after its start-up
    assert own - 0.02 <= seconds["unseen"] <= own + 2.0
    assert recovered["unseen"] == seconds["unseen"]


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
    changed = quickstart_task(original, data_file, features=64, hidden=200)
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
