"""How many SuperNodes one SuperLink holds on this machine, for the default model.

For each federation size N (default 5, 10, 20, 50) the benchmark starts a SuperLink and N
SuperNodes as local processes on loopback (``tests/deploy_helpers.LocalDeployment``: the same
processes as a deployment, plain gRPC), waits until all N are online, runs the app's default
configuration (digits, the MLP, every node trains each round) for a few rounds with
``num-clients = N``, and reports

- seconds until all N nodes were online, and each round's wall time (``round-seconds`` of the
  run's metrics: send, train on every node, receive, aggregate, evaluate);
- resident memory: the SuperLink, the ServerApp (peak, ``VmHWM``), and per node the SuperNode
  process with the ClientApp processes it starts (the peak of their sum over the run, divided
  by N);
- the run's status and, for a size that fails, the first error.

Before each size it checks ``MemAvailable`` against the per-node memory of the previous size
and skips sizes that would not fit (with the reason), because the machine is shared. Every
process is stopped by PID (each in its own process group), never by name.

Usage::

    nice -n 10 .venv/bin/python -m benchmarks.load                      # 5 10 20 50, 2 rounds
    nice -n 10 .venv/bin/python -m benchmarks.load --sizes 5 10 --rounds 3 --publish

``--publish`` writes ``docs/results/load.md`` (the table) besides the JSON in
``benchmarks/results/load/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from beyond_averaging.server.launch import LaunchError
from tests.deploy_helpers import (
    REPO,
    LocalDeployment,
    PeakMemory,
    peak_rss_bytes,
    read_metrics,
)

RESULTS = REPO / "benchmarks" / "results" / "load"
PUBLISHED = REPO / "docs" / "results" / "load.md"
MIB = 2**20


def rss_bytes(pid: int) -> int:
    """Current resident memory of a process (``VmRSS``), 0 once it ended."""
    try:
        status = (Path("/proc") / str(pid) / "status").read_text(encoding="utf-8")
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def available_bytes() -> int:
    """``MemAvailable`` of this machine."""
    for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def process_table() -> tuple[dict[int, list[int]], dict[int, int]]:
    """Children of every process and every process's RSS in bytes, from one ``ps`` call."""
    listing = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,rss="], capture_output=True, text=True, check=False
    ).stdout
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for line in listing.splitlines():
        pid, parent, kilobytes = (int(field) for field in line.split())
        children.setdefault(parent, []).append(pid)
        rss[pid] = kilobytes * 1024
    return children, rss


def tree_rss(pid: int, children: dict[int, list[int]], rss: dict[int, int]) -> int:
    """Summed RSS of a process and everything below it."""
    total, frontier = 0, [pid]
    while frontier:
        total += sum(rss.get(p, 0) for p in frontier)
        frontier = [child for p in frontier for child in children.get(p, [])]
    return total


class NodeMemory:
    """The peak over time of the summed RSS of every SuperNode and its ClientApp processes."""

    def __init__(self, deployment: LocalDeployment, interval: float = 1.0) -> None:
        self.deployment, self.interval = deployment, interval
        self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            children, rss = process_table()
            total = sum(
                tree_rss(node.process.pid, children, rss) for node in self.deployment.supernodes
            )
            self.peak_total = max(self.peak_total, total)
            self._stop.wait(self.interval)

    def __enter__(self) -> NodeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(size: int, rounds: int, workdir: Path, timeout: float) -> dict[str, Any]:
    """One federation of ``size`` SuperNodes: start, run ``rounds`` rounds, stop."""
    row: dict[str, Any] = {"supernodes": size, "rounds": rounds}
    # In-memory SuperLink state: with its SQLite file, 7 of 10 replies failed here with
    # "database is locked" (Flower's 5 s busy_timeout on a loaded machine); see docs/results.
    deployment = LocalDeployment(REPO, workdir / f"n{size}", file_state=False)
    started = time.monotonic()
    try:
        deployment.start()
        for partition in range(size):
            deployment.start_supernode(partition, size)
        deployment.wait_for_nodes(size, timeout=max(120.0, 5.0 * size))
        row["seconds-to-online"] = round(time.monotonic() - started, 1)
        row["supernode-idle-rss-mb"] = round(
            sum(rss_bytes(n.process.pid) for n in deployment.supernodes) / size / MIB, 1
        )
        settings = {
            "num-clients": size,
            "num-server-rounds": rounds,
            "round-timeout": 1800.0,  # measure slow rounds instead of dropping their replies
            "run-name": f"load-{size}",
            "output-dir": str(deployment.workdir / "runs"),
        }
        assert deployment.superlink is not None
        with NodeMemory(deployment) as nodes, PeakMemory(deployment.serverapp_pids) as server:
            run_started = time.monotonic()
            run_dir = deployment.run(settings, timeout=timeout)
            row["run-seconds"] = round(time.monotonic() - run_started, 1)
            row["superlink-peak-rss-mb"] = round(peak_rss_bytes(deployment.superlink.pid) / MIB, 1)
        metrics = read_metrics(run_dir)
        row["round-seconds"] = [round(float(m["round-seconds"]), 1) for m in metrics[1:]]
        row["replies-valid"] = [m.get("replies-valid") for m in metrics[1:]]
        row["final-accuracy"] = round(float(metrics[-1]["test-accuracy"]), 4)
        row["serverapp-peak-rss-mb"] = round(server.peak / MIB, 1)
        row["node-peak-rss-mb-per-node"] = round(nodes.peak_total / size / MIB, 1)
        row["status"] = "completed"
    except (LaunchError, OSError, AssertionError) as error:
        row["status"] = "failed"
        row["error"] = f"{type(error).__name__}: {error}"[:2000]
    finally:
        deployment.close()
    return row


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The published table."""
    lines = [
        "# SuperNodes per SuperLink: load on this machine",
        "",
        f"Measured {meta['date']} with `{meta['command']}` on {meta['machine']}: "
        f"{meta['cpus']} CPU cores and {meta['memory-gib']} GiB shared with other jobs (several "
        "agents ran tests and benchmarks on the same machine meanwhile, so times are upper "
        "bounds). Default configuration (digits, MLP, 2 local epochs, every node trains every "
        "round), plain gRPC on loopback, one SuperLink; each SuperNode starts its ClientApp in "
        "a process of its own (Flower's default isolation).",
        "",
        "| SuperNodes | online after (s) | round seconds | ServerApp peak RSS (MB) | SuperLink "
        "peak RSS (MB) | per node: idle / peak RSS (MB) | valid replies | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["status"] == "skipped":
            lines.append(f"| {row['supernodes']} | - | - | - | - | - | - | skipped: {row['why']} |")
            continue
        if row["status"] == "failed":
            lines.append(
                f"| {row['supernodes']} | {row.get('seconds-to-online', '-')} | - | - | - | - | - "
                f"| failed: {row['error'][:200]} |"
            )
            continue
        lines.append(
            f"| {row['supernodes']} | {row['seconds-to-online']} | "
            f"{', '.join(map(str, row['round-seconds']))} | {row['serverapp-peak-rss-mb']} | "
            f"{row['superlink-peak-rss-mb']} | {row['supernode-idle-rss-mb']} / "
            f"{row['node-peak-rss-mb-per-node']} | {row['replies-valid']} | completed |"
        )
    lines += [
        "",
        "Per node: the SuperNode process alone when idle, and the peak over the run of the sum "
        "of every SuperNode with its ClientApp processes, divided by the number of nodes.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    """Measure each size in turn; print and save the rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[5, 10, 20, 50])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument(
        "--reserve-gib", type=float, default=4.0, help="memory left to others on a shared machine"
    )
    parser.add_argument("--publish", action="store_true")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    per_node = 0.0
    with tempfile.TemporaryDirectory(prefix="ba-load-") as scratch:
        for size in sorted(args.sizes):
            spare = available_bytes() - args.reserve_gib * 2**30
            if per_node and size * per_node > spare:
                why = (
                    f"needs about {size * per_node / 2**30:.1f} GiB at "
                    f"{per_node / MIB:.0f} MB per node, {max(spare, 0) / 2**30:.1f} GiB spare"
                )
                rows.append({"supernodes": size, "status": "skipped", "why": why})
                print(json.dumps(rows[-1]), flush=True)
                continue
            row = measure(size, args.rounds, Path(scratch), args.timeout)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if row["status"] == "completed":
                per_node = row["node-peak-rss-mb-per-node"] * MIB
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "nice -n 10 .venv/bin/python -m benchmarks.load "
        + " ".join(f"--sizes {' '.join(map(str, args.sizes))} --rounds {args.rounds}".split()),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "memory-gib": round(int(Path("/proc/meminfo").read_text().split()[1]) * 1024 / 2**30, 1),
    }
    (RESULTS / "load.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    if args.publish:
        PUBLISHED.parent.mkdir(parents=True, exist_ok=True)
        PUBLISHED.write_text(markdown(rows, meta), encoding="utf-8")
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
