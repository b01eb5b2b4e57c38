"""``python -m benchmarks.pull_pace``: a deployed round of this project's app with
``ba-supernode``'s paced pull loop (``--pull-every``, server/deploy/pull_pace.py) against
Flower's fixed 3 s (``--pull-every 3``), runs alternating (docs/deployment.md, "How soon a
node sees a message").

Per run: a SuperLink (state in memory) and ``--nodes`` SuperNodes under ``ba-supernode`` with the
warm executor, one ``--rounds``-round run of the app (digits, the MLP, one local epoch, every node
trains); the run's ``round-seconds`` after the first round, and the CPU seconds of the SuperLink's
group (the SuperLink with the SuperExec and ServerApp it starts) and of the nodes' (every process
each ``ba-supernode`` starts), sampled from ``/proc`` from the moment the nodes are online until
the run ends (:mod:`server.deploy.resources`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import command
from benchmarks.spec import REPO
from beyond_averaging.server.deploy.flower_release import FlowerRelease
from beyond_averaging.server.deploy.local import LocalDeployment, watch_resources
from beyond_averaging.server.runs.folder import read_metrics


def measure(pull_every: float, nodes: int, rounds: int, workdir: Path) -> dict[str, Any]:
    """One deployment and one run with ``ba-supernode --pull-every pull_every``."""
    with LocalDeployment(
        REPO, workdir, file_state=False, executor="warm", pull_every=pull_every
    ) as deployment:
        for partition in range(nodes):
            deployment.start_supernode(partition, nodes)
        deployment.wait_for_nodes(nodes)
        resources = watch_resources(deployment)
        settings = {
            "dataset": "digits",
            "model": "mlp",
            "num-clients": nodes,
            "num-server-rounds": rounds,
            "local-epochs": 1,
            "fraction-train": 1.0,
            "seed": 0,
            "run-name": f"pace-{pull_every:g}",
            "output-dir": str(workdir / "runs"),
        }
        started = time.monotonic()
        run_dir = deployment.run(settings, timeout=1800.0)
        wall = time.monotonic() - started
        usage = resources.stop()
    seconds = [row["round-seconds"] for row in read_metrics(run_dir) if "round-seconds" in row]
    nodes_cpu = sum(figures["cpu-seconds"] for label, figures in usage.items() if "node" in label)
    return {
        "pull-every": pull_every,
        "wall": round(wall, 1),
        "round-seconds": [round(value, 2) for value in seconds[1:]],
        "median-round-seconds": round(statistics.median(seconds[1:]), 2),
        "superlink-group-cpu-per-round": round(usage["SuperLink"]["cpu-seconds"] / rounds, 2),
        "nodes-cpu-per-round": round(float(nodes_cpu) / rounds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pull-every", type=float, default=0.2, help="the paced runs' value")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the first round is left out")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ba-pull-pace-") as scratch:
        for repeat in range(args.repeats):
            for pull_every in (args.pull_every, 3.0):
                workdir = Path(scratch) / f"{repeat}-{pull_every:g}"
                row = measure(pull_every, args.nodes, args.rounds, workdir)
                rows.append({"repeat": repeat, **row})
                print(json.dumps(rows[-1]), flush=True)
    summary = {
        "command": command("pull_pace"),
        "flwr": FlowerRelease.installed().version,
        **{
            f"median-round-seconds@{pace:g}": statistics.median(
                row["median-round-seconds"] for row in rows if row["pull-every"] == pace
            )
            for pace in (args.pull_every, 3.0)
        },
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
