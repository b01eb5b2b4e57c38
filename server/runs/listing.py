"""Finding and comparing runs: ``ba-run --list`` and ``ba-run --compare``.

A run is a folder ``<output-dir>/<run-name>/`` (:mod:`beyond_averaging.server.runs.folder`,
written by :mod:`beyond_averaging.server.runs.recorder`). This module reads them only:

- :func:`find_runs` and :func:`runs_table`: every run under a folder, one row each (name, rule,
  dataset, status checked against the run's owner lock, rounds, final and best test accuracy,
  start time);
- :func:`compare_runs`, :func:`comparison_table` and :func:`plot_comparison`: final, best and
  last-5-round mean test accuracy of a few runs, the rounds each took to reach a target, and one
  figure overlaying their accuracy curves (with the client-diagnostics figures of runs that have
  them: :mod:`beyond_averaging.server.runs.plots`);
- :func:`existing_run_problem`: why a new run must not take a run folder that holds a run.

matplotlib (the ``bench`` extra) is imported only where a figure is drawn.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from .folder import (
    ACCURACY_KEY,
    METRICS_FILE,
    SUMMARY_FILE,
    RunsError,
    curve,
    read_metrics,
    read_summary,
    rule_of,
)
from .plots import diagnostics_figures, integer_rounds, pyplot, save_figure

#: Rounds averaged by the comparison's "last rounds" column.
LAST_ROUNDS = 5


def started_at(summary: Mapping[str, Any]) -> str | None:
    """When the run began (UTC, ISO 8601): ``started-at``; for a run recorded before that
    field, its last update less its wall time."""
    if summary.get("started-at"):
        return str(summary["started-at"])
    try:
        updated = datetime.fromisoformat(str(summary["updated-at"]))
        wall = float(summary.get("wall-seconds", 0.0))
    except (KeyError, ValueError):
        return None
    return (updated - timedelta(seconds=wall)).isoformat(timespec="seconds")


@dataclass
class RunInfo:
    """One run, as ``ba-run --list`` shows it."""

    name: str
    folder: str
    rule: str
    dataset: str
    #: Checked against the run's owner lock: ``interrupted`` for a ``running`` summary whose
    #: writer is gone (the summary is not rewritten here).
    status: str
    rounds: int
    planned_rounds: int | None
    final_accuracy: float | None
    best_accuracy: float | None
    best_round: int | None
    started: str | None


def run_info(folder: Path) -> RunInfo:
    """What :func:`find_runs` shows of one run folder."""
    from .recorder import run_status  # imports torch: only where runs are read

    folder = Path(folder)
    status = run_status(folder)
    summary = status.summary or read_summary(folder)
    config = summary.get("config") or {}
    try:
        accuracy = curve(read_metrics(folder), ACCURACY_KEY, first=1)
    except FileNotFoundError:
        accuracy = {}
    best_round = max(accuracy, key=lambda r: (accuracy[r], -r)) if accuracy else None
    planned = config.get("num-server-rounds")
    return RunInfo(
        name=folder.name,
        folder=str(folder),
        rule=rule_of(config),
        dataset=str(config.get("dataset", "?")),
        status=status.status,
        rounds=int(summary.get("rounds-completed", max(accuracy, default=0))),
        planned_rounds=planned if isinstance(planned, int) else None,
        final_accuracy=accuracy[max(accuracy)] if accuracy else None,
        best_accuracy=None if best_round is None else accuracy[best_round],
        best_round=best_round,
        started=started_at(summary),
    )


def find_runs(directory: Path) -> list[RunInfo]:
    """Every run folder directly under ``directory`` (a folder holding ``summary.json``),
    oldest first.

    Raises
    ------
    RunsError
        ``directory`` is not a folder.
    """
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise RunsError(
            f"{directory} is not a folder: pass the folder that holds your runs (output-dir, "
            "by default runs/ in the app's folder)"
        )
    runs = [run_info(folder) for folder in directory.iterdir() if (folder / SUMMARY_FILE).is_file()]
    return sorted(runs, key=lambda run: (run.started or "", run.name))


# --- tables ----------------------------------------------------------------------------------
def number(value: float | None, digits: int = 4) -> str:
    """``value`` rounded to ``digits`` places, ``-`` where there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def text_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Plain columns, left-aligned, two spaces apart: readable in a terminal, a file or grep."""
    cells = [list(map(str, header)), *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _time(stamp: str | None) -> str:
    if not stamp:
        return "-"
    try:
        moment = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M")


def runs_table(runs: Sequence[RunInfo]) -> str:
    """``ba-run --list``'s table."""
    header = [
        "name",
        "rule",
        "dataset",
        "status",
        "rounds",
        "final acc",
        "best acc",
        "started (UTC)",
    ]
    rows = [
        [
            run.name,
            run.rule,
            run.dataset,
            run.status,
            f"{run.rounds}/{'?' if run.planned_rounds is None else run.planned_rounds}",
            number(run.final_accuracy),
            number(run.best_accuracy),
            _time(run.started),
        ]
        for run in runs
    ]
    return text_table(header, rows)


def runs_json(runs: Sequence[RunInfo]) -> str:
    """``ba-run --list --format json``: one object per run, keys in kebab-case."""
    return json.dumps(
        [{key.replace("_", "-"): value for key, value in asdict(run).items()} for run in runs],
        indent=2,
    )


# --- comparison ------------------------------------------------------------------------------
@dataclass
class Compared:
    """One run of a comparison."""

    name: str
    folder: str
    rule: str
    dataset: str
    rounds: int
    final_accuracy: float | None
    best_accuracy: float | None
    best_round: int | None
    #: Mean test accuracy of the last :data:`LAST_ROUNDS` rounds (fewer in a shorter run).
    last_mean: float | None
    last_rounds: int
    #: The first round whose test accuracy reached the comparison's target (None: never).
    rounds_to_target: int | None
    #: Round -> test accuracy, round 0 (the initial model) included.
    accuracy: dict[int, float]


def resolve_run(reference: str | Path, directory: Path) -> Path:
    """A run folder: ``reference`` itself when it is one, else ``directory/reference``.

    Raises
    ------
    RunsError
        Neither holds a run's ``metrics.jsonl``.
    """
    for candidate in (Path(reference).expanduser(), Path(directory).expanduser() / reference):
        if (candidate / METRICS_FILE).is_file():
            return candidate
    raise RunsError(
        f"no run '{reference}': neither {reference} nor {Path(directory) / reference} holds a "
        f"{METRICS_FILE} (list the runs with `ba-run --list {directory}`)"
    )


def compare_runs(
    folders: Sequence[Path], target: float | None = None
) -> tuple[list[Compared], float]:
    """The compared runs and the target accuracy their ``rounds_to_target`` counts to.

    ``target`` None: the lowest of the runs' best accuracies, so that every run reaches it and
    the column says which got there first.
    """
    curves = []
    for folder in folders:
        rounds = read_metrics(folder)
        curves.append((Path(folder), read_summary(folder), curve(rounds, ACCURACY_KEY, first=0)))
    bests = [max(v for r, v in acc.items() if r >= 1) for _, _, acc in curves if len(acc) > 1]
    if target is None:
        target = min(bests) if bests else 1.0
    compared = []
    for folder, summary, accuracy in curves:
        trained = {r: v for r, v in accuracy.items() if r >= 1}
        last = list(trained.values())[-LAST_ROUNDS:]
        best_round = max(trained, key=lambda r: (trained[r], -r)) if trained else None
        config = summary.get("config") or {}
        compared.append(
            Compared(
                name=folder.name,
                folder=str(folder),
                rule=rule_of(config),
                dataset=str(config.get("dataset", "?")),
                rounds=max(trained, default=0),
                final_accuracy=trained[max(trained)] if trained else None,
                best_accuracy=None if best_round is None else trained[best_round],
                best_round=best_round,
                last_mean=sum(last) / len(last) if last else None,
                last_rounds=len(last),
                rounds_to_target=next((r for r, v in trained.items() if v >= target), None),
                accuracy=accuracy,
            )
        )
    return compared, target


def comparison_table(runs: Sequence[Compared], target: float) -> str:
    """``ba-run --compare``'s table."""
    window = max((run.last_rounds for run in runs), default=LAST_ROUNDS)
    header = [
        "run",
        "rule",
        "dataset",
        "rounds",
        "final acc",
        "best acc (round)",
        f"mean last {window}",
        f"rounds to {target:.4f}",
    ]
    rows = [
        [
            run.name,
            run.rule,
            run.dataset,
            run.rounds,
            number(run.final_accuracy),
            "-" if run.best_round is None else f"{number(run.best_accuracy)} ({run.best_round})",
            number(run.last_mean),
            "not reached" if run.rounds_to_target is None else run.rounds_to_target,
        ]
        for run in runs
    ]
    return text_table(header, rows)


def comparison_json(runs: Sequence[Compared], target: float) -> str:
    """``ba-run --compare --format json``."""
    entries = []
    for run in runs:
        entry = {key.replace("_", "-"): value for key, value in asdict(run).items()}
        entry["accuracy"] = {str(r): v for r, v in run.accuracy.items()}
        entries.append(entry)
    return json.dumps({"target": target, "runs": entries}, indent=2)


def plot_comparison(runs: Sequence[Compared], path: Path, target: float | None = None) -> Path:
    """One figure overlaying the runs' test accuracy per round (the target dotted)."""
    plt = pyplot("ba-run --compare's plot")
    figure, axes = plt.subplots(figsize=(7.0, 4.2))
    for run in runs:
        axes.plot(
            list(run.accuracy),
            list(run.accuracy.values()),
            marker=".",
            label=f"{run.name} ({run.rule})",
        )
    if target is not None:
        axes.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:.4f}")
    datasets = sorted({run.dataset for run in runs})
    axes.set_title(f"test accuracy per round ({', '.join(datasets)})")
    axes.set_ylabel("test accuracy")
    integer_rounds(axes)
    axes.legend(fontsize="small")
    return save_figure(figure, path)


# --- run names -------------------------------------------------------------------------------
def existing_run_problem(folder: Path) -> tuple[str, str] | None:
    """The status of the run ``folder`` holds and why a new run must not be written there, or
    None when it holds no run (no ``summary.json``: never started, or an empty folder).

    The message lists the three ways on: resume it, choose another name, or overwrite it (a
    ``running`` run, whose writer is alive: another name, or wait).
    """
    from .recorder import run_status  # imports torch: only where a run folder is read

    folder = Path(folder)
    if not (folder / SUMMARY_FILE).is_file():
        return None
    status = run_status(folder)
    summary = status.summary
    rounds = summary.get("rounds-completed", "?")
    planned = (summary.get("config") or {}).get("num-server-rounds", "?")
    if status.status == "running":
        return status.status, (
            f"run '{folder.name}' is running right now ({folder}, {rounds} of {planned} "
            "rounds so far): choose another run-name, or wait for it to end"
        )
    return status.status, (
        f"run folder {folder} already holds run '{folder.name}' ({status.status}, {rounds} of "
        f"{planned} rounds, started {_time(started_at(summary))} UTC), and a new run would "
        "replace its metrics, checkpoint and model. Either\n"
        f"  - continue it: ba-run --resume {folder} (add -c num-server-rounds=N to extend it),\n"
        '  - give the new run another name: -c run-name="<new name>", or\n'
        f"  - replace it: add --overwrite (deletes {folder} first)"
    )


# --- the commands ----------------------------------------------------------------------------
def list_command(directory: Path, output_format: str = "text") -> int:
    """``ba-run --list [DIR]``: print the runs under ``directory``; the exit code."""
    import sys

    try:
        runs = find_runs(directory)
    except RunsError as error:
        print(f"ba-run: error: {error}", file=sys.stderr)
        return 1
    if output_format == "json":
        print(runs_json(runs))
    elif runs:
        print(runs_table(runs), end="")
    else:
        print(f"ba-run: no runs in {directory} (no folder there holds a {SUMMARY_FILE})")
    return 0


def comparison_plot_path(directory: Path, names: Sequence[str]) -> Path:
    """The default file of ``ba-run --compare``'s figure: in ``directory`` (the folder of the
    first run compared), named by the runs."""
    stem = "compare-" + "-vs-".join(names)
    if len(stem) > 120:
        stem = f"compare-{len(names)}-runs"
    return Path(directory) / f"{stem}.png"


def compare_command(
    references: Sequence[str],
    directory: Path,
    target: float | None = None,
    plot: Path | None = None,
    output_format: str = "text",
) -> int:
    """``ba-run --compare RUN ...``: print the comparison and draw its figure; the exit code
    (1: a run cannot be read, or the figure cannot be drawn: the table is printed first)."""
    import sys

    try:
        folders = [resolve_run(reference, directory) for reference in references]
        runs, target = compare_runs(folders, target)
    except (RunsError, FileNotFoundError) as error:
        print(f"ba-run: error: {error}", file=sys.stderr)
        return 1
    if output_format == "json":
        print(comparison_json(runs, target))
    else:
        print(comparison_table(runs, target), end="")
    path = plot or comparison_plot_path(folders[0].parent, [run.name for run in runs])
    stream = sys.stderr if output_format == "json" else sys.stdout
    try:
        plot_comparison(runs, path, target)
        print(f"ba-run: figure: {path}", file=stream)
        for line in diagnostics_figures(folders, path):
            print(f"ba-run: {line}", file=stream)
    except RunsError as error:
        print(f"ba-run: error: no figure: {error}", file=sys.stderr)
        return 1
    return 0
