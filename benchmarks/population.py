"""Seconds per round and peak memory of a round of a large population, in process and in Flower's
simulation.

Every row is one real run in a fresh process, ``ba-run`` as a user types it: the synthetic task
(one device per client, generated from its id; docs/running.md), ``--sampled`` clients per round
(``fraction-train = sampled / population``), ``--rounds`` rounds. docs/benchmarks.md
("Populations") gives the tables and the commands, e.g.::

    nice -n 10 .venv/bin/python -m benchmarks.population --strategies fedavg elastic fedlaw \
        fedgma --publish

- **in process** (``ba-run --runtime inprocess``): peak RSS is the run's process's own (its
  ``ru_maxrss`` from ``wait4``: exact, the whole process, imports included);
- **Flower simulation** (``ba-run``, Ray): peak RSS is the sum over the ``ba-run`` process and
  every process below it (SuperLink, simulation, Ray's daemons and workers), sampled every
  0.5 s. Populations are tried in increasing size (``--simulation-populations``) until one fails,
  exceeds ``--simulation-timeout`` or holds more than ``--memory-limit`` GiB: the largest that ran
  is what Flower's simulation runs here.

s/round is the mean of the runs' own ``round-seconds`` (client training, replies, aggregation,
the server's evaluation) over the rounds; CPU s/round is the CPU time the run's processes spent
from the end of round 0 to the end of the last round, over the rounds (read from ``/proc`` when
each round's line reaches ``metrics.jsonl``): on a shared machine wall times carry other
processes' load, CPU times do not. The ratios are against the in-process run of the smallest
population with the same strategy, measured in the same invocation.
"""

from __future__ import annotations

import argparse
import json
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

from benchmarks.harness import MIB, PeakSampler, hardware
from benchmarks.load import descendants, process_table
from benchmarks.report import markdown_table, read_metrics, shown
from benchmarks.spec import REPO
from beyond_averaging.server.inprocess import FIRST_NODE_ID, InProcessGrid
from beyond_averaging.server.launch import (
    ALARMS_EXIT_CODE,
    read_summary,
    run_config_argument,
    stop_process_tree,
)
from beyond_averaging.server.recorder import FINISHED_STATUSES
from beyond_averaging.strategies import FedAvg
from beyond_averaging.tasks.synthetic import device_size

RESULTS = REPO / "benchmarks" / "results" / "population"
#: The measurement of an invocation, in its --runs folder (what --report-only reads).
ROWS_FILE = "population.json"
PUBLISHED = REPO / "docs" / "results" / "population.md"
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


def settings(population: int, sampled: int, rounds: int, strategy: str) -> dict[str, Any]:
    """The run configuration of one row (everything else: the defaults)."""
    return {
        "dataset": "synthetic",
        "strategy": strategy,
        "num-clients": population,
        "fraction-train": sampled / population,
        "num-server-rounds": rounds,
        "seed": 0,
    }


def samples_per_round(population: int, sampled: int, rounds: int) -> float:
    """Mean samples the sampled devices hold per round: the work a round does, which differs
    between populations only by which devices are drawn (the strategies' own sampling)."""
    strategy = FedAvg(fraction_train=sampled / population, min_available_nodes=2, seed=0)
    grid = InProcessGrid(ClientApp(), population, {})  # only its node ids are used
    total = 0
    for server_round in range(1, rounds + 1):
        cohort = strategy._sample(grid, sampled / population, 2, server_round)
        total += sum(device_size(node - FIRST_NODE_ID, seed=0) for node in cohort)
    return total / rounds


def ba_run(runtime: str, overrides: dict[str, Any], timeout: float) -> list[str]:
    """The ``ba-run`` command line of a row."""
    return [
        sys.executable,
        "-m",
        "beyond_averaging.server.launch",
        "--runtime",
        runtime,
        "--client-cpus",
        "1",
        "--timeout",
        str(timeout),
        "--overwrite",  # a measurement again in the same --runs folder replaces the earlier one
        "-c",
        run_config_argument(overrides),
    ]


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system) so far of ``root`` and every process below it."""
    children, _, _ = process_table()
    total = 0
    for pid in [root, *descendants(root, children)]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / CLOCK_TICKS


def tree_rss(root: int) -> dict[str, float]:
    """Summed RSS of ``root`` and every process below it (one ``ps`` call)."""
    children, rss, _ = process_table()
    return {"tree": float(sum(rss.get(pid, 0) for pid in [root, *descendants(root, children)]))}


def measure(
    runtime: str, strategy: str, population: int, args: argparse.Namespace, runs: Path
) -> Row:
    """One run of ``population`` clients in ``runtime``; its row (status ``failed`` or
    ``timeout`` when it did not complete within ``args.simulation_timeout``)."""
    name = f"{runtime}-{strategy}-{population}"
    overrides = {
        **settings(population, args.sampled, args.rounds, strategy),
        "run-name": name,
        "output-dir": str(runs),
    }
    limit = args.simulation_timeout if runtime == "simulation" else args.inprocess_timeout
    command = ba_run(runtime, overrides, limit)
    print("$", shlex.join(command[2:]), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (runs / f"{name}.log").open("wb")
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    status, code, usage = "completed", None, None
    with PeakSampler(lambda: tree_rss(process.pid), interval=0.5) as sampler:
        deadline = started + limit + 120  # ba-run stops its own run at `limit`
        limit_bytes = args.memory_limit * 2**30
        metrics = runs / name / "metrics.jsonl"
        cpu_at_round: dict[int, float] = {}  # CPU seconds when each round's line appeared
        while code is None and time.perf_counter() < deadline:
            lines = metrics.read_bytes().count(b"\n") if metrics.is_file() else 0
            if lines and lines - 1 not in cpu_at_round:
                cpu_at_round[lines - 1] = tree_cpu(process.pid)
            pid, wait_status, usage = os.wait4(process.pid, os.WNOHANG)  # its own rusage
            if pid:
                code = os.waitstatus_to_exitcode(wait_status)
            elif sampler.peaks["tree"] > limit_bytes:  # the machine is shared: stop in time
                status = "memory"
                break
            else:
                time.sleep(0.2)
        if code is None:
            stop_process_tree(process)
            status = "timeout" if status == "completed" else status
    wall = time.perf_counter() - started
    log.close()
    summary = read_summary(runs / name / "summary.json")
    if status == "completed" and code not in (0, ALARMS_EXIT_CODE):
        tail = (runs / f"{name}.log").read_text(errors="replace")
        status = "timeout" if "did not finish within" in tail else "failed"
    elif status == "completed":
        # Every round ran; a few rounds of the synthetic task may end `completed-with-alarms`
        # (never-above-chance): the row says so, and its costs count as a completed run's.
        status = str(summary.get("status", status))
    row = Row(runtime, strategy, population, status, wall_seconds=wall)
    if runtime == "inprocess" and usage is not None:
        row.peak_rss_mib = usage.ru_maxrss * 1024 / MIB  # kB on Linux
        row.cpu_seconds = usage.ru_utime + usage.ru_stime
    else:
        row.peak_rss_mib = sampler.peaks["tree"] / MIB
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


def ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def table(rows: Sequence[Row]) -> str:
    """The rows with their ratios against the smallest in-process population's row."""
    base: dict[str, Row] = {}
    for row in rows:
        if row.runtime == "inprocess" and row.status in FINISHED_STATUSES:
            current = base.get(row.strategy)
            if current is None or row.population < current.population:
                base[row.strategy] = row
    body = []
    for row in rows:
        ref = base.get(row.strategy)
        body.append(
            [
                "in process" if row.runtime == "inprocess" else "Flower simulation (Ray)",
                row.strategy,
                f"{row.population:,}",
                row.status,
                shown(row.seconds_per_round, ".2f"),
                ratio(row.seconds_per_round, ref.seconds_per_round if ref else None),
                shown(row.cpu_seconds_per_round, ".2f"),
                ratio(row.cpu_seconds_per_round, ref.cpu_seconds_per_round if ref else None),
                shown(row.peak_rss_mib, ".0f"),
                ratio(row.peak_rss_mib, ref.peak_rss_mib if ref else None),
                shown(row.samples_per_round, ".0f"),
                shown(row.wall_seconds, ".0f"),
                shown(row.cpu_seconds, ".0f"),
                shown(row.final_accuracy, ".3f"),
            ]
        )
    header = [
        "runtime",
        "rule",
        "clients",
        "status",
        "s / round",
        "vs smallest in process",
        "CPU s / round",
        "vs smallest in process",
        "peak RSS (MiB)",
        "vs smallest in process",
        "samples trained / round",
        "run wall s",
        "process CPU s",
        "final test acc.",
    ]
    return markdown_table(header, body)


def verdict(rows: Sequence[Row]) -> str:
    """Whether the largest in-process population meets the targets, per strategy."""
    lines = []
    for strategy in dict.fromkeys(row.strategy for row in rows):
        done = [
            r
            for r in rows
            if r.strategy == strategy and r.runtime == "inprocess" and r.status in FINISHED_STATUSES
        ]
        if len(done) < 2:
            continue
        small = min(done, key=lambda r: r.population)
        large = max(done, key=lambda r: r.population)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``python -m benchmarks.population``)."""
    parser = argparse.ArgumentParser(prog="benchmarks.population", description=__doc__)
    parser.add_argument("--populations", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    parser.add_argument("--sampled", type=int, default=100, help="clients sampled per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=["fedavg"],
        choices=["fedavg", "elastic", "fedlaw", "fedgma"],
        help="rules run in process at every population",
    )
    parser.add_argument(
        "--simulation-populations",
        type=int,
        nargs="*",
        default=[1_000, 10_000, 100_000, 1_000_000],
        help="Flower simulation (FedAvg) at these sizes, smallest first, until one fails or "
        "times out; none: skip",
    )
    parser.add_argument("--simulation-timeout", type=float, default=900.0)
    parser.add_argument("--inprocess-timeout", type=float, default=1800.0)
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=6.0,
        help="GiB a run's processes may hold together before it is stopped (status 'memory')",
    )
    parser.add_argument(
        "--runs",
        type=Path,
        nargs="+",
        default=[RESULTS / "runs"],
        help="folder of the run folders; with --report-only, several: one report each",
    )
    parser.add_argument("--publish", action="store_true", help=f"write {PUBLISHED}")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help=f"no runs: the report of the measurement saved in --runs ({ROWS_FILE})",
    )
    args = parser.parse_args(argv)
    if not args.report_only:
        if len(args.runs) != 1:
            parser.error("measuring writes to one --runs folder")
        args.runs[0].mkdir(parents=True, exist_ok=True)
        measure_all(args, args.runs[0], argv)
    reports = [
        render(json.loads((folder / ROWS_FILE).read_text(encoding="utf-8"))) for folder in args.runs
    ]
    print("\n".join(reports))
    if args.publish:
        PUBLISHED.parent.mkdir(parents=True, exist_ok=True)
        PUBLISHED.write_text(
            "# Populations: seconds per round and peak memory\n\n"
            "What each column means: [benchmarks](../benchmarks.md#populations).\n\n"
            + "\n".join(reports),
            encoding="utf-8",
        )
    return 0


def measure_all(args: argparse.Namespace, runs: Path, argv: Sequence[str] | None) -> None:
    """Every row of the invocation, saved with its context to ``runs / ROWS_FILE``."""
    load_before = os.getloadavg()
    rows = [
        measure("inprocess", strategy, population, args, runs)
        for strategy in args.strategies
        for population in args.populations
    ]
    for population in args.simulation_populations:
        row = measure("simulation", "fedavg", population, args, runs)
        rows.append(row)
        if row.status not in FINISHED_STATUSES:
            break
    torch.set_num_threads(1)  # the hardware line then names the runs' threads (--client-cpus 1)
    saved = {
        "measured": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "hardware": hardware(),
        "load": [load_before[0], os.getloadavg()[0]],
        "command": typed_command(argv),
        "sampled": args.sampled,
        "rounds": args.rounds,
        "rows": [asdict(row) for row in rows],
    }
    (runs / ROWS_FILE).write_text(json.dumps(saved, indent=1), encoding="utf-8")


def typed_command(argv: Sequence[str] | None) -> str:
    """This invocation as typed from the repository root (with its ``nice``, if any)."""
    python = Path(sys.executable)
    if python.is_relative_to(REPO):
        python = python.relative_to(REPO)
    words = [str(python), "-m", "benchmarks.population", *(argv or sys.argv[1:])]
    niceness = os.nice(0)
    return shlex.join(["nice", "-n", str(niceness), *words] if niceness else words)


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


if __name__ == "__main__":
    raise SystemExit(main())
