"""What every benchmark shares: the spread over seeds, the diagnostics figures, the systems
harness (peaks, timing), the systems tables' ratios, and the FedLAW Table 3 spec's setting.

The runner and the reporter are tested in tests/test_runner.py.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from benchmarks.harness import Stopwatch
from benchmarks.spec import REPO, load_spec
from benchmarks.systems import FLOWER, ServerFigure, client_table, server_table
from beyond_averaging.server.deploy.resources import PeakSampler
from beyond_averaging.server.runs.folder import read_metrics
from beyond_averaging.server.runs.plots import critical_point, plot_diagnostics
from beyond_averaging.server.sweep.report import band, mean_sd, seed_sd

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SPECS = REPO / "benchmarks" / "specs"


# ----------------------------------------------------------------------------- seeds
def test_every_report_spreads_seeds_by_the_sample_standard_deviation() -> None:
    finals = [88.47, 89.18, 89.04]
    assert mean_sd(finals, digits=2) == f"88.90 ± {statistics.stdev(finals):.2f}"  # 0.38, not 0.31
    curves = np.array([[10.0, 20.0, 30.0], [12.0, 20.0, 33.0]])
    mean, spread = band(curves)
    assert mean.tolist() == [11.0, 20.0, 31.5]
    assert spread.tolist() == [statistics.stdev([10, 12]), 0.0, statistics.stdev([30, 33])]


def test_one_seed_has_no_spread_to_report() -> None:
    assert mean_sd([85.27]) == "85.3"  # no "± 0.0" pretending the seeds agreed
    assert math.isnan(float(seed_sd([85.27])))
    assert band([[0.5, 0.6]])[1].tolist() == [0.0, 0.0]  # a plot draws no band


# ----------------------------------------------------------------------------- diagnostics
def write_metrics(run_dir: Path, coherence: list[float]) -> Path:
    run_dir.mkdir(parents=True)
    rows: list[dict[str, float]] = [{"round": 0, "test-accuracy": 0.1}]
    for r, value in enumerate(coherence, start=1):
        rows.append(
            {
                "round": r,
                "diag-coherence": value,
                "diag-cosine-mean": value * 2,
                "diag-euclidean-mean": float(r),
                "diag-manhattan-mean": 10.0 * r,
                "diag-chebyshev-mean": 0.1 * r,
                "diag-mi-mean": 0.5 + 0.1 * r,
                "diag-update-mi-mean": 0.2,
            }
        )
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows), "utf-8")
    return run_dir


def test_critical_point_is_the_first_round_coherence_crosses_zero() -> None:
    assert critical_point([1, 2, 3, 4, 5], [0.3, 0.1, -0.02, 0.01, -0.03]) == 3
    assert critical_point([1, 2, 3], [0.3, 0.0, 0.1]) == 2  # reaching zero counts
    assert critical_point([1, 2], [-0.1, -0.2]) is None  # never positive: no crossing
    assert critical_point([1, 2], [0.1, 0.2]) is None


def test_diagnostics_figures_are_drawn_from_metrics_jsonl(tmp_path: Path) -> None:
    run_dir = write_metrics(tmp_path / "run", [0.3, 0.1, -0.05, -0.02])
    paths = plot_diagnostics({"run": read_metrics(run_dir)}, tmp_path / "out", "d")
    assert [p.name for p in paths] == ["d-coherence.png", "d-distances.png", "d-mi.png"]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_diagnostics_figures_refuse_runs_without_diagnostics(tmp_path: Path) -> None:
    run_dir = tmp_path / "plain"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"round": 0}) + "\n", "utf-8")
    with pytest.raises(ValueError, match="diagnostics=true"):
        plot_diagnostics({"plain": read_metrics(run_dir)}, tmp_path, "x")


# ----------------------------------------------------------------------------- harness
def test_the_peak_sampler_keeps_each_figure_s_peak_overall_and_per_phase() -> None:
    readings = iter([{"a": 1.0, "b": 5.0}, {"a": 3.0, "b": 1.0}, {"a": 2.0, "b": 2.0}])
    last = {"a": 0.0, "b": 0.0}

    def measure() -> dict[str, float]:
        last.update(next(readings, last))
        return dict(last)

    sampler = PeakSampler(measure, interval=3600.0)  # the test samples by hand (mark)
    assert sampler.peaks == {"a": 1.0, "b": 5.0}
    assert sampler.mark() == {"a": 3.0, "b": 5.0}  # the first phase saw both readings
    assert sampler.mark() == {"a": 2.0, "b": 2.0}  # the second starts from the mark's reading
    assert sampler.peaks == {"a": 3.0, "b": 5.0}


def test_the_stopwatch_gives_wall_and_cpu_seconds_of_its_block() -> None:
    with Stopwatch() as clock:
        sum(i * i for i in range(200_000))
    assert clock.wall > 0
    assert clock.cpu > 0


# ----------------------------------------------------------------------------- systems
def test_server_ratios_are_the_paired_ones_and_buffers_against_flower_fedavg_of_the_run() -> None:
    model = 100
    figures = [  # 2 clients; Flower's FedAvg peaks at 3 models, its RSS the larger
        ServerFigure(FLOWER, 1.0, None, 10, peak_traced_bytes=200, peak_rss_growth_bytes=300),
        # the ratios measured against Flower's FedAvg timed beside each repeat, not seconds over
        # the Flower row's seconds (2.8 / 1.0): the load may change between the two rows; the
        # target is judged on the CPU ratio, which a load changes far less
        ServerFigure(
            "fast", 2.8, 1.0, 10, 1.7, 1.4, peak_traced_bytes=400, peak_rss_growth_bytes=450
        ),
        ServerFigure(
            "slow", 1.6, 1.5, 20, 1.2, 1.6, peak_traced_bytes=600, peak_rss_growth_bytes=None
        ),
        ServerFigure("elastic", 2.9, 2.5, 20, 2.9, 2.9),  # Elastic's target is 3x
    ]
    rows = server_table(figures, clients=2, model_bytes=model).splitlines()[2:]
    cells = [[cell.strip() for cell in row.split("|")[1:-1]] for row in rows]
    # (450 - 300) / 100 / 2 = 0.75 extra buffers per client; (600 - 300) / 100 / 2 = 1.5
    assert cells[1][3:6] == ["1.70", "1.40", "yes"]
    assert cells[1][9:] == ["0.75", "yes"]
    assert cells[2][3:6] == ["1.20", "1.60", "NO"]
    assert cells[2][8:] == ["-", "1.50", "NO"]
    assert cells[3][3:6] == ["2.90", "2.90", "yes"]
    # without Flower's FedAvg in the run there is nothing to pair with
    alone = server_table(figures[1:2], clients=2, model_bytes=model).splitlines()[2]
    assert [cell.strip() for cell in alone.split("|")[4:7]] == ["nan", "nan", "NO"]


def test_client_seconds_are_a_ratio_to_fedavg_s_client() -> None:
    table = client_table({"fedavg": 0.5, "elastic": 0.8})
    assert "| fedavg | 0.500 | 1.00 |" in table
    assert "| elastic | 0.800 | 1.60 |" in table


# ----------------------------------------------------------------------------- specs
def test_the_fedlaw_table3_specs_are_the_papers_setting_with_every_cell_s_number() -> None:
    # Li et al. (ICML 2023), section 6.2 and appendix D, Fashion-MNIST.
    spec = load_spec(SPECS / "fedlaw-table3.toml")
    paper = {
        "num-clients": 20,
        "fraction-train": 1.0,
        "local-epochs": 3,
        "learning-rate": 0.08,
        "lr-decay": 0.99,
        "momentum": 0.9,
        "weight-decay": 5e-4,
        "batch-size": 128,
        "proxy-per-class": 10,  # a 100-sample proxy set
        "dataset": "fashion-mnist",
    }
    assert {key: spec.settings[key] for key in paper} == paper
    alphas = next(axis for axis in spec.axes if axis.name == "dirichlet-alpha")
    assert alphas.labels == ("100", "0.1")
    assert len(spec.paper) == 12  # 2 models x 2 alphas x FedAvg, FedLAW, FedLAW (SWA)
    full = load_spec(SPECS / "fedlaw-table3-full.toml")
    assert full.settings["num-server-rounds"] == 200
    assert full.seeds == [8, 9, 10]
    assert full.settings["client-holdout"] == 0.3  # the authors' client_valid_ratio
    swa = next(run for run in full.runs() if run.labels["method"] == "fedlaw-swa")
    assert swa.settings["fedlaw-swa"] is True


def test_the_diagnostics_figures_leave_runs_without_diagnostics_out_and_tick_whole_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import beyond_averaging.server.runs.plots as plots

    figures = []
    honest = plots.save_figure

    def kept(figure: object, path: Path, *args: object) -> Path:
        figures.append(figure)
        return honest(figure, path, *args)

    monkeypatch.setattr(plots, "save_figure", kept)
    runs = {
        "diag": read_metrics(write_metrics(tmp_path / "diag", [0.3, 0.1])),  # 2 rounds
        "plain": [{"round": r, "test-accuracy": 0.5} for r in range(3)],  # no diag-* metric
    }
    plot_diagnostics(runs, tmp_path / "out", "d")
    assert len(figures) == 3
    for figure in figures:
        for axes in figure.axes:  # type: ignore[attr-defined]
            legend = axes.get_legend()
            if legend is not None:
                assert [text.get_text() for text in legend.get_texts()] == ["diag"]
            ticks = axes.get_xticks()
            assert len(ticks) > 0
            assert all(float(tick).is_integer() for tick in ticks), ticks


def test_a_report_shows_its_last_10_rounds_column_only_for_runs_longer_than_that() -> None:
    from beyond_averaging.server.sweep.report import RunData, table

    spec = load_spec(REPO / "benchmarks" / "specs" / "grid-smoke.toml")  # a 5-round spec
    title = "acc. last 10 rounds (%)"
    assert title in [column.title for column in spec.columns]

    def report(rounds: int) -> str:
        curve = [{"round": r, "test-accuracy": 0.5 + 0.01 * r} for r in range(rounds + 1)]
        data = [RunData(run, curve, {"wall-seconds": 1.0}, {}) for run in spec.runs()]
        return table(spec, data)

    assert title not in report(2)
    assert title not in report(10)  # the mean of every round, under a title that says not
    assert "rounds to 80%" in report(2)  # the other columns stay
    twelve = report(12)
    assert title in twelve
    # rounds 3..12: 0.53..0.62, mean 0.575 -> 57.50 %
    assert "| 12 | 57.50 ± 0.00 |" in twelve  # two seeds, the same curve
