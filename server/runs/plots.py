"""A run's figures: its own curves (``curves.png``) and the client-diagnostics figures of runs
made with ``diagnostics = true``; :func:`pyplot` and :func:`save_figure` draw and write every
figure of the project.

- :func:`plot_run`: a run's own accuracy and loss per round (``curves.png``), which the ServerApp
  draws when a run has run every round (:func:`write_run_plot`: skipped with a note where
  matplotlib is not installed, never failing the run);
- :func:`plot_diagnostics`: coherence (with the critical point), pairwise distances, and mutual
  information, from ``metrics.jsonl``; ``ba-run --compare`` draws them for runs that have them
  (:func:`diagnostics_figures`), and a sweep with ``[plot] diagnostics = true``;
  docs/benchmarks.md ("Client diagnostics") shows them.

matplotlib (the ``bench`` extra) is imported only where a figure is drawn (:func:`pyplot`).
Where it is missing, :func:`plot_advice` says how to get the figures where the run is: install
the extra, or, in this project's image (which leaves matplotlib out and where nothing can be
installed), copy the run folder out and draw them on the host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from .folder import (
    ACCURACY_KEY,
    LOSS_KEY,
    RUN_PLOT_FILE,
    RunsError,
    curve,
    read_metrics,
    read_summary,
    rule_of,
)

#: The extra that installs matplotlib.
PLOT_EXTRA = "bench"
DPI = 120
#: Set (to the image's flavour) in this project's image (docker/Dockerfile), which holds no
#: matplotlib and whose environment cannot be changed from inside a container.
IMAGE_ENV = "BA_IMAGE"
#: How a run folder leaves the compose stack's SuperLink container (docs/deployment.md).
COPY_RUNS_OUT = "docker compose exec -T superlink tar -C /app -cf - runs | tar -xf -"


def in_image() -> bool:
    """Whether this process runs in this project's image (:data:`IMAGE_ENV`)."""
    return bool(os.environ.get(IMAGE_ENV))


def plot_advice(folder: Path | str | None = None) -> str:
    """How to get a run's figures without matplotlib here: install the extra, or, in the image,
    copy the run out and draw them on the host (``folder``: the run, named in the command)."""
    extra = f"pip install 'beyond-averaging[{PLOT_EXTRA}]'"
    if not in_image():
        return f"{extra} (or pip install matplotlib)"
    run = "runs/<run-name>" if folder is None else f"runs/{Path(folder).name}"
    return (
        "this image leaves matplotlib out; copy the runs out of the SuperLink's container "
        f"({COPY_RUNS_OUT}) and draw its accuracy curve on the host ({extra}, then ba-run "
        f"--compare {run} --plot {run}/accuracy.png)"
    )


def pyplot(purpose: str, folder: Path | None = None) -> Any:
    """matplotlib's pyplot with the file-only Agg backend (``folder``: the run it draws, named
    in the advice where matplotlib is missing).

    Raises
    ------
    RunsError
        matplotlib is not installed; the message names the extra that installs it.
    """
    try:
        import matplotlib
    except ImportError:
        raise RunsError(
            f"{purpose} needs matplotlib, which is not installed: {plot_advice(folder)}"
        ) from None
    matplotlib.use("Agg")  # files only: no display on servers and in tests
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, path: Path, dpi: int = DPI, *, private: bool = False) -> Path:
    """Lay out, write and close ``figure`` as a PNG (its folder made if missing); ``private``:
    created ``0600``, as every file of a run folder
    (:func:`server.runs.checkpoint.private_file`)."""
    plt = pyplot("saving a figure")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    if private:
        from .checkpoint import private_file

        with private_file(path, "wb") as stream:
            figure.savefig(stream, dpi=dpi, format="png")
    else:
        figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def integer_rounds(axes: Any, *, label: bool = True) -> None:
    """Whole-number round ticks and a grid; ``label``: the ``round`` label too (off for a
    panel whose x axis another panel below it shares, which shows no tick labels either)."""
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if label:
        axes.set_xlabel("round")
    axes.grid(alpha=0.3)


def data_split(config: Mapping[str, Any]) -> str:
    """How a run's data is split over its clients, as a title says it: ``Dirichlet 0.5, 10
    clients``, ``IID, 10 clients``, ``2 classes per client, 10 clients``; the synthetic
    dataset's skew is its generator's ``synthetic(alpha, beta)``."""
    clients = f"{config.get('num-clients', '?')} clients"
    partition = config.get("partition", "?")
    if config.get("dataset") == "synthetic":
        skew = (
            f"synthetic({config.get('synthetic-alpha', '?')}, {config.get('synthetic-beta', '?')})"
        )
    elif partition == "dirichlet":
        skew = f"Dirichlet {config.get('dirichlet-alpha', '?')}"
    elif partition == "classes":
        skew = f"{config.get('classes-per-client', '?')} classes per client"
    elif partition == "iid":
        skew = "IID"
    else:
        skew = str(partition)
    return f"{skew}, {clients}"


def draw_run(folder: Path) -> Any:
    """The figure of :func:`plot_run`, not yet saved (its two axes: ``figure.axes``)."""
    folder = Path(folder)
    plt = pyplot("a run's plot", folder)
    rounds = read_metrics(folder)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 5.6), sharex=True)
    accuracy = curve(rounds, ACCURACY_KEY, first=0)
    loss = curve(rounds, LOSS_KEY, first=0)
    top.plot(list(accuracy), list(accuracy.values()), marker=".")
    top.set_ylabel("test accuracy")
    config = read_summary(folder).get("config") or {}
    top.set_title(
        f"{folder.name}: {rule_of(config)} on {config.get('dataset', '?')}\n{data_split(config)}"
    )
    bottom.plot(list(loss), list(loss.values()), marker=".", color="tab:red")
    bottom.set_ylabel("test loss")
    integer_rounds(top, label=False)  # the panels share x: the bottom one names it
    integer_rounds(bottom)
    return figure


def plot_run(folder: Path, path: Path | None = None) -> Path:
    """The run's test accuracy and test loss per round (round 0: the initial model), as
    ``<folder>/curves.png`` unless ``path`` is given; titled with the rule, the dataset and
    :func:`data_split`."""
    folder = Path(folder)
    figure = draw_run(folder)
    return save_figure(figure, path or folder / RUN_PLOT_FILE, private=path is None)


def write_run_plot(folder: Path) -> Path | None:
    """:func:`plot_run`, for the ServerApp: a missing matplotlib is logged as a note, any other
    failure as a warning, and neither fails the run (the figure is a convenience)."""
    from flwr.supercore import log

    try:
        return plot_run(folder)
    except RunsError as error:
        log(INFO, "no %s for run '%s': %s", RUN_PLOT_FILE, Path(folder).name, error)
    except Exception as error:  # a figure must never fail a run that trained
        log(
            WARNING,
            "no %s for run '%s': %s: %s",
            RUN_PLOT_FILE,
            Path(folder).name,
            type(error).__name__,
            error,
        )
    return None


# --- client diagnostics ----------------------------------------------------------------------
Metrics = list[dict[str, Any]]

COHERENCE_KEY = "diag-coherence"
COSINE_KEY = "diag-cosine-mean"
DISTANCE_KEYS = {
    "Euclidean": "diag-euclidean-mean",
    "Manhattan": "diag-manhattan-mean",
    "Chebyshev": "diag-chebyshev-mean",
}
INFORMATION_KEYS = {"parameters": "diag-mi-mean", "updates": "diag-update-mi-mean"}
#: Shared figure look: one size for the diagnostics PNGs (resolution: :data:`DPI`).
FIGURE_SIZE = (7.0, 4.2)


def series(metrics: Metrics, key: str) -> tuple[list[int], list[float]]:
    """Rounds and values of ``key``, as ``plot`` takes them (see :func:`curve`)."""
    points = curve(metrics, key, first=0)
    return list(points), list(points.values())


def critical_point(rounds: Sequence[int], coherence: Sequence[float]) -> int | None:
    """The first round whose coherence is <= 0 right after a round with coherence > 0."""
    for index in range(1, len(coherence)):
        if coherence[index - 1] > 0.0 >= coherence[index]:
            return int(rounds[index])
    return None


def with_metric(runs: Mapping[str, Metrics], key: str) -> dict[str, Metrics]:
    """The runs that logged ``key`` at least once: a run made without diagnostics has no line,
    so it gets no legend entry either."""
    return {label: metrics for label, metrics in runs.items() if series(metrics, key)[0]}


def round_axis(axes: Any) -> None:
    """Rounds on the x axis: whole numbers only (a 2-round run drew 0.25, 0.5, ...)."""
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_coherence(runs: Mapping[str, Metrics], path: Path) -> Path:
    """Cohort coherence (top) and mean pairwise cosine (bottom) per round, critical points marked.

    The cohort value weighs each pair by lambda_i lambda_j / m, so it is about (1 - sum lambda^2)/m
    times smaller than the mean cosine: two panels keep both readable.
    """
    plt = pyplot("the diagnostics figures")
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(FIGURE_SIZE[0], FIGURE_SIZE[1] * 1.5), sharex=True
    )
    for axes in (top, bottom):
        axes.axhline(0.0, color="grey", linewidth=0.8)
        round_axis(axes)
    for index, (label, metrics) in enumerate(with_metric(runs, COHERENCE_KEY).items()):
        rounds, coherence = series(metrics, COHERENCE_KEY)
        (line,) = top.plot(rounds, coherence, marker=".", label=label)
        bottom.plot(*series(metrics, COSINE_KEY), marker=".", color=line.get_color())
        point = critical_point(rounds, coherence)
        if point is None:
            continue
        for axes in (top, bottom):
            axes.axvline(point, color=line.get_color(), linestyle="--", linewidth=1.0)
        top.annotate(
            f"critical point: round {point}",
            (point, 0.0),
            textcoords="offset points",
            xytext=(6, 10 + 14 * index),  # one line per run when their points coincide
            color=line.get_color(),
        )
    top.set_ylabel("cohort coherence")
    top.set_title("Local gradient coherence (FedLAW, section 5)")
    top.legend(fontsize="small")
    bottom.set_ylabel("mean pairwise cosine")
    bottom.set_xlabel("round")
    return save_figure(figure, path)


def plot_distances(runs: Mapping[str, Metrics], path: Path) -> Path:
    """Mean pairwise Euclidean, Manhattan and Chebyshev distance between client models."""
    plt = pyplot("the diagnostics figures")
    figure, panels = plt.subplots(1, len(DISTANCE_KEYS), figsize=(FIGURE_SIZE[0] * 1.6, 3.6))
    for axes, (name, key) in zip(panels, DISTANCE_KEYS.items(), strict=True):
        for label, metrics in with_metric(runs, key).items():
            axes.plot(*series(metrics, key), marker=".", label=label)
        axes.set_title(f"{name} distance")
        axes.set_xlabel("round")
        round_axis(axes)
    panels[0].set_ylabel("mean over client pairs")
    panels[0].legend(fontsize="small")
    return save_figure(figure, path)


def plot_mutual_information(runs: Mapping[str, Metrics], path: Path) -> Path:
    """Mean pairwise Gaussian mutual information of client parameters (solid) and updates."""
    plt = pyplot("the diagnostics figures")
    figure, axes = plt.subplots(figsize=FIGURE_SIZE)
    for label, metrics in with_metric(runs, INFORMATION_KEYS["parameters"]).items():
        parameters, updates = (series(metrics, key) for key in INFORMATION_KEYS.values())
        (line,) = axes.plot(*parameters, marker=".", label=label)
        axes.plot(*updates, linestyle=":", color=line.get_color())
    axes.set_xlabel("round")
    round_axis(axes)
    axes.set_ylabel("mutual information (nats)")
    axes.set_title("Gaussian MI between clients (solid: parameters, dotted: updates)")
    axes.legend(fontsize="small")
    return save_figure(figure, path)


def plot_diagnostics(runs: Mapping[str, Metrics], output_dir: Path, stem: str) -> list[Path]:
    """The three diagnostics figures ``<stem>-coherence/-distances/-mi.png``.

    Raises
    ------
    ValueError
        When no run has diagnostics (they were run without ``diagnostics = true``).
    """
    if not any(series(metrics, COHERENCE_KEY)[0] for metrics in runs.values()):
        raise ValueError(
            f"runs {sorted(runs)} hold no '{COHERENCE_KEY}' metric: run them with "
            "-c 'diagnostics=true'"
        )
    return [
        plot_coherence(runs, output_dir / f"{stem}-coherence.png"),
        plot_distances(runs, output_dir / f"{stem}-distances.png"),
        plot_mutual_information(runs, output_dir / f"{stem}-mi.png"),
    ]


def diagnostics_figures(folders: Sequence[Path], comparison: Path) -> list[str]:
    """Runs made with ``diagnostics = true``: their client-diagnostics figures beside the
    comparison's (``<its stem>-coherence.png``, ``-distances.png``, ``-mi.png``) and each run's
    critical point; what was drawn, a line each (none when no run has diagnostics)."""
    runs = {Path(folder).name: read_metrics(folder) for folder in folders}
    drawn = {name: metrics for name, metrics in runs.items() if series(metrics, COHERENCE_KEY)[0]}
    if not drawn:
        return []
    paths = plot_diagnostics(drawn, comparison.parent, comparison.stem)
    lines = [f"diagnostics figure: {path}" for path in paths]
    for name, metrics in drawn.items():
        point = critical_point(*series(metrics, COHERENCE_KEY))
        lines.append(f"{name}: critical point {'none' if point is None else f'at round {point}'}")
    return lines
