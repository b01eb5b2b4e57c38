"""The reporter of ``ba-sweep``: a spec's table (markdown) and plot, from its run folders.

A column's metric turns one run into one number, shown over a row's seeds as docs/benchmarks.md
("The spec file") says: mean ± sample sd (:func:`mean_sd`; ``ddof=1``, docs/benchmarks.md says
why), ``range``, ``max`` or ``vs``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from beyond_averaging.server.runs.folder import (
    FINISHED_STATUSES,
    MODEL_FILE,
    curve,
    read_metrics,
    read_summary,
)

from .spec import (
    METHOD_AXIS,
    POOLED_SHOWS,
    SEED_AXIS,
    Column,
    Run,
    Spec,
    label_of,
    paper_value,
)

FloatArray = npt.NDArray[np.float64]

#: Written by the runner into each run folder: the machine, runtime, threads, wall and CPU time.
HOST_FILE = "runner.json"


def seed_sd(values: npt.ArrayLike, axis: int = 0) -> FloatArray:
    """Sample standard deviation of ``values`` over the seeds along ``axis``: float64 of the shape
    without ``axis`` (0-d for a 1-d input); NaN for one seed."""
    array = np.asarray(values, dtype=np.float64)
    if array.shape[axis] < 2:
        return np.full(np.delete(np.array(array.shape), axis), np.nan)
    spread: FloatArray = array.std(axis=axis, ddof=1)
    return spread


def band(values: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
    """Per-round mean and sample sd of curves stacked ``(seeds, rounds)``; sd 0 for one seed."""
    curves = np.asarray(values, dtype=np.float64)
    return curves.mean(axis=0), np.nan_to_num(seed_sd(curves, axis=0), nan=0.0)


def mean_sd(values: Any, digits: int = 1) -> str:
    """``"m ± s"`` over seeds (sample sd), or ``"m"`` alone when there is one seed."""
    array = np.asarray(values, dtype=np.float64).ravel()
    mean = f"{array.mean():.{digits}f}"
    return mean if array.size < 2 else f"{mean} ± {float(seed_sd(array)):.{digits}f}"


@dataclass
class RunData:
    """A completed run: its spec entry, its rounds (``metrics.jsonl``) and ``summary.json``."""

    run: Run
    rounds: list[dict[str, Any]]
    summary: dict[str, Any]
    host: dict[str, Any]

    def curve(self, key: str, first: int = 1) -> dict[int, float]:
        """:func:`curve` of this run's rounds."""
        return curve(self.rounds, key, first)


def read_run(run: Run) -> RunData | None:
    """The run's data if its folder holds a run that ran every round (completed, with alarms
    or without), else None."""
    summary = read_summary(run.folder)
    if summary.get("status") not in FINISHED_STATUSES:
        return None
    host_path = run.folder / HOST_FILE
    host = json.loads(host_path.read_text(encoding="utf-8")) if host_path.is_file() else {}
    return RunData(run, read_metrics(run.folder), summary, host)


def shown(value: float | None, spec: str) -> str:
    """``value`` in the format ``spec``, or ``-`` where there is none."""
    return "-" if value is None else format(value, spec)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table of ``rows`` (cells shown with ``str``) under ``header``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _values(data: RunData, column: Column) -> list[float]:
    return list(data.curve(column.key).values())


def _peak_round(data: RunData, column: Column) -> float | None:
    curve = data.curve(column.key)
    return float(max(curve, key=lambda r: (curve[r], -r))) if curve else None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def in_distribution_accuracy(data: RunData, column: Column) -> float | None:
    """Colored data sets (FedGMA): the final model's accuracy on the held-out digits colored as
    in training (flip 0.15) instead of reversed; the server's test accuracy is the OOD one."""
    import torch

    from beyond_averaging.tasks.colored import PROXY_FLIP_PROBABILITY, base_dataset, colorize
    from beyond_averaging.tasks.datasets import load_dataset
    from beyond_averaging.tasks.evaluation import evaluate
    from beyond_averaging.tasks.federation import TEST_SUBSET_OFFSET, seeded_subset
    from beyond_averaging.tasks.models import build_model

    config = data.summary["config"]
    _, heldout = load_dataset(base_dataset(config["dataset"]), seed=config["seed"])  # type: ignore[arg-type]
    stream = np.random.default_rng(np.random.SeedSequence([config["seed"], 99]))
    test = colorize(
        heldout,
        binary=config["dataset"].endswith("binary"),
        flip_probability=PROXY_FLIP_PROBABILITY,
        rng=stream,
    )  # cut as the OOD test is (test-size), from the next seed, as FedGMA's script cut it
    test = seeded_subset(test, config.get("test-size", 0), config["seed"] + TEST_SUBSET_OFFSET + 1)
    model = build_model(config["model"], test.input_shape, test.num_classes)
    model.load_state_dict(torch.load(data.run.folder / MODEL_FILE, weights_only=True))
    return float(evaluate(model, test, torch.device("cpu"))[1])


#: Metric name (each of the spec's :data:`~.spec.METRIC_NAMES`) -> the run's number (None: the
#: run has none); ``values`` is a list (show range).
METRICS: dict[str, Callable[[RunData, Column], Any]] = {
    "final": lambda d, c: next(reversed(d.curve(c.key, first=0).values()), None),
    "last": lambda d, c: _mean(_values(d, c)[-c.rounds :]),
    "mean": lambda d, c: _mean(_values(d, c)),
    "sum": lambda d, c: float(sum(_values(d, c))),
    "at": lambda d, c: d.curve(c.key, first=0).get(c.round),
    "peak": lambda d, c: max(_values(d, c), default=None),
    "peak-round": _peak_round,
    "reach": lambda d, c: next(
        (float(r) for r, v in d.curve(c.key).items() if v >= c.target), None
    ),
    "values": _values,
    "wall-seconds": lambda d, c: float(d.summary.get("wall-seconds", math.nan)),
    "id-accuracy": in_distribution_accuracy,
    "paper": lambda d, c: None,  # the spec's paper entry of the row, not a run's number
}


@dataclass
class Row:
    """All seeds of one combination of the other axes."""

    labels: dict[str, str]
    runs: list[RunData]


def rows_of(spec: Spec, runs: Sequence[RunData]) -> list[Row]:
    """Runs grouped by their labels on every axis but the seed, in the spec's order."""
    rows: dict[tuple[str, ...], Row] = {}
    for data in runs:
        labels = {k: v for k, v in data.run.labels.items() if k != SEED_AXIS}
        rows.setdefault(tuple(labels.values()), Row(labels, [])).runs.append(data)
    return list(rows.values())


def _signed(values: Sequence[float], digits: int) -> str:
    text = mean_sd(values, digits)  # a mean that rounds to zero is +0, never -0
    return text if float(text.split()[0]) < 0 else f"+{text.removeprefix('-')}"


def cell(spec: Spec, row: Row, rows: Sequence[Row], column: Column) -> str:
    """One table cell: the column's metric over the row's seeds."""
    if column.metric == "paper":
        paper = paper_value(spec, row.labels)
        if paper is None:
            return "-"
        return label_of(paper) if isinstance(paper, str) else f"{paper:.{column.digits}f}"
    metric = METRICS[column.metric]
    values = {d.run.labels[SEED_AXIS]: metric(d, column) for d in row.runs}
    if column.vs:
        base_name = spec.baseline.get(row.labels.get(METHOD_AXIS, ""))
        base = next((r for r in rows if r.labels == {**row.labels, METHOD_AXIS: base_name}), None)
        if base is None:
            return "-"
        theirs = {d.run.labels[SEED_AXIS]: metric(d, column) for d in base.runs}
        pairs = [(values[s], theirs[s]) for s in values if s in theirs]
        diffs = [column.scale * (a - b) for a, b in pairs if a is not None and b is not None]
        if not diffs:
            return f"- vs {base_name}"
        sign = -1 if column.better == "lower" else 1
        better = sum(sign * d > 0 for d in diffs)
        return (
            f"{_signed(diffs, column.digits)} vs {base_name} "
            f"(better in {better}/{len(diffs)} seeds)"
        )
    if column.show in POOLED_SHOWS:
        pooled = [column.scale * v for vs in values.values() for v in vs]
        if not pooled or column.show == "median":
            return f"{np.median(pooled):.{column.digits}f}" if pooled else "-"
        low, mean, high = (
            f"{v:.{column.digits}f}" for v in (min(pooled), np.mean(pooled), max(pooled))
        )
        return f"{mean} ({low}-{high})"
    numbers = [column.scale * v for v in values.values() if v is not None]
    if column.show == "max":
        return (
            f"{max(numbers):.{column.digits}f} ({len(numbers)} of {len(values)} runs)"
            if numbers
            else "-"
        )
    some = column.metric == "reach" or 0 < len(numbers) < len(values)
    counted = f" ({len(numbers)}/{len(values)})" if some else ""
    return f"{mean_sd(numbers, column.digits) if numbers else '-'}{counted}"


def shown_columns(spec: Spec, runs: Sequence[RunData]) -> list[Column]:
    """The spec's columns, less each ``last`` column whose window holds every round of every
    run (its "last 10 rounds" would be the mean of all rounds, under a title that says not)."""
    return [
        c
        for c in spec.columns
        if c.metric != "last" or any(len(d.curve(c.key)) > c.rounds for d in runs)
    ]


def table(spec: Spec, runs: Sequence[RunData]) -> str:
    """The markdown table: one row per combination of the axes, seeds pooled."""
    rows = rows_of(spec, runs)
    axes = [a.name for a in spec.axes]
    columns = shown_columns(spec, runs)
    cells = []
    for row in rows:
        rounds = sorted({max(d.curve("test-accuracy", first=0), default=0) for d in row.runs})
        span = str(rounds[0]) if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
        cells.append(
            [*(row.labels[a] for a in axes), len(row.runs), span]
            + [cell(spec, row, rows, column) for column in columns]
        )
    return markdown_table([*axes, "seeds", "rounds", *(c.title for c in columns)], cells)


#: What the shaded band around each curve of a report's figure is, as its legend says it.
BAND_LABEL = "band: mean ± 1 sample sd over seeds"
#: What the dotted line is.
PAPER_LABEL = "dotted: the paper's number"


def plot(spec: Spec, runs: Sequence[RunData], path: Path) -> Path:
    """:func:`draw`, saved as ``path`` (a PNG)."""
    from beyond_averaging.server.runs.plots import save_figure

    return save_figure(draw(spec, runs), path, dpi=100)


def draw(spec: Spec, runs: Sequence[RunData]) -> Any:
    """Per plot row (a metric key) and panel (labels of ``panels`` axes): the mean per round of
    each row of the table, with a band of ± one sample sd over seeds (:func:`band`; none for one
    seed); the paper's number dotted. Titled with the spec's title and the metrics; each panel's
    legend says what the band (and a dotted line) is. The figure, not yet saved."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    from beyond_averaging.server.runs.plots import pyplot

    plt = pyplot("a report's plot")  # matplotlib only where a plot is drawn (Agg)

    keys = spec.plot.get("rows") or [
        {"key": "test-accuracy", "scale": 100, "label": "test accuracy (%)", "paper": True}
    ]
    panels_by = spec.plot.get("panels", [])
    rows = rows_of(spec, runs)
    panels = list(dict.fromkeys(tuple(r.labels[a] for a in panels_by) for r in rows))
    figure, axes = plt.subplots(
        len(keys), len(panels), figsize=(6 * len(panels), 4 * len(keys)), squeeze=False
    )
    papers: set[tuple[int, int]] = set()
    for column, panel in enumerate(panels):
        for row in (r for r in rows if tuple(r.labels[a] for a in panels_by) == panel):
            label = " ".join(v for k, v in row.labels.items() if k not in panels_by) or spec.title
            for index, entry in enumerate(keys):
                curves = [d.curve(entry["key"], first=0) for d in row.runs]
                shared = sorted(set.intersection(*(set(c) for c in curves)))
                if not shared:
                    continue
                values = float(entry.get("scale", 1)) * np.array(
                    [[c[r] for r in shared] for c in curves]
                )
                mean, spread = band(values)
                axis = axes[index][column]
                (line,) = axis.plot(shared, mean, label=f"{label} ({len(curves)} seeds)")
                axis.fill_between(
                    shared, mean - spread, mean + spread, color=line.get_color(), alpha=0.15
                )
                paper = paper_value(spec, row.labels) if entry.get("paper") else None
                if isinstance(paper, int | float):
                    axis.axhline(paper, color=line.get_color(), linestyle=":", linewidth=1)
                    papers.add((index, column))
        for index, entry in enumerate(keys):
            axis = axes[index][column]
            axis.set_title(", ".join(f"{a} {v}" for a, v in zip(panels_by, panel, strict=True)))
            axis.set_xlabel("round")
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
            axis.set_ylabel(str(entry.get("label", entry["key"])))
            axis.grid(alpha=0.3)
            # The curves' entries, then what the grey band (and a dotted line) stand for: a
            # reader cannot tell a seed spread from a min-max range or a confidence interval.
            handles, labels = axis.get_legend_handles_labels()
            handles.append(Patch(color="grey", alpha=0.3))
            labels.append(BAND_LABEL)
            if (index, column) in papers:
                handles.append(plt.Line2D([], [], color="grey", linestyle=":", linewidth=1))
                labels.append(PAPER_LABEL)
            axis.legend(handles, labels, fontsize=7)
    metrics = ", ".join(str(entry.get("label", entry["key"])) for entry in keys)
    figure.suptitle(f"{spec.title}: {metrics}")
    return figure


def write_report(
    spec: Spec, runs: Sequence[RunData], missing: Sequence[str], destination: Path, command: str
) -> list[Path]:
    """The page (``destination``, markdown) and its plot (same stem, ``.png``); with
    ``plot.diagnostics`` also the client-diagnostics figures of every run."""
    settings = ", ".join(f"`{k} = {json.dumps(v)}`" for k, v in spec.settings.items())
    wall = sum(float(d.summary.get("wall-seconds", 0.0)) for d in runs) / 60
    machines = sorted({str(d.host["hardware"]) for d in runs if "hardware" in d.host})
    unknown = sum("hardware" not in d.host for d in runs)
    image = destination.with_suffix(".png")
    lines = [f"# {spec.title}", ""]
    lines += [spec.description, ""] if spec.description else []
    lines += [
        f"Settings of every run: {settings or 'the run configuration defaults'}; runtime "
        f"`{spec.runtime}`. Mean ± sample standard deviation over seeds.",
        "",
        f"Command: `{command}`",
        "",
        f"Hardware: {'; '.join(machines) or 'not recorded'}"
        + (f" ({unknown} runs made before the runner recorded it)" if machines and unknown else "")
        + ".",
        "",
        f"Runs: {len(runs)}, {wall:.1f} min of wall time in all"
        + (f"; not finished: {', '.join(missing)}" if missing else "")
        + ".",
        "",
        table(spec, runs),
        f"![{spec.title}]({image.name})",
        "",
    ]
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_text("\n".join(lines), encoding="utf-8")
    written = [destination, plot(spec, runs, image)]
    if spec.plot.get("diagnostics"):
        from beyond_averaging.server.runs.plots import plot_diagnostics

        metrics = {d.run.name: d.rounds for d in runs}
        written += plot_diagnostics(metrics, destination.parent, destination.stem)
    return written
