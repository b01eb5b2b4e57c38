"""Every round's metrics in an experiment tracker: TensorBoard, MLflow or Weights & Biases.

One :class:`Tracker` per run, opened by :func:`open_tracker`; each tool is an optional extra
of this package, imported only when chosen (``pip install 'beyond-averaging[tensorboard]'``,
``[mlflow]``, ``[wandb]``), and a missing one raises :class:`TrackerUnavailableError`, naming
the extra, when the tracker is opened (before round 1). Where each writes, for a run folder
``<dir>/<run>``:

- ``tensorboard``: event files in ``<dir>/<run>/tensorboard/`` (``tensorboard --logdir <dir>``
  shows every run): the metrics per round as scalars, the configuration as a text table and as
  the run's HParams session (its last value of each scalar, the final test accuracy among them,
  is the session's metric there), the run's figures as images (:meth:`Tracker.log_images`) and
  each round's per-client figures as histograms (:meth:`Tracker.log_clients`);
- ``mlflow``: the tracking URI given, else a local store shared by the runs of ``<dir>``
  (``sqlite:///<dir>/.mlflow/mlflow.db``, artifacts in ``<dir>/.mlflow/artifacts``; ``mlflow ui
  --backend-store-uri sqlite:///<dir>/.mlflow/mlflow.db``, from the ``[mlflow-ui]`` extra): the
  configuration as parameters, the metrics per round, MLflow's source tags (user, source, git
  commit), files as artifacts, and the final model as an MLflow PyTorch model
  (:meth:`Tracker.log_model`; ``mlflow.pytorch.load_model``, the model registry);
- ``wandb``: offline unless ``WANDB_MODE`` says otherwise, in ``<dir>/<run>/wandb/``
  (``wandb sync <dir>/<run>/wandb/offline-run-*`` uploads it later): the configuration, the
  metrics per round, and the files given as the run's files (in its ``files`` records).

Only finite numbers are sent as metrics (lists such as FedLAW's per-client weights stay in the
run's own records). A tracker that fails while the run goes on (a tracking server gone) logs a
warning once and is not called again: the run never stops for its tracker.

A Flower app's strategy, of this package or any other, reports to one with a single call,
:func:`track` (docs/library.md, "Experiment trackers").
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from functools import wraps
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Literal, TypeVar, cast, get_args

import torch
from flwr.app import Context
from flwr.common import log

from .arguments import accepted_keywords as _accepted_keywords

TrackerName = Literal["none", "tensorboard", "mlflow", "wandb"]
TRACKERS: tuple[str, ...] = get_args(TrackerName)
#: Per tracker: the module it needs and the extra of this package that installs it.
EXTRAS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
#: MLflow's experiment and W&B's project when none is given.
DEFAULT_PROJECT = "beyond-averaging"
#: The local MLflow store of a run folder's parent, when no tracking URI is given.
MLFLOW_STORE = ".mlflow"
#: The final statuses of a run, as MLflow names them.
MLFLOW_STATUS = {"failed": "FAILED", "interrupted": "KILLED"}
#: The name of the final model among an MLflow run's logged models (``runs:/<run id>/model``).
MLFLOW_MODEL_NAME = "model"


class TrackerUnavailableError(ImportError):
    """The chosen tracker's package is not installed; the message names the extra to install."""


def require(name: str) -> Any:
    """Import the module tracker ``name`` needs, or raise :class:`TrackerUnavailableError`."""
    if name not in EXTRAS:
        raise ValueError(f"tracker = {name!r} is not one of {', '.join(TRACKERS)}")
    module, extra = EXTRAS[name]
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise TrackerUnavailableError(
            f"tracker = {name!r} needs the package '{module}', which cannot be imported here "
            f"({error}): install it with pip install 'beyond-averaging[{extra}]', or set "
            "tracker = 'none'"
        ) from None


def numeric_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of ``metrics`` (not booleans, lists or text), keys prefixed."""
    return {
        f"{prefix}{key}": float(value)
        for key, value in metrics.items()
        if isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and key != "round"
    }


#: The per-client figures of a round's ``clients.jsonl`` lines that :meth:`Tracker.log_clients`
#: sends as histograms (one value per reply that has the figure).
CLIENT_FIGURES = (
    "update-norm",
    "update-scale",
    "direction-cosine",
    "trust",
    "weight",
    "train-loss",
)
#: A reply's fate in ``clients.jsonl`` (``status``), counted per round by
#: :meth:`Tracker.log_clients`.
CLIENT_STATUSES = ("kept", "clipped", "dropped")
#: The section (tag prefix) of the per-client histograms and counts, and of the figures.
_CLIENTS_SECTION = "clients/"
_FIGURES_SECTION = "figures/"


def _client_figures(
    records: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """A round's per-client records (``clients.jsonl`` lines) as histogram values and counts.

    Returns
    -------
    histograms : dict
        ``clients/<figure>`` (:data:`CLIENT_FIGURES`) to the finite values the replies have;
        a figure no reply has (``trust`` without FLTrust) is left out.
    counts : dict
        ``clients/<status>`` (:data:`CLIENT_STATUSES`) to the number of replies with it, zeros
        included, so that a count's curve does not skip the rounds where it is 0.
    """
    histograms: dict[str, list[float]] = {}
    for figure in CLIENT_FIGURES:
        values = [
            float(value)
            for record in records
            if isinstance(value := record.get(figure), int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        ]
        if values:
            histograms[f"{_CLIENTS_SECTION}{figure}"] = values
    counts = {
        f"{_CLIENTS_SECTION}{status}": float(sum(r.get("status") == status for r in records))
        for status in CLIENT_STATUSES
    }
    return histograms, counts


class Tracker(ABC):
    """One run in an experiment tracker.

    Each public call is guarded: the first error is logged as a warning, and the tracker is
    off for the rest of the run (:attr:`failed`), which goes on.
    """

    #: The tracker's name (:data:`TRACKERS`).
    name = ""

    def __init__(self) -> None:
        self.failed = False
        #: Where the tracker writes, for a reader of the log: a folder, a URI, a run's URL.
        self.where = ""

    def _guarded(self, action: str, call: Callable[[], None]) -> None:
        if self.failed:
            return
        try:
            call()
        except Exception as error:  # a tracker never ends the run it reports on
            self.failed = True
            log(
                WARNING,
                "tracker %s failed to %s (%s: %s): it receives nothing more from this run, "
                "whose own records (metrics.jsonl, summary.json) go on",
                self.name,
                action,
                type(error).__name__,
                error,
            )

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record the run's configuration."""
        self._guarded("record the configuration", lambda: self._params(params))

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record the finite numbers of ``metrics`` at ``step`` (the round)."""
        numbers = numeric_metrics(metrics)
        if numbers:
            self._guarded(f"record round {step}", lambda: self._metrics(step, numbers))

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        """Keep copies of the files in ``paths`` that exist with the run (TensorBoard: none)."""
        files = [Path(path) for path in paths if Path(path).is_file()]
        if files:
            self._guarded("store the run's files", lambda: self._artifacts(files))

    def log_clients(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """A round's per-client records (``clients.jsonl``'s lines of round ``step``): their
        figures as histograms and how many replies were kept, clipped and dropped
        (:func:`_client_figures`). TensorBoard only; the others keep ``clients.jsonl`` whole."""
        if records:  # counted inside the guard: a foreign strategy's records may be anything
            self._guarded(
                f"record round {step}'s clients",
                lambda: self._clients(step, *_client_figures(records)),
            )

    def log_images(self, step: int, paths: Iterable[Path]) -> None:
        """Show the PNG figures in ``paths`` that exist as of ``step`` (the round they were
        written after), tagged ``figures/<file stem>``. TensorBoard only; the others keep the
        figures as files (:meth:`log_artifacts`)."""
        files = [Path(path) for path in paths if Path(path).is_file()]
        if files:
            self._guarded("show the run's figures", lambda: self._images(step, files))

    def log_model(self, step: int, model: torch.nn.Module, example: torch.Tensor) -> None:
        """Keep ``model`` (the final global model, on the CPU, in evaluation mode) as the
        tracker's own model at ``step``, with ``example`` (a batch of inputs) as the example of
        what it takes. MLflow only (:meth:`MLflowTracker._model`); the others keep the final
        model as a file (:meth:`log_artifacts`).

        A model that cannot be stored (one ``torch.export`` cannot trace, MLflow's model
        flavour missing) is logged as a warning without turning the tracker off: its files and
        final status still go to it."""
        if self.failed:
            return
        try:
            self._model(step, model, example)
        except Exception as error:  # the model is one record of the run, never the tracker's end
            log(
                WARNING,
                "tracker %s could not store the final model as a model of its own (%s: %s); "
                "the final model stays among its files",
                self.name,
                type(error).__name__,
                error,
            )

    def close(self, status: str = "completed") -> None:
        """End the tracker's run with the run's final status and flush everything."""
        self._guarded("close its run", lambda: self._close(status))

    @abstractmethod
    def _params(self, params: Mapping[str, Any]) -> None: ...

    @abstractmethod
    def _metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def _artifacts(self, paths: list[Path]) -> None:
        return None

    def _clients(
        self, step: int, histograms: Mapping[str, list[float]], counts: Mapping[str, float]
    ) -> None:
        return None

    def _images(self, step: int, paths: list[Path]) -> None:
        return None

    def _model(self, step: int, model: torch.nn.Module, example: torch.Tensor) -> None:
        return None

    @abstractmethod
    def _close(self, status: str) -> None: ...


#: A PNG file's first bytes, and the colour type in its header to TensorBoard's colour space
#: (grey 1, grey and alpha 2, RGB or a palette 3, RGBA 4).
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_COLORSPACE = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}
#: A run's final status as TensorBoard's HParams dashboard names it; any other (interrupted:
#: HParams has no word for it, and it is no failure of the run) is unknown there.
_HPARAMS_STATUS = {
    "completed": "STATUS_SUCCESS",
    "completed-with-alarms": "STATUS_SUCCESS",
    "failed": "STATUS_FAILURE",
}


def _hparam_value(value: Any) -> bool | int | float | str:
    """A configuration value as an HParams value, which is a number, a boolean or text: any
    other (None, a list) as its JSON text, so that every option is in the HParams table."""
    if isinstance(value, bool | int | float | str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _png_image(path: Path) -> tuple[int, int, int, bytes] | None:
    """A PNG file's width, height, TensorBoard colour space and bytes; None for another file
    or one that cannot be read.

    Read from the PNG header (its IHDR chunk), so that showing a figure needs no image library:
    TensorBoard stores and serves the encoded bytes as they are.
    """
    try:
        data = path.read_bytes()
    except OSError:  # gone since it was listed: one figure missing never turns the tracker off
        return None
    if len(data) < 26 or data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return width, height, _PNG_COLORSPACE.get(data[25], 3), data


class TensorBoardTracker(Tracker):
    """Event files in ``directory`` (torch's ``SummaryWriter``): a scalar per metric and round,
    the configuration as a text table and as the run's HParams session (TensorBoard's
    ``summary_v2.hparams_pb``; its end, with the run's status, at :meth:`close`), the run's
    figures as images and each round's per-client figures as histograms."""

    name = "tensorboard"

    def __init__(self, directory: Path) -> None:
        super().__init__()
        require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(directory)
        self.writer = SummaryWriter(log_dir=str(self.directory))
        folder = self.directory.resolve()
        self.where = f"{folder} (tensorboard --logdir {folder.parent})"
        # TensorBoard's own protos and HParams helpers (no type information: imported as Any).
        self.proto: Any = importlib.import_module("tensorboard.compat.proto.summary_pb2")
        self.hparams: Any = importlib.import_module("tensorboard.plugins.hparams.summary_v2")
        self.hparams_data: Any = importlib.import_module(
            "tensorboard.plugins.hparams.plugin_data_pb2"
        )
        self.hparams_api: Any = importlib.import_module("tensorboard.plugins.hparams.api_pb2")
        self.hparams_metadata: Any = importlib.import_module("tensorboard.plugins.hparams.metadata")

    def _summary(self, summary: Any, step: int | None = None) -> None:
        """Write one of TensorBoard's own summary protos, which the writer has no call for."""
        cast(Any, self.writer.file_writer).add_summary(summary, step)

    def _params(self, params: Mapping[str, Any]) -> None:
        rows = "\n".join(f"| {key} | {value} |" for key, value in sorted(params.items()))
        self.writer.add_text("config", f"| option | value |\n|---|---|\n{rows}", 0)
        # No experiment summary beside it: TensorBoard takes the first one it finds for every
        # run under --logdir, hiding the options of runs it does not list; from the sessions
        # alone it lists every run's options, and each scalar's last value as a metric.
        hparams = {str(key): _hparam_value(value) for key, value in params.items()}
        self._summary(self.hparams.hparams_pb(hparams))

    def _metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def _clients(
        self, step: int, histograms: Mapping[str, list[float]], counts: Mapping[str, float]
    ) -> None:
        import numpy as np

        for key, values in histograms.items():
            self.writer.add_histogram(key, np.asarray(values, dtype=np.float64), step)
        for key, value in counts.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def _images(self, step: int, paths: list[Path]) -> None:
        summary = self.proto.Summary
        for path in paths:
            image = _png_image(path)
            if image is None:
                continue
            width, height, colorspace, data = image
            picture = summary.Image(
                height=height, width=width, colorspace=colorspace, encoded_image_string=data
            )
            tag = f"{_FIGURES_SECTION}{path.stem}"
            self._summary(summary(value=[summary.Value(tag=tag, image=picture)]), step)
        self.writer.flush()

    def _close(self, status: str) -> None:
        self.writer.add_text("status", status, 0)
        data, metadata = self.hparams_data, self.hparams_metadata
        end = data.SessionEndInfo(
            status=self.hparams_api.Status.Value(_HPARAMS_STATUS.get(status, "STATUS_UNKNOWN")),
            end_time_secs=time.time(),
        )
        value = self.proto.Summary.Value(  # as summary_v2 writes a session's start: null tensor
            tag=metadata.SESSION_END_INFO_TAG,
            metadata=metadata.create_summary_metadata(data.HParamsPluginData(session_end_info=end)),
            tensor=metadata.NULL_TENSOR,
        )
        self._summary(self.proto.Summary(value=[value]))
        self.writer.close()


def _import_keeping_root_logger(module: str) -> Any:
    """Import ``module`` and undo what it did to the root logger.

    ``mlflow.pytorch`` calls ``logging.basicConfig`` when imported (its Lightning autolog
    module): the root logger's new stderr handler would print every later line of Flower's log
    a second time (``INFO:flwr:...``).
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return importlib.import_module(module)
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)


class MLflowTracker(Tracker):
    """An MLflow run (``MlflowClient``): parameters, metrics per step, artifacts, the final
    model as a logged PyTorch model, status.

    ``uri`` empty: a local SQLite store in ``store`` (MLflow's file store is in maintenance).
    The run carries the tags MLflow's own ``mlflow.start_run`` gives a run (its context
    providers: ``mlflow.user``, ``mlflow.source.name``, ``mlflow.source.type``,
    ``mlflow.source.git.commit`` where the program runs from a git checkout), ``tags`` over
    them.
    """

    name = "mlflow"
    #: MLflow's limit on a parameter's value (characters), and on entries per ``log_batch``.
    PARAM_LENGTH = 6000
    BATCH = 100

    def __init__(
        self,
        run_name: str,
        *,
        uri: str,
        experiment: str,
        store: Path,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        mlflow = require("mlflow")
        artifacts: str | None = None
        if not uri:
            store.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{store.resolve() / 'mlflow.db'}"
            artifacts = (store.resolve() / "artifacts").as_uri()
        self.entities = importlib.import_module("mlflow.entities")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            try:
                experiment_id = self.client.create_experiment(
                    experiment, artifact_location=artifacts
                )
            except Exception:  # another run created it meanwhile; anything else raises below
                found = self.client.get_experiment_by_name(experiment)
                if found is None:
                    raise
                experiment_id = found.experiment_id
        else:
            experiment_id = found.experiment_id
        self.experiment_id: str = experiment_id
        #: The parameters recorded, and the last step's metrics: the final model's own
        #: (:meth:`_model`), as ``mlflow.pytorch.log_model`` gives a model its run's.
        self.params: dict[str, str] = {}
        self.last_metrics: tuple[int, dict[str, tuple[float, int]]] = (-1, {})
        context = importlib.import_module("mlflow.tracking.context.registry")
        run_tags = context.resolve_tags(dict(tags or {}))
        self.run_id: str = self.client.create_run(
            experiment_id, run_name=run_name, tags=run_tags
        ).info.run_id
        self.uri = uri
        self.where = f"{uri}, experiment {experiment!r}, run {self.run_id}"
        if artifacts is not None:  # the local store: how to look at it
            self.where += f" (mlflow ui --backend-store-uri {uri})"

    def _params(self, params: Mapping[str, Any]) -> None:
        entries = [
            self.entities.Param(str(key), str(value)[: self.PARAM_LENGTH])
            for key, value in sorted(params.items())
        ]
        self.params.update({entry.key: entry.value for entry in entries})
        for start in range(0, len(entries), self.BATCH):
            self.client.log_batch(self.run_id, params=entries[start : start + self.BATCH])

    def _metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        stamp = int(time.time() * 1000)
        entries = [self.entities.Metric(k, v, stamp, step) for k, v in metrics.items()]
        last_step, last = self.last_metrics
        recorded = {k: (v, stamp) for k, v in metrics.items()}
        self.last_metrics = (step, {**(last if last_step == step else {}), **recorded})
        for start in range(0, len(entries), self.BATCH):
            self.client.log_batch(self.run_id, metrics=entries[start : start + self.BATCH])

    def _artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def _model(self, step: int, model: torch.nn.Module, example: torch.Tensor) -> None:
        """``model`` as one of the run's logged models, named :data:`MLFLOW_MODEL_NAME`.

        What ``mlflow.pytorch.log_model`` does, through this tracker's own client rather than
        MLflow's process-wide tracking URI and active run (which a user's app may hold): a
        logged model whose source is this run, saved by ``mlflow.pytorch.save_model`` in
        MLflow's default format (``pt2``, the graph ``torch.export`` traces on ``example``:
        loading it runs no pickled code and needs no class of this package) with the signature
        and input example of ``example``, its files uploaded, then marked ready and recorded as
        the run's output at ``step``, with the run's parameters and the metrics of ``step`` as
        its own (the model's page shows its final test accuracy).
        """
        models: Any = importlib.import_module("mlflow.models")
        pytorch: Any = _import_keeping_root_logger("mlflow.pytorch")
        with torch.no_grad():
            output = model(example)
        inputs = example.numpy()
        logged = self.client.create_logged_model(
            self.experiment_id,
            name=MLFLOW_MODEL_NAME,
            source_run_id=self.run_id,
            params=self.params,
        )
        description = models.Model(
            artifact_path=logged.artifact_location, run_id=self.run_id, model_id=logged.model_id
        )
        with tempfile.TemporaryDirectory() as folder:
            local = Path(folder) / MLFLOW_MODEL_NAME
            pytorch.save_model(
                model,
                str(local),
                mlflow_model=description,
                signature=models.infer_signature(inputs, output.numpy()),
                input_example=inputs,
                # The model's one need, as MLflow would infer it by loading the model in a
                # subprocess of its own (seconds per run): torch, without its local build label.
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
            )
            self.client.log_model_artifacts(logged.model_id, str(local))
        self.client.finalize_logged_model(logged.model_id, "READY")
        self.client.log_outputs(
            self.run_id, [self.entities.LoggedModelOutput(logged.model_id, step=step)]
        )
        last_step, last = self.last_metrics
        if last_step == step:  # as recorded (same time): the run's history gains no point
            entries = [
                self.entities.Metric(k, v, stamp, step, model_id=logged.model_id)
                for k, (v, stamp) in last.items()
            ]
            for start in range(0, len(entries), self.BATCH):
                self.client.log_batch(self.run_id, metrics=entries[start : start + self.BATCH])

    def _close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(status, "FINISHED"))


class WandbTracker(Tracker):
    """A W&B run, offline by default (``WANDB_MODE`` overrides), written under ``directory``."""

    name = "wandb"

    def __init__(self, directory: Path, run_name: str, *, project: str) -> None:
        super().__init__()
        wandb = require("wandb")
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=run_name,
            dir=str(directory),
            mode=os.environ.get("WANDB_MODE") or "offline",
            # No console capture (it would rewrap Flower's log) and no system-metrics sampler.
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        folder = Path(self.run.dir).parent  # the run's own folder, holding files/ and its log
        self.where = (
            f"{folder} (offline: wandb sync {folder})" if self.run.offline else str(self.run.url)
        )

    def _params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def _metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def _artifacts(self, paths: list[Path]) -> None:
        # Copied into the run's files folder, then saved from there: wandb.save of the file
        # where it is would link it (and warn about each link), and a file only copied there is
        # in no ``files`` record, so the run's Files tab (and ``wandb sync``) leaves it out.
        for path in paths:
            copy = Path(self.run.dir) / path.name
            shutil.copy2(path, copy)
            self.run.save(str(copy), base_path=self.run.dir, policy="now")

    def _close(self, status: str) -> None:
        self.run.summary["status"] = status
        self.run.finish(exit_code=0 if status not in MLFLOW_STATUS else 1)


def open_tracker(
    name: str,
    directory: str | Path,
    *,
    run_name: str,
    uri: str = "",
    project: str = DEFAULT_PROJECT,
    tags: Mapping[str, str] | None = None,
) -> Tracker | None:
    """The tracker ``name`` for the run written to ``directory``; None for ``"none"``.

    Parameters
    ----------
    name : {"none", "tensorboard", "mlflow", "wandb"}
    directory : path
        The run's folder (TensorBoard's events and W&B's files go inside it; MLflow's local
        store beside it, in ``.mlflow``, shared by the runs of one folder).
    run_name : str
        The run's name in MLflow and W&B.
    uri : str
        MLflow's tracking URI (a server, ``sqlite:///...``, ``databricks``); empty: the local
        store. Ignored by the others.
    project : str
        MLflow's experiment, W&B's project.
    tags : mapping, optional
        MLflow's run tags, over those MLflow gives a run itself (``mlflow.source.name``,
        ``mlflow.source.git.commit``, ...). Ignored by the others.

    Raises
    ------
    TrackerUnavailableError
        The tracker's package is not installed (the message names the extra).
    ValueError
        An unknown tracker name.
    """
    directory = Path(directory)
    if name == "none":
        return None
    if name == "tensorboard":
        return TensorBoardTracker(directory / "tensorboard")
    if name == "mlflow":
        return MLflowTracker(
            run_name,
            uri=uri,
            experiment=project,
            store=directory.parent / MLFLOW_STORE,
            tags=tags,
        )
    if name == "wandb":
        return WandbTracker(directory, run_name, project=project)
    raise ValueError(f"tracker = {name!r} is not one of {', '.join(TRACKERS)}")


StrategyT = TypeVar("StrategyT")


def strategy_params(strategy: object) -> dict[str, Any]:
    """A strategy's options: ``class`` (its class's name) and each attribute that is a number or
    text and named as a keyword argument its class takes (``fraction_train``), so not its state
    (``last_aggregation_seconds`` changes every round and is no option)."""
    klass: type = type(strategy)
    try:
        options = _accepted_keywords(klass)
    except (TypeError, ValueError):  # a constructor inspect cannot read: its class alone
        options = frozenset()
    return {
        "class": klass.__name__,
        **{
            key: value
            for key, value in sorted(vars(strategy).items())
            if key in options and isinstance(value, int | float | str | bool)
        },
    }


def _run_params(strategy: object, context: Context | None, run_id: int | None) -> dict[str, Any]:
    """What :func:`track` records as the run's configuration: the app's run config (``lr``,
    ``local-epochs``, as ``context.run_config`` holds it), ``flower-run-id``, and the strategy's
    options (:func:`strategy_params`) as ``strategy/<name>``."""
    params: dict[str, Any] = dict(context.run_config) if context is not None else {}
    if run_id is not None:
        params["flower-run-id"] = run_id
    params.update({f"strategy/{k}": v for k, v in strategy_params(strategy).items()})
    return params


def _grid_run_id(grid: Any) -> int | None:
    """The Flower run id a grid serves, or None where it cannot tell (a grid of another kind,
    or one not yet given its run)."""
    try:
        run_id = grid.run.run_id
    except Exception:  # a tracker's record never stops the run it records
        return None
    return run_id if isinstance(run_id, int) else None


def track(
    strategy: StrategyT,
    tracker: Tracker | str,
    *,
    directory: str | Path = "runs",
    run_name: str = "",
    uri: str = "",
    project: str = DEFAULT_PROJECT,
    context: Context | None = None,
) -> StrategyT:
    """Send every round of ``strategy`` to an experiment tracker; return the same strategy.

    For any Flower message-API strategy (``flwr.serverapp.strategy.Strategy``), this package's
    or another: after each ``aggregate_train`` its clients' train metrics (``train/<key>``) and,
    where the strategy keeps them, its ``aggregation_metrics`` of the round
    (``aggregation/<key>``); after each ``aggregate_evaluate`` the clients' evaluation metrics
    (``evaluate/<key>``); and the ``evaluate_fn`` given to ``start`` (``server/<key>``, round 0
    too). A strategy of this package also sends each round's per-reply records
    (``last_client_records``; TensorBoard: ``clients/<figure>`` histograms and counts).
    ``start`` first records the run's configuration (:func:`_run_params`: the app's run config,
    Flower's run id, the strategy's options) and closes the tracker's run when it returns
    (``failed`` when it raises). One INFO line says where the tracker writes.

    Parameters
    ----------
    strategy : Strategy
        The strategy, before ``strategy.start(...)``.
    tracker : Tracker or {"tensorboard", "mlflow", "wandb"}
        An open :class:`Tracker`, or the name of one to open for ``directory / run_name``
        (:func:`open_tracker`).
    directory, run_name, uri, project
        Where a tracker opened by name writes (:func:`open_tracker`); ``run_name`` empty:
        ``<strategy class>-<UTC time>``.
    context : flwr.app.Context, optional
        The ServerApp's context (``main(grid, context)``): its ``run_config`` is recorded as the
        run's configuration and its ``run_id`` as ``flower-run-id``. Without it the run config is
        not recorded (track cannot see it), and the run id is the one ``start``'s grid serves.

    Raises
    ------
    TrackerUnavailableError
        The tracker's package is not installed (the message names the extra to install).
    """
    if isinstance(tracker, str):
        name = run_name or (
            f"{type(strategy).__name__}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
        )
        opened = open_tracker(
            tracker, Path(directory) / name, run_name=name, uri=uri, project=project
        )
        if opened is None:
            return strategy
        tracker = opened
    sink = tracker
    log(
        INFO,
        "track: %s's rounds go to %s at %s%s",
        type(strategy).__name__,
        sink.name or type(sink).__name__,
        sink.where or "(a tracker that does not say where)",
        ""
        if context is not None
        else "; pass track(..., context=context) to record the app's run config",
    )
    target = cast(Any, strategy)
    aggregate_train, aggregate_evaluate, start = (
        target.aggregate_train,
        target.aggregate_evaluate,
        target.start,
    )

    @wraps(aggregate_train)
    def tracked_train(server_round: int, replies: Iterable[Any]) -> Any:
        arrays, metrics = aggregate_train(server_round, replies)
        figures = getattr(strategy, "aggregation_metrics", {}).get(server_round, {})
        sink.log_metrics(
            server_round,
            {
                **numeric_metrics(metrics or {}, "train/"),
                **numeric_metrics(figures, "aggregation/"),
            },
        )
        # This package's strategies keep the round's per-reply records (clients.jsonl's lines).
        sink.log_clients(server_round, getattr(strategy, "last_client_records", None) or [])
        return arrays, metrics

    @wraps(aggregate_evaluate)
    def tracked_evaluate(server_round: int, replies: Iterable[Any]) -> Any:
        metrics = aggregate_evaluate(server_round, replies)
        sink.log_metrics(server_round, numeric_metrics(metrics or {}, "evaluate/"))
        return metrics

    @wraps(start)
    def tracked_start(*args: Any, **kwargs: Any) -> Any:
        call = inspect.signature(start).bind(*args, **kwargs)  # evaluate_fn by name or place
        evaluate_fn = call.arguments.get("evaluate_fn")
        if evaluate_fn is not None:

            def tracked_evaluate_fn(server_round: int, arrays: Any) -> Any:
                metrics = evaluate_fn(server_round, arrays)
                sink.log_metrics(server_round, numeric_metrics(metrics or {}, "server/"))
                return metrics

            call.arguments["evaluate_fn"] = tracked_evaluate_fn
        run_id = context.run_id if context is not None else _grid_run_id(call.arguments.get("grid"))
        sink.log_params(_run_params(strategy, context, run_id))
        try:
            result = start(*call.args, **call.kwargs)
        except BaseException:
            sink.close("failed")
            raise
        sink.close("completed")
        return result

    target.aggregate_train = tracked_train
    target.aggregate_evaluate = tracked_evaluate
    target.start = tracked_start
    return strategy
