"""The experiment runner: spec files, which runs run (skip, resume, lock, conflict), the report.

Run folders are written by hand here (a ``metrics.jsonl`` and a ``summary.json``, the app's run
format) so that every figure of a report can be checked against a hand computation; two tests run
the real app in process on digits for a few rounds.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.spec import REPO, Spec, SpecError, load_spec
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.overrides import parse_overrides
from beyond_averaging.server.runs.folder import CHECKPOINT_FILE
from beyond_averaging.server.sweep import run as sweep
from beyond_averaging.server.sweep.report import METRICS, draw, read_run, table
from beyond_averaging.server.sweep.run import claim, run_spec, state
from beyond_averaging.server.sweep.spec import METRIC_NAMES
from tests.factories import make_spec

SPECS = sorted((REPO / "benchmarks" / "specs").glob("*.toml"))


def write_spec(folder: Path, text: str, name: str = "exp.toml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def write_run(
    folder: Path,
    settings: dict[str, Any],
    accuracy: Sequence[float],
    *,
    status: str = "completed",
    extra: dict[str, Sequence[float]] | None = None,
    checkpoint: bool = False,
) -> Path:
    """A run folder as the app writes it: round 0 is the initial model."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for index, value in enumerate(accuracy):
        entry: dict[str, Any] = {"round": index, "test-accuracy": value}
        for key, values in (extra or {}).items():
            entry[key] = values[index]
        lines.append(json.dumps(entry))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary = {
        "status": status,
        "config": parse_run_config(settings).to_run_config(),
        "rounds-completed": len(accuracy) - 1,
        "wall-seconds": 60.0,
    }
    (folder / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    if checkpoint:
        (folder / CHECKPOINT_FILE).write_bytes(b"checkpoint")
    return folder


class FakeLaunch:
    """Stands in for ``launch_runtime``: records each call and writes a completed run."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.app_dirs: list[Path] = []

    def __call__(self, runtime: str, app_dir: Path, overrides: list[str], **_: Any) -> Path:
        settings = parse_overrides(overrides)
        self.calls.append(settings)
        self.app_dirs.append(app_dir)
        folder = Path(settings["output-dir"]) / settings["run-name"]
        rounds = int(settings["num-server-rounds"])
        clean = {k: v for k, v in settings.items() if k != "resume-from"}
        return write_run(folder, clean, [0.1 * r for r in range(rounds + 1)])


@pytest.fixture
def fake_launch(monkeypatch: pytest.MonkeyPatch) -> FakeLaunch:
    fake = FakeLaunch()
    monkeypatch.setattr(sweep, "launch_runtime", fake)
    return fake


# ----------------------------------------------------------------------------- spec files
def test_runs_are_every_axis_value_times_every_seed_with_names_from_their_labels(
    tmp_path: Path,
) -> None:
    spec = load_spec(make_spec(tmp_path))
    assert [run.name for run in spec.runs()][:3] == [
        "fedavg-seed0",
        "elastic-seed0",
        "fedavg-seed1",
    ]
    path = make_spec(
        tmp_path,
        title=None,
        runs=str(tmp_path / "r"),
        settings={"dataset": "digits"},
        grid={
            "dirichlet-alpha": [100.0, 0.1],
            "partition": [
                {"label": "iid", "partition": "iid"},
                {"label": "dir0.5", "dirichlet-alpha": 0.5},
            ],
            "seed": [8, 9],
        },
        methods={"fedavg": {}, "fedadam": {"strategy": "fedavg", "server-optimizer": "adam"}},
    )
    runs = load_spec(path).runs()
    assert len(runs) == 2 * 2 * 2 * 2
    first = runs[0]
    assert first.name == "100-iid-fedavg-seed8"
    assert first.labels == {
        "dirichlet-alpha": "100",
        "partition": "iid",
        "seed": "8",
        "method": "fedavg",
    }
    assert first.settings["partition"] == "iid"
    assert first.settings["seed"] == 8
    adam = next(r for r in runs if r.name == "0.1-dir0.5-fedadam-seed9")
    # the labelled table's overrides win over the scalar axis given before it
    assert adam.settings["dirichlet-alpha"] == 0.5
    assert adam.settings["server-optimizer"] == "adam"
    assert adam.settings["strategy"] == "fedavg"
    assert adam.folder == tmp_path / "r" / adam.name


def test_a_spec_extends_another_merging_settings_and_replacing_methods(tmp_path: Path) -> None:
    settings = {"num-clients": 5, "local-epochs": 1}
    make_spec(tmp_path, "base.toml", title=None, runs=None, grid=None, settings=settings)
    child = make_spec(
        tmp_path,
        title=None,
        runs=None,
        grid=None,
        extends="base.toml",
        settings={"local-epochs": 3},
        methods={"fedlaw": {}},
    )
    spec = load_spec(child)
    assert spec.settings == {"num-clients": 5, "local-epochs": 3}
    assert [run.labels["method"] for run in spec.runs()] == ["fedlaw"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colums = []", "key 'colums' is unknown: did you mean 'columns'?"),
        ("[settings]\nnum-server-round = 3", "unknown key 'num-server-round'"),
        ("[settings]\nlearning-rate = -1", "key 'learning-rate' = -1"),
        ("[grid]\nseed = [0.5]", "give a list of integers"),
        ("[grid]\nmodel = []", "grid axis 'model' = []: give a non-empty list"),
        ('[grid]\nsplit = [{partition = "iid"}]', "name it with label"),
        (
            '[[columns]]\ntitle = "x"\nmetrc = "last"',
            "field 'metrc' is unknown: did you mean 'metric'?",
        ),
        (
            '[[columns]]\ntitle = "x"\nmetric = "lst"',
            "metric 'lst' is unknown: did you mean 'last'?",
        ),
        ('[[columns]]\ntitle = "x"\nrounds = "10"', "rounds = '10' must be a int"),
        ('[[columns]]\ntitle = "x"\nvs = true', "add a [baseline] table (each line reads <"),
        (  # docs/benchmarks.md once showed this form; the labels it names are those that exist
            '[methods.fedavg]\n[methods.elastic]\n[baseline]\nmethod = "its baseline"',
            "[baseline] method = \"its baseline\": 'method' and 'its baseline' are not [methods] "
            'labels (the labels: fedavg, elastic); each line reads <method label> = "<its '
            'baseline\'s label>", e.g. elastic = "fedavg"',
        ),
        (
            '[methods.fedavg]\n[methods.elastic]\n[baseline]\nelastic = "fedav"',
            "'fedav' is not a [methods] label",
        ),
        ('name = "run-{moddel}"', "use {axis} or {run-config-key} fields"),
        ('name = "same"\n[grid]\nseed = [0, 1]', "gives several runs the name ['same']"),
        ('runtime = "ray"', "runtime = 'ray': choose one of"),
        ('[[paper]]\nmodel = "mlp"', "needs 'value' and axis names only"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_key_and_the_fix(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write_spec(tmp_path, text)
    with pytest.raises(SpecError, match=r"spec .*exp\.toml") as error:
        load_spec(path).runs()
    assert message in str(error.value)


def test_the_spec_accepts_the_metrics_the_report_computes_and_no_other() -> None:
    # The spec owns a column's metric names (it checks a spec file before any run); the report
    # owns what each computes. Neither imports the other's table back.
    assert tuple(METRICS) == METRIC_NAMES


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_every_committed_spec_gives_runs_the_app_accepts(path: Path) -> None:
    spec = load_spec(path)
    runs = spec.runs()  # raises SpecError naming the run if the app would refuse one
    assert runs
    assert all(run.folder.parent == spec.runs_dir for run in runs)


# ----------------------------------------------------------------------------- the runner
def test_a_sweep_runs_each_run_once_and_a_second_call_runs_nothing(
    tmp_path: Path, fake_launch: FakeLaunch
) -> None:
    spec = load_spec(make_spec(tmp_path))
    run_spec(spec)
    assert sorted(call["run-name"] for call in fake_launch.calls) == sorted(
        r.name for r in spec.runs()
    )
    assert all(state(run) == "finished" for run in spec.runs())
    run_spec(spec)
    assert len(fake_launch.calls) == 6


def test_a_run_saved_with_the_step_that_server_lr_auto_stands_for_is_not_run_again(
    tmp_path: Path, fake_launch: FakeLaunch
) -> None:
    spec = load_spec(make_spec(tmp_path))
    for run in spec.runs():  # saved before "auto" existed: SGD's explicit step 1.0
        write_run(run.folder, {**run.settings, "server-lr": 1.0}, [0.1, 0.2, 0.3, 0.4])
    assert all(state(run) == "finished" for run in spec.runs())
    run = spec.runs()[0]
    write_run(run.folder, {**run.settings, "server-lr": 0.5}, [0.1, 0.2, 0.3, 0.4])
    assert state(run) == "conflict"


def test_a_run_saved_before_the_reply_bounds_existed_ran_with_them_off(
    tmp_path: Path, fake_launch: FakeLaunch
) -> None:
    # The published evidence ran before update-clip-factor, direction-outlier-factor and
    # max-claim-factor existed, i.e. with them off: it matches a spec that turns them off, and
    # not one that leaves today's defaults (2, 2, 10) on.
    spec = load_spec(make_spec(tmp_path))
    newer = ("update-clip-factor", "direction-outlier-factor", "max-claim-factor")
    for run in spec.runs():
        write_run(run.folder, run.settings, [0.1, 0.2, 0.3, 0.4])
        summary = json.loads((run.folder / "summary.json").read_text(encoding="utf-8"))
        for key in newer:
            del summary["config"][key]
        (run.folder / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    assert {state(run) for run in spec.runs()} == {"conflict"}
    spec.settings.update(dict.fromkeys(newer, 0.0))
    assert {state(run) for run in spec.runs()} == {"finished"}


def test_an_interrupted_run_resumes_from_its_checkpoint_and_a_failed_one_without_reruns(
    tmp_path: Path, fake_launch: FakeLaunch
) -> None:
    spec = load_spec(make_spec(tmp_path))
    interrupted, failed, *done = spec.runs()
    write_run(
        interrupted.folder, interrupted.settings, [0.1, 0.2], status="running", checkpoint=True
    )
    write_run(failed.folder, failed.settings, [0.1], status="failed")
    for run in done:
        write_run(run.folder, run.settings, [0.1, 0.2, 0.3, 0.4])
    assert [state(r) for r in (interrupted, failed)] == ["resumable", "new"]
    run_spec(spec)
    calls = {call["run-name"]: call for call in fake_launch.calls}
    assert sorted(calls) == sorted([interrupted.name, failed.name])
    assert calls[interrupted.name]["resume-from"] == str(interrupted.folder)
    assert "resume-from" not in calls[failed.name]


def test_completed_runs_with_other_settings_stop_the_sweep_before_any_run(
    tmp_path: Path, fake_launch: FakeLaunch
) -> None:
    spec = load_spec(make_spec(tmp_path))
    first = spec.runs()[0]
    write_run(first.folder, {**first.settings, "learning-rate": 0.2}, [0.1, 0.2, 0.3, 0.4])
    with pytest.raises(SpecError, match=r"learning-rate': \(0.2, 0.05\).*--runs DIR"):
        run_spec(spec)
    assert fake_launch.calls == []


def test_ba_sweep_puts_a_spec_without_folders_under_the_app_and_names_itself_on_the_page(
    tmp_path: Path, fake_launch: FakeLaunch, capsys: pytest.CaptureFixture[str]
) -> None:
    app = tmp_path / "my-app"
    spec = make_spec(
        tmp_path,
        "cmp.toml",
        title=None,
        runs=None,
        grid=None,
        settings={"num-server-rounds": 2},
        methods={"fedavg": {}},
    )
    assert sweep.main([str(spec), "--app", str(app)]) == 0
    assert fake_launch.app_dirs == [app]  # every run runs the app named
    run = app / "sweeps" / "cmp" / "runs" / "fedavg-seed0"
    assert json.loads((run / "summary.json").read_text(encoding="utf-8"))["status"] == "completed"
    page = (app / "sweeps" / "cmp" / "cmp.md").read_text(encoding="utf-8")
    assert f"Command: `ba-sweep {spec} --app {app}`" in page
    assert "| fedavg | 1 | 2 | 20.00 |" in page  # the fake run's final accuracy, 0.1 x 2 rounds
    capsys.readouterr()
    assert sweep.main([str(spec), "--app", str(app), "--dry-run"]) == 0
    assert capsys.readouterr().out == "fedavg-seed0: finished\n"


def test_a_run_another_process_holds_is_left_to_it(tmp_path: Path, fake_launch: FakeLaunch) -> None:
    spec = load_spec(make_spec(tmp_path))
    held = spec.runs()[0]
    lock = claim(held)
    assert lock is not None
    assert claim(held) is None
    with lock:
        lines = run_spec(spec)
    assert held.name not in [call["run-name"] for call in fake_launch.calls]
    assert f"{held.name}: another process is running it, left to it" in lines
    run_spec(spec)  # released: the next call runs it
    assert fake_launch.calls[-1]["run-name"] == held.name


# ----------------------------------------------------------------------------- the report
def report_spec(tmp_path: Path) -> Spec:
    columns = [
        {"title": "last 2 (%)", "metric": "last", "rounds": 2, "scale": 100, "digits": 2},
        {"title": "vs", "metric": "last", "rounds": 2, "scale": 100, "digits": 2, "vs": True},
        {"title": "to 50 %", "metric": "reach", "target": 0.5, "digits": 1},
        {"title": "gamma", "metric": "values", "key": "g", "show": "range", "digits": 1},
        {"title": "paper", "metric": "paper", "digits": 1},
    ]
    return load_spec(
        make_spec(
            tmp_path,
            baseline={"elastic": "fedavg"},
            columns=columns,
            paper=[{"method": "fedavg", "value": 55.0}],
        )
    )


def test_the_sweep_figure_is_titled_and_its_band_is_one_sample_sd_over_seeds_as_it_says(
    tmp_path: Path,
) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    spec = report_spec(tmp_path)
    curves = {"0": [0.1, 0.3, 0.5, 0.6], "1": [0.1, 0.2, 0.4, 0.5], "2": [0.1, 0.3, 0.6, 0.7]}
    for run in spec.runs():
        write_run(run.folder, run.settings, curves[run.labels["seed"]])
    data = [d for d in (read_run(run) for run in spec.runs()) if d is not None]
    figure = draw(spec, data)
    assert figure.get_suptitle() == f"{spec.title}: test accuracy (%)"
    (axis,) = figure.axes
    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    assert "band: mean ± 1 sample sd over seeds" in legend
    assert "dotted: the paper's number" in legend  # fedavg's 55.0 is drawn
    # Round 3's accuracies over the seeds, in %: 60, 50, 70: mean 60, sample sd 10.
    (band, *_) = [c for c in axis.collections if isinstance(c, PolyCollection)]
    heights = np.asarray(band.get_paths()[0].vertices, dtype=np.float64)[:, 1]
    assert float(heights.max()) == pytest.approx(60.0 + statistics.stdev([60.0, 50.0, 70.0]))
    plt.close(figure)


def test_a_median_column_pools_every_round_of_every_seed(tmp_path: Path) -> None:
    column = {"title": "median", "metric": "values", "key": "g", "show": "median"}
    spec = load_spec(make_spec(tmp_path, columns=[column]))
    rounds = {"0": [9.0, 1.0, 2.0, 7.0], "1": [9.0, 3.0, 4.0, 5.0], "2": [9.0, 6.0, 8.0, 10.0]}
    for run in spec.runs():
        extra = {"g": rounds[run.labels["seed"]]}
        write_run(run.folder, run.settings, [0.1, 0.2, 0.3, 0.4], extra=extra)
    data = [d for d in (read_run(run) for run in spec.runs()) if d is not None]
    # Rounds 1-3 of the three seeds: 1 2 7 3 4 5 6 8 10, whose median is 5 (round 0 left out).
    assert "| fedavg | 3 | 3 | 5.00 |" in table(spec, data)
    with pytest.raises(SpecError, match="metric 'values' goes with show 'range' or 'median'"):
        load_spec(make_spec(tmp_path, columns=[{**column, "metric": "last"}]))


def test_the_table_shows_mean_and_sample_sd_over_seeds_and_seed_paired_differences(
    tmp_path: Path,
) -> None:
    spec = report_spec(tmp_path)
    curves = {  # round 0 .. 3
        ("fedavg", "0"): [0.1, 0.3, 0.5, 0.6],
        ("fedavg", "1"): [0.1, 0.2, 0.4, 0.5],
        ("fedavg", "2"): [0.1, 0.3, 0.6, 0.7],
        ("elastic", "0"): [0.1, 0.4, 0.5, 0.7],
        ("elastic", "1"): [0.1, 0.2, 0.3, 0.4],
        ("elastic", "2"): [0.1, 0.5, 0.6, 0.8],
    }
    for run in spec.runs():
        curve = curves[(run.labels["method"], run.labels["seed"])]
        write_run(run.folder, run.settings, curve, extra={"g": [0.0, 1.0, 1.5, 2.0]})
    data = [d for d in (read_run(run) for run in spec.runs()) if d is not None]
    text = table(spec, data)
    lines = text.splitlines()
    assert lines[0] == "| method | seeds | rounds | last 2 (%) | vs | to 50 % | gamma | paper |"
    fedavg = [55.0, 45.0, 65.0]  # mean of rounds 2, 3 per seed, in %
    elastic = [60.0, 35.0, 70.0]
    diffs = [5.0, -10.0, 5.0]  # a mean of 0 is written +0.00, not -0.00
    sd = statistics.stdev  # the sample standard deviation, n - 1 in the denominator
    reach_fedavg, reach_elastic = [2, 3, 2], [2, 1]  # first round >= 0.5; seed 1 never
    assert lines[2] == (
        f"| fedavg | 3 | 3 | {np.mean(fedavg):.2f} ± {sd(fedavg):.2f} | - | "
        f"{np.mean(reach_fedavg):.1f} ± {sd(reach_fedavg):.1f} (3/3) | 1.5 (1.0-2.0) | 55.0 |"
    )
    assert lines[3] == (
        f"| elastic | 3 | 3 | {np.mean(elastic):.2f} ± {sd(elastic):.2f} | "
        f"+0.00 ± {sd(diffs):.2f} vs fedavg (better in 2/3 seeds) | "
        f"{np.mean(reach_elastic):.1f} ± {sd(reach_elastic):.1f} (2/3) | 1.5 (1.0-2.0) | - |"
    )


def test_one_seed_has_no_spread_and_a_target_never_reached_counts_no_seed(
    tmp_path: Path,
) -> None:
    spec = report_spec(tmp_path)
    spec.seeds = [0]
    for run in spec.runs():
        write_run(run.folder, run.settings, [0.1, 0.2, 0.3, 0.4], extra={"g": [0, 1, 1, 1]})
    data = [d for d in (read_run(run) for run in spec.runs()) if d is not None]
    row = table(spec, data).splitlines()[2]
    assert row == "| fedavg | 1 | 3 | 35.00 | - | - (0/1) | 1.0 (1.0-1.0) | 55.0 |"


# ----------------------------------------------------------------------------- real runs
@pytest.fixture
def flower_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "FLWR_HOME": str(tmp_path / "flwr"),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }.items():
        monkeypatch.setenv(key, value)


def test_the_documented_user_spec_runs_and_reports(tmp_path: Path, flower_env: None) -> None:
    spec_path = REPO / "benchmarks" / "specs" / "elastic-vs-fedavg.toml"
    arguments = [
        str(spec_path),
        "--app",
        str(REPO),
        "--seeds",
        "0",
        "--runs",
        str(tmp_path / "runs"),
    ]
    arguments += ["--set", 'dataset="digits"', "num-server-rounds=2"]
    assert sweep.main(arguments) == 0
    page = (tmp_path / "elastic-vs-fedavg.md").read_text(encoding="utf-8")
    assert "Command: `ba-sweep benchmarks/specs/elastic-vs-fedavg.toml --app " in page
    assert "| method | seeds | rounds | final acc. (%) |\n" in page  # no "last 10" of 2 rounds
    assert "| fedavg | 1 | 2 |" in page
    assert "| elastic | 1 | 2 |" in page
    assert (tmp_path / "elastic-vs-fedavg.png").stat().st_size > 0


def test_more_rounds_continue_a_finished_run_to_the_same_numbers_as_a_fresh_one(
    tmp_path: Path, flower_env: None
) -> None:
    settings = {"dataset": "digits", "num-clients": 3, "local-epochs": 1}
    path = make_spec(
        tmp_path, title=None, runs=None, grid=None, settings=settings, methods={"elastic": {}}
    )
    extended = load_spec(path, runs_dir=tmp_path / "extended")
    extended.settings["num-server-rounds"] = 2
    run_spec(extended)
    extended.settings["num-server-rounds"] = 3
    (run,) = extended.runs()
    assert state(run) == "resumable"
    run_spec(extended)
    fresh = load_spec(path, runs_dir=tmp_path / "fresh")
    fresh.settings["num-server-rounds"] = 3
    run_spec(fresh)
    summary = json.loads((run.folder / "summary.json").read_text())
    assert summary["resumed-from-round"] == 2
    curves = [
        [
            json.loads(line)["test-accuracy"]
            for line in (f / "metrics.jsonl").read_text().splitlines()
        ]
        for f in (run.folder, fresh.runs()[0].folder)
    ]
    assert len(curves[0]) == 4
    assert curves[0] == curves[1]


def write_scaled_run(settings: dict[str, Any]) -> None:
    """A function runtime: a run folder in the app's format, from a setting of its own."""
    config = {k: v for k, v in settings.items() if k != "scale"}
    folder = Path(settings["output-dir"]) / settings["run-name"]
    rounds = settings["num-server-rounds"]
    write_run(folder, config, [settings["scale"] * r for r in range(rounds + 1)])


def test_a_function_runtime_runs_each_run_with_settings_the_app_does_not_know(
    tmp_path: Path,
) -> None:
    path = make_spec(
        tmp_path,
        title=None,
        runtime="tests.test_runner:write_scaled_run",
        name="scale{scale}-seed{seed}",
        columns=[{"title": "final", "metric": "final", "digits": 2}],
        grid={"scale": [0.1, 0.2]},
        methods=None,
    )
    spec = load_spec(path)
    assert [run.extra for run in spec.runs()] == [{"scale": 0.1}, {"scale": 0.2}]
    run_spec(spec)
    data = [d for d in (read_run(run) for run in spec.runs()) if d is not None]
    assert table(spec, data).splitlines()[2:] == [
        "| 0.1 | 1 | 3 | 0.30 |",
        "| 0.2 | 1 | 3 | 0.60 |",
    ]
    assert all(state(run) == "finished" for run in spec.runs())


def test_a_spec_with_diagnostics_draws_their_figures_beside_its_table(
    tmp_path: Path, flower_env: None
) -> None:
    path = make_spec(
        tmp_path,
        title=None,
        runs=None,
        grid=None,
        methods=None,
        extends=str(REPO / "benchmarks" / "specs" / "diagnostics-digits.toml"),
        runtime="inprocess",
        settings={"num-server-rounds": 2, "num-clients": 3},
    )
    spec = load_spec(path, runs_dir=tmp_path / "runs")
    run_spec(spec)
    data = [d for d in (read_run(run) for run in spec.runs()) if d is not None]
    assert [d.rounds[-1]["diag-clients"] for d in data] == [3, 3]
    written = sweep.report(spec, tmp_path / "page.md", "command")
    assert [p.name for p in written] == [
        "page.md",
        "page.png",
        "page-coherence.png",
        "page-distances.png",
        "page-mi.png",
    ]


def test_the_spec_docs_benchmarks_shows_is_the_committed_file() -> None:
    page = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    shown = page.split("```toml\n", 1)[1].split("```", 1)[0]
    assert shown == (REPO / "benchmarks" / "specs" / "elastic-vs-fedavg.toml").read_text("utf-8")


def test_git_ignores_what_ba_sweep_writes_by_default_in_the_checkout() -> None:
    import shutil
    import subprocess

    from beyond_averaging.server.sweep.spec import Layout

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    layout = Layout(REPO)
    written = [
        layout.runs.format(stem="my-comparison") + "/fedavg-seed0/summary.json",
        layout.report.format(stem="my-comparison"),
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *written],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert ignored == written
