"""The ServerApp: validate the configuration, build the strategy, run it, record everything.

After every round the global model is evaluated on the server's test split, the round's metrics
are appended to ``metrics.jsonl`` and a checkpoint is written (:mod:`server.runs.checkpoint`), from
which ``resume-from`` continues the run. A run that cannot train ends ``failed`` with the reason
(:class:`RunStalledError`); a run stopped from outside (a signal, ``flwr stop``, a SuperLink that
forgot it) ends ``interrupted``; a run whose model collapses, whose loss explodes or that never
rose above chance says so every round it holds (:func:`round_alarms`) and in ``summary.json``,
whose status is then ``completed-with-alarms``, never ``completed``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from datetime import UTC, datetime
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from beyond_averaging import __version__
from beyond_averaging.server.runs.checkpoint import RunCheckpoint, capture_rng, restore_rng
from beyond_averaging.server.runs.folder import COMPLETED_WITH_ALARMS
from beyond_averaging.server.runs.partitions import record_partitions
from beyond_averaging.server.runs.plots import write_run_plot
from beyond_averaging.server.runs.recorder import RunRecorder
from beyond_averaging.server.runs.tracking import open_run_tracker
from beyond_averaging.server.runtime.inprocess import InProcessGrid
from beyond_averaging.strategies.defences.trigger_unlearning import (
    backdoor_alarms,
    dormant_flagged,
)
from beyond_averaging.strategies.diagnostics import ClientDiagnostics
from beyond_averaging.strategies.secure import RunStrategy
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import DeviceData, evaluate, resolve_device
from beyond_averaging.tasks.federation import DataSpec, load_server_splits
from beyond_averaging.tasks.models import build_model
from beyond_averaging.tasks.protocol import LIBRARY_VERSION_KEY, ClientTask

from .bounded_pull import round_grid
from .config import ConfigError, RunConfig, parse_run_config
from .packed_grid import PackedGrid
from .rounds import RoundOutcome, run_rounds
from .strategy_factory import ServerResources, build_strategy

app = ServerApp()


def data_spec(config: RunConfig) -> DataSpec:
    """The data a run uses, built from the task the clients receive, as they build it."""
    return DataSpec.from_task(
        client_task(config), config.num_clients, config.proxy_per_class, config.test_size
    )


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


class RunStalledError(RuntimeError):
    """The run kept its previous model ``max-idle-rounds`` rounds in a row, or in every round."""


#: A model has collapsed when its test accuracy has stayed within CHANCE_MARGIN of chance for
#: COLLAPSE_ROUNDS rounds in a row after it had reached chance + LEARNED_MARGIN, or when the run's
#: last model is within CHANCE_MARGIN of chance after any trained round rose above it; its loss
#: has exploded when the test loss is not finite, or above LOSS_VS_UNTRAINED x the untrained
#: model's (round 0) and LOSS_VS_BEST x the lowest so far; a run never rose above chance when no
#: trained round's accuracy passed chance + CHANCE_MARGIN.
CHANCE_MARGIN = 0.05
LEARNED_MARGIN = 0.2
#: One round at chance is not a collapse: under strong label skew an honest round can dip there
#: and recover (an honest FLAME run on digits, Dirichlet 0.1, fell to chance in round 6 and
#: ended at 50.9 %). A model that stays there this many rounds, or ends there, is one.
COLLAPSE_ROUNDS = 3
LOSS_VS_UNTRAINED = 2.0
LOSS_VS_BEST = 10.0
#: What an alarm suggests: causes to check, none of them an accusation.
COLLAPSE_CAUSES = (
    "possible causes: a learning rate too high for this data, strong label skew with few "
    "clients per round, a defence's noise or clipping, or a poisoned update; see "
    "docs/reliability.md, Runs"
)
NEVER_LEARNED_CAUSES = (
    "possible causes: too few rounds for this task, a learning rate too low or too high, a "
    "data or model configuration that does not fit, or poisoned updates from the first round; "
    "see docs/reliability.md, Runs"
)


def chance_accuracy(labels: np.ndarray) -> float:
    """The test accuracy of always answering the most frequent label: what "chance" means."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64))
    return float(counts.max() / counts.sum()) if counts.size else 0.0


def round_alarms(
    history: Sequence[tuple[float, float]],
    accuracy: float,
    loss: float,
    chance: float | None,
    *,
    last: bool = False,
) -> dict[str, str]:
    """What is wrong with a round's global model, judged against the run's earlier rounds.

    Parameters
    ----------
    history : sequence of (accuracy, loss)
        The server's test figures of the earlier rounds, round 0 (the untrained model) first.
    accuracy, loss : float
        This round's.
    chance : float, optional
        :func:`chance_accuracy` of the test split; None skips the accuracy checks.
    last : bool
        The run's last round: its model is what the run delivers, so a last model within
        CHANCE_MARGIN of chance raises an alarm whatever came before: ``never-above-chance``
        when no trained round (round 1 on) rose above chance + CHANCE_MARGIN, else
        ``accuracy-at-chance``.

    Returns
    -------
    dict
        Alarm kind (``accuracy-at-chance``, ``loss-exploded``, ``never-above-chance``) -> a
        message naming the figures (accuracy, loss, rounds) and causes to check. Empty for a
        healthy round, for a single round's dip to chance, and for every round before the model
        learned anything but the last.
    """
    alarms: dict[str, str] = {}
    # Round numbers: history[i] is round i, this round is len(history).
    this_round = len(history)
    if chance is not None and history:
        at_chance = chance + CHANCE_MARGIN
        trained = [past for past, _ in history[1:]] + [accuracy]
        best_round, best = max(enumerate(trained, start=1), key=lambda item: item[1])
        recent = [past for past, _ in history[-(COLLAPSE_ROUNDS - 1) :]] + [accuracy]
        stayed = len(recent) == COLLAPSE_ROUNDS and max(recent) <= at_chance
        collapsed = best >= chance + LEARNED_MARGIN and stayed and this_round >= COLLAPSE_ROUNDS
        ended = last and accuracy <= at_chance and best > at_chance
        if collapsed or ended:
            span = (
                f"in the run's last round ({this_round})"
                if ended and not stayed
                else f"in rounds {this_round - len(recent) + 1}-{this_round}"
            )
            alarms["accuracy-at-chance"] = (
                f"test accuracy {accuracy:.4f} (test loss {loss:.4g}) is within "
                f"{CHANCE_MARGIN:g} of chance ({chance:.4f}, always the most frequent label) "
                f"{span}, after {best:.4f} in round {best_round}: the global model lost what "
                f"it had learned; {COLLAPSE_CAUSES}"
            )
        if last and best <= at_chance:
            alarms["never-above-chance"] = (
                f"no round's test accuracy rose above chance ({chance:.4f}, always the most "
                f"frequent label) + {CHANCE_MARGIN:g}: the best was {best:.4f} in round "
                f"{best_round} of {len(trained)} rounds (test loss {loss:.4g}, untrained "
                f"{history[0][1]:.4g}); the run learned nothing; {NEVER_LEARNED_CAUSES}"
            )
    if not math.isfinite(loss):
        alarms["loss-exploded"] = (
            f"test loss is {loss} in round {this_round}: the global model is not finite "
            "(possible causes: a learning rate too high, an unbounded update; see "
            "docs/reliability.md, Runs)"
        )
    elif history:
        untrained = history[0][1]
        lowest = min(past for _, past in history)
        if (
            math.isfinite(untrained)
            and loss > LOSS_VS_UNTRAINED * untrained
            and loss > LOSS_VS_BEST * lowest
        ):
            alarms["loss-exploded"] = (
                f"test loss {loss:.4g} in round {this_round} (test accuracy {accuracy:.4f}) is "
                f"{loss / untrained:.1f}x the untrained model's ({untrained:.4g}) and "
                f"{loss / lowest:.1f}x the lowest so far ({lowest:.4g}): the global model "
                "exploded (possible causes: a learning rate too high, a server step too large, "
                "an unbounded update; see docs/reliability.md, Runs)"
            )
    return alarms


class CentralEvaluation:
    """Evaluates the global model on the server's test split after every round and records it."""

    def __init__(
        self,
        model: torch.nn.Module,
        test_set: Any,
        device: torch.device,
        strategy: RunStrategy,
        recorder: RunRecorder,
        num_rounds: int,
    ) -> None:
        # On the device once, not copied there every round.
        self.test_set = (
            DeviceData.from_labeled(test_set, device)
            if isinstance(test_set, LabeledData)
            else test_set
        )
        self.chance = (
            chance_accuracy(test_set.labels) if isinstance(test_set, LabeledData) else None
        )
        self.model, self.device = model, device
        self.strategy, self.recorder, self.num_rounds = strategy, recorder, num_rounds
        self.last_time = time.perf_counter()
        # The rounds a resumed run kept: its alarms judge against the whole run.
        self.history: list[tuple[float, float]] = [
            (float(r["test-accuracy"]), float(r["test-loss"])) for r in recorder.rounds
        ]
        self.dormant_flags = sum(dormant_flagged(r) for r in recorder.rounds)

    def __call__(
        self, server_round: int, arrays: ArrayRecord, extra: Mapping[str, Any] | None = None
    ) -> MetricRecord:
        """Flower's ``evaluate_fn``: test the global model, log a progress line, record it.

        ``extra`` joins the recorded metrics (the round loop's reply counts). Alarms
        (:func:`round_alarms`) are logged as warnings, every round they hold, and recorded.
        """
        state = arrays.to_torch_state_dict()
        self.model.load_state_dict(state)
        loss, accuracy = evaluate(self.model, self.test_set, self.device)
        now = time.perf_counter()
        seconds, self.last_time = now - self.last_time, now
        train_metrics = {
            **(self.strategy.last_round_metrics if server_round > 0 else {}),
            **(extra or {}),
        }
        log(
            INFO,
            "round %d/%d | test accuracy %.4f | test loss %.4f | %.1f s | replies %s/%s",
            server_round,
            self.num_rounds,
            accuracy,
            loss,
            seconds,
            train_metrics.get("replies-valid", "-"),
            train_metrics.get("replies-sent", train_metrics.get("replies-received", "-")),
        )
        last = server_round == self.num_rounds
        alarms = round_alarms(self.history, accuracy, loss, self.chance, last=last)
        alarms |= backdoor_alarms(train_metrics, self.dormant_flags)
        self.dormant_flags += dormant_flagged(train_metrics)
        for kind, message in alarms.items():
            log(WARNING, "round %d: ALARM %s: %s", server_round, kind, message)
        self.history.append((accuracy, loss))
        self.recorder.log_round(
            {
                "round": server_round,
                "test-accuracy": accuracy,
                "test-loss": loss,
                "round-seconds": seconds,
                **train_metrics,
            },
            alarms,
        )
        return MetricRecord({"test-accuracy": accuracy, "test-loss": loss})


def round_reply_counts(
    outcome: RoundOutcome, strategy_metrics: Mapping[str, Any]
) -> dict[str, Any]:
    """The loop's view of a round: instructions sent, late replies counted as dropped, and the
    pulls of replies it made where the Grid counts them (``reply-pulls``: what the round asked
    of the SuperLink, server/pull.py)."""
    counts: dict[str, Any] = {
        "replies-sent": outcome.train_sent,
        "replies-dropped": int(strategy_metrics.get("replies-dropped", 0)) + outcome.train_late,
        **outcome.evaluate_metrics,
    }
    if outcome.train_late:
        counts["dropped-timeout"] = outcome.train_late
    if outcome.pulls is not None:
        counts["reply-pulls"] = outcome.pulls
    return counts


def idle_reason(outcome: RoundOutcome, metrics: Mapping[str, Any], strategy: RunStrategy) -> str:
    """Why a round kept the previous model, from its metrics (reply counts, drops, rejection)."""
    drops = ", ".join(
        f"{key.removeprefix('dropped-')} {value}"
        for key, value in sorted(metrics.items())
        if key.startswith("dropped-")
    )
    reason = (
        f"round {outcome.server_round}: {metrics.get('replies-valid', 0)} valid of "
        f"{outcome.train_sent} replies wanted" + (f" (dropped: {drops})" if drops else "")
    )
    if metrics.get("model-rejected"):
        rejection = getattr(strategy, "last_model_rejection", None) or "non-finite or exploding"
        reason += f"; the aggregate was not committed: {rejection}"
    return reason


class RunProgress:
    """After each round: evaluate, record, checkpoint, and stop a run that cannot train."""

    def __init__(
        self,
        config: RunConfig,
        strategy: RunStrategy,
        evaluation: CentralEvaluation,
        recorder: RunRecorder,
        idle_rounds: int = 0,
        node_states: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.config, self.strategy = config, strategy
        self.evaluation, self.recorder = evaluation, recorder
        self.idle_rounds = idle_rounds
        # The nodes' client-side state, where this process can read it (in-process runtime).
        self.node_states = node_states

    def checkpoint(self, server_round: int, arrays: ArrayRecord) -> None:
        """Write the run's state after ``server_round`` (see :mod:`server.runs.checkpoint`).

        Nothing is written once the run has a final status (stopped by Flower meanwhile: the
        folder may already belong to a resumed run).
        """
        if self.recorder.final_status is not None:
            return
        RunCheckpoint(
            round=server_round,
            model=arrays.to_torch_state_dict(),
            strategy=self.strategy.state_dict(),
            rng=capture_rng(),
            idle_rounds=self.idle_rounds,
            config=self.config.to_run_config(),
            nodes={} if self.node_states is None else self.node_states(),
        ).save(self.recorder.directory)

    def __call__(self, arrays: ArrayRecord, outcome: RoundOutcome) -> None:
        """The round hook of :func:`server.rounds.run_rounds`."""
        self.recorder.log_clients(self.strategy.last_client_records)
        metrics = {**self.strategy.last_round_metrics}
        extra = round_reply_counts(outcome, metrics)
        self.evaluation(outcome.server_round, arrays, extra)
        self.idle_rounds = 0 if outcome.aggregated else self.idle_rounds + 1
        self.checkpoint(outcome.server_round, arrays)
        if self.idle_rounds == 0:
            return
        reason = idle_reason(outcome, {**metrics, **extra}, self.strategy)
        if self.idle_rounds >= self.config.max_idle_rounds:
            raise RunStalledError(
                f"no round aggregated in the last {self.idle_rounds} rounds "
                f"(max-idle-rounds = {self.config.max_idle_rounds}); last: {reason}"
            )
        if outcome.server_round == self.config.num_server_rounds and (
            self.idle_rounds >= outcome.server_round
        ):
            raise RunStalledError(f"no round of the run aggregated; last: {reason}")


def check_fab_version(fab_version: str) -> None:
    """Refuse a run whose FAB names another release than the installed library.

    The FAB carries the app's manifest, not its code (pyproject.toml, ``fab-include``): the
    ServerApp runs the beyond-averaging installed beside the SuperLink, which must be the release
    ``flwr run`` was started from. ``fab_version`` is empty where no FAB is involved (the
    in-process runtime).
    """
    if fab_version and fab_version != __version__:
        raise RuntimeError(
            f"the run's FAB is beyond-averaging {fab_version} and the SuperLink's environment "
            f"has {__version__}: install beyond-averaging=={fab_version} there (or rebuild the "
            "image from the checkout you run `flwr run` in)"
        )


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the configured federated training and write ``<output-dir>/<run-name>/``.

    With ``resume-from = <run folder>`` the run continues in that folder from its checkpoint.
    """
    try:  # stops the run before round 1 on bad input
        config = parse_run_config(context.run_config)
    except ConfigError as error:
        # One ERROR line per bad key, ahead of Flower's traceback: what a `flwr run` user reads
        # (ba-run refuses the same values itself, before anything starts).
        for problem in error.problems:
            log(ERROR, "invalid run configuration: %s", problem)
        raise
    check_fab_version(grid.run.fab_version)
    if config.server_optimizer == "adam" and config.resolved_server_lr >= 0.5:
        log(
            WARNING,
            "server-lr = %s with server-optimizer = 'adam': Adam's step is normalised per "
            "coordinate, so every weight moves by up to %s a round (a digits run stayed at "
            'chance with 1.0); Flower\'s FedAdam uses 0.1 (server-lr = "auto")',
            config.resolved_server_lr,
            config.resolved_server_lr,
        )
    if config.client_backend != "clientapp" and not isinstance(grid, InProcessGrid):
        log(
            WARNING,
            "client-backend=%r takes effect in the in-process runtime only (ba-run --runtime "
            "inprocess); this run trains with the ClientApp on every node",
            config.client_backend,
        )
    checkpoint = None
    if config.resume_from:  # read before anything is written: a refused resume changes nothing
        folder = Path(config.resume_from).expanduser().resolve()
        checkpoint = RunCheckpoint.load(folder, config.to_run_config())
        output_dir, run_name = str(folder.parent), folder.name
    else:
        output_dir, run_name = config.output_dir, default_run_name(config)
    recorder = RunRecorder(
        output_dir,
        run_name,
        config.to_run_config(),
        resume_round=None if checkpoint is None else checkpoint.round,
    )
    log(INFO, "run '%s' writes to %s", run_name, recorder.directory)

    def record_flower_exit() -> None:
        reason = interruption_message(FLOWER_EXIT, recorder, run_name)
        recorder.write_summary("interrupted", error=reason)

    unregister = on_flower_exit(record_flower_exit)
    try:
        tracking = open_run_tracker(config, recorder.directory, run_name)  # before round 1
        if tracking is not None:
            for entry in recorder.rounds:  # a resumed run's tracker gets the rounds it kept
                tracking.on_round(entry)
            recorder.observers.append(tracking)
            recorder.tracker = {"name": tracking.tracker.name, "where": tracking.tracker.where}
        torch.manual_seed(config.seed)
        device = resolve_device(config.device)
        test_set, proxy_set = load_server_splits(data_spec(config))
        if checkpoint is None:
            record_partitions(recorder.directory, data_spec(config))
        model = build_model(
            config.model, test_set.input_shape, test_set.num_classes, seed=config.seed
        ).to(device)
        strategy = build_strategy(config, ServerResources(model, proxy_set, device, test_set))
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
        in_process = grid if isinstance(grid, InProcessGrid) else None
        # Behind a SuperLink, replies are pulled soon after they arrive (server/pull.py) and
        # those over the strategy's byte limit are dropped while pulled.
        grid = round_grid(grid, lambda: strategy.reply_byte_limit)
        if config.pack_model and config.secure_aggregation == "none" and in_process is None:
            # One array per message on the wire (SecAgg+'s clients read the model per tensor).
            grid = PackedGrid(grid)
            log(INFO, "the model is sent packed, one array per message (pack-model = true)")
        progress = RunProgress(
            config,
            strategy,
            evaluation,
            recorder,
            node_states=None if in_process is None else in_process.node_states,
        )
        arrays = ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})
        if checkpoint is None:
            evaluation(0, arrays)
            progress.checkpoint(0, arrays)
        else:
            log(INFO, "run '%s' resumes after round %d", run_name, checkpoint.round)
            arrays = ArrayRecord(checkpoint.model)
            strategy.load_state_dict(checkpoint.strategy)
            restore_rng(checkpoint.rng)
            progress.idle_rounds = checkpoint.idle_rounds
            if in_process is not None:
                in_process.load_node_states(checkpoint.nodes)
            elif checkpoint.nodes:
                log(
                    WARNING,
                    "the checkpoint holds the client-side state of %d in-process nodes; this "
                    "runtime's nodes keep their own, so their state restarts (e.g. Elastic's "
                    "sensitivity moving average)",
                    len(checkpoint.nodes),
                )
        strategy.summary()
        task = {**client_task(config).to_config(), LIBRARY_VERSION_KEY: __version__}
        arrays = run_rounds(
            strategy,
            grid,
            arrays,
            first_round=1 if checkpoint is None else checkpoint.round + 1,
            num_rounds=config.num_server_rounds,
            timeout=config.round_timeout,
            train_config=ConfigRecord(dict(task)),
            evaluate_config=ConfigRecord(dict(task)),
            on_round_end=progress,
        )
        recorder.save_model(arrays.to_torch_state_dict())
        if tracking is not None:  # its own model (MLflow's PyTorch model), logged at the end
            tracking.keep_model(model, arrays.to_torch_state_dict(), test_set.features[:2])
        write_run_plot(recorder.directory)  # curves.png; without matplotlib only a note
    except (SystemExit, KeyboardInterrupt) as error:
        # Not the run's own failure: Flower stops the ServerApp this way on a signal, on
        # `flwr stop`, and when a restarted SuperLink no longer knows its run (SystemExit 0).
        cause = (
            str(error) or "a keyboard interrupt"  # ba-run's StopSignal names the signal
            if isinstance(error, KeyboardInterrupt)
            else f"SystemExit {error.code!r} from {FLOWER_EXIT}"
        )
        reason = interruption_message(cause, recorder, run_name)
        recorder.write_summary("interrupted", error=reason)  # unless Flower's exit wrote it
        log(ERROR, "run '%s' interrupted: %s", run_name, recorder.final_error or reason)
        raise
    except BaseException as error:
        reason = recorder.failure(error)  # names a full disk (ENOSPC)
        recorder.write_summary("failed", error=reason)
        log(ERROR, "run '%s' failed: %s", run_name, reason)
        raise
    finally:
        unregister()
    alarms = recorder.alarm_summary()
    path = recorder.write_summary(COMPLETED_WITH_ALARMS if alarms else "completed")
    log(INFO, "run '%s' %s: %s", run_name, recorder.final_status, path)
    for kind, alarm in alarms.items():
        log(WARNING, "run '%s' raised %s in %d round(s)", run_name, kind, alarm["rounds"])


#: Who stops a ServerApp through Flower's exit path, and when.
FLOWER_EXIT = (
    "Flower (a signal, `flwr stop`, or a SuperLink that no longer knows this run, e.g. "
    "restarted with its state in memory)"
)


def on_flower_exit(handler: Callable[[], None]) -> Callable[[], None]:
    """Run ``handler`` first when Flower stops this process; return what unregisters it.

    Flower's ServerApp process ends through ``flwr_exit`` (on SIGINT/SIGTERM, and when its
    SuperLink answers 401 because it no longer knows the run): it starts a timer that calls
    ``os._exit`` after 5 s, then runs its own clean-up (pushing logs and output with retries),
    and only then raises SystemExit in the run. When the clean-up outlasts the timer, which
    happened after a SuperLink restart, ``except SystemExit`` never runs and the summary kept
    ``running``. A handler registered to run before that timer (Flower's own
    ``add_exit_handler(..., run_before_force_exit=True)``) records the interruption first.
    With another Flower, which lacks that hook, nothing is registered.
    """
    try:
        from flwr.supercore.exit import exit_handler as flower_exit

        flower_exit.add_exit_handler(handler, run_before_force_exit=True)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another Flower
        return lambda: None

    def unregister() -> None:
        with suppress(AttributeError):
            flower_exit.registered_exit_handlers[:] = [
                entry
                for entry in flower_exit.registered_exit_handlers
                if entry.exit_handler is not handler
            ]

    return unregister


def interruption_message(cause: str, recorder: RunRecorder, run_name: str) -> str:
    """Why a run stopped from outside (by ``cause``) ended, and how it continues."""
    rounds = max((int(r.get("round", 0)) for r in recorder.rounds), default=0)
    return (
        f"the ServerApp of run '{run_name}' was stopped after round {rounds} by {cause}; "
        f'continue it with run-config resume-from = "{recorder.directory}" (ba-run --resume '
        f"{recorder.directory})"
    )
