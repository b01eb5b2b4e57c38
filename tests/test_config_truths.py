"""Settings mean what a user takes them to mean, or stop the run before round 1 naming the fix.

- ``server-optimizer = "adam"`` alone is FedAdam with Flower's server step ``eta = 0.1``
  (``server-lr = "auto"``); the former default 1.0 started and ended a digits run at chance;
- a ``data-dir`` that does not exist is an error for every data set (digits used to ignore it);
- more clients than training samples is one error from the ServerApp before any ClientApp runs
  (``num-clients = 5000`` on digits used to print 5,000 ClientApp errors before failing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from beyond_averaging.server.config import ConfigError, parse_run_config
from beyond_averaging.server.runtime.inprocess import InProcessGrid, run_inprocess
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.tasks.datasets import DatasetNotFoundError, LabeledData, load_dataset
from beyond_averaging.tasks.federation import DataSpec, load_server_splits
from beyond_averaging.tasks.models import build_model
from tests.deploy_helpers import REPO, read_metrics

LEAN: dict[str, Any] = {
    "dataset": "digits",
    "model": "mlp",
    "num-clients": 3,
    "local-epochs": 1,
    "device": "cpu",
}
#: Flower 1.39's FedAdam: ``eta = 1e-1`` (flwr.serverapp.strategy.FedAdam's default).
FLOWER_FEDADAM_ETA = 0.1
DIGITS_TRAIN_SAMPLES = 1347  # 1797 samples, 25 % of every class held out for the server


def _server_optimizer_lr(overrides: dict[str, Any]) -> float:
    """The step size the built strategy's server optimizer uses for these settings."""
    config = parse_run_config({**LEAN, **overrides})
    probe = LabeledData(torch.zeros(10, 1, 8, 8).numpy(), torch.arange(10).long().numpy(), 10)
    model = build_model(config.model, probe.input_shape, probe.num_classes, seed=0)
    strategy = build_strategy(config, ServerResources(model, probe, torch.device("cpu")))
    return float(strategy.optimizer.lr)  # type: ignore[attr-defined]


def test_flowers_fedadam_step_is_the_default_for_the_adam_server_optimizer() -> None:
    assert _flower_fedadam_default_eta() == FLOWER_FEDADAM_ETA
    assert _server_optimizer_lr({"server-optimizer": "adam"}) == FLOWER_FEDADAM_ETA
    # sgd and momentum keep 1.0 (plain averaging; FedAvgM's server step in Hsu et al.).
    assert _server_optimizer_lr({"server-optimizer": "sgd"}) == 1.0
    assert _server_optimizer_lr({"server-optimizer": "momentum"}) == 1.0
    # An explicit value is used as given, for every optimizer.
    assert _server_optimizer_lr({"server-optimizer": "adam", "server-lr": 0.03}) == 0.03
    assert _server_optimizer_lr({"server-optimizer": "sgd", "server-lr": 0.5}) == 0.5


def _flower_fedadam_default_eta() -> float:
    """Read FedAdam's default ``eta`` from the installed Flower (an independent source)."""
    import inspect

    from flwr.serverapp.strategy import FedAdam

    return float(inspect.signature(FedAdam.__init__).parameters["eta"].default)


def test_server_lr_auto_is_recorded_as_auto_and_a_bad_word_is_refused() -> None:
    assert parse_run_config({"server-optimizer": "adam"}).to_run_config()["server-lr"] == "auto"
    with pytest.raises(ConfigError, match=r"server-lr"):
        parse_run_config({"server-lr": "fast"})


def test_the_server_app_under_flwr_run_logs_a_bad_value_as_one_error_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    from beyond_averaging.server.app import main as server_app_main

    # What `flwr run` hands the ServerApp: the app's run config with a value ba-run would refuse.
    context = SimpleNamespace(run_config={"strategy": "fedprox", "num-server-rounds": 0})
    with caplog.at_level("ERROR", logger="flwr"), pytest.raises(ConfigError):
        server_app_main(None, context)  # type: ignore[arg-type]  # stops before the grid
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sorted(errors) == [  # one line per key
        "invalid run configuration: key 'num-server-rounds' = 0 is not allowed: allowed is >= 1; "
        "the closest allowed value is 1",
        "invalid run configuration: key 'strategy' = 'fedprox' is not allowed: allowed is "
        "'fedavg', 'elastic', 'fedlaw' or 'fedgma'; the closest allowed value is 'fedlaw'",
    ]


def test_fedadam_with_default_settings_learns(tmp_path: Path) -> None:
    # With server-lr 1.0 this run stayed at chance (test accuracy 0.10 after 15 rounds, 0.11
    # after 3); with Flower's eta 0.1 it learns (0.96 after 15 rounds).
    run_inprocess(
        REPO,
        {
            **LEAN,
            "server-optimizer": "adam",
            "num-server-rounds": 3,
            "run-name": "fedadam",
            "output-dir": str(tmp_path),
        },
    )
    rounds = read_metrics(tmp_path / "fedadam")
    assert rounds[-1]["test-accuracy"] > 0.5, [r["test-accuracy"] for r in rounds]


@pytest.mark.parametrize("dataset", ["digits", "synthetic", "colored-digits", "fashion-mnist"])
def test_a_data_dir_that_does_not_exist_is_an_error_for_every_dataset(
    tmp_path: Path, dataset: str
) -> None:
    missing = tmp_path / "does" / "not" / "exist"
    spec = DataSpec(
        dataset=dataset,
        data_dir=str(missing),
        partition="iid",
        dirichlet_alpha=0.5,
        classes_per_partition=2,
        num_partitions=3,
        seed=0,
        proxy_per_class=0,
    )
    with pytest.raises(DatasetNotFoundError, match=rf"data-dir = '{missing}' does not exist"):
        load_server_splits(spec)


def test_a_data_dir_given_to_a_dataset_that_reads_no_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"dataset 'digits' reads no files .* leave data-dir"):
        load_dataset("digits", data_dir=tmp_path)


def test_a_run_with_a_missing_data_dir_fails_before_round_one(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        run_inprocess(
            REPO, {**LEAN, "data-dir": missing, "run-name": "r", "output-dir": str(tmp_path)}
        )
    summary = json.loads((tmp_path / "r" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "failed"
    assert missing in summary["error"]
    assert read_metrics(tmp_path / "r") == []


@pytest.fixture
def instructions_sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of instructions of every ``send_and_receive`` of the in-process Grid."""
    calls: list[int] = []
    original = InProcessGrid.send_and_receive

    def counting(self: InProcessGrid, messages: Any, **kwargs: Any) -> Any:
        messages = list(messages)
        calls.append(len(messages))
        return original(self, messages, **kwargs)

    monkeypatch.setattr(InProcessGrid, "send_and_receive", counting)
    return calls


def test_more_clients_than_samples_is_one_error_before_any_client_runs(
    tmp_path: Path, instructions_sent: list[int]
) -> None:
    settings = {**LEAN, "num-clients": 5000, "run-name": "many", "output-dir": str(tmp_path)}
    with pytest.raises(ValueError, match="exceeds the") as caught:
        run_inprocess(REPO, settings)
    message = str(caught.value)
    assert f"num-clients = 5000 exceeds the {DIGITS_TRAIN_SAMPLES} training samples" in message
    assert "'digits'" in message
    assert instructions_sent == []  # no instruction reached any client
    summary = json.loads((tmp_path / "many" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "failed"
    assert "num-clients = 5000" in summary["error"]


def test_as_many_clients_as_samples_is_allowed() -> None:
    spec = DataSpec(
        dataset="digits",
        data_dir="",
        partition="iid",
        dirichlet_alpha=0.5,
        classes_per_partition=2,
        num_partitions=DIGITS_TRAIN_SAMPLES,
        seed=0,
        proxy_per_class=0,
    )
    test, _ = load_server_splits(spec)
    assert len(test) > 0


def test_a_dirichlet_draw_that_cannot_divide_the_data_is_one_error_before_any_client_runs(
    tmp_path: Path, instructions_sent: list[int]
) -> None:
    # 1,000 digits clients under Dirichlet(0.5) used to fail in every sampled ClientApp (the
    # partitioner's "left a partition too small in 55 draws"), then as a run that aggregated
    # no round; the ServerApp now partitions before round 1.
    settings = {**LEAN, "num-clients": 1000, "partition": "dirichlet", "fraction-train": 0.01}
    settings |= {"run-name": "skewed", "output-dir": str(tmp_path)}
    with pytest.raises(ValueError, match="cannot divide") as caught:
        run_inprocess(REPO, settings)
    message = str(caught.value)
    assert "num-clients = 1000 with partition = 'dirichlet' (dirichlet-alpha = 0.5" in message
    assert f"the {DIGITS_TRAIN_SAMPLES} training samples of dataset 'digits'" in message
    assert "partition = 'iid'" in message
    assert "dataset = 'synthetic'" in message
    assert instructions_sent == []
