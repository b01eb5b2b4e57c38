"""Measurements of real local deployments (:class:`server.deploy.local.LocalDeployment`, every
process sampled from ``/proc`` by :mod:`server.deploy.resources`); docs/deployment.md gives the
method, the headlines and the commands.

- ``python -m benchmarks.deployment``: a deployed round of this project's app beside Flower's
  quickstart on the same work, one deployment per app and repeat, apps alternating. The
  quickstart is ``tests/apps/quickstart`` with a ``task.py`` that trains this project's MLP on
  its partitions (:func:`quickstart_copy`). ("Deployment figures")
- ``python -m benchmarks.deployment --secure RULE``: what secure aggregation costs a deployed run
  of this project's app, RULE without and with ``secure-aggregation = "secaggplus"``, per round
  (:func:`secure_figures`; docs/results/secure-aggregation.md, "One deployed run").
- ``python -m benchmarks.load`` (benchmarks/load.py) shares its launcher and page facts.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness import Stopwatch, command, save
from benchmarks.spec import REPO
from beyond_averaging.server.app import client_task, data_spec
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.deploy.flower_release import CLIENTAPP_EXECUTORS, FlowerRelease
from beyond_averaging.server.deploy.local import CONNECTION, LocalDeployment, SuperNodeProcess
from beyond_averaging.server.deploy.resources import (
    KINDS,
    MIB,
    PeakSampler,
    ProcessWatch,
    cpu_seconds_by,
    kinds_of,
)
from beyond_averaging.server.overrides import LaunchError, run_config_argument
from beyond_averaging.server.runs.folder import read_metrics
from beyond_averaging.server.runs.provenance import hardware_line
from beyond_averaging.server.runtime.watch import strip_ansi
from beyond_averaging.server.sweep.report import markdown_table
from beyond_averaging.tasks.federation import DataSpec, load_client_partition, load_server_splits
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.partition_cache import CACHE_ENV

RESULTS = REPO / "benchmarks" / "results" / "deployment"
QUICKSTART = REPO / "tests" / "apps" / "quickstart"
QUICKSTART_TASK = Path("pytorchexample") / "task.py"
TASK_MODULE = "pytorchexample.task"

#: The work both apps do: run-config settings of this project's app. ``weight-decay`` 0 and
#: ``lr-decay`` 1 (defaults 5e-4 and 0.99) make its update the quickstart's ``torch.optim.SGD(lr,
#: momentum=0.9)``; everything else is the app's default (digits, Dirichlet 0.5 partitions, the
#: MLP, 2 local epochs, batch 32, learning rate 0.05, momentum 0.9, FedAvg, no client evaluation).
WORK: dict[str, Any] = {
    "strategy": "fedavg",
    "dataset": "digits",
    "model": "mlp",
    "local-epochs": 2,
    "batch-size": 32,
    "learning-rate": 0.05,
    "momentum": 0.9,
    "weight-decay": 0.0,
    "lr-decay": 1.0,
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
}
APPS = {"project": "this project's app", "quickstart": "Flower's quickstart"}
#: Hidden width of this project's MLP (tasks/models.py), which the quickstart's copy trains too
#: (tests/test_deployment_benchmark.py holds the copy to the project's model, shape by shape).
HIDDEN = 200
#: Kinds whose one process's peak memory the page shows, after the nodes' own.
MEMORY_KINDS = ("clientapp", "serverapp", "superlink")

#: What a SuperNode logs when a train instruction reaches it (flwr 1.39 to 1.42).
RECEIVED_TRAIN = "Receiving: train message"


def spread(values: Sequence[float]) -> list[float]:
    """Smallest, mean and largest of ``values`` (load averages), to 0.1."""
    return [round(v, 1) for v in (min(values), statistics.fmean(values), max(values))]


def page_facts(module: str) -> dict[str, Any]:
    """When, how and where a page was measured, and the Flower release (its Fleet transport)."""
    release = FlowerRelease.installed()
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command(module),
        "flwr": release.version,
        "transport": "gRPC" if release.transport == "grpc" else "HTTP",
        "machine": hardware_line(),
        "cpus": os.cpu_count(),
    }


def round_intervals(receipts: Mapping[int, Sequence[float]], rounds: int) -> list[float] | None:
    """Seconds from the start of each round to the start of the next.

    ``receipts`` holds the times each node received a train instruction. Every node trains
    once per round, so its k-th receipt belongs to round k, and round k starts at the first
    node's. With any other count (a node missed a round) the rounds cannot be told apart and
    None is returned."""
    if not receipts or any(len(times) != rounds for times in receipts.values()):
        return None
    firsts = [min(sorted(times)[k] for times in receipts.values()) for k in range(rounds)]
    return [later - earlier for earlier, later in itertools.pairwise(firsts)]


class LogWatch:
    """When each line containing ``marker`` appeared in each log file, read as it grows."""

    def __init__(self, logs: Mapping[int, Path], marker: str) -> None:
        self.logs, self.marker = dict(logs), marker
        self.offsets = {key: path.stat().st_size for key, path in self.logs.items()}
        self.partial = dict.fromkeys(self.logs, b"")
        self.seen: dict[int, list[float]] = {key: [] for key in self.logs}

    def read(self) -> None:
        """Read what each log gained since the last call; time its complete marked lines."""
        now = time.monotonic()
        for key, path in self.logs.items():
            with path.open("rb") as log:
                log.seek(self.offsets[key])
                chunk = log.read()
            self.offsets[key] += len(chunk)
            *lines, self.partial[key] = (self.partial[key] + chunk).split(b"\n")
            marker = self.marker.encode()
            self.seen[key] += [now for line in lines if marker in line]


# --------------------------------------------------------------------------- the quickstart copy
def quickstart_task(original: str, data_file: Path, features: int, hidden: int) -> str:
    """Flower's quickstart ``task.py`` with this benchmark's model and data.

    Its imports, ``train`` and ``test`` stay as Flower wrote them; from ``class Net`` to
    ``def train`` is replaced: ``Net`` becomes this project's MLP (``features``-``hidden``-
    ``hidden``-10, ReLU) and ``load_data``/``load_centralized_dataset`` read the digits
    partitions and test split that :func:`write_digits` saved in ``data_file``."""
    start, end = original.index("class Net(nn.Module):"), original.index("def train(")
    middle = f'''import numpy as np
from torch.utils.data import StackDataset

# Changed for benchmarks/deployment.py: beyond-averaging's MLP and its digits partitions.
DATA_FILE = "{data_file}"


class Net(nn.Module):
    """Model (beyond-averaging's MLP: {features}-{hidden}-{hidden}-10, ReLU)"""

    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = nn.Linear({features}, {hidden})
        self.fc2 = nn.Linear({hidden}, {hidden})
        self.fc3 = nn.Linear({hidden}, 10)

    def forward(self, x):
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load partition data (beyond-averaging's digits partition, all of it for training)."""
    with np.load(DATA_FILE) as data:
        assert int(data["num_partitions"]) == num_partitions, "partitions saved for another N"
        images, labels = data[f"features_{{partition_id}}"], data[f"labels_{{partition_id}}"]
    partition = StackDataset(img=torch.from_numpy(images), label=torch.from_numpy(labels))
    trainloader = DataLoader(partition, batch_size=batch_size, shuffle=True)
    testloader = DataLoader(partition, batch_size=batch_size)  # unused: fraction-evaluate 0
    return trainloader, testloader


def load_centralized_dataset():
    """Load test set and return dataloader (beyond-averaging's digits test split)."""
    with np.load(DATA_FILE) as data:
        images, labels = data["test_features"], data["test_labels"]
    dataset = StackDataset(img=torch.from_numpy(images), label=torch.from_numpy(labels))
    return DataLoader(dataset, batch_size=128)


'''
    return original[:start] + middle + original[end:]


def quickstart_copy(destination: Path, data_file: Path, features: int, hidden: int) -> str:
    """Copy the quickstart app to ``destination`` with :func:`quickstart_task`'s ``task.py``;
    return the diff of ``task.py`` (the only file changed)."""
    shutil.copytree(QUICKSTART, destination)
    original = (QUICKSTART / QUICKSTART_TASK).read_text(encoding="utf-8")
    changed = quickstart_task(original, data_file, features, hidden)
    (destination / QUICKSTART_TASK).write_text(changed, encoding="utf-8")
    name = f"tests/apps/quickstart/{QUICKSTART_TASK.as_posix()}"
    lines = difflib.unified_diff(
        original.splitlines(keepends=True),
        changed.replace(str(data_file), "<the benchmark's digits.npz>").splitlines(keepends=True),
        fromfile=name,
        tofile=f"{name} (the benchmark's copy)",
    )
    return "".join(lines)


def write_digits(path: Path, settings: Mapping[str, Any], nodes: int) -> tuple[int, int]:
    """Save the clients' digits partitions and the server's test split of ``settings`` (as this
    project's app builds them; the partition cache is filled on the way) for the quickstart's
    copy; returns (input features, classes)."""
    config = parse_run_config(settings)
    spec = DataSpec.from_task(client_task(config), nodes)
    test_set, _ = load_server_splits(data_spec(config))
    arrays: dict[str, np.ndarray] = {"num_partitions": np.array(nodes)}
    for partition_id in range(nodes):
        partition = load_client_partition(spec, partition_id)
        arrays[f"features_{partition_id}"] = partition.features
        arrays[f"labels_{partition_id}"] = partition.labels
    arrays["test_features"], arrays["test_labels"] = test_set.features, test_set.labels
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return int(np.prod(test_set.input_shape)), test_set.num_classes


# ---------------------------------------------------------------------------------- measuring
def quickstart_settings(rounds: int) -> dict[str, Any]:
    """:data:`WORK` in the quickstart's run-config keys (its momentum, 0.9, is in its code)."""
    keys = ("fraction-evaluate", "local-epochs", "learning-rate", "batch-size")
    return {"num-server-rounds": rounds, **{key: WORK[key] for key in keys}}


def quickstart_run(deployment: LocalDeployment, rounds: int, timeout: float) -> float:
    """``flwr run <quickstart> <connection> --stream``; its final test accuracy
    (:func:`final_accuracy`) once ``flwr ls`` says the run completed."""
    arguments = ["run", str(deployment.staged_app), CONNECTION, "--stream"]
    arguments += ["--run-config", run_config_argument(quickstart_settings(rounds))]
    try:
        completed = deployment.flwr(*arguments, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"flwr run did not finish within {timeout} s") from None
    log = strip_ansi(completed.stdout + completed.stderr)
    listing = deployment.flwr("ls", CONNECTION, "--format", "json").stdout
    runs = json.loads(listing[listing.index("{") :]).get("runs", []) if "{" in listing else []
    status = str(runs[-1].get("status", "unknown")) if runs else "unknown"
    accuracy = final_accuracy(log)
    if not status.endswith("completed") or accuracy is None:
        raise LaunchError(f"the quickstart did not complete (status {status!r}): {log[-3000:]}")
    return round(accuracy, 4)


def final_accuracy(log: str) -> float | None:
    """The last round's ``accuracy`` in the ``ServerApp-side Evaluate Metrics`` of the ``Final
    results`` that Flower's ``Strategy.start`` logs (values as Flower writes them: quoted)."""
    evaluated = log.partition("ServerApp-side Evaluate Metrics:")[2]
    accuracies = re.findall(r"'accuracy': '?([-+.e0-9]+)", evaluated)
    return float(accuracies[-1]) if accuracies else None


def measure(app: str, app_dir: Path, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One deployment of ``app`` with ``--nodes`` SuperNodes: start it, run ``--rounds`` rounds
    under the process watch (the window is ``flwr run`` alone), stop it.

    This project's app runs as docs/deployment.md deploys it, each SuperNode under
    ``ba-supernode`` with ``--executor``; the quickstart as Flower runs it, bare
    ``flower-supernode`` processes with Flower's subprocess isolation. The secure-aggregation
    legs (:data:`SECURE_APPS`) run this project's app with ``--secure``'s rule, each node through
    a Fleet API byte counter, and mark the processes' CPU and the bytes at each round's end."""
    nodes, rounds, executor, secure = args.nodes, args.rounds, args.executor, app in SECURE_APPS
    project = app == "project" or secure
    executor = "warm" if app.startswith("user-warm") else executor
    deployment = LocalDeployment(
        app_dir,
        workdir,
        file_state=False,
        executor="warm" if executor == "warm" else "subprocess",
        pull_every=args.pull_every,
        warm=f"{TASK_MODULE}:warm" if app.startswith("user-warmed") else None,
    )
    row: dict[str, Any] = {"app": app, "nodes": nodes, "rounds": rounds}
    supervised = project or app.startswith("user-warm")
    row["executor"] = executor if supervised else "flower-subprocess"
    # PSS (read for the page's memory rows) is costly, and the secure legs show no memory.
    watch, load = ProcessWatch(os.getpid(), pss_every=math.inf if secure else 1.0), []
    marks: list[dict[str, Any]] = []  # the secure legs' readings at each round's end
    try:
        deployment.start()  # at most 10 s a node to be online, 2 minutes at least
        started_nodes = deployment.start_supernodes(
            nodes, supervised=supervised, relayed=secure, timeout=max(120.0, 10.0 * nodes)
        )
        watch.groups = {node.process.pid: f"node {i}" for i, node in enumerate(started_nodes)}
        run_settings = {**(secure_settings(app, args) if secure else WORK)}
        run_settings |= {"num-server-rounds": rounds, "num-clients": nodes, "run-name": "bench"}
        run_settings["output-dir"] = str(deployment.workdir / "runs")
        logs = {node.process.pid: node.log_path for node in deployment.supernodes}
        receipts = LogWatch(logs, RECEIVED_TRAIN)
        metrics_file = deployment.workdir / "runs" / "bench" / "metrics.jsonl"
        ticks, written = float(os.sysconf("SC_CLK_TCK")), [0]

        def sample() -> dict[str, float]:  # the processes, the logs and the load, each sample
            receipts.read()
            load.append(os.getloadavg()[0])
            memory = watch.sample()
            lines = metrics_file.read_bytes().count(b"\n") if metrics_file.is_file() else 0
            if secure and lines > written[0]:  # a round's line: its end
                marks.append(node_snapshot(watch, started_nodes, ticks))
                written[0] = lines
            return memory

        watch.open_window()
        with PeakSampler(sample, interval=args.interval) as sampler:
            started = time.monotonic()
            if project:
                run_dir = deployment.run(run_settings, timeout=args.timeout)
            else:
                accuracy = quickstart_run(deployment, rounds, args.timeout)
            seconds = time.monotonic() - started
        row["run-seconds"] = round(seconds, 2)
        if project:
            metrics = read_metrics(run_dir)
            row["app-round-seconds"] = [round(float(m["round-seconds"]), 2) for m in metrics[1:]]
            row["final-accuracy"] = round(float(metrics[-1]["test-accuracy"]), 4)
        else:
            row["final-accuracy"] = accuracy
        row.update(figures(watch, sampler.peaks, rounds, receipts.seen, load))
        row.update(secure_figures(marks, metrics) if secure else {})
        row["status"] = "completed"
    except (LaunchError, OSError, KeyError, ValueError) as error:
        row["status"] = "failed"
        row["error"] = f"{type(error).__name__}: {error}"[:3000]
    finally:
        deployment.close()
    return row


def figures(
    watch: ProcessWatch,
    node_peaks: Mapping[str, float],
    rounds: int,
    receipts: Mapping[int, Sequence[float]],
    load: Sequence[float],
) -> dict[str, Any]:
    """The figures of one run from its process watch, the SuperNodes' peak memory, the times
    each node received a train instruction and the load averages sampled."""
    ticks = float(os.sysconf("SC_CLK_TCK"))
    processes = watch.processes
    kinds = kinds_of(processes, watch.root)
    seconds, recovered = cpu_seconds_by(processes, kinds, ticks)
    seconds = {kind: seconds.get(kind, 0.0) for kind in KINDS}
    clientapps = [pid for pid, kind in kinds.items() if kind == "clientapp"]
    intervals = round_intervals(receipts, rounds)
    peak_rss = dict.fromkeys(KINDS, 0.0)
    for pid, process in processes.items():
        peak_rss[kinds[pid]] = max(peak_rss[kinds[pid]], process.peak_rss_pages * watch.page)
    nodes = [value for key, value in node_peaks.items() if key.startswith("rss-")]
    proportional = [value for key, value in node_peaks.items() if key.startswith("pss-")]

    def mean_mb(values: Sequence[float]) -> float | None:
        return round(statistics.fmean(values) / MIB, 1) if values else None

    return {
        "round-seconds": None if intervals is None else [round(s, 2) for s in intervals],
        "cpu-seconds": {kind: round(value, 2) for kind, value in seconds.items()},
        "cpu-from-reaped-times": {k: round(v, 2) for k, v in recovered.items() if v},
        "other-processes": sorted(processes[p].last.comm for p, k in kinds.items() if k == "other"),
        "clientapp-processes": len(clientapps),
        "clientapp-cpu-seconds-each": sorted(
            round(processes[pid].own_ticks / ticks, 2) for pid in clientapps
        ),
        "train-messages-per-node": sorted(len(times) for times in receipts.values()),
        "peak-rss-mb": {kind: round(value / MIB, 1) for kind, value in peak_rss.items() if value},
        "node-peak-rss-mb": mean_mb(nodes),
        "node-peak-rss-mb-max": round(max(nodes) / MIB, 1) if nodes else None,
        "node-peak-pss-mb": mean_mb(proportional),
        "load-average": spread(load),
        "samples": watch.samples,
    }


# ------------------------------------------------------------------------------- the summary
def per_round(row: Mapping[str, Any], kind: str | None = None) -> float:
    """CPU seconds per round of one run: of one kind, or (``None``) of the deployment's every
    process (all but the benchmark's own)."""
    cpu = row["cpu-seconds"]
    if kind is not None:
        return float(cpu.get(kind, 0.0)) / int(row["rounds"])
    return sum(float(v) for k, v in cpu.items() if k != "benchmark") / int(row["rounds"])


def round_median(row: Mapping[str, Any]) -> float:
    """The run's median seconds per round: of its round intervals, else its wall time / rounds."""
    intervals = row.get("round-seconds")
    if intervals:
        return float(statistics.median(intervals))
    return float(row["run-seconds"]) / int(row["rounds"])


def summarize(rows: Sequence[Mapping[str, Any]], legs: Iterable[str] = APPS) -> dict[str, Any]:
    """Each of ``legs``' figures (medians over its completed runs), the ratios project/quickstart,
    each taken within a repeat (both apps of a repeat ran back to back) and then the median."""
    done = [row for row in rows if row["status"] == "completed"]
    apps: dict[str, dict[str, Any]] = {}
    for app in legs:
        mine = [row for row in done if row["app"] == app]
        if not mine:
            continue
        intervals = [s for row in mine for s in row.get("round-seconds") or []]
        kinds = {kind: statistics.median(per_round(row, kind) for row in mine) for kind in KINDS}
        memory = {
            kind: max(row["peak-rss-mb"].get(kind, 0.0) for row in mine)
            for kind in KINDS
            if any(kind in row["peak-rss-mb"] for row in mine)
        }
        apps[app] = {
            "runs": len(mine),
            "seconds-per-round": statistics.median(round_median(row) for row in mine),
            "round-seconds": intervals,
            "run-seconds": statistics.median(row["run-seconds"] for row in mine),
            "cpu-per-round": statistics.median(per_round(row) for row in mine),
            "cpu-per-round-by-kind": kinds,
            "clientapps-per-round": statistics.median(
                row["clientapp-processes"] / row["rounds"] for row in mine
            ),
            # Every node trains every round: nodes x rounds train instructions.
            "cpu-per-message": statistics.median(map(message_cpu, mine)),
            "cpu-per-clientapp-median": statistics.median(
                statistics.median(row["clientapp-cpu-seconds-each"]) for row in mine
            ),
            "node-peak-rss-mb": max(row["node-peak-rss-mb"] or 0.0 for row in mine),
            "node-peak-pss-mb": max(row.get("node-peak-pss-mb") or 0.0 for row in mine),
            "peak-rss-mb": memory,
            "final-accuracy": [row["final-accuracy"] for row in mine],
        }
    ratios: dict[str, list[float]] = {"seconds-per-round": [], "cpu-per-round": []}
    for repeat in sorted({row["repeat"] for row in done}):
        pair = {row["app"]: row for row in done if row["repeat"] == repeat}
        if set(pair) == set(APPS):
            project, flower = pair["project"], pair["quickstart"]
            ratios["seconds-per-round"].append(round_median(project) / round_median(flower))
            ratios["cpu-per-round"].append(per_round(project) / per_round(flower))
    return {
        "apps": apps,
        "ratios": {key: [round(v, 3) for v in values] for key, values in ratios.items()},
        "ratio-medians": {
            key: round(statistics.median(values), 3) for key, values in ratios.items() if values
        },
    }


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> str:
    """The published page: the headline table, each run, the method and the quickstart's diff."""
    summary = summarize(rows)
    apps, ratio = summary["apps"], summary["ratio-medians"]
    project, flower = apps.get("project", {}), apps.get("quickstart", {})
    lines = [
        f"# A deployed round: this project's app beside Flower's quickstart (flwr {meta['flwr']}, "
        f"{meta['transport']} Fleet API)",
        "",
        f"Measured {meta['date']} with `{meta['command']}` on {meta['machine']}: "
        f"{meta['cpus']} CPU cores shared with other jobs (load average during the runs: "
        f"{meta['load']}; the ratios are taken within each repeat, both apps back to back). "
        f"Per app and repeat a SuperLink (state in memory) and {meta['nodes']} SuperNodes on "
        f"loopback; this project's under `ba-supernode` with the "
        f"{meta.get('executor', 'subprocess')} executor, `--pull-every "
        f"{meta.get('pull_every', 3) or 0.2:g}` (3: Flower's), the quickstart's as Flower runs; "
        f"{meta['rounds']} rounds, {meta['repeats']} repeats, apps alternating ({meta['order']}); "
        f"{meta['threads']} torch thread per process (`OMP_NUM_THREADS`), niced by 10.",
        "",
        "The work, the same for both, as this project's run configuration: "
        + ", ".join(f"`{key} = {json.dumps(value)}`" for key, value in WORK.items())
        + f"; the MLP {meta['model']} "
        f"({meta['parameters']:,} parameters); what that means, and the method: "
        "[deployment](../deployment.md#deployment-figures).",
        "",
    ]
    cells: list[list[object]] = []

    def add(name: str, key: str, digits: int = 1, ratio_key: str | None = None) -> None:
        a, b = project.get(key), flower.get(key)
        paired = ratio.get(ratio_key) if ratio_key else None
        quotient = paired if paired is not None else (a / b if a and b else None)
        cells.append([name, _f(a, digits), _f(b, digits), _f(quotient, 2)])

    add("seconds per round (median)", "seconds-per-round", 1, "seconds-per-round")
    add("`flwr run` wall seconds (whole run)", "run-seconds", 1)
    add("CPU seconds per round, the deployment's processes", "cpu-per-round", 1, "cpu-per-round")
    for kind, name in KINDS.items():
        a = project.get("cpu-per-round-by-kind", {}).get(kind, 0.0)
        b = flower.get("cpu-per-round-by-kind", {}).get(kind, 0.0)
        if a or b:
            cells.append([f"- {name}", _f(a, 2), _f(b, 2), _f(a / b if b else None, 2)])
    add("ClientApp processes per round", "clientapps-per-round", 1)
    add("ClientApp CPU seconds per train instruction", "cpu-per-message", 2)
    add("CPU seconds of one ClientApp process (median)", "cpu-per-clientapp-median", 2)
    add("peak RSS per node (MB): every process of the node, summed", "node-peak-rss-mb", 0)
    add("peak PSS per node (MB): the same, shared pages counted once", "node-peak-pss-mb", 0)
    for kind in ("supernode", "superexec-node", "supervisor", "warm-executor", *MEMORY_KINDS):
        a, b = (app.get("peak-rss-mb", {}).get(kind) for app in (project, flower))
        name = f"- peak RSS of one {KINDS[kind]} (MB)"
        cells.append([name, _f(a, 0), _f(b, 0), _f(a / b if a and b else None, 2)])
    header = ["per run (median of the repeats)", APPS["project"], APPS["quickstart"], "ratio"]
    lines += [markdown_table(header, cells)]
    lines += [
        f"Ratio: {APPS['project']} / {APPS['quickstart']}; for seconds and CPU per round the "
        "median of the per-repeat ratios "
        f"(seconds: {summary['ratios']['seconds-per-round']}, CPU: "
        f"{summary['ratios']['cpu-per-round']}). Final test accuracy: "
        f"{project.get('final-accuracy')} (this project) and {flower.get('final-accuracy')} "
        "(quickstart).",
        "",
        "## Each run",
        "",
    ]
    run_cells = []
    for row in rows:
        if row["status"] != "completed":
            error = row["error"].splitlines()[0][:300].replace("|", "/")
            run_cells.append([row["repeat"], APPS[row["app"]], *["-"] * 6, f"failed: {error}"])
            continue
        rounds = ", ".join(map(str, row["round-seconds"] or ["-"]))
        figures = [row["run-seconds"], _f(per_round(row), 1), row["clientapp-processes"]]
        load = " / ".join(map(str, row["load-average"]))
        run_cells.append([row["repeat"], APPS[row["app"]], rounds, *figures])
        run_cells[-1] += [row["node-peak-rss-mb"], load, "completed"]
    head = "repeat | app | seconds of each round | run seconds | CPU s per round"
    head += " | ClientApp processes | peak RSS per node (MB) | load average min / mean / max"
    head += " | status"
    lines += [markdown_table(head.split(" | "), run_cells)]
    lines += [
        "## Method",
        "",
        f"Every process sampled from `/proc` every {meta['interval']} s; what each figure counts, "
        "and what it misses: "
        "[deployment](../deployment.md#how-the-deployment-figures-are-measured).",
        "",
        "## What the quickstart copy changes",
        "",
        "`tests/apps/quickstart` is Flower's examples/quickstart-pytorch; the copy changes "
        "`task.py` only, as below, and the run's settings go in `--run-config` ("
        + ", ".join(f"`{k} = {v}`" for k, v in quickstart_settings(meta["rounds"]).items())
        + ").",
        "",
        "```diff",
        meta["quickstart-diff"].rstrip("\n"),
        "```",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------ the user-app leg
#: ``--user RULE``: the quickstart copy with the rule's recipes from docs/ and the docs' ``warm()``,
#: under Flower's subprocess isolation and under ``ba-supernode``'s warm executor, without and
#: with ``--warm`` (docs/deployment.md), and with it and docs/library.md's ``polling-server``.
USER_APPS = {
    "user-flower": "Flower's subprocess isolation",
    "user-warm": "`ba-supernode` (warm executor)",
    "user-warmed": f"the same, `--warm {TASK_MODULE}:warm`",
    "user-warmed-polled": "the same, and `polling(grid)`",
}
_RECIPE = re.compile(r"^<!-- recipe: ([\w-]+) -->\n```diff\n(.*?)^```", re.MULTILINE | re.DOTALL)


def apply_recipe(source: str, name: str) -> str:
    """``source`` with the docs' ``diff`` recipe ``name`` (none: unchanged): each hunk's context
    and removed lines must occur once, and become its context and added lines."""
    pages = [page.read_text(encoding="utf-8") for page in (REPO / "docs").glob("*.md")]
    text = f"\n{source}"
    for found, diff in (found for page in pages for found in _RECIPE.findall(page)):
        for hunk in re.split(r"^@@.*\n", diff, flags=re.MULTILINE) if found == name else []:
            lines = hunk.splitlines()
            old, new = ("".join(f"\n{line[1:]}" for line in lines if line[:1] != x) for x in "+-")
            if lines and text.count(f"{old}\n") != 1:
                raise ValueError(f"recipe {name}: {old!r} is not in the app exactly once")
            text = text.replace(f"{old}\n", f"{new}\n") if lines else text
    return text[1:]


def user_app(quickstart: Path, destination: Path, rule: str, *extras: str) -> Path:
    """The quickstart copy with ``rule``'s recipes, then server recipes ``extras``, and warm()."""
    shutil.copytree(quickstart, destination)
    package = destination / "pytorchexample"
    recipes = {"server_app.py": (f"{rule}-server", *extras), "client_app.py": (f"{rule}-client",)}
    for module, names in recipes.items():
        source = (package / module).read_text(encoding="utf-8")
        for name in names:
            source = apply_recipe(source, name)
        (package / module).write_text(source, encoding="utf-8")
    page = (REPO / "docs" / "deployment.md").read_text(encoding="utf-8")
    warm = re.search(r"^def warm\(node_config\):\n.*?(?=^```)", page, re.MULTILINE | re.DOTALL)
    assert warm is not None, "docs/deployment.md has no def warm(node_config):"
    with (destination / QUICKSTART_TASK).open("a", encoding="utf-8") as task:
        task.write(f"\n\n{warm.group(0)}")
    return destination


def in_process_round(app_dir: Path, nodes: int) -> float:
    """Wall seconds of one round's training in this Python: the app's ``train`` on every node's
    partition (``WORK``'s epochs and rate), the second of two rounds (the first call paid)."""
    sys.path.insert(0, str(app_dir))
    task = importlib.import_module(TASK_MODULE)
    for _ in range(2):
        with Stopwatch() as clock:
            for partition in range(nodes):
                loader, _ = task.load_data(partition, nodes, WORK["batch-size"])
                task.train(task.Net(), loader, WORK["local-epochs"], WORK["learning-rate"], "cpu")
    return round(clock.wall, 2)


def user_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per leg, :func:`summarize`'s figures, and per repeat its ClientApp CPU per message over
    Flower's isolation's."""
    done = [row for row in rows if row["status"] == "completed"]
    flower = {row["repeat"]: message_cpu(row) for row in done if row["app"] == "user-flower"}
    legs: dict[str, dict[str, Any]] = summarize(done, USER_APPS)["apps"]
    for app, leg in legs.items():
        mine = [row for row in done if row["app"] == app and row["repeat"] in flower]
        leg["cpu-per-message-ratios"] = [
            round(message_cpu(row) / flower[row["repeat"]], 3) for row in mine
        ]
    return legs


def message_cpu(row: Mapping[str, Any]) -> float:
    """ClientApp CPU seconds per train instruction (every node trains every round)."""
    return float(row["cpu-seconds"]["clientapp"]) / int(row["nodes"] * row["rounds"])


def user_markdown(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> str:
    """The user-app leg's page: one column per leg (each run's figures: the saved JSON)."""
    legs, in_process = user_summary(rows), meta["in-process-round-seconds"]
    failed = [f"{row['app']}: {row['error'][:300]}" for row in rows if row["status"] != "completed"]
    lines = [
        f"# A user's app deployed: Flower's quickstart with the {meta['rule']} recipes (flwr "
        f"{meta['flwr']}, {meta['transport']} Fleet API)",
        "",
        f"Measured {meta['date']} with `{meta['command']}` on {meta['machine']}: {meta['cpus']} "
        f"CPU cores shared with other jobs (load average: {meta['load']}). The quickstart copy "
        f"of [the deployment page](deployment-{meta['transport'].lower()}.md) (Flower's code, "
        f"this project's MLP and digits partitions) with the docs' `{meta['rule']}-server` and "
        f"`{meta['rule']}-client` recipes and the docs' `warm()` in its `task.py`; "
        f"{meta['nodes']} SuperNodes, {meta['rounds']} rounds, {meta['repeats']} repeats, legs "
        f"in turn ({meta['order']}). The same round's training in one Python (every node's "
        f"`train`, not the recipe's extra pass): {in_process} s. Failed runs: {failed or 'none'}.",
        "",
    ]
    cells: list[list[object]] = []
    for name, key, digits in (
        ("seconds per round (median)", "seconds-per-round", 1),
        ("CPU seconds per round, the deployment's processes", "cpu-per-round", 1),
        ("ClientApp CPU seconds per train instruction", "cpu-per-message", 2),
    ):
        cells.append([name, *(_f(legs.get(app, {}).get(key), digits) for app in USER_APPS)])
    for name, key in (
        ("ClientApp CPU per message / Flower's isolation's, per repeat", "cpu-per-message-ratios"),
        ("final test accuracy", "final-accuracy"),
    ):
        cells.append([name, *(legs.get(app, {}).get(key) for app in USER_APPS)])
    rounds = [legs.get(app, {}).get("seconds-per-round") for app in USER_APPS]
    cells.append(
        ["seconds per round / the in-process round", *(_f(s and s / in_process) for s in rounds)]
    )
    lines += [markdown_table(["per run (median of the repeats)", *USER_APPS.values()], cells)]
    return "\n".join(lines)


# ------------------------------------------------------------ the secure-aggregation leg
#: ``--secure RULE``: this project's app with RULE, without and with SecAgg+, on its settings
#: below and the app's defaults otherwise (not :data:`WORK`: the cost of the protocol, not a
#: comparison with the quickstart).
SECURE_APPS = {"plain": "no", "secure": "secaggplus"}
SECURE_WORK = {"dataset": "digits", "model": "mlp", "fraction-train": 1.0, "seed": 0}
#: The secure legs' figures per round, each the median over the repeats in :func:`secure_table`.
SECURE_FIGURES = ("serverapp-cpu-s", "clientapp-cpu-s", "node-up-kB", "node-down-kB", "round-s")


def secure_settings(app: str, args: argparse.Namespace) -> dict[str, Any]:
    """The run settings of a secure-aggregation leg (every node's reply needed when secure)."""
    settings: dict[str, Any] = {"strategy": args.secure, **SECURE_WORK}
    if app == "secure":
        settings |= {"secure-aggregation": "secaggplus", "min-train-replies": args.nodes}
    return settings


def node_snapshot(
    watch: ProcessWatch, nodes: Sequence[SuperNodeProcess], ticks: float
) -> dict[str, Any]:
    """CPU seconds so far of the ServerApp and of each node's ClientApps, and each node's Fleet
    API bytes (sent, received), from the watch's last sample (its groups: ``node <i>``)."""
    kinds = kinds_of(watch.processes, watch.root)
    by_kind, _ = cpu_seconds_by(watch.processes, kinds, ticks)
    # A node's ClientApps with the warm executor that forks them: a ClientApp that ended
    # between two samples is in the executor's reaped-children time (subtrees), and the
    # executor itself idles between messages.
    apps = {pid: kind in ("clientapp", "warm-executor") for pid, kind in kinds.items()}
    groups = {pid: watch.group_of(pid) or "other" for pid in watch.processes}
    per_node = {pid: f"{groups[pid]}-clientapp" if apps[pid] else "rest" for pid in groups}
    by_node, _ = cpu_seconds_by(watch.processes, per_node, ticks, subtrees=True)
    return {
        "serverapp": by_kind.get("serverapp", 0.0),
        "clientapp": [by_node.get(f"node {i}-clientapp", 0.0) for i in range(len(nodes))],
        "bytes": [node.relay.counts() if node.relay else (0, 0) for node in nodes],
    }


def secure_figures(
    marks: Sequence[Mapping[str, Any]], metrics: Sequence[Mapping[str, Any]]
) -> dict[str, float]:
    """A secure leg's figures per round, from the end of round 0 (the initial evaluation) to the
    end of the last: the ServerApp's CPU seconds, one node's ClientApps' (the mean over the
    nodes), one node's kB sent to and received from the Fleet API, the app's round seconds."""
    rounds = len(metrics) - 1
    if len(marks) != rounds + 1:
        raise ValueError(f"{len(marks)} round ends read for {rounds} rounds and round 0")
    first, last = marks[0], marks[-1]
    clientapps = zip(first["clientapp"], last["clientapp"], strict=True)
    sent = list(zip(first["bytes"], last["bytes"], strict=True))
    return {
        "serverapp-cpu-s": (last["serverapp"] - first["serverapp"]) / rounds,
        "clientapp-cpu-s": statistics.mean((b - a) / rounds for a, b in clientapps),
        "node-up-kB": statistics.mean((b[0] - a[0]) / rounds / 1e3 for a, b in sent),
        "node-down-kB": statistics.mean((b[1] - a[1]) / rounds / 1e3 for a, b in sent),
        "round-s": statistics.mean(float(m["round-seconds"]) for m in metrics[1:]),
        "test-accuracy": float(metrics[-1]["test-accuracy"]),
    }


def secure_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table: the median of each figure over the completed repeats, per leg."""
    lines = [
        "| secure aggregation | ServerApp CPU s | one node's ClientApps CPU s | node up kB "
        "| node down kB | round s | final accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for app, shown_as in SECURE_APPS.items():
        mine = [row for row in rows if row["app"] == app and row["status"] == "completed"]
        if not mine:
            errors = [row.get("error", "") for row in rows if row["app"] == app] or ["not run"]
            lines.append(f"| {shown_as} | failed: {errors[-1][:300].replace(chr(10), ' ')} |")
            continue
        values = [statistics.median(row[name] for row in mine) for name in SECURE_FIGURES]
        lines.append(
            f"| {shown_as} | {values[0]:.2f} | {values[1]:.2f} | {values[2]:.0f} | "
            f"{values[3]:.0f} | {values[4]:.1f} | {mine[-1]['test-accuracy']:.4f} |"
        )
    return "\n".join(lines)


def measure_all(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Alternate the two apps for ``args.repeats`` repeats; the rows and the page's facts."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ba-deploy-bench-") as scratch_dir:
        scratch = Path(scratch_dir)
        os.environ[CACHE_ENV] = str(scratch / "partitions")  # inherited by every process
        settings = {**WORK, "num-clients": args.nodes}
        data_file = scratch / "digits.npz"
        features, classes = write_digits(data_file, settings, args.nodes)
        diff = quickstart_copy(scratch / "quickstart", data_file, features, HIDDEN)
        parameters = sum(p.numel() for p in build_model("mlp", (features,), classes).parameters())
        order, apps = [], ["project", "quickstart"]
        if args.user:  # the warm-up's module is imported where ba-supernode runs
            user = user_app(scratch / "quickstart", scratch / "user", args.user)
            user_app(scratch / "quickstart", scratch / "user-polled", args.user, "polling-server")
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [str(user), os.environ.get("PYTHONPATH", "")]
            )
            apps, in_process = list(USER_APPS), in_process_round(user, args.nodes)
        apps = list(SECURE_APPS) if args.secure else apps
        for repeat in range(1, args.repeats + 1):
            apps = apps[1:] + apps[:1] if repeat > 1 else apps
            order.append(" ".join(app.removeprefix("user-") for app in apps))
            for app in apps:
                app_dir = REPO if app in ("project", *SECURE_APPS) else scratch / "quickstart"
                app_dir = scratch / "user" if app in USER_APPS else app_dir
                app_dir = scratch / "user-polled" if app.endswith("-polled") else app_dir
                row = measure(app, app_dir, scratch / f"{app}-{repeat}", args)
                rows.append({"repeat": repeat, **row})
                print(json.dumps(rows[-1]), flush=True)
    loads = [row["load-average"][1] for row in rows if row["status"] == "completed"]
    options = ("nodes", "executor", "pull_every", "rounds", "repeats", "threads", "interval")
    meta = {
        **page_facts("deployment"),
        **{option: getattr(args, option) for option in options},
        "load": f"mean {min(loads):.1f} to {max(loads):.1f} per run" if loads else "-",
        "order": ", ".join(order),
        "model": f"{features}-{HIDDEN}-{HIDDEN}-{classes}",
        "parameters": parameters,
        "quickstart-diff": diff,
    }
    if args.user:
        meta |= {"rule": args.user, "in-process-round-seconds": in_process}
    return rows, meta


def main() -> None:
    """Measure (or, with ``--render``, read back) the runs; print and save the rows and page."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples")
    threads = "torch threads per process (default 1; --secure: torch's default)"
    parser.add_argument("--threads", type=int, help=threads)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    rerender = "measure nothing: write the page again from this release's saved rows"
    parser.add_argument("--render", action="store_true", help=rerender)
    executor = "how this project's SuperNodes run ClientApps (the quickstart: Flower's own)"
    parser.add_argument("--executor", choices=CLIENTAPP_EXECUTORS, default="warm", help=executor)
    pace = "ba-supernode --pull-every for this project's SuperNodes (3: Flower's fixed pace)"
    parser.add_argument("--pull-every", type=float, metavar="SECONDS", help=pace)
    user = "measure the user-app leg instead: the quickstart with RULE's recipes (e.g. elastic)"
    parser.add_argument("--user", metavar="RULE", help=user)
    secure = "measure secure aggregation's cost instead: RULE without and with secaggplus"
    parser.add_argument("--secure", metavar="RULE", help=secure)
    parser.add_argument("--publish", action="store_true")
    args = parser.parse_args()
    # SIGTERM unwinds the runs, so that every process they started is stopped by PID (a shell's
    # background job ignores SIGINT).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: a round's seconds are read between rounds")
    if args.secure and args.user:
        parser.error("--secure and --user measure different legs: give one")
    args.threads = args.threads or (None if args.secure else 1)
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)  # this process too (it loads the data)
    if args.secure:
        print(secure_table(measure_all(args)[0]))
        return
    name = f"deployment-{FlowerRelease.installed().transport}"
    name = name.replace("-", f"-user-{args.user}-", 1) if args.user else name
    saved = RESULTS / f"{name}.json"
    if args.render:
        if not saved.is_file():
            parser.error(f"{saved} is missing: measure the runs first")
        record = json.loads(saved.read_text(encoding="utf-8"))
        rows, meta = record["rows"], record["meta"]
    else:
        rows, meta = measure_all(args)
    if args.user:
        record = {"meta": meta, "rows": rows, "summary": user_summary(rows)}
        save("deployment", name, user_markdown(rows, meta), record, args.publish)
        return
    record = {"meta": meta, "rows": rows, "summary": summarize(rows)}
    save("deployment", name, markdown(rows, meta), record, args.publish)


if __name__ == "__main__":
    main()
