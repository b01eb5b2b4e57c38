"""``python -m benchmarks.pull_pace``: this project's app deployed with ``ba-supernode``'s paced
pull loop (``--pull-every``) against Flower's fixed 3 s (``--pull-every 3``), runs alternating
(docs/deployment.md, "How soon a node sees a message"). Per run: a SuperLink and ``--nodes``
SuperNodes under ``ba-supernode`` (warm executor), ``--rounds`` rounds of digits and the MLP (one
local epoch); the rounds' ``round-seconds`` after the first, and CPU per round of the SuperLink's
group (with its ServerApp) and of the nodes (:mod:`server.deploy.resources`)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.spec import REPO
from beyond_averaging.server.deploy.local import LocalDeployment, watch_resources
from beyond_averaging.server.runs.folder import read_metrics


def measure(pull_every: float, nodes: int, rounds: int, workdir: Path) -> dict[str, object]:
    with LocalDeployment(REPO, workdir, file_state=False, pull_every=pull_every) as deployment:
        for partition in range(nodes):
            deployment.start_supernode(partition, nodes)
        deployment.wait_for_nodes(nodes)
        resources = watch_resources(deployment)
        settings = {"dataset": "digits", "model": "mlp", "num-clients": nodes, "run-name": "pace"}
        settings |= {"num-server-rounds": rounds, "local-epochs": 1, "seed": 0}
        run_dir = deployment.run({**settings, "output-dir": str(workdir / "runs")}, timeout=1800)
        usage = resources.stop()
    seconds = [row["round-seconds"] for row in read_metrics(run_dir) if "round-seconds" in row][1:]
    cpu = {label: figures["cpu-seconds"] / rounds for label, figures in usage.items()}
    return {
        "pull-every": pull_every,
        "median-round-seconds": round(statistics.median(seconds), 2),
        "round-seconds": [round(value, 2) for value in seconds],
        "superlink-cpu-per-round": round(cpu.pop("SuperLink"), 2),
        "nodes-cpu-per-round": round(sum(cpu.values()), 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--nodes", 3), ("--rounds", 5), ("--repeats", 2)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--pull-every", type=float, default=0.2, help="the paced runs' value")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ba-pull-pace-") as scratch:
        for repeat in range(args.repeats):
            for pace in (args.pull_every, 3.0):
                where = Path(scratch) / f"{repeat}-{pace:g}"
                print(json.dumps(measure(pace, args.nodes, args.rounds, where)), flush=True)
