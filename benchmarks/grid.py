"""The benchmark grid: strategies x datasets x partitions x models x seeds, one real run per cell.

Every cell is one real run of the app (ServerApp + ClientApp) through
:func:`server.launch.launch_runtime`, exactly what ``ba-run --runtime <runtime>`` does:
``--runtime simulation`` (default, Flower's Ray simulation) or ``--runtime inprocess`` (the same
apps in this process, no Ray; see docs/runtimes.md), with a deterministic run name
(``<dataset>-<partition>-<model>-<strategy>-seed<seed>``) under ``<grid folder>/runs/``. Per cell
the grid writes ``<grid folder>/cells/<cell>.json`` (per-round test accuracy and loss, every round
metric, the run's configuration, its status and wall time). A cell is *finished* when that file
exists, its status is ``completed`` and its settings equal the grid's current ones, so a grid that
was interrupted (or extended with more seeds, strategies...) resumes without redoing finished
cells; a failed cell is recorded with its error and run again next time.

Then the grid writes

- ``summary.md`` / ``summary.csv``: per (dataset, partition, model, strategy), mean and sample
  standard deviation over seeds of the mean test accuracy of the last 10 rounds (the papers'
  metric) and of the first round that reached the target accuracy, beside the papers' numbers
  where the setting has one (FedLAW's Table 3);
- ``plots/accuracy-<dataset>-<partition>-<model>.png``: test accuracy per round, one line per
  strategy (mean over seeds) with a band of +- one standard deviation over seeds.

Progress (cells done, elapsed time, estimated time left) is printed after every cell.

The grid comes from a TOML file (``benchmarks/grids/*.toml``), from command-line options, or
both (options win)::

    # 2 strategies x 1 dataset x 2 partitions x 2 seeds, 5 rounds each
    .venv/bin/python -m benchmarks.grid --name smoke --strategies fedavg,elastic \\
        --datasets digits --partitions dir0.5,iid --seeds 0,1 --rounds 5

    # a strategy variant with its own run-config overrides (FedAdam's server learning rate)
    .venv/bin/python -m benchmarks.grid --strategies fedavg,fedadam \\
        --variant 'fedadam: strategy="fedavg" server-optimizer="adam" server-lr=0.01'

    .venv/bin/python -m benchmarks.grid --grid benchmarks/grids/fedlaw-table3.toml --publish

Partition tokens: ``iid``, ``dir<alpha>`` (Dirichlet label skew, e.g. ``dir0.1``) and
``classes<n>`` (n classes per client).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import re
import shutil
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from benchmarks.plots import plot_accuracy_bands
from benchmarks.seed_stats import seed_sd
from beyond_averaging.server.config import ConfigError, parse_run_config
from beyond_averaging.server.launch import (
    RUNTIMES,
    LaunchError,
    app_defaults,
    launch,
    launch_runtime,
    parse_overrides,
    run_config_argument,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "grid"
DEFAULT_PUBLISH = REPO / "docs" / "results"
#: The papers report the mean test accuracy of the last 10 rounds (FedLAW, Table 3).
DEFAULT_LAST_ROUNDS = 10
STATUS_COMPLETED = "completed"
ACCURACY_KEY = "test-accuracy"

#: FedLAW (Li et al., ICML 2023) Table 3, FashionMNIST, 20 clients, E = 3, 200 rounds, 3 seeds:
#: (dirichlet alpha, model, method) -> top-1 accuracy in % (mean of the last 10 rounds).
FEDLAW_TABLE3: dict[tuple[float, str, str], float] = {
    (100.0, "mlp", "fedavg"): 89.29,
    (100.0, "lenet5", "fedavg"): 90.54,
    (0.1, "mlp", "fedavg"): 85.11,
    (0.1, "lenet5", "fedavg"): 88.08,
    (100.0, "mlp", "fedlaw"): 88.51,
    (100.0, "lenet5", "fedlaw"): 90.66,
    (0.1, "mlp", "fedlaw"): 86.30,
    (0.1, "lenet5", "fedlaw"): 88.26,
    (100.0, "mlp", "fedlaw-swa"): 88.27,
    (100.0, "lenet5", "fedlaw-swa"): 90.51,
    (0.1, "mlp", "fedlaw-swa"): 86.89,
    (0.1, "lenet5", "fedlaw-swa"): 88.18,
}

Launcher = Callable[..., Path]


class GridError(ValueError):
    """The grid specification is invalid; the message names the bad entry and the fix."""


# ----------------------------------------------------------------------------- specification
def partition_overrides(token: str) -> dict[str, Any]:
    """Run-config overrides of a partition token (``iid``, ``dir<alpha>``, ``classes<n>``)."""
    if token == "iid":
        return {"partition": "iid"}
    if match := re.fullmatch(r"dir(?:ichlet)?[-:]?(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)", token):
        return {"partition": "dirichlet", "dirichlet-alpha": float(match.group(1))}
    if match := re.fullmatch(r"classes[-:]?(\d+)", token):
        return {"partition": "classes", "classes-per-client": int(match.group(1))}
    raise GridError(
        f"partition {token!r} is unknown: use 'iid', 'dir<alpha>' (e.g. dir0.1) or 'classes<n>'"
    )


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``'label: key=value key=value'`` (TOML values) -> (label, overrides)."""
    label, separator, rest = text.partition(":")
    label = label.strip()
    if not separator or not re.fullmatch(r"[A-Za-z0-9_.+-]+", label):
        raise GridError(
            f"variant {text!r}: write 'label: key=value ...', e.g. "
            '\'fedadam: strategy="fedavg" server-optimizer="adam" server-lr=0.01\' (labels: '
            "letters, digits, '_.+-')"
        )
    overrides = parse_overrides([rest]) if rest.strip() else {}
    return label, overrides


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    strategy: str
    dataset: str
    partition: str
    model: str
    seed: int

    @property
    def cell_id(self) -> str:
        """Deterministic run name and result file stem."""
        return f"{self.dataset}-{self.partition}-{self.model}-{self.strategy}-seed{self.seed}"

    @property
    def group(self) -> tuple[str, str, str, str]:
        """The summary row this cell belongs to (all seeds of one setting and strategy)."""
        return (self.dataset, self.partition, self.model, self.strategy)


@dataclass
class GridSpec:
    """What to run and how to report it.

    Attributes
    ----------
    name : str
        Folder name of the grid under the output directory.
    strategies : dict
        Strategy label -> its run-config overrides (at least ``strategy``).
    datasets, partitions, models : list of str
        Axes of the grid (partition tokens as in :func:`partition_overrides`).
    seeds : list of int
        Seeds of every setting.
    common : dict
        Run-config overrides of every cell (rounds, clients, local training...).
    target_accuracy : float
        For "rounds to reach the target" (a fraction in (0, 1]).
    last_rounds : int
        The summary averages the accuracy of this many last rounds.
    """

    name: str = "default"
    strategies: dict[str, dict[str, Any]] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=lambda: ["digits"])
    partitions: list[str] = field(default_factory=lambda: ["dir0.5"])
    models: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0])
    common: dict[str, Any] = field(default_factory=dict)
    target_accuracy: float = 0.8
    last_rounds: int = DEFAULT_LAST_ROUNDS

    def validate(self) -> None:
        """Raise :class:`GridError` naming the first bad entry."""
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", self.name):
            raise GridError(f"grid name {self.name!r}: use letters, digits and '_.+-' only")
        if not self.strategies:
            raise GridError("the grid has no strategy: pass --strategies fedavg,elastic,...")
        for label, overrides in self.strategies.items():
            if "strategy" not in overrides:
                raise GridError(
                    f"strategy variant {label!r} sets no 'strategy' key: add e.g. "
                    f'strategy="fedavg" to its overrides'
                )
        for token in self.partitions:
            partition_overrides(token)
        if not (self.datasets and self.partitions and self.seeds):
            raise GridError("datasets, partitions and seeds must each name at least one value")
        if not 0.0 < self.target_accuracy <= 1.0:
            raise GridError(
                f"target accuracy {self.target_accuracy}: a fraction in (0, 1] (0.8 is 80 %)"
            )
        if self.last_rounds < 1:
            raise GridError(f"last-rounds = {self.last_rounds}: allowed is >= 1")
        for key in ("dataset", "partition", "dirichlet-alpha", "seed", "run-name", "output-dir"):
            if key in self.common:
                raise GridError(
                    f"common override {key!r} is set by the grid itself: use the grid's axes "
                    "(datasets, partitions, seeds) instead"
                )

    def model_axis(self, defaults: Mapping[str, Any]) -> list[str]:
        """The models of the grid: the ``models`` axis, else the common or app default model."""
        return self.models or [str(self.common.get("model", defaults.get("model", "mlp")))]

    def cells(self, defaults: Mapping[str, Any]) -> list[Cell]:
        """Every cell, seeds innermost (so each setting's seeds run one after another)."""
        return [
            Cell(strategy, dataset, partition, model, seed)
            for dataset in self.datasets
            for partition in self.partitions
            for model in self.model_axis(defaults)
            for strategy in self.strategies
            for seed in self.seeds
        ]

    def overrides(self, cell: Cell, runs_dir: Path) -> dict[str, Any]:
        """The full run-config overrides of a cell (strategy variant beats common)."""
        return {
            **self.common,
            **self.strategies[cell.strategy],
            "dataset": cell.dataset,
            **partition_overrides(cell.partition),
            "model": cell.model,
            "seed": cell.seed,
            "run-name": cell.cell_id,
            "output-dir": str(runs_dir),
        }


def _split(values: str) -> list[str]:
    return [value.strip() for value in values.split(",") if value.strip()]


def load_grid_file(path: Path) -> GridSpec:
    """A :class:`GridSpec` from a TOML file (see ``benchmarks/grids/``)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise GridError(f"cannot read grid file {path}: {error}") from None
    known = {
        "name",
        "strategies",
        "datasets",
        "partitions",
        "models",
        "seeds",
        "common",
        "target-accuracy",
        "last-rounds",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise GridError(f"grid file {path}: unknown keys {unknown}; allowed are {sorted(known)}")
    strategies: dict[str, dict[str, Any]] = {}
    for label, value in dict(data.get("strategies", {})).items():
        strategies[label] = dict(value) if value else {"strategy": label}
    spec = GridSpec(
        name=str(data.get("name", path.stem)),
        strategies=strategies,
        common=dict(data.get("common", {})),
    )
    for key, attribute in (("datasets", "datasets"), ("partitions", "partitions")):
        if key in data:
            setattr(spec, attribute, [str(v) for v in data[key]])
    if "models" in data:
        spec.models = [str(v) for v in data["models"]]
    if "seeds" in data:
        spec.seeds = [int(v) for v in data["seeds"]]
    spec.target_accuracy = float(data.get("target-accuracy", spec.target_accuracy))
    spec.last_rounds = int(data.get("last-rounds", spec.last_rounds))
    return spec


def spec_from_args(args: argparse.Namespace) -> GridSpec:
    """The grid of the command line: a grid file (if any) with the options applied on top."""
    spec = load_grid_file(args.grid) if args.grid else GridSpec()
    variants = dict(parse_variant(text) for text in args.variant)
    if args.strategies:
        spec.strategies = {
            label: variants.get(label) or spec.strategies.get(label) or {"strategy": label}
            for label in _split(args.strategies)
        }
    elif variants:
        spec.strategies.update(variants)
    if not spec.strategies:
        spec.strategies = {"fedavg": {"strategy": "fedavg"}}
    if args.name:
        spec.name = args.name
    if args.datasets:
        spec.datasets = _split(args.datasets)
    if args.partitions:
        spec.partitions = _split(args.partitions)
    if args.models:
        spec.models = _split(args.models)
    if args.seeds:
        try:
            spec.seeds = [int(seed) for seed in _split(args.seeds)]
        except ValueError:
            raise GridError(f"--seeds {args.seeds!r}: write integers, e.g. 0,1,2") from None
    for text in args.set:
        spec.common.update(parse_overrides([text]))
    if args.rounds is not None:
        spec.common["num-server-rounds"] = args.rounds
    if args.target_accuracy is not None:
        spec.target_accuracy = args.target_accuracy
    if args.last_rounds is not None:
        spec.last_rounds = args.last_rounds
    spec.validate()
    return spec


# ----------------------------------------------------------------------------- running cells
def result_path(grid_dir: Path, cell: Cell) -> Path:
    """Where a cell's result JSON lives."""
    return grid_dir / "cells" / f"{cell.cell_id}.json"


def _normalised(overrides: Mapping[str, Any]) -> dict[str, Any]:
    return dict(json.loads(json.dumps(overrides, sort_keys=True)))


def read_result(path: Path) -> dict[str, Any] | None:
    """A cell's stored result, or None when absent or unreadable (then the cell runs again)."""
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def finished_result(path: Path, overrides: Mapping[str, Any]) -> dict[str, Any] | None:
    """The stored result if the cell is finished with these exact settings, else None."""
    result = read_result(path)
    if result is None or result.get("status") != STATUS_COMPLETED:
        return None
    if result.get("overrides") != _normalised(overrides):
        return None
    return result


def _run_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def run_cell(
    cell: Cell,
    overrides: Mapping[str, Any],
    grid_dir: Path,
    *,
    launcher: Launcher | None = None,
    timeout: float | None = None,
    client_cpus: int | None = 1,
) -> dict[str, Any]:
    """Run one cell through the launcher and write its result JSON (also when it failed)."""
    run = launch if launcher is None else launcher
    run_dir = Path(str(overrides["output-dir"])) / cell.cell_id
    started = time.perf_counter()
    status, error = STATUS_COMPLETED, None
    try:
        run_dir = run(
            REPO, [run_config_argument(overrides)], timeout=timeout, client_cpus=client_cpus
        )
    except LaunchError as failure:
        status, error = "failed", str(failure)
    seconds = time.perf_counter() - started
    metrics = _run_metrics(run_dir)
    summary_path = run_dir / "summary.json"
    summary = read_result(summary_path) or {}
    result: dict[str, Any] = {
        "cell": {
            "id": cell.cell_id,
            "strategy": cell.strategy,
            "dataset": cell.dataset,
            "partition": cell.partition,
            "model": cell.model,
            "seed": cell.seed,
        },
        "overrides": _normalised(overrides),
        "config": summary.get("config", {}),
        "status": status if status != STATUS_COMPLETED else summary.get("status", "missing"),
        "error": error,
        "wall-seconds": seconds,
        "run-dir": str(run_dir),
        "finished-at": datetime.now(UTC).isoformat(timespec="seconds"),
        "rounds": [int(entry["round"]) for entry in metrics],
        "test-accuracy": [entry.get(ACCURACY_KEY) for entry in metrics],
        "test-loss": [entry.get("test-loss") for entry in metrics],
        "metrics": metrics,
    }
    path = result_path(grid_dir, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(result, indent=1, sort_keys=True), encoding="utf-8")
    temporary.replace(path)  # atomic: an interrupted write never leaves a half result file
    return result


def format_seconds(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``4s``."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """Prints cells done, elapsed time and the estimated time left after every cell.

    The estimate is the mean wall time of the cells run so far (this session first; before the
    first one finishes, the stored wall times of cells finished earlier) times the cells left.
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stdout
        self.clock = clock
        self.started = clock()
        self.session_seconds: list[float] = []
        self.earlier_seconds: list[float] = []

    def skip(self, cell: Cell, stored_seconds: float | None) -> None:
        """A cell finished in an earlier session."""
        self.done += 1
        if stored_seconds is not None:
            self.earlier_seconds.append(stored_seconds)
        self._print(f"{cell.cell_id}: finished earlier, skipped")

    def start(self, cell: Cell) -> None:
        """A cell starts running."""
        self._print(f"{cell.cell_id}: running (cell {self.done + 1} of {self.total})")

    def finish(self, cell: Cell, seconds: float, status: str) -> None:
        """A cell ran (completed or failed) in ``seconds``."""
        self.done += 1
        self.session_seconds.append(seconds)
        self._print(f"{cell.cell_id}: {status} in {format_seconds(seconds)}")

    def estimate_left(self) -> float | None:
        """Seconds left, or None when no cell time is known yet."""
        known = self.session_seconds or self.earlier_seconds
        if not known:
            return None
        return float(np.mean(known)) * (self.total - self.done)

    def _print(self, event: str) -> None:
        left = self.estimate_left()
        eta = "unknown" if left is None else f"~{format_seconds(left)}"
        elapsed = format_seconds(self.clock() - self.started)
        print(
            f"[grid] {self.done}/{self.total} cells done | elapsed {elapsed} | left {eta} | "
            f"{event}",
            file=self.stream,
            flush=True,
        )


@dataclass
class GridOutcome:
    """What a grid session did."""

    results: list[dict[str, Any]]
    ran: list[str]
    skipped: list[str]
    failed: list[str]


def check_cells(spec: GridSpec, cells: Sequence[Cell], runs_dir: Path) -> None:
    """Validate every cell's run configuration before the first run starts.

    Raises
    ------
    GridError
        Naming the first cell whose settings the app would reject, with the app's reason.
    """
    for cell in cells:
        try:
            parse_run_config(spec.overrides(cell, runs_dir))
        except ConfigError as error:
            raise GridError(f"cell {cell.cell_id}: {error}") from None


def run_grid(
    spec: GridSpec,
    grid_dir: Path,
    *,
    launcher: Launcher | None = None,
    timeout: float | None = None,
    client_cpus: int | None = 1,
    stream: TextIO | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> GridOutcome:
    """Run every cell not finished yet; return every cell's result (old and new)."""
    spec.validate()
    defaults = app_defaults(REPO) if defaults is None else defaults
    cells = spec.cells(defaults)
    runs_dir = grid_dir / "runs"
    check_cells(spec, cells, runs_dir)
    progress = Progress(len(cells), stream=stream)
    outcome = GridOutcome([], [], [], [])
    for cell in cells:
        overrides = spec.overrides(cell, runs_dir)
        stored = finished_result(result_path(grid_dir, cell), overrides)
        if stored is not None:
            progress.skip(cell, stored.get("wall-seconds"))
            outcome.results.append(stored)
            outcome.skipped.append(cell.cell_id)
            continue
        progress.start(cell)
        result = run_cell(
            cell,
            overrides,
            grid_dir,
            launcher=launcher,
            timeout=timeout,
            client_cpus=client_cpus,
        )
        progress.finish(cell, result["wall-seconds"], result["status"])
        outcome.results.append(result)
        outcome.ran.append(cell.cell_id)
        if result["status"] != STATUS_COMPLETED:
            outcome.failed.append(cell.cell_id)
            print(f"[grid] {cell.cell_id} failed: {result['error']}", file=progress.stream)
    return outcome


# ----------------------------------------------------------------------------- summary
def accuracy_by_round(result: Mapping[str, Any]) -> dict[int, float]:
    """Round -> test accuracy of a cell (rounds without a number are left out)."""
    return {
        int(r): float(a)
        for r, a in zip(result["rounds"], result["test-accuracy"], strict=True)
        if isinstance(a, int | float)
    }


def last_rounds_accuracy(accuracy: Mapping[int, float], last: int) -> float:
    """Mean accuracy of the last ``last`` training rounds (round 0, the initial model, excluded)."""
    trained = [accuracy[r] for r in sorted(accuracy) if r >= 1]
    if not trained:
        return math.nan
    return float(np.mean(trained[-last:]))


def rounds_to_target(accuracy: Mapping[int, float], target: float) -> int | None:
    """The first training round whose test accuracy reaches ``target`` (None if none does)."""
    return next((r for r in sorted(accuracy) if r >= 1 and accuracy[r] >= target), None)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return float(np.mean(values)), float(seed_sd(values))


def paper_reference(result: Mapping[str, Any]) -> float | None:
    """FedLAW Table 3's accuracy (%) for a cell's setting, when the paper has one."""
    overrides = result["overrides"]
    if overrides.get("dataset") != "fashion-mnist" or overrides.get("partition") != "dirichlet":
        return None
    strategy = overrides.get("strategy")
    default_server = (
        overrides.get("server-optimizer", "sgd") == "sgd"
        and float(overrides.get("server-lr", 1.0)) == 1.0
    )
    if strategy == "fedavg" and default_server:
        method = "fedavg"
    elif strategy == "fedlaw" and overrides.get("fedlaw-learn", "both") == "both":
        method = "fedlaw-swa" if overrides.get("fedlaw-swa", False) else "fedlaw"
    else:
        return None
    key = (float(overrides.get("dirichlet-alpha", math.nan)), str(overrides.get("model")), method)
    return FEDLAW_TABLE3.get(key)


@dataclass(frozen=True)
class SummaryRow:
    """One (dataset, partition, model, strategy) row of the summary, accuracies in %."""

    dataset: str
    partition: str
    model: str
    strategy: str
    seeds: int
    rounds: int
    accuracy_mean: float
    accuracy_std: float
    rounds_to_target_mean: float
    rounds_to_target_std: float
    reached_target: int
    wall_seconds_mean: float
    paper: float | None


def summarise(
    results: Iterable[Mapping[str, Any]], *, target: float, last: int
) -> list[SummaryRow]:
    """Mean and standard deviation over seeds per setting and strategy (completed cells only).

    The standard deviation is the sample one (ddof = 1), NaN for a single seed. Rounds-to-target
    statistics are over the seeds that reached the target; ``reached_target`` counts them.
    """
    groups: dict[tuple[str, str, str, str], list[Mapping[str, Any]]] = {}
    for result in results:
        if result.get("status") == STATUS_COMPLETED:
            cell = result["cell"]
            key = (cell["dataset"], cell["partition"], cell["model"], cell["strategy"])
            groups.setdefault(key, []).append(result)
    rows = []
    for (dataset, partition, model, strategy), members in groups.items():
        curves = [accuracy_by_round(member) for member in members]
        finals = [100.0 * last_rounds_accuracy(curve, last) for curve in curves]
        reached = [r for r in (rounds_to_target(c, target) for c in curves) if r is not None]
        accuracy_mean, accuracy_std = _mean_std(finals)
        reach_mean, reach_std = _mean_std([float(r) for r in reached])
        rows.append(
            SummaryRow(
                dataset=dataset,
                partition=partition,
                model=model,
                strategy=strategy,
                seeds=len(members),
                rounds=max((max(c, default=0) for c in curves), default=0),
                accuracy_mean=accuracy_mean,
                accuracy_std=accuracy_std,
                rounds_to_target_mean=reach_mean,
                rounds_to_target_std=reach_std,
                reached_target=len(reached),
                wall_seconds_mean=float(np.mean([m["wall-seconds"] for m in members])),
                paper=paper_reference(members[0]),
            )
        )
    return rows


def _number(value: float | None, digits: int) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.{digits}f}"


def summary_markdown(rows: Sequence[SummaryRow], *, target: float, last: int) -> str:
    """The summary as a Markdown table."""
    header = (
        f"| dataset | partition | model | strategy | seeds | rounds | "
        f"acc. last {last} rounds, or all if fewer (%) mean ± std | "
        f"rounds to {target:.0%} mean ± std (reached) "
        f"| paper (%) | wall s / run |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        spread = f" ± {_number(row.rounds_to_target_std, 1)}" if row.reached_target > 1 else ""
        reach = (
            f"{_number(row.rounds_to_target_mean, 1)}{spread} ({row.reached_target}/{row.seeds})"
        )
        lines.append(
            f"| {row.dataset} | {row.partition} | {row.model} | {row.strategy} | {row.seeds} | "
            f"{row.rounds} | {_number(row.accuracy_mean, 2)}"
            f"{f' ± {_number(row.accuracy_std, 2)}' if row.seeds > 1 else ''} | "
            f"{reach} | {_number(row.paper, 2)} | {_number(row.wall_seconds_mean, 0)} |"
        )
    return "\n".join(lines) + "\n"


CSV_COLUMNS = (
    "dataset",
    "partition",
    "model",
    "strategy",
    "seeds",
    "rounds",
    "accuracy_mean",
    "accuracy_std",
    "rounds_to_target_mean",
    "rounds_to_target_std",
    "reached_target",
    "wall_seconds_mean",
    "paper",
)


def write_summary(
    rows: Sequence[SummaryRow], directory: Path, *, target: float, last: int
) -> list[Path]:
    """``summary.md`` and ``summary.csv`` (accuracies in %, empty cells for undefined values)."""
    directory.mkdir(parents=True, exist_ok=True)
    markdown = directory / "summary.md"
    markdown.write_text(summary_markdown(rows, target=target, last=last), encoding="utf-8")
    table = directory / "summary.csv"
    with table.open("w", newline="", encoding="utf-8") as stream:
        writer = csv.writer(stream)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            values = [getattr(row, column) for column in CSV_COLUMNS]
            writer.writerow(
                ["" if isinstance(v, float) and not math.isfinite(v) else v for v in values]
            )
    return [markdown, table]


def plot_grid(
    results: Iterable[Mapping[str, Any]], directory: Path, *, target: float | None = None
) -> list[Path]:
    """One accuracy-per-round PNG per (dataset, partition, model): a line per strategy."""
    groups: dict[tuple[str, str, str], dict[str, list[dict[int, float]]]] = {}
    for result in results:
        if result.get("status") == STATUS_COMPLETED:
            cell = result["cell"]
            setting = (cell["dataset"], cell["partition"], cell["model"])
            groups.setdefault(setting, {}).setdefault(cell["strategy"], []).append(
                accuracy_by_round(result)
            )
    paths = []
    for (dataset, partition, model), strategies in groups.items():
        curves = {}
        for label, seeds in strategies.items():
            # Seeds of one setting share the rounds; a shorter run limits the band to its length.
            rounds = sorted(set.intersection(*(set(curve) for curve in seeds)))
            curves[label] = (rounds, np.array([[curve[r] for r in rounds] for curve in seeds]))
        path = directory / f"accuracy-{dataset}-{partition}-{model}.png"
        title = f"{dataset}, {partition}, {model}: test accuracy (mean ± std over seeds)"
        paths.append(plot_accuracy_bands(curves, path, title=title, target=target))
    return paths


def report(spec: GridSpec, results: Sequence[Mapping[str, Any]], grid_dir: Path) -> list[Path]:
    """Write the summary table and the plots of a grid's results."""
    rows = summarise(results, target=spec.target_accuracy, last=spec.last_rounds)
    written = write_summary(rows, grid_dir, target=spec.target_accuracy, last=spec.last_rounds)
    written += plot_grid(results, grid_dir / "plots", target=spec.target_accuracy)
    return written


def stored_results(spec: GridSpec, grid_dir: Path) -> list[dict[str, Any]]:
    """The stored results of the grid's cells (any status), for ``--report-only``."""
    defaults = app_defaults(REPO)
    found = []
    for cell in spec.cells(defaults):
        result = read_result(result_path(grid_dir, cell))
        if result is not None:
            found.append(result)
    return found


# ----------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    """The ``python -m benchmarks.grid`` options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.grid",
        description="Run a resumable grid of strategies x datasets x partitions x seeds.",
    )
    parser.add_argument("--grid", type=Path, help="TOML grid file (benchmarks/grids/)")
    parser.add_argument("--name", help="grid folder name (default: the grid file's name)")
    parser.add_argument("--strategies", help="comma-separated strategy names or variant labels")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="a strategy variant: 'label: key=value ...' (run-config overrides, TOML values)",
    )
    parser.add_argument("--datasets", help="comma-separated, e.g. digits,fashion-mnist")
    parser.add_argument("--partitions", help="comma-separated: iid, dir<alpha>, classes<n>")
    parser.add_argument("--models", help="comma-separated, e.g. mlp,lenet5")
    parser.add_argument("--seeds", help="comma-separated integers, e.g. 0,1,2")
    parser.add_argument("--rounds", type=int, help="num-server-rounds of every cell")
    parser.add_argument(
        "--set", action="append", default=[], help="run-config overrides of every cell"
    )
    parser.add_argument("--target-accuracy", type=float, help="fraction, e.g. 0.8")
    parser.add_argument("--last-rounds", type=int, help=f"default {DEFAULT_LAST_ROUNDS}")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument(
        "--publish",
        nargs="?",
        const=DEFAULT_PUBLISH,
        type=Path,
        help="also copy the summary and plots to this folder (default docs/results)",
    )
    parser.add_argument("--report-only", action="store_true", help="only redraw from results")
    parser.add_argument("--dry-run", action="store_true", help="list the cells and exit")
    parser.add_argument("--timeout", type=float, help="seconds per cell before giving up")
    parser.add_argument(
        "--client-cpus",
        type=int,
        default=1,
        help="CPUs Ray reserves per simulated client (in process: torch threads)",
    )
    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default=RUNTIMES[0],
        help="simulation (Flower/Ray) or inprocess (no Ray, much faster; docs/runtimes.md)",
    )
    return parser


def publish(paths: Sequence[Path], grid_dir: Path, destination: Path, name: str) -> list[Path]:
    """Copy the report files to ``<destination>/grid-<name>/`` (keeping ``plots/``)."""
    copied = []
    for path in paths:
        target = destination / f"grid-{name}" / path.relative_to(grid_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied.append(target)
    return copied


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: run (or resume) a grid, then write its summary and plots."""
    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
    except (GridError, ValueError) as error:
        print(f"grid: error: {error}", file=sys.stderr)
        return 2
    grid_dir = args.output_dir.resolve() / spec.name
    try:
        check_cells(spec, spec.cells(app_defaults(REPO)), grid_dir / "runs")
    except GridError as error:
        print(f"grid: error: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        for cell in spec.cells(app_defaults(REPO)):
            overrides = spec.overrides(cell, grid_dir / "runs")
            state = finished_result(result_path(grid_dir, cell), overrides)
            print(f"{cell.cell_id}: {'finished' if state else 'to run'}")
        return 0
    failed: list[str] = []
    if args.report_only:
        results = stored_results(spec, grid_dir)
    else:
        started = time.monotonic()
        outcome = run_grid(
            spec,
            grid_dir,
            launcher=functools.partial(launch_runtime, args.runtime),
            timeout=args.timeout,
            client_cpus=args.client_cpus,
        )
        results, failed = outcome.results, outcome.failed
        print(
            f"[grid] ran {len(outcome.ran)}, skipped {len(outcome.skipped)} finished earlier, "
            f"{len(failed)} failed, in {format_seconds(time.monotonic() - started)}"
        )
    paths = report(spec, results, grid_dir)
    print((grid_dir / "summary.md").read_text(encoding="utf-8"))
    if args.publish:
        paths = publish(paths, grid_dir, args.publish, spec.name)
    for path in paths:
        print(f"wrote {path}")
    if failed:
        print(f"grid: {len(failed)} cell(s) failed: {failed}; rerun to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
