"""What the systems benchmarks share: the hardware line and the command as typed, time, memory,
process trees, an in-process federation to take instructions and replies from, and where a page
is written. Targets and ratios are each benchmark's own; docs/benchmarks.md is the manual.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore.task_identity import TaskIdentity

from benchmarks.spec import REPO
from beyond_averaging.client.app import app as client_app
from beyond_averaging.server.app import client_task, data_spec
from beyond_averaging.server.config import RunConfig, parse_run_config
from beyond_averaging.server.inprocess import InProcessGrid
from beyond_averaging.server.resources import PeakSampler
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.server.watch import strip_ansi
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import DeviceData, evaluate
from beyond_averaging.tasks.federation import load_server_splits
from beyond_averaging.tasks.models import build_model


def interpreter() -> str:
    """This interpreter as a published command names it: relative to the checkout that holds its
    virtual environment (``.venv/bin/python``, ``.venvs/fleet-http/bin/python``), else in full."""
    path = Path(sys.executable)
    for folder in Path(sys.prefix).parents:
        if (folder / "pyproject.toml").is_file() and path.is_relative_to(folder):
            return str(path.relative_to(folder))
    return str(path)


def command(module: str, argv: Sequence[str] | None = None) -> str:
    """This invocation as typed in the checkout, with its ``OMP_NUM_THREADS`` and ``nice``."""
    words = [interpreter(), "-m", f"benchmarks.{module}"]
    words += sys.argv[1:] if argv is None else argv
    niceness = os.nice(0)
    words = ["nice", "-n", str(niceness), *words] if niceness else words
    threads = os.environ.get("OMP_NUM_THREADS")
    return shlex.join([f"OMP_NUM_THREADS={threads}", *words] if threads else words)


def save(module: str, name: str, page: str, raw: Any, publish: bool) -> None:
    """Print ``page``; write it and ``raw`` (JSON) to ``benchmarks/results/<module>/<name>``, and
    the page to ``docs/results/<name>.md`` with ``publish``."""
    print(page)
    folder = REPO / "benchmarks" / "results" / module
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(raw, indent=1), encoding="utf-8")
    for where in [folder, REPO / "docs" / "results"][: 1 + publish]:
        (where / f"{name}.md").write_text(page, encoding="utf-8")


class Stopwatch:
    """Wall, process-CPU and children's CPU seconds of a ``with`` block (``wall``, ``cpu``,
    ``children_cpu`` once it is left; children: the subprocesses it waited for)."""

    def __enter__(self) -> Stopwatch:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.children_cpu = sum(os.times()[2:4])
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        self.children_cpu = sum(os.times()[2:4]) - self.children_cpu


def status_bytes(field: str, pid: int | str = "self", path: str = "") -> int:
    """A memory line of ``/proc/<pid>/status`` (or ``path``, e.g. ``/proc/meminfo``) in bytes
    (``VmRSS``: now, ``VmHWM``: the peak, ``MemAvailable``); 0 once the process has ended."""
    try:
        status = Path(path or f"/proc/{pid}/status").read_text(encoding="utf-8")
    except OSError:
        return 0
    line = next((line for line in status.splitlines() if line.startswith(f"{field}:")), "")
    return int(line.split()[1]) * 1024 if line else 0  # the kernel writes kB


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (``VmHWM``) to its current RSS; False if not allowed.

    ``ru_maxrss`` cannot be reset and carries a parent's peak across fork and exec.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def process_table() -> tuple[dict[int, list[int]], dict[int, int], dict[int, str]]:
    """Children, RSS in bytes and command line of every process, from one ``ps`` call."""
    listing = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,rss=,args="], capture_output=True, text=True, check=False
    ).stdout
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    commands: dict[int, str] = {}
    for line in listing.splitlines():
        pid, parent, kilobytes, *args = line.split(maxsplit=3)
        children.setdefault(int(parent), []).append(int(pid))
        rss[int(pid)], commands[int(pid)] = int(kilobytes) * 1024, "".join(args)
    return children, rss, commands


def descendants(pid: int, children: dict[int, list[int]]) -> list[int]:
    """Every process below ``pid``."""
    found, frontier = [], list(children.get(pid, []))
    while frontier:
        found += frontier
        frontier = [child for p in frontier for child in children.get(p, [])]
    return found


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system) so far of ``root`` and every process below it."""
    total = 0
    for pid in [root, *descendants(root, process_table()[0])]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class Federation:
    """The server's side of an in-process federation, driven round by round by a benchmark.

    The real strategy of the run configuration, the real ClientApp behind the one in-process
    Grid (``server.inprocess``): what ``ba-run --runtime inprocess`` runs, with the round loop in
    the benchmark's hands so that it can read (or rewrite: wrap ``grid``) instructions and replies.
    """

    config: RunConfig
    model: torch.nn.Module
    strategy: Strategy
    grid: Grid
    arrays: ArrayRecord
    test_set: LabeledData

    def instructions(self, server_round: int) -> list[Message]:
        """The strategy's train instructions of a round, for the current global model."""
        task = ConfigRecord(client_task(self.config).to_config())
        return list(self.strategy.configure_train(server_round, self.arrays, task, self.grid))

    def round(self, server_round: int) -> list[Message]:
        """Train one round on the sampled nodes and aggregate; returns the replies."""
        replies = list(self.grid.send_and_receive(self.instructions(server_round)))
        arrays, _ = self.strategy.aggregate_train(server_round, replies)
        self.arrays = arrays if arrays is not None else self.arrays
        return replies

    def evaluate(self) -> tuple[float, float]:
        """Loss and accuracy of the current global model on the server's test split."""
        self.model.load_state_dict(self.arrays.to_torch_state_dict())
        cpu = torch.device("cpu")
        return evaluate(self.model, DeviceData.from_labeled(self.test_set, cpu), cpu)


def federation(
    settings: Mapping[str, Any],
    strategy: Callable[[RunConfig, ServerResources], Strategy] = build_strategy,
) -> Federation:
    """A :class:`Federation` of run-config ``settings``: model and strategy as the ServerApp's,
    or the strategy ``strategy`` builds (e.g. one of Flower's own)."""
    config = parse_run_config(settings)
    # The ClientApp reads the task identity Flower's runtime sets; a benchmark sets its own.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    torch.manual_seed(config.seed)
    test_set, proxy_set = load_server_splits(data_spec(config))
    model = build_model(config.model, test_set.input_shape, test_set.num_classes, seed=config.seed)
    rule = strategy(config, ServerResources(model, proxy_set, torch.device("cpu"), test_set))
    grid = InProcessGrid(client_app, config.num_clients, config.to_run_config())
    arrays = ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return Federation(config, model, rule, grid, arrays, test_set)


def peak_rss_sampler(pids: Callable[[], list[int]], interval: float = 0.2) -> PeakSampler:
    """A :class:`PeakSampler` of ``rss``: the largest peak RSS (``VmHWM``) of the processes
    ``pids()`` returns, sampled every ``interval`` s (e.g. a deployment's ServerApps)."""
    return PeakSampler(
        lambda: {"rss": float(max((status_bytes("VmHWM", pid) for pid in pids()), default=0))},
        interval,
    )


_LOG_PREFIX = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) *: *\t?", re.MULTILINE)


@dataclass(frozen=True)
class RunOutcome:
    """What one ``flwr run`` did, read from its streamed log and ``flwr ls``."""

    run_id: int | None
    status: str
    log: str
    seconds: float

    @property
    def completed(self) -> bool:
        return self.status.endswith("completed")

    def strategy(self) -> str | None:
        """The strategy class Flower's ``Strategy.start`` announced."""
        match = re.search(r"Starting (\w+) strategy", self.log)
        return match.group(1) if match else None

    def final_metrics(self, heading: str) -> dict[int, dict[str, float]]:
        """A per-round metrics table of the ``Final results`` that ``Strategy.start`` logs.

        ``heading`` is one of Flower's ``Aggregated ClientApp-side Train Metrics``,
        ``Aggregated ClientApp-side Evaluate Metrics`` or ``ServerApp-side Evaluate Metrics``.
        """
        _, found, rest = self.log.partition(f"{heading}:\n")
        if not found:
            return {}
        text = rest.split("\n\n", 1)[0]
        text = "".join(line.strip() for line in text.splitlines() if line.strip())
        table = ast.literal_eval(text[: text.rindex("}") + 1])
        return {int(r): {k: float(v) for k, v in m.items()} for r, m in table.items()}

    def tail(self, characters: int = 6000) -> str:
        return (
            f"status {self.status!r}, run {self.run_id}, {self.seconds:.0f} s:\n"
            + (self.log[-characters:])
        )


def clean_log(text: str) -> str:
    """A Flower log without colour codes and ``INFO :`` prefixes; each line as it was logged."""
    return _LOG_PREFIX.sub("", strip_ansi(text)).replace("\r", "")
