"""A run's experiment tracker (run option ``tracker``), fed by the run's recorder.

:func:`open_run_tracker` opens the tracker the configuration names (:mod:`strategies.tracking`) for
a run folder, before round 1, logs where it writes and records the resolved configuration as its
parameters. The
:class:`RunTracking` it returns observes the :class:`~server.runs.recorder.RunRecorder`: each line
``metrics.jsonl`` gets is sent as the round's metrics, and when the run ends its files go along as
artifacts (MLflow, W&B): the summary, the metrics (JSON lines and table), the per-client records,
the partitions, the final model, the console log and any plot in the folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from pathlib import Path
from typing import Any

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


class RunTracking:
    """Sends a run's recorded rounds and final files to a :class:`Tracker`."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def on_round(self, entry: Mapping[str, Any]) -> None:
        """A round's line of ``metrics.jsonl``: its numbers at step ``round``."""
        self.tracker.log_metrics(int(entry.get("round", 0)), entry)

    def on_end(self, directory: Path, status: str) -> None:
        """The run's files as artifacts, then the tracker's run closed with ``status``."""
        files = [directory / name for name in RUN_ARTIFACTS] + sorted(directory.glob("*.png"))
        self.tracker.log_artifacts(files)
        self.tracker.close(status)


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
    )
    if tracker is None:
        return None
    log(INFO, "tracker %s writes to %s", tracker.name, tracker.where)
    tracker.log_params(config.to_run_config())
    return RunTracking(tracker)
