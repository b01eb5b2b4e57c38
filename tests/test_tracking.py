"""Experiment trackers (strategies/tracking.py, server/runs/tracking.py).

What a run sends to TensorBoard, MLflow and W&B is read back with each tool's own reader
(TensorBoard's EventAccumulator, MLflow's MlflowClient, W&B's offline run file through wandb's
DataStore and protobuf records), never with this project's code; a missing package stops the run
before round 1 naming the extra; the library's one call, ``track``, on a Flower app's strategy.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from beyond_averaging import __version__, track
from beyond_averaging.client.app import app as client_app
from beyond_averaging.server.app import client_task
from beyond_averaging.server.cli.main import main as ba_run
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.overrides import run_config_argument
from beyond_averaging.server.runtime.inprocess import RUN_ID, InProcessGrid, run_inprocess
from beyond_averaging.strategies import FedAvg
from beyond_averaging.strategies.tracking import Tracker, TrackerUnavailableError
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.protocol import LIBRARY_VERSION_KEY
from tests.test_inprocess import REPO
from tests.test_inprocess import SETTINGS as INPROCESS

#: The in-process runtime's test run (3 clients, 2 rounds of FedAvg on digits), named "r".
SETTINGS: dict[str, Any] = {**INPROCESS, "run-name": "r"}


def run_with(tracker: str, tmp_path: Path, **extra: Any) -> tuple[Path, list[dict[str, Any]]]:
    """Run the app in process with ``tracker``; its folder and its metrics.jsonl rounds."""
    run_inprocess(REPO, {**SETTINGS, "output-dir": str(tmp_path), "tracker": tracker, **extra})
    run = tmp_path / "r"
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return run, [json.loads(line) for line in lines]


def test_tensorboard_holds_every_rounds_metrics_beside_the_run(tmp_path: Path) -> None:
    run, rounds = run_with("tensorboard", tmp_path)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for key in ("test-accuracy", "test-loss", "replies-valid"):
        recorded = {e.step: e.value for e in events.Scalars(key)}
        expected = {r["round"]: r[key] for r in rounds if key in r}
        assert sorted(recorded) == sorted(expected), key
        for step, value in expected.items():
            assert recorded[step] == pytest.approx(value, rel=1e-6), (key, step)
    assert sorted(e.step for e in events.Scalars("test-accuracy")) == [0, 1, 2]


def test_mlflow_holds_the_configuration_the_metrics_the_files_and_the_status(
    tmp_path: Path,
) -> None:
    from mlflow import MlflowClient

    run, rounds = run_with("mlflow", tmp_path, **{"tracker-project": "trial"})
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / '.mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("trial")
    assert experiment is not None
    [found] = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "r"
    assert found.info.status == "FINISHED"
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    for key, value in summary["config"].items():  # the resolved configuration, every option
        assert found.data.params[key] == str(value), key
    history = client.get_metric_history(found.info.run_id, "test-accuracy")
    assert {m.step: m.value for m in history} == {r["round"]: r["test-accuracy"] for r in rounds}
    artifacts = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"summary.json", "metrics.jsonl", "clients.jsonl", "final_model.pt"} <= artifacts
    assert "partitions.json" in artifacts
    # The final model as an MLflow PyTorch model of the run (the light [mlflow] extra suffices;
    # tests/test_mlflow_server.py loads it from MLflow's server and registers it).
    [output] = client.get_run(found.info.run_id).outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert (model.name, model.source_run_id, output.step) == ("model", found.info.run_id, 2)
    assert model.params == found.data.params  # the run's options and final metrics, its own
    final = {m.key: m.value for m in model.metrics if m.step == 2}
    assert final["test-accuracy"] == pytest.approx(rounds[-1]["test-accuracy"])
    assert len(client.get_metric_history(found.info.run_id, "test-accuracy")) == len(rounds)
    assert "MLmodel" in {a.path for a in client.list_logged_model_artifacts(output.model_id)}


def test_logging_the_mlflow_model_leaves_the_root_logger_as_it_was(tmp_path: Path) -> None:
    """``mlflow.pytorch`` calls ``logging.basicConfig`` when first imported, which would print
    every later line of Flower's log twice; the tracker undoes it (a fresh interpreter, where
    the import is the first)."""
    code = (
        "import logging, sys, torch\n"
        "from pathlib import Path\n"
        "from beyond_averaging.strategies.tracking import MLflowTracker\n"
        "tracker = MLflowTracker('r', uri='', experiment='e', store=Path(sys.argv[1]))\n"
        "tracker.log_model(1, torch.nn.Linear(4, 2).eval(), torch.zeros(2, 4))\n"
        "tracker.close()\n"
        "print(len(logging.getLogger().handlers), 'mlflow.pytorch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["0", "True"], done.stderr
    assert "could not store the final model" not in done.stderr


def wandb_records(run: Path, wait: float = 60.0) -> list[Any]:
    """The records of the run's offline W&B file, parsed by wandb's own DataStore and protobuf,
    once its ``exit`` record is there (wandb's service process writes the file behind
    ``run.finish()``, and has flushed it all when its process ends)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    [path] = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + wait
    while True:
        store = datastore.DataStore()
        store.open_for_scan(str(path))
        records = []
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {wait} s"
        time.sleep(0.5)


def items(updates: Any) -> dict[str, Any]:
    """W&B's key/value items (a flat ``key``, or a ``nested_key`` path) as a dict."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}


def test_wandb_runs_offline_beside_the_run_with_every_rounds_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    run, rounds = run_with("wandb", tmp_path)
    records = wandb_records(run)
    history: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = items(record.history.item)
            history[int(row["_step"])] = row
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            config.update(items(updates))
    assert sorted(history) == [r["round"] for r in rounds]
    for entry in rounds:
        assert history[entry["round"]]["test-accuracy"] == pytest.approx(entry["test-accuracy"])
    assert config["strategy"] == "fedavg"
    assert config["num-server-rounds"] == 2
    [files] = list((run / "wandb").glob("offline-run-*/files"))
    assert (files / "summary.json").is_file()


def test_a_wandb_offline_run_records_the_run_folders_files_for_wandb_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started with ``ba-run`` (which writes log.txt), offline as the docs' ``wandb sync`` needs:
    the run's ``files`` records name the run folder's files, and the offline run's files folder
    holds them as the run folder does at the run's end."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    settings = {**SETTINGS, "output-dir": str(tmp_path), "tracker": "wandb"}
    code = ba_run(
        ["--app", str(REPO), "--runtime", "inprocess", "-c", run_config_argument(settings)]
    )
    assert code == 0
    run = tmp_path / "r"
    recorded = {
        file.path
        for record in wandb_records(run)
        if record.WhichOneof("record_type") == "files"
        for file in record.files.files
    }
    expected = {
        "log.txt",
        "metrics.jsonl",
        "metrics.csv",
        "curves.png",
        "partitions.png",
        "clients.jsonl",
        "summary.json",
        "final_model.pt",
    }
    assert expected <= recorded, sorted(expected - recorded)
    [files] = list((run / "wandb").glob("offline-run-*/files"))
    for name in expected - {"log.txt"}:
        assert (files / name).read_bytes() == (run / name).read_bytes(), name
    # ba-run's closing lines reach log.txt after the tracker's run has ended: a prefix of it.
    kept = (files / "log.txt").read_text(encoding="utf-8")
    assert "round 2" in kept.lower()
    assert (run / "log.txt").read_text(encoding="utf-8").startswith(kept)


def test_a_missing_tracker_package_stops_the_run_before_round_1_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    with pytest.raises(TrackerUnavailableError, match=r"pip install 'beyond-averaging\[mlflow\]'"):
        run_with("mlflow", tmp_path)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "failed"
    assert "beyond-averaging[mlflow]" in summary["error"]
    assert summary["rounds-completed"] == 0
    assert (tmp_path / "r" / "metrics.jsonl").read_text(encoding="utf-8") == ""


class Failing(Tracker):
    """A tracker whose every metric call fails, as one whose server went away."""

    name = "failing"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _params(self, params: Mapping[str, Any]) -> None:
        return None

    def _metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.calls += 1
        raise ConnectionError("tracking server gone")

    def _close(self, status: str) -> None:
        return None


def test_a_failing_tracker_warns_once_and_is_not_called_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracker = Failing()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        tracker.log_metrics(1, {"a": 1.0})
        tracker.log_metrics(2, {"a": 2.0})
    assert tracker.calls == 1
    assert tracker.failed
    warnings = [r.getMessage() for r in caplog.records if "tracker failing" in r.getMessage()]
    assert len(warnings) == 1
    assert "tracking server gone" in warnings[0]


@pytest.fixture
def server_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's task identity as a ServerApp process holds it before ``main`` runs (the grid's
    messages need it): a strategy started by hand, with no run_inprocess before it in this
    process, would otherwise fail on its first message."""
    for name, value in (("_run_id", RUN_ID), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


@pytest.mark.usefixtures("server_process")
def test_track_sends_a_flower_apps_rounds_to_tensorboard(tmp_path: Path) -> None:
    """A library user's app: this package's FedAvg started by hand on a Grid, with an
    ``evaluate_fn``, after one call to ``track``."""
    config = parse_run_config({**SETTINGS, "seed": 1})
    grid = InProcessGrid(client_app, config.num_clients, {})
    model = build_model(config.model, (1, 8, 8), 10, seed=config.seed)
    task = ConfigRecord({**client_task(config).to_config(), LIBRARY_VERSION_KEY: __version__})
    central: dict[int, float] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        weights = arrays.to_torch_state_dict()
        central[server_round] = float(sum(v.float().abs().sum() for v in weights.values()))
        return MetricRecord({"weight-l1": central[server_round]})

    strategy = track(
        FedAvg(fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=3),
        "tensorboard",
        directory=tmp_path,
        run_name="mine",
    )
    strategy.start(
        grid,
        ArrayRecord(model.state_dict()),
        num_rounds=2,
        train_config=task,
        evaluate_fn=evaluate_fn,
    )
    events = EventAccumulator(str(tmp_path / "mine" / "tensorboard"))
    events.Reload()
    server = {e.step: e.value for e in events.Scalars("server/weight-l1")}
    assert server == pytest.approx(central)
    assert sorted(server) == [0, 1, 2]
    valid = {e.step: e.value for e in events.Scalars("aggregation/replies-valid")}
    assert valid == {1: 3.0, 2: 3.0}
    losses = {e.step: e.value for e in events.Scalars("train/train-loss")}
    assert sorted(losses) == [1, 2]
    assert all(np.isfinite(list(losses.values())))


def start_tracked(strategy: Any, rounds: int = 1) -> InProcessGrid:
    """Start ``strategy`` by hand on an in-process grid of this project's ClientApp, as a user's
    ServerApp does; the grid it ran on."""
    config = parse_run_config({**SETTINGS, "seed": 1})
    grid = InProcessGrid(client_app, config.num_clients, {})
    model = build_model(config.model, (1, 8, 8), 10, seed=config.seed)
    task = ConfigRecord({**client_task(config).to_config(), LIBRARY_VERSION_KEY: __version__})
    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=rounds, train_config=task)
    return grid


@pytest.mark.usefixtures("server_process")
def test_track_records_the_apps_run_config_flowers_run_id_and_the_strategys_options(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A user's ServerApp passes its ``context``: the tracker's configuration is what the app
    was run with (its pyproject's run config), Flower's run id and the strategy's options, not
    the strategy's per-round state."""
    from mlflow import MlflowClient

    context = Context(
        run_id=4242,
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config={"learning-rate": 0.05, "local-epochs": 2, "batch-size": 32},
    )
    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=3)
    with caplog.at_level(logging.INFO, logger="flwr"):
        track(strategy, "mlflow", directory=tmp_path, run_name="mine", context=context)
    start_tracked(strategy)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / '.mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("beyond-averaging")
    assert experiment is not None
    [found] = client.search_runs([experiment.experiment_id])
    params = found.data.params
    assert params["learning-rate"] == "0.05"
    assert params["local-epochs"] == "2"
    assert params["batch-size"] == "32"
    assert params["flower-run-id"] == "4242"
    assert params["strategy/class"] == "FedAvg"
    assert params["strategy/fraction_evaluate"] == "0.0"
    assert params["strategy/min_train_nodes"] == "3"
    assert params["strategy/update_norm_factor"] == "10.0"  # an option left at its default
    assert not [key for key in params if "seconds" in key]  # last_aggregation_seconds: state
    # MLflow's own source tags, as mlflow.start_run gives a run.
    assert found.data.tags["mlflow.source.type"] == "LOCAL"
    assert found.data.tags["mlflow.user"]
    [record] = [r for r in caplog.records if r.getMessage().startswith("track:")]
    assert record.levelno == logging.INFO
    line = record.getMessage()
    assert "mlflow" in line
    assert found.info.run_id in line
    assert str(tmp_path / ".mlflow" / "mlflow.db") in line
    assert "context=context" not in line


@pytest.mark.usefixtures("server_process")
def test_without_its_context_track_records_the_grids_run_id_and_says_how_to_add_the_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=3)
    with caplog.at_level(logging.INFO, logger="flwr"):
        track(strategy, "tensorboard", directory=tmp_path, run_name="mine")
    grid = start_tracked(strategy)
    events = EventAccumulator(str(tmp_path / "mine" / "tensorboard"))
    events.Reload()
    [config] = events.Tensors("config/text_summary")
    table = config.tensor_proto.string_val[0].decode()
    assert f"| flower-run-id | {grid.run.run_id} |" in table
    assert "| strategy/class | FedAvg |" in table
    assert "| strategy/min_train_nodes | 3 |" in table
    assert "last_aggregation_seconds" not in table
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("track:")]
    assert str(tmp_path / "mine" / "tensorboard") in line
    assert "track(..., context=context)" in line


def test_a_resumed_run_may_add_a_tracker_which_gets_the_rounds_kept_and_the_new_ones(
    tmp_path: Path,
) -> None:
    run, first = run_with("none", tmp_path, **{"num-server-rounds": 1})
    settings = {**SETTINGS, "output-dir": str(tmp_path), "num-server-rounds": 2}
    run_inprocess(REPO, {**settings, "resume-from": str(run), "tracker": "tensorboard"})
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    rounds = [json.loads(line) for line in lines]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[:2] == first
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    recorded = {e.step: e.value for e in events.Scalars("test-accuracy")}
    assert recorded == pytest.approx({r["round"]: r["test-accuracy"] for r in rounds})
