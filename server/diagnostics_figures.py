"""Client-diagnostics figures of runs made with ``diagnostics = true``, from ``metrics.jsonl``:
coherence (with the critical point), pairwise distances, and mutual information.

``ba-run --compare`` draws them for runs that have them, and a sweep with ``[plot] diagnostics =
true``; docs/benchmarks.md ("Client diagnostics") shows them. matplotlib is imported only here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .runs import curve, pyplot, save_figure

Metrics = list[dict[str, Any]]

COHERENCE_KEY = "diag-coherence"
COSINE_KEY = "diag-cosine-mean"
DISTANCE_KEYS = {
    "Euclidean": "diag-euclidean-mean",
    "Manhattan": "diag-manhattan-mean",
    "Chebyshev": "diag-chebyshev-mean",
}
INFORMATION_KEYS = {"parameters": "diag-mi-mean", "updates": "diag-update-mi-mean"}
#: Shared figure look: one size for the diagnostics PNGs (resolution: server.runs.DPI).
FIGURE_SIZE = (7.0, 4.2)


def series(metrics: Metrics, key: str) -> tuple[list[int], list[float]]:
    """Rounds and values of ``key``, as ``plot`` takes them (see :func:`report.curve`)."""
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
