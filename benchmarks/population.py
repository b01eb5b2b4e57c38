"""Seconds per round and peak memory of a round of a large population, in process and in Flower's
simulation: every row one ``ba-run`` in a fresh process. docs/benchmarks.md ("Populations") says
what each column means and gives the commands.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from flwr.clientapp import ClientApp

from benchmarks.harness import command, save
from benchmarks.spec import REPO
from beyond_averaging.server.cli.status import ALARMS_EXIT_CODE
from beyond_averaging.server.deploy.resources import MIB, PeakSampler, ProcessWatch
from beyond_averaging.server.overrides import run_config_argument
from beyond_averaging.server.runs.folder import FINISHED_STATUSES, read_metrics, read_summary
from beyond_averaging.server.runs.provenance import hardware_line
from beyond_averaging.server.runtime.inprocess import FIRST_NODE_ID, InProcessGrid
from beyond_averaging.server.runtime.processes import stop_process_tree
from beyond_averaging.server.sweep.report import markdown_table, shown
from beyond_averaging.strategies import FedAvg
from beyond_averaging.tasks.synthetic import device_size

#: The measurement of an invocation, in its --runs folder (what --report-only reads).
ROWS_FILE = "population.json"
#: The targets of issue 29 for the largest in-process population, against the smallest.
RSS_TARGET, SECONDS_TARGET = 1.5, 2.0


@dataclass
class Row:
    """One run."""

    runtime: str
    strategy: str
    population: int
    status: str
    rounds: int = 0
    seconds_per_round: float | None = None
    wall_seconds: float | None = None
    cpu_seconds: float | None = None
    cpu_seconds_per_round: float | None = None
    peak_rss_mib: float | None = None
    samples_per_round: float | None = None
    final_accuracy: float | None = None


def samples_per_round(population: int, sampled: int, rounds: int) -> float:
    """Mean samples the sampled devices hold per round (the strategies' own sampling)."""
    strategy = FedAvg(fraction_train=sampled / population, min_available_nodes=2, seed=0)
    grid = InProcessGrid(ClientApp(), population, {})  # only its node ids are used
    total = 0
    for server_round in range(1, rounds + 1):
        cohort = strategy._sample(grid, sampled / population, 2, server_round)
        total += sum(device_size(node - FIRST_NODE_ID, seed=0) for node in cohort)
    return total / rounds


def measure(
    runtime: str, strategy: str, population: int, args: argparse.Namespace, runs: Path
) -> Row:
    """One run of ``population`` clients in ``runtime``; its row (status ``failed``, ``timeout``
    or ``memory`` when it did not complete)."""
    name = f"{runtime}-{strategy}-{population}"
    settings = {"dataset": "synthetic", "strategy": strategy, "num-clients": population}
    settings |= {"fraction-train": args.sampled / population, "num-server-rounds": args.rounds}
    settings |= {"seed": 0, "run-name": name, "output-dir": str(runs)}
    limit = args.simulation_timeout if runtime == "simulation" else args.inprocess_timeout
    words = ["-m", "beyond_averaging.server.cli.main", "--runtime", runtime, "--client-cpus", "1"]
    # --overwrite: a measurement again in the same --runs folder replaces the earlier one.
    words += ["--timeout", str(limit), "--overwrite", "-c", run_config_argument(settings)]
    print("$", shlex.join(words[1:]), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (runs / f"{name}.log").open("wb")
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, *words], cwd=REPO, env=env, stdout=log, stderr=log)

    watch = ProcessWatch(process.pid, pss_every=math.inf)  # the run and every process below it
    ticks = os.sysconf("SC_CLK_TCK")

    def tree_rss() -> dict[str, float]:
        watch.sample()
        live = [p.last.rss_pages for p in list(watch.processes.values()) if not p.ended]
        return {"tree": float(sum(live) * watch.page)}

    def tree_cpu() -> float:  # CPU seconds so far of the run's processes, at their last reading
        return sum(p.last.cpu_ticks for p in list(watch.processes.values())) / ticks

    status, code, usage = "completed", None, None
    metrics = runs / name / "metrics.jsonl"
    cpu_at_round: dict[int, float] = {}  # CPU seconds when each round's line appeared
    with PeakSampler(tree_rss, interval=0.5) as sampler:
        while code is None and time.perf_counter() < started + limit + 120:  # ba-run stops at limit
            lines = metrics.read_bytes().count(b"\n") if metrics.is_file() else 0
            if lines and lines - 1 not in cpu_at_round:
                cpu_at_round[lines - 1] = tree_cpu()
            pid, wait_status, usage = os.wait4(process.pid, os.WNOHANG)  # its own rusage
            if pid:
                code = os.waitstatus_to_exitcode(wait_status)
            elif sampler.peaks["tree"] > args.memory_limit * 2**30:  # a shared machine
                status = "memory"
                break
            else:
                time.sleep(0.2)
        if code is None:
            stop_process_tree(process)
            status = "timeout" if status == "completed" else status
    log.close()
    summary = read_summary(runs / name)
    if status == "completed" and code not in (0, ALARMS_EXIT_CODE):
        tail = (runs / f"{name}.log").read_text(errors="replace")
        status = "timeout" if "did not finish within" in tail else "failed"
    elif status == "completed":  # `completed-with-alarms` (never above chance) says so
        status = str(summary.get("status", status))
    row = Row(runtime, strategy, population, status, wall_seconds=time.perf_counter() - started)
    row.peak_rss_mib = sampler.peaks["tree"] / MIB
    if runtime == "inprocess" and usage is not None:  # exact: the process's own peak
        row.peak_rss_mib = usage.ru_maxrss * 1024 / MIB  # kB on Linux
        row.cpu_seconds = usage.ru_utime + usage.ru_stime
    if summary.get("status") in FINISHED_STATUSES:
        rounds = read_metrics(runs / name)[1:]
        row.rounds = len(rounds)
        row.seconds_per_round = sum(r["round-seconds"] for r in rounds) / len(rounds)
        row.final_accuracy = float(rounds[-1]["test-accuracy"])
        if runtime == "inprocess":  # the simulation's node ids, and so its cohorts, are random
            row.samples_per_round = samples_per_round(population, args.sampled, args.rounds)
        last = max(cpu_at_round)
        if 0 in cpu_at_round and last > 0:
            row.cpu_seconds_per_round = (cpu_at_round[last] - cpu_at_round[0]) / last
    print(f"  {row}", flush=True)
    return row


def finished_in_process(rows: Sequence[Row], strategy: str) -> list[Row]:
    """The finished in-process rows of ``strategy``, fewest clients first."""
    done = [r for r in rows if r.strategy == strategy and r.runtime == "inprocess"]
    return sorted((r for r in done if r.status in FINISHED_STATUSES), key=lambda r: r.population)


def table(rows: Sequence[Row]) -> str:
    """The rows with their ratios against the smallest in-process population's row."""
    body = []
    for row in rows:
        ref = next(iter(finished_in_process(rows, row.strategy)), None)
        runtime = "in process" if row.runtime == "inprocess" else "Flower simulation (Ray)"
        cells = [runtime, row.strategy, f"{row.population:,}", row.status]
        for field in ("seconds_per_round", "cpu_seconds_per_round", "peak_rss_mib"):
            value, base = getattr(row, field), getattr(ref, field, None)
            cells.append(shown(value, ".0f" if field == "peak_rss_mib" else ".2f"))
            cells.append("-" if value is None or not base else f"{value / base:.2f}x")
        cells += [shown(row.samples_per_round, ".0f"), shown(row.wall_seconds, ".0f")]
        body.append([*cells, shown(row.cpu_seconds, ".0f"), shown(row.final_accuracy, ".3f")])
    header = "runtime|rule|clients|status|s / round|vs smallest in process|CPU s / round"
    header += "|vs smallest in process|peak RSS (MiB)|vs smallest in process"
    header += "|samples trained / round|run wall s|process CPU s|final test acc."
    return markdown_table(header.split("|"), body)


def verdict(rows: Sequence[Row]) -> str:
    """Whether the largest in-process population meets the targets, per strategy."""
    lines = []
    for strategy in dict.fromkeys(row.strategy for row in rows):
        done = finished_in_process(rows, strategy)
        if len(done) < 2:
            continue
        small, large = done[0], done[-1]
        rss = (large.peak_rss_mib or 0) / (small.peak_rss_mib or 1)
        seconds = (large.seconds_per_round or 0) / (small.seconds_per_round or 1)
        cpu = (large.cpu_seconds_per_round or 0) / (small.cpu_seconds_per_round or 1)
        met = rss <= RSS_TARGET and seconds <= SECONDS_TARGET
        lines.append(
            f"- {strategy}: {large.population:,} vs {small.population:,} clients in process: peak "
            f"RSS {rss:.2f}x (target <= {RSS_TARGET}x), s/round {seconds:.2f}x (target <= "
            f"{SECONDS_TARGET}x; CPU s/round {cpu:.2f}x): {'met' if met else 'NOT met'}"
        )
    return "\n".join(lines)


def render(saved: dict[str, Any]) -> str:
    """The report of a saved measurement: its context, the table and the verdict."""
    rows = [Row(**row) for row in saved["rows"]]
    before, after = saved["load"]
    return (
        f"Measured {saved['measured']} on {saved['hardware']}; every run with 1 torch thread "
        f"(`--client-cpus 1`), niced; load average {before:.1f} before, {after:.1f} after. "
        f"Command: `{saved['command']}`; {saved['sampled']} clients sampled per round, "
        f"{saved['rounds']} rounds, synthetic task.\n\n" + table(rows) + "\n" + verdict(rows) + "\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Measure (unless ``--report-only``), print the report, publish it with ``--publish``."""
    parser = argparse.ArgumentParser(prog="benchmarks.population", description=__doc__)
    parser.add_argument("--populations", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    parser.add_argument("--sampled", type=int, default=100, help="clients sampled per round")
    parser.add_argument("--rounds", type=int, default=3)
    rules = ["fedavg", "elastic", "fedlaw", "fedgma"]
    parser.add_argument("--strategies", nargs="+", default=["fedavg"], choices=rules)
    sizes = "Flower simulation (FedAvg) at these sizes until one fails; none: skip"
    default = [1_000, 10_000, 100_000, 1_000_000]
    parser.add_argument(
        "--simulation-populations", type=int, nargs="*", default=default, help=sizes
    )
    parser.add_argument("--simulation-timeout", type=float, default=900.0)
    parser.add_argument("--inprocess-timeout", type=float, default=1800.0)
    held = "GiB a run's processes may hold before it is stopped (status 'memory')"
    parser.add_argument("--memory-limit", type=float, default=6.0, help=held)
    runs = "run folders; with --report-only, several: one report each"
    folder = REPO / "benchmarks" / "results" / "population" / "runs"
    parser.add_argument("--runs", type=Path, nargs="+", default=[folder], help=runs)
    parser.add_argument("--publish", action="store_true", help="write docs/results/population.md")
    parser.add_argument("--report-only", action="store_true", help=f"read --runs' {ROWS_FILE}")
    args = parser.parse_args(argv)
    if not args.report_only:
        if len(args.runs) != 1:
            parser.error("measuring writes to one --runs folder")
        args.runs[0].mkdir(parents=True, exist_ok=True)
        load_before = os.getloadavg()
        rows = [
            measure("inprocess", strategy, population, args, args.runs[0])
            for strategy in args.strategies
            for population in args.populations
        ]
        for population in args.simulation_populations:
            rows.append(measure("simulation", "fedavg", population, args, args.runs[0]))
            if rows[-1].status not in FINISHED_STATUSES:
                break
        torch.set_num_threads(1)  # the hardware line then names the runs' threads
        saved = {
            "measured": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            "hardware": hardware_line(),
            "load": [load_before[0], os.getloadavg()[0]],
            "command": command("population", argv),
            "sampled": args.sampled,
            "rounds": args.rounds,
            "rows": [asdict(row) for row in rows],
        }
        (args.runs[0] / ROWS_FILE).write_text(json.dumps(saved, indent=1), encoding="utf-8")
    saved_runs = [json.loads((f / ROWS_FILE).read_text(encoding="utf-8")) for f in args.runs]
    page = "# Populations: seconds per round and peak memory\n\n"
    page += "What each column means: [benchmarks](../benchmarks.md#populations).\n\n"
    page += "\n".join(map(render, saved_runs))
    save("population", "population", page, saved_runs, args.publish)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
