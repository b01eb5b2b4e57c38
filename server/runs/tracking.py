"""A run's experiment tracker (run option ``tracker``), fed by the run's recorder.

:func:`open_run_tracker` opens the tracker the configuration names (:mod:`strategies.tracking`) for
a run folder, before round 1, logs where it writes and records the resolved configuration as its
parameters. The
:class:`RunTracking` it returns observes the :class:`~server.runs.recorder.RunRecorder`: each line
``metrics.jsonl`` gets is sent as the round's metrics, with that round's lines of ``clients.jsonl``
(:meth:`~strategies.tracking.Tracker.log_clients`: TensorBoard's per-client histograms) and the
figures written since the round before (:meth:`~strategies.tracking.Tracker.log_images`:
``partitions.png`` at round 0, ``curves.png`` at the last round, any other ``*.png`` of the
folder when it appears or changes); when the run ends its files go along as artifacts (MLflow,
W&B): the summary, the metrics (JSON lines and table), the per-client records, the partitions,
the final model, the console log and any plot in the folder; then the final model as the
tracker's own model (:meth:`RunTracking.keep_model`; MLflow: a PyTorch model). An MLflow run
carries MLflow's source tags for the command that started the run (:func:`source_tags`).
"""

from __future__ import annotations

import copy
import json
import os
import shlex
from collections import defaultdict
from collections.abc import Mapping
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.common import log

from beyond_averaging.server.config import RunConfig
from beyond_averaging.strategies.tracking import Tracker, open_tracker

from .folder import (
    CLIENTS_FILE,
    LOG_FILE,
    METRICS_CSV_FILE,
    METRICS_FILE,
    MODEL_FILE,
    PARTITIONS_FILE,
    SUMMARY_FILE,
)
from .provenance import COMMAND_LINE_ENV, command_line, git_state

#: The run's files a tracker keeps at the end (those that exist), plus every ``*.png``.
RUN_ARTIFACTS = (
    SUMMARY_FILE,
    METRICS_FILE,
    METRICS_CSV_FILE,
    CLIENTS_FILE,
    PARTITIONS_FILE,
    MODEL_FILE,
    LOG_FILE,
)

#: MLflow's limit on a tag's value (characters).
MLFLOW_TAG_LENGTH = 8000


class RunTracking:
    """Sends a run's recorded rounds, per-client records, figures and final files to a
    :class:`Tracker`.

    The recorder appends a round's lines to ``clients.jsonl`` before its line of
    ``metrics.jsonl``, so each :meth:`on_round` finds its round's client lines already there;
    they are read on from where the last call stopped (a resumed run's first call reads the
    rounds it kept, which the ServerApp then sends again round by round).
    """

    def __init__(self, tracker: Tracker, directory: Path) -> None:
        self.tracker = tracker
        self.directory = Path(directory)
        #: How far ``clients.jsonl`` has been read (bytes), and its lines read by round.
        self.clients_read = 0
        self.clients: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
        #: Each figure shown, by name: its size and modification time when shown.
        self.figures: dict[str, tuple[int, int]] = {}
        self.step = 0
        #: The final model and a batch of its inputs (:meth:`keep_model`), logged at the end.
        self.model: tuple[torch.nn.Module, torch.Tensor] | None = None

    def keep_model(
        self,
        model: torch.nn.Module,
        state: Mapping[str, torch.Tensor],
        example: np.ndarray,
    ) -> None:
        """Hold the final model, for :meth:`on_end` to log as the tracker's own model: a copy of
        ``model`` (the server's, on its device) on the CPU with ``state`` (the final global
        weights), in evaluation mode, and ``example`` (a few test inputs) as its input example.
        """
        final = copy.deepcopy(model).cpu()
        final.load_state_dict({key: value.detach().cpu() for key, value in state.items()})
        self.model = (final.eval(), torch.from_numpy(np.array(example, dtype=np.float32)))

    def on_round(self, entry: Mapping[str, Any]) -> None:
        """A round's line of ``metrics.jsonl``: its numbers, its clients and the new figures at
        step ``round``."""
        self.step = int(entry.get("round", 0))
        self.tracker.log_metrics(self.step, entry)
        self._read_clients()
        self.tracker.log_clients(self.step, self.clients.pop(self.step, []))
        self._show_figures()

    def on_end(self, directory: Path, status: str) -> None:
        """The figures drawn at the end (``curves.png``) at the last round, the run's files as
        artifacts, the final model (when :meth:`keep_model` was given one), then the tracker's
        run closed with ``status``."""
        self._show_figures()
        files = [directory / name for name in RUN_ARTIFACTS] + sorted(directory.glob("*.png"))
        self.tracker.log_artifacts(files)
        if self.model is not None:
            self.tracker.log_model(self.step, *self.model)
        self.tracker.close(status)

    def _read_clients(self) -> None:
        """The whole lines ``clients.jsonl`` gained since the last call, kept by round."""
        try:
            with (self.directory / CLIENTS_FILE).open("rb") as file:
                file.seek(self.clients_read)
                data = file.read()
        except OSError:  # none yet, or unreadable: the tracker goes without, never the run
            return
        whole = data[: data.rfind(b"\n") + 1]  # a line being appended waits for the next call
        self.clients_read += len(whole)
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # the run's own reader reports a damaged line; skip it here
                continue
            if isinstance(record, dict) and isinstance(record.get("round"), int):
                self.clients[record["round"]].append(record)

    def _show_figures(self) -> None:
        """The folder's ``*.png`` files that are new or changed since last shown, at the
        current step."""
        changed = []
        for path in sorted(self.directory.glob("*.png")):
            try:
                stat = path.stat()
            except OSError:  # replaced meanwhile: shown once it is there again
                continue
            stamp = (stat.st_size, stat.st_mtime_ns)
            if self.figures.get(path.name) != stamp:
                self.figures[path.name] = stamp
                changed.append(path)
        self.tracker.log_images(self.step, changed)


def source_tags() -> dict[str, str]:
    """MLflow's source tags for the command that started this run, over those MLflow reads from
    the process itself (``mlflow.user``; ``mlflow.source.name``, the process's program, which is
    Flower's in the ServerApp's process of a simulation): ``mlflow.source.name`` ``ba-run`` for a
    run ``ba-run`` started (:data:`COMMAND_LINE_ENV`), ``mlflow.source.type`` ``LOCAL``,
    ``mlflow.source.git.commit`` the commit of the checkout this package runs from (none for an
    installed package), and ``command-line``, the whole command (:func:`command_line`)."""
    command = command_line()
    tags = {"mlflow.source.type": "LOCAL", "command-line": command[:MLFLOW_TAG_LENGTH]}
    if os.environ.get(COMMAND_LINE_ENV):
        tags["mlflow.source.name"] = (shlex.split(command) or [command])[0]
    git = git_state()
    if git is not None:
        tags["mlflow.source.git.commit"] = str(git["commit"])
    return tags


def open_run_tracker(config: RunConfig, directory: Path, run_name: str) -> RunTracking | None:
    """The tracker of ``config`` for the run in ``directory``, its parameters recorded; None
    for ``tracker = "none"``.

    Raises
    ------
    TrackerUnavailableError
        The tracker's package is not installed (the message names the extra).
    """
    tracker = open_tracker(
        config.tracker,
        directory,
        run_name=run_name,
        uri=config.tracker_uri,
        project=config.tracker_project,
        tags=source_tags() if config.tracker == "mlflow" else None,
    )
    if tracker is None:
        return None
    log(INFO, "tracker %s writes to %s", tracker.name, tracker.where)
    tracker.log_params(config.to_run_config())
    return RunTracking(tracker, directory)
