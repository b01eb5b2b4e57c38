"""Seconds per round of each runtime and client backend, next to a vmapped yardstick.
docs/runtimes.md ("What each costs") defines the settings, rows, columns and the yardstick and
gives the commands.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.harness import Stopwatch, command, save
from benchmarks.spec import REPO, load_spec
from beyond_averaging.server.app import data_spec
from beyond_averaging.server.config import RunConfig, parse_run_config
from beyond_averaging.server.overrides import LaunchError, run_config_argument
from beyond_averaging.server.runs.folder import read_metrics, read_summary
from beyond_averaging.server.runs.provenance import hardware_line
from beyond_averaging.server.runtime.launch import RUNTIMES, launch_runtime
from beyond_averaging.server.sweep.report import markdown_table, shown
from beyond_averaging.tasks.evaluation import resolve_device
from beyond_averaging.tasks.federation import load_client_partition
from beyond_averaging.tasks.models import build_model

BACKENDS = ("clientapp", "vectorized")
#: FedLAW's Table 3 setting, from its spec (the benchmark sets the rounds itself).
TABLE3 = load_spec(REPO / "benchmarks" / "specs" / "fedlaw-table3.toml").settings
TABLE3.pop("num-server-rounds")
#: Run-config overrides of each setting (everything else: the RunConfig defaults).
SETTINGS: dict[str, dict[str, Any]] = {
    "table3": {**TABLE3, "strategy": "fedavg", "dirichlet-alpha": 0.1, "seed": 8},
    "digits": {},
}


@dataclass
class Row:
    """One run's timing; CPU seconds per round in process only (the runs' own work, first round
    included), robust to other load on a shared machine."""

    setting: str
    runtime: str
    backend: str
    rounds: int
    seconds_per_round: float
    first_round_seconds: float = 0.0
    wall_seconds: float = 0.0
    final_accuracy: float | None = None
    yardstick_seconds: float | None = None
    cpu_seconds_per_round: float | None = None
    yardstick_cpu_seconds: float | None = None


def time_run(setting: str, runtime: str, backend: str, args: argparse.Namespace, runs: Path) -> Row:
    """One run of ``setting`` in ``runtime`` with ``backend``; its seconds per round."""
    overrides = {**SETTINGS[setting], "num-server-rounds": args.rounds, "device": args.device}
    overrides |= {"client-backend": backend, "output-dir": str(runs)}
    overrides["run-name"] = f"{setting}-{runtime}-{backend}-{args.device}-r{args.rounds}"
    with Stopwatch() as clock:
        config = [run_config_argument(overrides)]
        run_dir = launch_runtime(runtime, REPO, config, client_cpus=args.threads)
    entries = read_metrics(run_dir)
    per_round = [float(e["round-seconds"]) for e in entries if int(e["round"]) >= 1]
    row = Row(setting, runtime, backend, args.rounds, statistics.median(per_round[1:] or per_round))
    row.first_round_seconds, row.wall_seconds = per_round[0], clock.wall
    row.final_accuracy = entries[-1].get("test-accuracy")
    row.cpu_seconds_per_round = clock.cpu / args.rounds if runtime == "inprocess" else None
    return row


def time_ba_run(output_dir: Path) -> dict[str, Any]:
    """Wall seconds of the default ``ba-run --runtime inprocess`` in a fresh process: cold, then
    warm (page cache and partition cache filled), and the warm run's CPU seconds."""
    settings = run_config_argument({"output-dir": str(output_dir), "run-name": "ba-run-default"})
    # The same run twice: the second replaces the first (ba-run refuses that unasked).
    ba_run = [str(Path(sys.executable).parent / "ba-run"), "--runtime", "inprocess", "--overwrite"]
    ba_run += ["-c", settings]
    clocks = []
    for _ in range(2):
        with Stopwatch() as clock:
            subprocess.run(ba_run, cwd=REPO, check=True, capture_output=True)
        clocks.append(clock)
    final = read_summary(output_dir / "ba-run-default")["final"]
    return {
        "command": "ba-run --runtime inprocess",  # plus an output-dir in a temporary folder
        "cold-seconds": clocks[0].wall,
        "warm-seconds": clocks[1].wall,
        "warm-cpu-seconds": clocks[1].children_cpu,
        "final-accuracy": final["test-accuracy"],
        "rounds": final["round"],
    }


def time_refusal(output_dir: Path) -> dict[str, Any]:
    """Wall seconds from the start of ``ba-run -c 'strategy="fedprox"'`` (a value that is not
    allowed) to its exit, in a fresh process; its exit code and whether a run folder appeared."""
    bad = run_config_argument({"output-dir": str(output_dir), "strategy": "fedprox"})
    with Stopwatch() as clock:
        done = subprocess.run([str(Path(sys.executable).parent / "ba-run"), "-c", bad], cwd=REPO)
    folders = [p.name for p in output_dir.glob("fedprox-*")]
    return {"refusal-seconds": clock.wall, "exit-code": done.returncode, "run-folders": folders}


def yardstick_seconds(setting: str, device: torch.device, rounds: int) -> tuple[float, float]:
    """Median wall and CPU seconds of one round of all clients' local training as one vmapped
    SGD loop."""
    config = parse_run_config({**SETTINGS[setting], "device": str(device)})
    partitions = [load_client_partition(data_spec(config), k) for k in range(config.num_clients)]
    # Longest first: the clients still training at step s are always a prefix.
    partitions.sort(key=len, reverse=True)
    sizes = torch.tensor([len(p) for p in partitions], device=device)
    longest = int(sizes[0])
    features = torch.zeros((len(partitions), longest, *partitions[0].input_shape), device=device)
    labels = torch.zeros((len(partitions), longest), dtype=torch.int64, device=device)
    for k, part in enumerate(partitions):
        features[k, : len(part)] = torch.from_numpy(part.features).to(device)
        labels[k, : len(part)] = torch.from_numpy(part.labels).to(device)
    model = build_model(
        config.model, partitions[0].input_shape, partitions[0].num_classes, seed=config.seed
    ).to(device)
    seconds, cpu_seconds = [], []
    for _ in range(rounds + 1):  # the first round warms up
        with Stopwatch() as clock:
            _vmapped_round(model, features, labels, sizes, config)
            if device.type == "cuda":
                torch.cuda.synchronize()
        seconds.append(clock.wall)
        cpu_seconds.append(clock.cpu)
    return statistics.median(seconds[1:]), statistics.median(cpu_seconds[1:])


def _vmapped_round(
    model: nn.Module,
    features: torch.Tensor,
    labels: torch.Tensor,
    sizes: torch.Tensor,
    config: RunConfig,
) -> dict[str, torch.Tensor]:
    """All clients' E epochs from the global model; returns the weighted-average model."""
    clients, batch = features.shape[0], config.batch_size
    device = features.device
    global_state = {name: p.detach() for name, p in model.named_parameters()}
    params = {n: p.unsqueeze(0).repeat(clients, *[1] * p.dim()) for n, p in global_state.items()}
    velocity = {n: torch.zeros_like(p) for n, p in params.items()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    gradient = torch.func.vmap(torch.func.grad(loss))
    steps_per_epoch = [int(s) for s in ((sizes + batch - 1) // batch).tolist()]
    offsets = torch.arange(batch, device=device)
    clients_index = torch.arange(clients, device=device)
    for _ in range(config.local_epochs):
        # One permutation per client of its own samples (padding sorts last).
        keys = torch.rand(features.shape[:2], device=device)
        keys[torch.arange(features.shape[1], device=device)[None, :] >= sizes[:, None]] = 2.0
        order = keys.argsort(dim=1)
        for step in range(steps_per_epoch[0]):
            active = sum(1 for count in steps_per_epoch if count > step)
            positions = (step * batch + offsets)[None, :] % sizes[:active, None]
            clients_rows = (clients_index[:active, None], order[:active].gather(1, positions))
            x, y = features[clients_rows], labels[clients_rows]
            live = {n: p[:active] for n, p in params.items()}
            grads = gradient(live, x, y)
            with torch.no_grad():
                for name, g in grads.items():
                    g = g + config.weight_decay * live[name]
                    velocity[name][:active] = config.momentum * velocity[name][:active] + g
                    params[name][:active] -= config.learning_rate * velocity[name][:active]
    weights = (sizes / sizes.sum()).to(features.dtype)
    return {n: (p * weights.view(-1, *[1] * (p.dim() - 1))).sum(dim=0) for n, p in params.items()}


def report(rows: Sequence[Row], ba_run: dict[str, Any] | None, device: str) -> str:
    """The Markdown page; x yardstick: over the yardstick measured in the same process."""
    header = "setting, runtime, backend, rounds, s / round, x yardstick, yardstick s / round, "
    header += "CPU s / round, x yardstick CPU, first round s, run wall s, final accuracy"
    cells = []
    for r in rows:
        ratio = r.seconds_per_round / r.yardstick_seconds if r.yardstick_seconds else None
        cpu, yardstick_cpu = r.cpu_seconds_per_round, r.yardstick_cpu_seconds
        cpu_ratio = cpu / yardstick_cpu if cpu is not None and yardstick_cpu else None
        cells.append(
            [
                *(r.setting, r.runtime, r.backend, r.rounds, f"{r.seconds_per_round:.3f}"),
                *(shown(ratio, ".1f"), shown(r.yardstick_seconds, ".3f")),
                *(shown(cpu, ".3f"), shown(cpu_ratio, ".1f")),
                *(f"{r.first_round_seconds:.2f}", f"{r.wall_seconds:.1f}"),
                shown(r.final_accuracy, ".4f"),
            ]
        )
    load = os.getloadavg()
    text = [
        "# Speed: seconds per round by runtime and client backend\n",
        f"Hardware: {hardware_line()}; device `{device}`; load average when written "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}.\n",
        f"Command: `{command('speed')}`\n",
        'Written by `benchmarks/speed.py`; docs/runtimes.md ("What each costs") defines every '
        "column; x yardstick: over the vmapped yardstick measured in the same process.\n",
        markdown_table(header.split(", "), cells),
    ]
    if ba_run is not None:
        text.append(
            f"\nDefault run as a user starts it: `{ba_run['command']}` took "
            f"{ba_run['warm-seconds']:.1f} s warm ({ba_run['cold-seconds']:.1f} s the first "
            f"time; {ba_run['warm-cpu-seconds']:.1f} CPU seconds warm, which is the wall time "
            "it needs on an otherwise idle core), final test accuracy "
            f"{ba_run['final-accuracy']:.4f} after round {ba_run['rounds']}. A value that is not "
            f"allowed (`ba-run -c 'strategy=\"fedprox\"'`) was refused in "
            f"{ba_run['refusal-seconds']:.2f} s from the command's start (exit code "
            f"{ba_run['exit-code']}, run folders left: {len(ba_run['run-folders'])}).\n"
        )
    return "\n".join(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Time the requested rows, print the table, write the report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--rounds", type=int, default=3, help="rounds per run (>= 2)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads / CPUs per client")
    parser.add_argument("--ba-run", action="store_true", help="also time the default ba-run")
    parser.add_argument("--publish", action="store_true", help="also write docs/results/speed.md")
    parser.add_argument("--refusal", action="store_true", help="only time a refused bad value")
    args = parser.parse_args(argv)
    if args.refusal:
        with tempfile.TemporaryDirectory(prefix="speed-refusal-") as runs:
            print(f"[speed] {time_refusal(Path(runs))}", flush=True)
        return 0
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="speed-runs-") as runs:
        for setting in args.settings:
            yardstick, yardstick_cpu = yardstick_seconds(setting, device, args.rounds)
            print(f"[speed] {setting}: yardstick {yardstick:.3f} s/round", flush=True)
            for runtime in args.runtimes:
                for backend in args.backends:
                    if backend != "clientapp" and runtime != "inprocess":
                        continue  # the cohort backend exists in the in-process runtime only
                    try:
                        row = time_run(setting, runtime, backend, args, Path(runs))
                    except LaunchError as error:
                        print(f"[speed] {setting}/{runtime}/{backend} failed: {error}")
                        continue
                    row.yardstick_seconds, row.yardstick_cpu_seconds = yardstick, yardstick_cpu
                    rows.append(row)
                    print(f"[speed] {asdict(row)}", flush=True)
        ba_run = time_ba_run(Path(runs)) if args.ba_run else None
    raw = {"rows": [asdict(r) for r in rows], "ba-run": ba_run}
    save("speed", "speed", report(rows, ba_run, str(device)), raw, args.publish)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
