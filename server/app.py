"""The ServerApp: validate the configuration, build the strategy, run it, record everything."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from logging import ERROR, INFO
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from ..strategies import ContractStrategy
from ..strategies.diagnostics import ClientDiagnostics
from ..tasks.evaluation import evaluate, resolve_device
from ..tasks.federation import DataSpec, load_server_splits
from ..tasks.models import build_model
from ..tasks.protocol import ClientTask
from .config import RunConfig, parse_run_config
from .recorder import RunRecorder
from .strategy_factory import ServerResources, build_strategy

app = ServerApp()


def data_spec(config: RunConfig) -> DataSpec:
    """The data a run uses, built from the task the clients receive, as they build it."""
    return DataSpec.from_task(client_task(config), config.num_clients, config.proxy_per_class)


def client_task(config: RunConfig) -> ClientTask:
    """The per-round instructions every client receives."""
    return ClientTask(
        dataset=config.dataset,
        data_dir=config.data_dir,
        partition=config.partition,
        dirichlet_alpha=config.dirichlet_alpha,
        classes_per_client=config.classes_per_client,
        seed=config.seed,
        synthetic_alpha=config.synthetic_alpha,
        synthetic_beta=config.synthetic_beta,
        model=config.model,
        device=config.device,
        local_epochs=config.local_epochs,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        lr_decay=config.lr_decay,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        proximal_mu=config.proximal_mu,
        client_holdout=config.client_holdout,
    )


def default_run_name(config: RunConfig) -> str:
    """``<strategy>-<dataset>-<UTC time>`` when the configuration names no run."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return config.run_name or f"{config.strategy}-{config.dataset}-{stamp}"


class CentralEvaluation:
    """Evaluates the global model on the server's test split after every round and records it."""

    def __init__(
        self,
        model: torch.nn.Module,
        test_set: Any,
        device: torch.device,
        strategy: ContractStrategy,
        recorder: RunRecorder,
        num_rounds: int,
    ) -> None:
        self.model, self.test_set, self.device = model, test_set, device
        self.strategy, self.recorder, self.num_rounds = strategy, recorder, num_rounds
        self.last_time = time.perf_counter()

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Flower's ``evaluate_fn``: test the global model, log a progress line, record it."""
        state = arrays.to_torch_state_dict()
        self.model.load_state_dict(state)
        loss, accuracy = evaluate(self.model, self.test_set, self.device)
        now = time.perf_counter()
        seconds, self.last_time = now - self.last_time, now
        train_metrics = self.strategy.last_round_metrics if server_round > 0 else {}
        log(
            INFO,
            "round %d/%d | test accuracy %.4f | test loss %.4f | %.1f s | replies %s/%s",
            server_round,
            self.num_rounds,
            accuracy,
            loss,
            seconds,
            train_metrics.get("replies-valid", "-"),
            train_metrics.get("replies-received", "-"),
        )
        self.recorder.log_round(
            {
                "round": server_round,
                "test-accuracy": accuracy,
                "test-loss": loss,
                "round-seconds": seconds,
                **train_metrics,
            }
        )
        self.recorder.save_model(state)
        return MetricRecord({"test-accuracy": accuracy, "test-loss": loss})


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the configured federated training and write ``<output-dir>/<run-name>/``."""
    config = parse_run_config(context.run_config)  # stops the run before round 1 on bad input
    run_name = default_run_name(config)
    recorder = RunRecorder(config.output_dir, run_name, config.to_run_config())
    log(INFO, "run '%s' writes to %s", run_name, recorder.directory)
    try:
        torch.manual_seed(config.seed)
        device = resolve_device(config.device)
        test_set, proxy_set = load_server_splits(data_spec(config))
        model = build_model(
            config.model, test_set.input_shape, test_set.num_classes, seed=config.seed
        ).to(device)
        strategy = build_strategy(config, ServerResources(model, proxy_set, device))
        if config.diagnostics:  # per-round client coherence, distances and MI (diag-* metrics)
            strategy.add_reply_observer(
                ClientDiagnostics(
                    [name for name, p in model.named_parameters() if p.requires_grad],
                    mi_coordinates=config.diagnostics_mi_coordinates,
                    seed=config.seed,
                )
            )
        evaluation = CentralEvaluation(
            model, test_set, device, strategy, recorder, config.num_server_rounds
        )
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(
                {k: v.detach().cpu() for k, v in model.state_dict().items()}
            ),
            num_rounds=config.num_server_rounds,
            train_config=ConfigRecord(client_task(config).to_config()),
            evaluate_config=ConfigRecord(client_task(config).to_config()),
            evaluate_fn=evaluation,
        )
        del result  # the evaluation hook already loaded the last global model into `model`
        recorder.save_model(model.state_dict(), final=True)
    except BaseException as error:
        recorder.write_summary("failed", error=f"{type(error).__name__}: {error}")
        log(ERROR, "run '%s' failed: %s: %s", run_name, type(error).__name__, error)
        raise
    path = recorder.write_summary("completed")
    log(INFO, "run '%s' completed: %s", run_name, path)
