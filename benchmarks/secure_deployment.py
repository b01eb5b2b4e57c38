"""What secure aggregation costs a deployed run: CPU seconds and Fleet API bytes per round.

A SuperLink and ``--nodes`` SuperNodes on this machine (``ba-deploy local``'s processes: each
SuperNode under ``ba-supernode`` with the warm executor), each SuperNode's Fleet API traffic relayed
through a byte-counting relay (:class:`server.deploy.resources.FleetRelay`, as ``ba-deploy local
--resources`` counts them), then ``--rounds`` rounds of ``--strategy`` with and without
``secure-aggregation = "secaggplus"`` (one deployment each, alternating for ``--repeats``). Every
process below this one is sampled from ``/proc`` (server/deploy/resources.py) each time the run
folder's metrics.jsonl gains a line, so each round's figures are the interval from the end of one
round (its evaluation included) to the end of the next:

- ``serverapp-cpu-s``: CPU seconds of the ServerApp process per round;
- ``clientapp-cpu-s``: CPU seconds of one node's ClientApps per round (the node's forked
  ClientApp processes of the round and the warm executor that forks them, summed; the mean over
  the nodes): training, and under secure aggregation the four stages' work;
- ``node-up-kB``, ``node-down-kB``: bytes one SuperNode sent to and received from the Fleet API per
  round (the mean over the nodes; polling included);
- ``round-s``: the app's own round time (``round-seconds``), wall time on a shared machine.

Usage::

    .venv/bin/python -m benchmarks.secure_deployment --nodes 3 --rounds 3 \\
        --strategy elastic
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.spec import REPO
from beyond_averaging.server.deploy.local import LocalDeployment
from beyond_averaging.server.deploy.resources import (
    FleetRelay,
    ProcessWatch,
    cpu_seconds_by,
    kinds_of,
)
from beyond_averaging.server.runs.folder import read_metrics


def snapshot(watch: ProcessWatch, relays: list[FleetRelay], ticks: float) -> dict[str, Any]:
    """CPU seconds so far of the ServerApp and of each node's ClientApps, and each relay's bytes."""
    watch.sample()
    kinds = kinds_of(watch.processes, watch.root)
    by_kind, _ = cpu_seconds_by(watch.processes, kinds, ticks)
    # A node's ClientApps with the warm executor that forks them: a ClientApp that ended
    # between two samples is in the executor's reaped-children time (subtrees), and the
    # executor itself idles between messages.
    apps = {pid: kind in ("clientapp", "warm-executor") for pid, kind in kinds.items()}
    nodes = {pid: watch.group_of(pid) or "other" for pid in watch.processes}
    per_node = {pid: f"{nodes[pid]}-clientapp" if apps[pid] else "rest" for pid in watch.processes}
    by_node, _ = cpu_seconds_by(watch.processes, per_node, ticks, subtrees=True)
    return {
        "serverapp": by_kind.get("serverapp", 0.0),
        "clientapp": [by_node.get(f"node {i}-clientapp", 0.0) for i in range(len(relays))],
        "bytes": [relay.counts() for relay in relays],
    }


def measure(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One deployment, one run of ``args.rounds`` rounds: the per-round figures."""
    deployment = LocalDeployment(REPO, workdir, file_state=False, executor="warm")
    try:
        deployment.start()
        nodes = deployment.start_supernodes(args.nodes, relayed=True)
        relays = [node.relay for node in nodes if node.relay is not None]
        watch = ProcessWatch(os.getpid(), pss_every=math.inf)  # PSS: not needed, costly
        watch.groups = {
            node.process.pid: f"node {i}" for i, node in enumerate(deployment.supernodes)
        }
        ticks = float(os.sysconf("SC_CLK_TCK"))
        settings: dict[str, Any] = {
            "strategy": args.strategy,
            "dataset": "digits",
            "model": "mlp",
            "num-clients": args.nodes,
            "num-server-rounds": args.rounds,
            "fraction-train": 1.0,
            "seed": 0,
            "run-name": mode,
            "output-dir": str(workdir / "runs"),
        }
        if mode == "secure":
            settings |= {"secure-aggregation": "secaggplus", "min-train-replies": args.nodes}
        metrics_file = workdir / "runs" / mode / "metrics.jsonl"
        marks: list[dict[str, Any]] = []
        done = threading.Event()

        def follow() -> None:  # a snapshot each time a round's line is written
            seen = 0
            while not done.is_set():
                lines = metrics_file.read_text().count("\n") if metrics_file.exists() else 0
                if lines > seen:
                    marks.append(snapshot(watch, relays, ticks))
                    seen = lines
                else:
                    watch.sample()  # find the ClientApps while they run
                done.wait(0.1)

        watch.open_window()
        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        run_dir = deployment.run(settings, timeout=args.timeout)
        done.set()
        follower.join()
        metrics = read_metrics(run_dir)
    finally:
        deployment.close()  # its relays too
    if len(marks) != args.rounds + 1:
        raise RuntimeError(f"{mode}: {len(marks)} snapshots for {args.rounds} rounds + round 0")
    first, last = marks[0], marks[-1]
    rounds = args.rounds
    return {
        "mode": mode,
        "serverapp-cpu-s": (last["serverapp"] - first["serverapp"]) / rounds,
        "clientapp-cpu-s": statistics.mean(
            (b - a) / rounds for a, b in zip(first["clientapp"], last["clientapp"], strict=True)
        ),
        "node-up-kB": statistics.mean(
            (b[0] - a[0]) / rounds / 1e3 for a, b in zip(first["bytes"], last["bytes"], strict=True)
        ),
        "node-down-kB": statistics.mean(
            (b[1] - a[1]) / rounds / 1e3 for a, b in zip(first["bytes"], last["bytes"], strict=True)
        ),
        "round-s": statistics.mean(float(m["round-seconds"]) for m in metrics[1:]),
        "test-accuracy": float(metrics[-1]["test-accuracy"]),
    }


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table: the median of each figure over the repeats, per mode."""
    names = ("serverapp-cpu-s", "clientapp-cpu-s", "node-up-kB", "node-down-kB", "round-s")
    lines = [
        "| secure aggregation | ServerApp CPU s | one node's ClientApps CPU s | node up kB "
        "| node down kB | round s | final accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in ("plain", "secure"):
        mine = [row for row in rows if row["mode"] == mode]
        values = [statistics.median(row[name] for row in mine) for name in names]
        accuracy = mine[-1]["test-accuracy"]
        lines.append(
            f"| {'no' if mode == 'plain' else 'secaggplus'} | {values[0]:.2f} | {values[1]:.2f} "
            f"| {values[2]:.0f} | {values[3]:.0f} | {values[4]:.1f} | {accuracy:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategy", default="elastic")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="secure-cost-") as scratch:
        for repeat in range(args.repeats):
            for mode in ("plain", "secure"):
                started = time.monotonic()
                row = measure(mode, args, Path(scratch) / f"{mode}-{repeat}")
                rows.append(row)
                print(json.dumps(row), f"({time.monotonic() - started:.0f} s)", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
