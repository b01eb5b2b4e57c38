"""Finding and comparing runs: ``ba-run --list``, ``ba-run --compare``, and each run's plot.

The figures asked of the table are computed here from the runs' ``metrics.jsonl`` by hand
(final, best, mean of the last rounds, first round at a target), not with server.runs.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from beyond_averaging.server.app import data_spec
from beyond_averaging.server.cli.main import main as ba_run
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.runs.partitions import record_partitions
from beyond_averaging.server.runs.plots import (
    COPY_RUNS_OUT,
    IMAGE_ENV,
    data_split,
    draw_run,
    write_run_plot,
)
from beyond_averaging.server.runs.recorder import RunRecorder
from beyond_averaging.server.runtime.inprocess import run_inprocess
from tests.deploy_helpers import REPO, read_metrics
from tests.test_run_outcomes import LEAN as LEAN_RUN

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LEAN: dict[str, Any] = {**LEAN_RUN, "num-server-rounds": 6}


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two finished runs (FedAvg, Elastic; 6 rounds) and one whose writer died (interrupted)."""
    folder = tmp_path_factory.mktemp("runs")
    for strategy in ("fedavg", "elastic"):
        settings = {**LEAN, "strategy": strategy, "run-name": strategy, "output-dir": str(folder)}
        run_inprocess(REPO, settings)
    dead = RunRecorder(folder, "dead", {"strategy": "fedlaw", "dataset": "digits"})
    dead.log_round({"round": 0, "test-accuracy": 0.1, "test-loss": 2.3})
    dead.close()  # "running" in its summary, no live writer: what kill -9 leaves
    return folder


def accuracies(run_dir: Path) -> dict[int, float]:
    return {r["round"]: r["test-accuracy"] for r in read_metrics(run_dir)}


def test_list_prints_every_run_with_rule_dataset_status_rounds_accuracies_and_start(
    runs_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ba_run(["--list", str(runs_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "name", "rule", "dataset", "status", "rounds", "final", "acc", "best", "acc", "started",
        "(UTC)",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"fedavg", "elastic", "dead"}
    for name in ("fedavg", "elastic"):
        accuracy = accuracies(runs_dir / name)
        trained = [accuracy[r] for r in range(1, 7)]
        summary = json.loads((runs_dir / name / "summary.json").read_text(encoding="utf-8"))
        assert rows[name][1:7] == [
            name,
            "digits",
            "completed",
            "6/6",
            f"{accuracy[6]:.4f}",
            f"{max(trained):.4f}",
        ]
        assert " ".join(rows[name][7:]) == summary["started-at"][:16].replace("T", " ")
    assert rows["dead"][1:5] == ["fedlaw", "digits", "interrupted", "0/?"]


def test_list_as_json_and_the_default_folder(
    runs_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert ba_run(["--list", str(runs_dir), "--format", "json"]) == 0
    entries = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    accuracy = accuracies(runs_dir / "elastic")
    assert entries["elastic"]["final-accuracy"] == accuracy[6]
    assert entries["elastic"]["best-accuracy"] == max(accuracy[r] for r in range(1, 7))
    assert entries["elastic"]["rounds"] == 6
    assert entries["elastic"]["status"] == "completed"
    # Without DIR: the app's output-dir (runs/ beside its pyproject.toml).
    app = tmp_path / "app"
    (app / "runs").mkdir(parents=True)
    (app / "pyproject.toml").write_text('[tool.flwr.app.config]\noutput-dir = "runs"\n')
    assert ba_run(["--app", str(app), "--list"]) == 0
    assert f"no runs in {app / 'runs'}" in capsys.readouterr().out
    assert ba_run(["--list", str(tmp_path / "nowhere")]) == 1
    assert "is not a folder" in capsys.readouterr().err
    # --status on the folder of runs (it answered "missing") lists them.
    assert ba_run(["--status", str(runs_dir)]) == 0
    assert "is a folder of runs" in capsys.readouterr().out


def test_compare_prints_final_best_last_five_and_rounds_to_target_and_draws_one_png(
    runs_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    figure = tmp_path / "vs.png"
    assert (
        ba_run(
            [
                "--compare",
                "fedavg",
                str(runs_dir / "elastic"),
                "--app",
                str(tmp_path),
                "--plot",
                str(figure),
                "--target",
                "0.5",
            ]
        )
        != 0
    )  # "fedavg" names no run under the default folder of that app: refused
    assert "no run 'fedavg'" in capsys.readouterr().err
    code = ba_run(
        [
            "--compare",
            str(runs_dir / "fedavg"),
            str(runs_dir / "elastic"),
            "--plot",
            str(figure),
            "--target",
            "0.5",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "mean last 5" in lines[0]
    assert "rounds to 0.5000" in lines[0]
    for line, name in zip(lines[2:4], ("fedavg", "elastic"), strict=True):
        accuracy = accuracies(runs_dir / name)
        trained = [accuracy[r] for r in range(1, 7)]
        best = max(trained)
        reached = next((r for r in range(1, 7) if accuracy[r] >= 0.5), None)
        assert line.split() == [
            name,
            name,
            "digits",
            "6",
            f"{accuracy[6]:.4f}",
            f"{best:.4f}",
            f"({trained.index(best) + 1})",
            f"{statistics.fmean(trained[-5:]):.4f}",
            *(["not", "reached"] if reached is None else [str(reached)]),
        ]
    assert f"ba-run: figure: {figure}" in out
    assert figure.read_bytes()[:8] == PNG_MAGIC


def test_compare_defaults_the_target_to_what_every_run_reaches(
    runs_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ba_run(["--compare", "fedavg", "elastic", "--app", str(runs_dir.parent)]) == 1
    capsys.readouterr()  # names resolve under the app's output-dir: not this folder
    code = ba_run(["--compare", str(runs_dir / "fedavg"), str(runs_dir / "elastic"),
                   "--format", "json"])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    bests = {
        name: max(v for r, v in accuracies(runs_dir / name).items() if r >= 1)
        for name in ("fedavg", "elastic")
    }
    assert result["target"] == min(bests.values())
    for entry in result["runs"]:
        assert entry["rounds-to-target"] is not None  # every run reaches the lowest best
    assert (runs_dir / "compare-fedavg-vs-elastic.png").read_bytes()[:8] == PNG_MAGIC


def test_compare_without_matplotlib_prints_the_table_and_names_the_extra(
    runs_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    code = ba_run(["--compare", str(runs_dir / "fedavg"), str(runs_dir / "elastic")])
    assert code == 1
    captured = capsys.readouterr()
    assert "fedavg" in captured.out  # the table came first
    assert "pip install 'beyond-averaging[bench]'" in captured.err


def test_every_finished_run_has_its_accuracy_and_loss_plot(runs_dir: Path) -> None:
    for name in ("fedavg", "elastic"):
        plot = runs_dir / name / "curves.png"
        assert plot.read_bytes()[:8] == PNG_MAGIC
        assert plot.stat().st_mode & 0o777 == 0o600
    assert not (runs_dir / "dead" / "curves.png").exists()


def test_a_runs_figure_names_round_once_and_titles_its_skew_and_clients(runs_dir: Path) -> None:
    import matplotlib.pyplot as plt

    figure = draw_run(runs_dir / "fedavg")
    top, bottom = figure.axes
    # The panels share x: the top one shows no tick labels, so it names no axis either.
    assert top.get_xlabel() == ""
    assert bottom.get_xlabel() == "round"
    # LEAN: 3 clients on digits, under the default Dirichlet 0.5 split.
    assert top.get_title() == "fedavg: fedavg on digits\nDirichlet 0.5, 3 clients"
    plt.close(figure)
    assert data_split({"partition": "iid", "num-clients": 8}) == "IID, 8 clients"
    classes = {"partition": "classes", "classes-per-client": 2, "num-clients": 5}
    assert data_split(classes) == "2 classes per client, 5 clients"
    synthetic = {"dataset": "synthetic", "synthetic-alpha": 1.0, "synthetic-beta": 0.5}
    assert data_split({**synthetic, "num-clients": 30}) == "synthetic(1.0, 0.5), 30 clients"


def test_a_run_without_matplotlib_completes_with_a_note_and_no_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    settings = {**LEAN, "num-server-rounds": 1, "run-name": "plain", "output-dir": str(tmp_path)}
    with caplog.at_level("INFO", logger="flwr"):
        run_inprocess(REPO, settings)
    summary = json.loads((tmp_path / "plain" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "completed"
    assert not (tmp_path / "plain" / "curves.png").exists()
    assert "no curves.png for run 'plain'" in caplog.text
    assert "beyond-averaging[bench]" in caplog.text


def test_in_the_image_the_note_says_how_to_get_the_plots_not_to_install_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The image leaves matplotlib out and nothing can be installed in its containers: the
    note says how to copy the run out and draw its curves on the host."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setenv(IMAGE_ENV, "grpc")
    folder = tmp_path / "elastic-digits-1"
    folder.mkdir()
    with caplog.at_level("INFO", logger="flwr"):
        assert write_run_plot(folder) is None
        record_partitions(folder, data_spec(parse_run_config({"num-clients": 3})))
    notes = [r.getMessage() for r in caplog.records]
    curves = next(note for note in notes if "no curves.png" in note)
    assert COPY_RUNS_OUT in curves
    assert "ba-run --compare runs/elastic-digits-1 --plot runs/elastic-digits-1/accuracy.png" in (
        curves
    )
    partitions = next(note for note in notes if "label counts" in note)
    assert COPY_RUNS_OUT in partitions
    assert "pip install" not in partitions


def test_compare_of_runs_with_diagnostics_draws_their_figures_and_names_each_critical_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run's critical point is the first round whose coherence is <= 0 right after one > 0."""
    coherences = {"shrink": [-0.01, 0.2, 0.1, -0.05, 0.03], "avg": [0.3, 0.2, 0.1, 0.05, 0.01]}
    for name, coherence in coherences.items():
        recorder = RunRecorder(tmp_path, name, {"strategy": "fedavg", "dataset": "digits"})
        recorder.log_round({"round": 0, "test-accuracy": 0.1, "test-loss": 2.3})
        for index, value in enumerate(coherence, 1):
            diagnostics = {"diag-coherence": value, "diag-cosine-mean": 2 * value}
            diagnostics |= {"diag-euclidean-mean": 1.0 / index, "diag-mi-mean": 0.5 * index}
            recorder.log_round({"round": index, "test-accuracy": 0.5, **diagnostics})
        recorder.close()
    plain = RunRecorder(tmp_path, "plain", {"strategy": "fedavg", "dataset": "digits"})
    plain.log_round({"round": 0, "test-accuracy": 0.1})
    plain.log_round({"round": 1, "test-accuracy": 0.4})
    plain.close()
    figure = tmp_path / "figures" / "vs.png"
    runs = [str(tmp_path / name) for name in ("shrink", "avg", "plain")]
    assert ba_run(["--compare", *runs, "--plot", str(figure)]) == 0
    out = capsys.readouterr().out
    assert "ba-run: shrink: critical point at round 4\n" in out  # 0.1 then -0.05
    assert "ba-run: avg: critical point none\n" in out  # positive throughout
    assert "plain: critical point" not in out  # made without diagnostics: no line, no curve
    for part in ("coherence", "distances", "mi"):
        drawn = tmp_path / "figures" / f"vs-{part}.png"
        assert f"ba-run: diagnostics figure: {drawn}\n" in out
        assert drawn.read_bytes()[:8] == PNG_MAGIC


def test_compare_of_runs_without_diagnostics_draws_no_diagnostics_figure(
    runs_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    figure = tmp_path / "vs.png"
    runs = [str(runs_dir / "fedavg"), str(runs_dir / "elastic")]
    assert ba_run(["--compare", *runs, "--plot", str(figure)]) == 0
    assert "diagnostics" not in capsys.readouterr().out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["vs.png"]
