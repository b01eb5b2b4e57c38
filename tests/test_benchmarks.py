"""The benchmark grid (resume, summary statistics, progress) and the plots, without simulation.

The launcher is replaced by a fake that writes what a real run writes (metrics.jsonl and
summary.json); one test marked ``simulation`` runs a real one-cell grid.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import benchmarks.grid as grid
from benchmarks.fedlaw_table3 import METHODS, PAPER_TABLE3, TABLE3_SETTING, write_report
from benchmarks.fedlaw_table3 import main as table3_main
from benchmarks.grid import (
    Cell,
    GridError,
    GridSpec,
    Progress,
    last_rounds_accuracy,
    load_grid_file,
    paper_reference,
    parse_variant,
    partition_overrides,
    rounds_to_target,
    run_grid,
    summarise,
)
from benchmarks.plots import critical_point, plot_diagnostics, read_run_metrics
from benchmarks.run_lock import claim_run
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.launch import LaunchError, parse_overrides

DEFAULTS = {"model": "mlp"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class FakeLauncher:
    """Stands in for server.launch.launch: records calls, writes a run's files."""

    def __init__(self, accuracy: Sequence[float] = (0.1, 0.5, 0.9), fail: set[str] | None = None):
        self.calls: list[str] = []
        self.accuracy = list(accuracy)
        self.fail = fail or set()

    def __call__(self, app_dir: Path, overrides: list[str], **_: Any) -> Path:
        settings = parse_overrides(overrides)
        name = str(settings["run-name"])
        self.calls.append(name)
        run_dir = Path(settings["output-dir"]) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps({"round": r, "test-accuracy": a, "test-loss": 1.0 - a})
            for r, a in enumerate(self.accuracy)
        ]
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        status = "failed" if name in self.fail else "completed"
        summary = {"status": status, "config": settings}
        (run_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
        if name in self.fail:
            raise LaunchError(f"run '{name}' did not complete: boom")
        return run_dir


def small_spec(**changes: Any) -> GridSpec:
    spec = GridSpec(
        name="t",
        strategies={"fedavg": {"strategy": "fedavg"}, "elastic": {"strategy": "elastic"}},
        datasets=["digits"],
        partitions=["dir0.5", "iid"],
        seeds=[0, 1],
        common={"num-server-rounds": 2},
    )
    for key, value in changes.items():
        setattr(spec, key, value)
    return spec


def test_partition_tokens_become_run_config_overrides() -> None:
    assert partition_overrides("iid") == {"partition": "iid"}
    assert partition_overrides("dir0.1") == {"partition": "dirichlet", "dirichlet-alpha": 0.1}
    assert partition_overrides("dirichlet-100") == {
        "partition": "dirichlet",
        "dirichlet-alpha": 100.0,
    }
    assert partition_overrides("classes2") == {"partition": "classes", "classes-per-client": 2}
    with pytest.raises(GridError, match="'dirx'"):
        partition_overrides("dirx")


def test_variant_text_gives_a_label_and_typed_overrides() -> None:
    label, overrides = parse_variant('fedadam: strategy="fedavg" server-lr=0.01 fedlaw-swa=true')
    assert label == "fedadam"
    assert overrides == {"strategy": "fedavg", "server-lr": 0.01, "fedlaw-swa": True}
    with pytest.raises(GridError, match="label: key=value"):
        parse_variant('strategy="fedavg"')


def test_cells_cover_the_grid_with_deterministic_names(tmp_path: Path) -> None:
    spec = small_spec()
    cells = spec.cells(DEFAULTS)
    assert len(cells) == 2 * 1 * 2 * 2
    assert cells[0].cell_id == "digits-dir0.5-mlp-fedavg-seed0"
    assert len({c.cell_id for c in cells}) == len(cells)
    spec.strategies["fedadam"] = {"strategy": "fedavg", "server-lr": 0.1, "num-server-rounds": 3}
    overrides = spec.overrides(Cell("fedadam", "digits", "iid", "mlp", 4), tmp_path)
    assert overrides["num-server-rounds"] == 3  # the variant beats the common overrides
    assert overrides["run-name"] == "digits-iid-mlp-fedadam-seed4"
    assert overrides["output-dir"] == str(tmp_path)
    assert (overrides["partition"], overrides["seed"]) == ("iid", 4)


def test_grid_rejects_a_variant_without_strategy_and_axes_set_in_common() -> None:
    with pytest.raises(GridError, match="'fedadam'"):
        small_spec(strategies={"fedadam": {"server-lr": 0.1}}).validate()
    with pytest.raises(GridError, match="'seed'"):
        small_spec(common={"seed": 3}).validate()


def test_a_cell_the_app_would_reject_stops_the_grid_before_any_run(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    spec = small_spec(
        strategies={"fedavg": {"strategy": "fedavg"}, "typo": {"strategy": "fedavgg"}}
    )
    with pytest.raises(GridError, match=r"(?s)digits-dir0\.5-mlp-typo-seed0.*fedavgg"):
        run_grid(spec, tmp_path, launcher=launcher, stream=io.StringIO(), defaults=DEFAULTS)
    assert launcher.calls == []


def test_grid_runs_every_cell_once_and_resumes_without_rerunning(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    spec = small_spec()
    first = run_grid(spec, tmp_path, launcher=launcher, stream=io.StringIO(), defaults=DEFAULTS)
    assert len(launcher.calls) == 8
    assert len(first.ran) == 8
    assert not first.skipped
    again = run_grid(spec, tmp_path, launcher=launcher, stream=io.StringIO(), defaults=DEFAULTS)
    assert len(launcher.calls) == 8  # nothing re-run
    assert len(again.skipped) == 8
    assert len(again.results) == 8
    (tmp_path / "cells" / "digits-iid-mlp-elastic-seed1.json").unlink()  # "interrupted" there
    run_grid(spec, tmp_path, launcher=launcher, stream=io.StringIO(), defaults=DEFAULTS)
    assert launcher.calls[8:] == ["digits-iid-mlp-elastic-seed1"]


def test_resume_reruns_cells_whose_settings_changed_or_that_failed(tmp_path: Path) -> None:
    failing = FakeLauncher(fail={"digits-iid-mlp-fedavg-seed0"})
    spec = small_spec(strategies={"fedavg": {"strategy": "fedavg"}}, seeds=[0])
    outcome = run_grid(spec, tmp_path, launcher=failing, stream=io.StringIO(), defaults=DEFAULTS)
    assert outcome.failed == ["digits-iid-mlp-fedavg-seed0"]
    stored = json.loads((tmp_path / "cells" / "digits-iid-mlp-fedavg-seed0.json").read_text())
    assert stored["status"] == "failed"
    assert "boom" in stored["error"]
    healthy = FakeLauncher()
    run_grid(spec, tmp_path, launcher=healthy, stream=io.StringIO(), defaults=DEFAULTS)
    assert healthy.calls == ["digits-iid-mlp-fedavg-seed0"]  # only the failed cell
    spec.common["num-server-rounds"] = 5
    run_grid(spec, tmp_path, launcher=healthy, stream=io.StringIO(), defaults=DEFAULTS)
    assert len(healthy.calls) == 3  # both cells again: their stored settings differ


def test_cell_result_holds_per_round_accuracy_config_and_wall_time(tmp_path: Path) -> None:
    spec = small_spec(strategies={"fedavg": {"strategy": "fedavg"}}, seeds=[0], partitions=["iid"])
    run_grid(spec, tmp_path, launcher=FakeLauncher(), stream=io.StringIO(), defaults=DEFAULTS)
    result = json.loads((tmp_path / "cells" / "digits-iid-mlp-fedavg-seed0.json").read_text())
    assert result["status"] == "completed"
    assert result["rounds"] == [0, 1, 2]
    assert result["test-accuracy"] == [0.1, 0.5, 0.9]
    assert result["config"]["strategy"] == "fedavg"
    assert result["overrides"]["num-server-rounds"] == 2
    assert result["wall-seconds"] >= 0.0


def test_last_rounds_accuracy_and_rounds_to_target_by_hand() -> None:
    accuracy = {0: 0.9, 1: 0.2, 2: 0.4, 3: 0.7, 4: 0.65, 5: 0.8}
    assert last_rounds_accuracy(accuracy, 2) == pytest.approx((0.65 + 0.8) / 2)
    assert last_rounds_accuracy(accuracy, 10) == pytest.approx((0.2 + 0.4 + 0.7 + 0.65 + 0.8) / 5)
    assert rounds_to_target(accuracy, 0.7) == 3  # round 0 (the initial model) never counts
    assert rounds_to_target(accuracy, 0.95) is None


def result(
    strategy: str, seed: int, accuracy: list[float], seconds: float = 10.0
) -> dict[str, Any]:
    return {
        "cell": {
            "id": f"x-{strategy}-{seed}",
            "strategy": strategy,
            "dataset": "digits",
            "partition": "iid",
            "model": "mlp",
            "seed": seed,
        },
        "overrides": {"dataset": "digits", "partition": "iid", "strategy": strategy},
        "status": "completed",
        "wall-seconds": seconds,
        "rounds": list(range(len(accuracy))),
        "test-accuracy": accuracy,
    }


def test_summary_statistics_match_a_hand_computation() -> None:
    # 12 rounds after round 0; the last 10 are rounds 3..12.
    seed0 = [0.0, *[0.05 * r for r in range(1, 13)]]  # 0.05 ... 0.60
    seed1 = [0.0, *[0.05 * r + 0.1 for r in range(1, 13)]]  # 0.15 ... 0.70
    results = [result("fedavg", 0, seed0, 10.0), result("fedavg", 1, seed1, 20.0)]
    results.append({**result("fedavg", 2, seed1), "status": "failed"})  # ignored
    (row,) = summarise(results, target=0.5, last=10)
    last0 = 100 * sum(0.05 * r for r in range(3, 13)) / 10  # 37.5
    last1 = last0 + 10.0  # 47.5
    assert row.seeds == 2
    assert row.rounds == 12
    assert row.accuracy_mean == pytest.approx((last0 + last1) / 2)
    assert row.accuracy_std == pytest.approx(statistics.stdev([last0, last1]))  # 7.07
    # target 0.5: seed 0 reaches 0.50 at round 10, seed 1 at round 8 (0.05 * 8 + 0.1)
    assert row.rounds_to_target_mean == pytest.approx(9.0)
    assert row.rounds_to_target_std == pytest.approx(statistics.stdev([10, 8]))
    assert row.reached_target == 2
    assert row.wall_seconds_mean == pytest.approx(15.0)


def test_summary_with_one_seed_has_no_spread_and_counts_seeds_missing_the_target() -> None:
    (row,) = summarise([result("elastic", 0, [0.0, 0.2, 0.3])], target=0.9, last=10)
    assert row.accuracy_mean == pytest.approx(25.0)
    assert math.isnan(row.accuracy_std)
    assert math.isnan(row.rounds_to_target_mean)
    assert row.reached_target == 0


def test_summary_files_and_accuracy_plots_are_written(tmp_path: Path) -> None:
    results = [
        result("fedavg", 0, [0.1, 0.4, 0.6]),
        result("fedavg", 1, [0.1, 0.5, 0.7]),
        result("elastic", 0, [0.1, 0.45, 0.65]),
    ]
    written = grid.report(small_spec(target_accuracy=0.6), results, tmp_path)
    names = {path.name for path in written}
    assert {"summary.md", "summary.csv", "accuracy-digits-iid-mlp.png"} <= names
    plot = tmp_path / "plots" / "accuracy-digits-iid-mlp.png"
    assert plot.read_bytes()[:8] == PNG_MAGIC
    markdown = (tmp_path / "summary.md").read_text()
    # seed 0: mean(40, 60) = 50, seed 1: mean(50, 70) = 60 -> 55 +- stdev(50, 60) = 7.07
    assert "| digits | iid | mlp | fedavg | 2 | 2 | 55.00 ± 7.07 |" in markdown
    csv_lines = (tmp_path / "summary.csv").read_text().splitlines()
    assert csv_lines[0].startswith("dataset,partition,model,strategy,seeds")
    assert len(csv_lines) == 3


def test_progress_reports_cells_done_elapsed_and_time_left() -> None:
    now = [0.0]
    stream = io.StringIO()
    progress = Progress(4, stream=stream, clock=lambda: now[0])
    cell = Cell("fedavg", "digits", "iid", "mlp", 0)
    progress.skip(cell, stored_seconds=100.0)
    assert progress.estimate_left() == pytest.approx(300.0)  # earlier cells' mean x 3 left
    progress.start(cell)
    now[0] = 60.0
    progress.finish(cell, 60.0, "completed")
    assert progress.estimate_left() == pytest.approx(120.0)  # this session's mean x 2 left
    last = stream.getvalue().splitlines()[-1]
    assert "2/4 cells done" in last
    assert "elapsed 1m00s" in last
    assert "left ~2m00s" in last


def test_grid_file_defines_variants_axes_and_targets(tmp_path: Path) -> None:
    path = tmp_path / "paper.toml"
    path.write_text(
        """
datasets = ["fashion-mnist"]
partitions = ["dir0.1", "dir100"]
models = ["mlp", "lenet5"]
seeds = [0, 1, 2]
target-accuracy = 0.85

[common]
num-server-rounds = 200
num-clients = 20

[strategies.fedavg]
[strategies.fedadam]
strategy = "fedavg"
server-optimizer = "adam"
server-lr = 0.01
""",
        encoding="utf-8",
    )
    spec = load_grid_file(path)
    spec.validate()
    assert spec.name == "paper"
    assert spec.strategies == {
        "fedavg": {"strategy": "fedavg"},
        "fedadam": {"strategy": "fedavg", "server-optimizer": "adam", "server-lr": 0.01},
    }
    assert len(spec.cells(DEFAULTS)) == 2 * 2 * 2 * 3
    assert spec.target_accuracy == 0.85
    (tmp_path / "bad.toml").write_text("rounds = 3\n", encoding="utf-8")
    with pytest.raises(GridError, match="unknown keys"):
        load_grid_file(tmp_path / "bad.toml")


def test_command_line_options_override_the_grid_file(tmp_path: Path) -> None:
    args = grid.build_parser().parse_args(
        [
            "--strategies",
            "fedavg,fedadam",
            "--variant",
            'fedadam: strategy="fedavg" server-optimizer="adam" server-lr=0.01',
            "--partitions",
            "iid",
            "--seeds",
            "3,4",
            "--rounds",
            "7",
            "--set",
            "num-clients=5",
        ]
    )
    spec = grid.spec_from_args(args)
    assert list(spec.strategies) == ["fedavg", "fedadam"]
    assert spec.strategies["fedadam"]["server-lr"] == 0.01
    assert spec.common == {"num-clients": 5, "num-server-rounds": 7}
    assert spec.seeds == [3, 4]


def test_paper_reference_only_for_fedlaw_table3_settings() -> None:
    base = {"dataset": "fashion-mnist", "partition": "dirichlet", "dirichlet-alpha": 0.1}
    fedavg = {"overrides": {**base, "model": "mlp", "strategy": "fedavg"}}
    assert paper_reference(fedavg) == 85.11
    swa = {"overrides": {**base, "model": "lenet5", "strategy": "fedlaw", "fedlaw-swa": True}}
    assert paper_reference(swa) == 88.18
    adam = {"overrides": {**base, "model": "mlp", "strategy": "fedavg", "server-lr": 0.1}}
    assert paper_reference(adam) is None
    assert (
        paper_reference({"overrides": {**base, "dataset": "digits", "strategy": "fedavg"}}) is None
    )


def write_metrics(run_dir: Path, coherence: list[float]) -> Path:
    run_dir.mkdir(parents=True)
    rows = [{"round": 0, "test-accuracy": 0.1}]
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
    paths = plot_diagnostics({"run": read_run_metrics(run_dir)}, tmp_path / "out", "d")
    assert [p.name for p in paths] == ["d-coherence.png", "d-distances.png", "d-mi.png"]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_diagnostics_figures_refuse_runs_without_diagnostics(tmp_path: Path) -> None:
    run_dir = tmp_path / "plain"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"round": 0}) + "\n", "utf-8")
    with pytest.raises(ValueError, match="diagnostics=true"):
        plot_diagnostics({"plain": read_run_metrics(run_dir)}, tmp_path, "x")


@pytest.mark.simulation
def test_one_real_grid_cell_with_diagnostics_runs_and_then_resumes(tmp_path: Path) -> None:
    spec = GridSpec(
        name="sim",
        strategies={"fedavg": {"strategy": "fedavg"}},
        partitions=["iid"],
        seeds=[0],
        common={"num-server-rounds": 2, "num-clients": 3, "diagnostics": True},
    )
    outcome = run_grid(spec, tmp_path, stream=io.StringIO(), defaults=DEFAULTS)
    assert outcome.failed == []
    (stored,) = outcome.results
    assert stored["rounds"] == [0, 1, 2]
    round_two = stored["metrics"][-1]
    assert round_two["diag-clients"] == 3
    assert -1.0 <= round_two["diag-coherence"] <= 1.0
    assert np.isfinite(round_two["diag-euclidean-mean"])
    again = run_grid(spec, tmp_path, stream=io.StringIO(), defaults=DEFAULTS)
    assert again.skipped == ["digits-iid-mlp-fedavg-seed0"]


@pytest.mark.parametrize(
    "grid_file", sorted((Path(__file__).parents[1] / "benchmarks" / "grids").glob("*.toml"))
)
def test_every_committed_grid_file_gives_cells_the_app_accepts(
    grid_file: Path, tmp_path: Path
) -> None:
    spec = load_grid_file(grid_file)
    spec.validate()
    grid.check_cells(spec, spec.cells(DEFAULTS), tmp_path)  # raises GridError naming the cell


def test_the_fedlaw_table3_grid_is_the_papers_setting() -> None:
    # Li et al. (ICML 2023), Fashion-MNIST: a 100-sample proxy set (10 per class), and the
    # authors' clients train on 70 % of their partition (client_valid_ratio 0.3).
    spec = load_grid_file(Path(__file__).parents[1] / "benchmarks/grids/fedlaw-table3.toml")
    assert spec.common["proxy-per-class"] * 10 == 100
    assert spec.common["client-holdout"] == 0.3
    assert (spec.common["num-clients"], spec.common["num-server-rounds"]) == (20, 200)


@pytest.mark.parametrize("model", ["mlp", "lenet5"])
@pytest.mark.parametrize("method", ["fedavg", "fedlaw", "fedlaw-swa"])
def test_every_table3_row_and_column_is_a_configuration_the_app_accepts(
    model: str, method: str
) -> None:
    config = parse_run_config({**TABLE3_SETTING, **METHODS[method], "model": model})
    assert config.model == model
    assert config.fedlaw_swa == (method == "fedlaw-swa")
    # Every cell of the Fashion-MNIST half of the paper's Table 3 has its number.
    assert {(model, 100.0, method), (model, 0.1, method)} <= PAPER_TABLE3.keys()


def table3_result(model: str | None, method: str, seed: int, accuracy: float) -> dict[str, Any]:
    """A run's summary as benchmarks/fedlaw_table3.py saves it (alpha 0.1)."""
    result: dict[str, Any] = {
        "alpha": 0.1,
        "strategy": method,
        "seed": seed,
        "last-10-accuracy": accuracy,
        "accuracy-per-round": [10.0, accuracy],
        "gamma-per-round": [None if method == "fedavg" else 1.0],
        "aggregation-seconds-mean": 0.5,
        "wall-seconds": 60.0,
    }
    if model is not None:  # results written before the model column have none
        result["model"] = model
        result["update-norm-ratio-max"] = 4.0 + seed
    return result


def test_the_table3_report_sets_each_run_beside_the_papers_number(tmp_path: Path) -> None:
    run = table3_result
    results = [
        run(None, "fedavg", 8, 85.0),
        run("mlp", "fedavg", 9, 87.0),
        run("lenet5", "fedlaw-swa", 8, 88.5),
    ]
    args = argparse.Namespace(
        rounds=200, client_holdout=0.3, client_backend="vectorized", publish=tmp_path
    )
    write_report(results, args)
    table = (tmp_path / "fedlaw_table3.md").read_text(encoding="utf-8")
    # Old and new MLP results pool into one row: mean 86, sample std sqrt(2); ratio logged once.
    assert "| mlp | 0.1 | fedavg | 85.11 | 86.00 ± 1.41 | 2 | 0.500 | - | 13.0 (1 of 2 runs) |" in (
        table
    )
    assert "| lenet5 | 0.1 | fedlaw-swa | 88.18 | 88.50 | 1 |" in table
    assert (tmp_path / "fedlaw_table3.png").read_bytes().startswith(PNG_MAGIC)


def test_table3_report_only_runs_nothing_and_reports_the_runs_done(tmp_path: Path) -> None:
    done = table3_result("mlp", "fedlaw", 8, 86.3)
    results, publish = tmp_path / "results", tmp_path / "publish"
    results.mkdir()
    (results / "table3-fedlaw-alpha0.1-seed8-rounds200.json").write_text(json.dumps(done))
    common = ["--report-only", "--results", str(results), "--publish", str(publish)]
    # Seed 9 is not done: without --report-only this call would start a 200-round run.
    assert table3_main([*common, "--seeds", "8", "9", "--alphas", "0.1"]) == 0
    table = (publish / "fedlaw_table3.md").read_text(encoding="utf-8")
    assert "| mlp | 0.1 | fedlaw | 86.30 | 86.30 | 1 |" in table
    assert table3_main([*common, "--seeds", "10"]) == 1  # nothing done: no report


def test_table3_writes_its_report_beside_the_runs_unless_told_to_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A trial run must not overwrite the table published in docs/results.
    import benchmarks.fedlaw_table3 as table3

    published = tmp_path / "docs-results"
    monkeypatch.setattr(table3, "PUBLISH", published)
    results = tmp_path / "results"
    results.mkdir()
    done = table3_result("mlp", "fedavg", 8, 85.0)
    (results / "table3-fedavg-alpha0.1-seed8-rounds200.json").write_text(json.dumps(done))
    common = ["--report-only", "--results", str(results), "--seeds", "8", "--alphas", "0.1"]
    assert table3_main([*common, "--strategies", "fedavg"]) == 0
    assert (results / "fedlaw_table3.md").is_file()
    assert not published.exists()
    assert table3_main([*common, "--strategies", "fedavg", "--publish"]) == 0
    table = (published / "fedlaw_table3.md").read_text(encoding="utf-8")
    assert "| mlp | 0.1 | fedavg | 85.11 | 85.00 | 1 |" in table


def test_table3_runs_with_set_options_are_named_and_reported_apart(tmp_path: Path) -> None:
    base = table3_result("mlp", "fedlaw", 9, 85.0)
    results, publish = tmp_path / "results", tmp_path / "publish"
    results.mkdir()
    plain = {**base, "last-10-accuracy": 84.95}
    filtered = {**base, "last-10-accuracy": 85.5, "overrides": {"update-norm-factor": 10.0}}
    (results / "table3-fedlaw-alpha0.1-seed9-rounds200.json").write_text(json.dumps(plain))
    name = "table3-fedlaw-alpha0.1-seed9-rounds200-update-norm-factor10.json"
    (results / name).write_text(json.dumps(filtered))
    common = ["--report-only", "--results", str(results), "--publish", str(publish)]
    common += ["--seeds", "9", "--alphas", "0.1", "--strategies", "fedlaw"]
    assert table3_main(common) == 0
    assert table3_main([*common, "--set", "update-norm-factor=10.0"]) == 0
    table = (publish / "fedlaw_table3.md").read_text(encoding="utf-8")
    # The second call's report holds the filtered run only, as its own method.
    assert "| mlp | 0.1 | fedlaw (update-norm-factor=10.0) | - | 85.50 | 1 |" in table
    assert "| mlp | 0.1 | fedlaw | " not in table


def test_a_table3_run_another_process_holds_is_left_to_it(tmp_path: Path) -> None:
    # Two processes in one run folder would interleave their metrics.jsonl lines.
    results = tmp_path / "results"
    held = claim_run(results / "table3-fedavg-alpha0.1-seed8-rounds1.lock")
    assert held is not None
    with held:
        assert claim_run(results / "table3-fedavg-alpha0.1-seed8-rounds1.lock") is None
        arguments = ["--rounds", "1", "--seeds", "8", "--alphas", "0.1", "--strategies", "fedavg"]
        code = table3_main([*arguments, "--results", str(results), "--publish", str(tmp_path)])
        assert code == 1  # nothing run, nothing to report
        assert not (results / "runs").exists()
    released = claim_run(results / "table3-fedavg-alpha0.1-seed8-rounds1.lock")
    assert released is not None  # the holder's exit (here: closing) frees the run
    released.close()
