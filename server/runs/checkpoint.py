"""Run checkpoints: everything a run needs to continue, bit for bit, after any crash.

``<run folder>/checkpoint.pt`` is rewritten after every completed round. It holds

- ``round``: the last completed round (0: the initial model, nothing trained yet);
- ``model``: the global model after that round (a torch state dict);
- ``strategy``: the strategy's state (:meth:`ContractStrategy.state_dict`: server-optimizer
  moments and any other state a rule carries from round to round);
- ``rng``: the ServerApp process's torch and Python random generator states (the project never
  draws from NumPy's global generator: ruff's NPY002 forbids it). Client
  sampling needs no state of its own: each round's cohort is drawn by a generator seeded with
  ``(seed, round)`` from the sorted connected node ids (``ContractStrategy._sample``);
- ``idle-rounds``: the current streak of rounds that did not aggregate (``max-idle-rounds``);
- ``nodes``: each node's ``context.state`` (client-side state, e.g. Elastic's sensitivity moving
  average), where the ServerApp can see it: in the in-process runtime, whose Grid holds every
  node's Context. A SuperNode's state lives in another process and is not saved (empty here);
- ``config`` and ``config-hash``: the resolved run configuration, so that a resume with a
  different one is refused with the differing keys named.

The file is written to a temporary name in the same folder, flushed to disk (``fsync``), then
renamed over the previous checkpoint (``os.replace`` is atomic on POSIX): a crash at any moment
leaves either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from .folder import CHECKPOINT_FILE

FORMAT_VERSION = 1
#: Keys that may differ between a run and its resume: where it runs from and writes to, how
#: many rounds it runs in all (a finished run can be extended), which experiment tracker it
#: also reports to (none changes a result; checkpoints written before the tracker keys existed
#: resume too), and the defence profile's name (a shorthand: the options it sets are in the
#: configuration themselves, so a profile and its options written out are one run).
RESUME_FREE_KEYS = frozenset(
    {
        "resume-from",
        "run-name",
        "output-dir",
        "num-server-rounds",
        "tracker",
        "tracker-uri",
        "tracker-project",
        "defence-profile",
    }
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not belong to this configuration."""


def config_hash(config: Mapping[str, Any]) -> str:
    """SHA-256 of the keys that fix a run's result (all but :data:`RESUME_FREE_KEYS`)."""
    fixed = {key: value for key, value in config.items() if key not in RESUME_FREE_KEYS}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: saved -> current`` for every result-fixing key whose value differs."""
    keys = sorted((set(saved) | set(current)) - RESUME_FREE_KEYS)
    missing = object()
    return [
        f"{key}: {saved.get(key, '<absent>')!r} -> {current.get(key, '<absent>')!r}"
        for key in keys
        if saved.get(key, missing) != current.get(key, missing)
    ]


def _to_storable(value: Any) -> Any:
    """NumPy arrays as torch tensors (the form ``torch.load(weights_only=True)`` reads back)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, copy=True))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(key): _to_storable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_to_storable(item) for item in value]
    return value


def _from_storable(value: Any) -> Any:
    """Inverse of :func:`_to_storable`: strategy state holds NumPy arrays, never tensors."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, Mapping):
        return {key: _from_storable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_storable(item) for item in value]
    return value


def record_dict_to_plain(records: RecordDict) -> dict[str, Any]:
    """A node's ``context.state`` as plain data: arrays as NumPy, config and metric values as is."""
    return {
        "arrays": {
            name: {key: array.numpy() for key, array in record.items()}
            for name, record in records.array_records.items()
        },
        "configs": {name: dict(record) for name, record in records.config_records.items()},
        "metrics": {name: dict(record) for name, record in records.metric_records.items()},
    }


def record_dict_from_plain(plain: Mapping[str, Any]) -> RecordDict:
    """Inverse of :func:`record_dict_to_plain` (dtypes and values bit for bit)."""
    records: dict[str, ArrayRecord | ConfigRecord | MetricRecord] = {}
    for name, arrays in plain.get("arrays", {}).items():
        records[name] = ArrayRecord(
            {key: Array(np.asarray(value)) for key, value in arrays.items()}
        )
    for name, values in plain.get("configs", {}).items():
        records[name] = ConfigRecord(dict(values))
    for name, values in plain.get("metrics", {}).items():
        records[name] = MetricRecord(dict(values))
    return RecordDict(records)


def capture_rng() -> dict[str, Any]:
    """The process's torch and Python random generator states."""
    version, python_state, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "python": [version, list(python_state), gauss]}


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the generators to a state from :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    version, python_state, gauss = state["python"]
    random.setstate((version, tuple(python_state), gauss))


@dataclass
class RunCheckpoint:
    """The state of a run after ``round`` completed rounds."""

    round: int
    model: dict[str, torch.Tensor]
    strategy: dict[str, Any]
    rng: dict[str, Any]
    idle_rounds: int
    config: dict[str, Any]
    #: Node id (as text) -> :func:`record_dict_to_plain` of that node's ``context.state``.
    nodes: dict[str, Any] = field(default_factory=dict)

    def save(self, directory: Path) -> Path:
        """Write ``directory/checkpoint.pt`` atomically (temporary file, fsync, rename)."""
        payload = {
            "format": FORMAT_VERSION,
            "round": self.round,
            "model": {key: value.detach().cpu().clone() for key, value in self.model.items()},
            "strategy": _to_storable(self.strategy),
            "rng": self.rng,
            "idle-rounds": self.idle_rounds,
            "nodes": _to_storable(self.nodes),
            "config": dict(self.config),
            "config-hash": config_hash(self.config),
        }
        return atomic_torch_save(payload, directory / CHECKPOINT_FILE)

    @classmethod
    def load(cls, directory: Path, config: Mapping[str, Any]) -> RunCheckpoint:
        """Read ``directory/checkpoint.pt`` and check that it belongs to ``config``.

        Raises
        ------
        CheckpointError
            No checkpoint, an unreadable one, or one written under a configuration whose
            result-fixing keys differ (each differing key is named with both values).
        """
        path = directory / CHECKPOINT_FILE
        if not path.is_file():
            raise CheckpointError(
                f"resume-from = {str(directory)!r}: no {CHECKPOINT_FILE} there; pass the folder "
                "of a run that completed at least its initial evaluation (runs/<run-name>)"
            )
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # any unpickling failure: say which file and why
            raise CheckpointError(f"{path} is not a readable checkpoint: {error}") from error
        if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} is not a checkpoint of format {FORMAT_VERSION} (written by an older "
                "version, which stored only the model weights): it cannot be resumed"
            )
        if payload["config-hash"] != config_hash(config):
            differences = config_differences(payload["config"], config)
            raise CheckpointError(
                f"{path} was written under another configuration; a resumed run must use the "
                f"same one. Differing keys (checkpoint -> now): {'; '.join(differences)}"
            )
        return cls(
            round=int(payload["round"]),
            model=dict(payload["model"]),
            strategy=_from_storable(payload["strategy"]),
            rng=dict(payload["rng"]),
            idle_rounds=int(payload["idle-rounds"]),
            config=dict(payload["config"]),
            nodes=_from_storable(payload.get("nodes", {})),
        )


#: Run outputs (checkpoint, final model, metrics, summary) are their owner's alone.
PRIVATE_FILE_MODE = 0o600
_OPEN_FLAGS = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
}


def private_file(path: Path, mode: str) -> IO[Any]:
    """Open ``path`` for writing (``mode`` "w", "wb" or "ab"), created ``0600``.

    ``open()`` creates files ``0666`` minus the umask (``0644`` usually), readable by every
    account on the machine; the mode here is given to ``open(2)`` itself, so the file is never
    readable by others, not even between its creation and a ``chmod``. An existing file keeps
    its mode, so it is set again.
    """
    descriptor = os.open(path, _OPEN_FLAGS[mode], PRIVATE_FILE_MODE)
    with suppress(PermissionError):  # an existing file of another owner: leave its mode
        os.fchmod(descriptor, PRIVATE_FILE_MODE)
    if mode == "w":
        return os.fdopen(descriptor, mode, encoding="utf-8")
    return os.fdopen(descriptor, mode)


class _WriteErrors:
    """A binary stream that remembers the ``OSError`` a write raised: torch's zip writer turns
    it into a ``RuntimeError`` ("unexpected pos 7360 vs 7254" on a full disk), which names
    neither the disk nor ENOSPC."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.stream.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.stream.flush()


def atomic_torch_save(obj: Any, path: Path) -> Path:
    """``torch.save`` to ``path`` so that readers see the old file or the new one, never a part.

    The file is created ``0600`` (:func:`private_file`). A write that fails (a full disk) leaves
    no temporary file behind and raises the ``OSError`` itself (``errno.ENOSPC``), not the
    ``RuntimeError`` torch makes of it.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with private_file(temporary, "wb") as stream:
            watched = _WriteErrors(stream)
            try:
                torch.save(obj, watched)  # type: ignore[arg-type]
            except RuntimeError as error:
                if watched.error is None:
                    raise
                raise watched.error from error
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:  # the rename itself reaches the disk
        os.fsync(directory)
    finally:
        os.close(directory)
    return path
