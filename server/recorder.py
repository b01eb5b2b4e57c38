"""Where a run's results land: ``<output-dir>/<run-name>/``.

- ``metrics.jsonl``: one JSON line per round (round 0 is the initial model);
- ``checkpoint.pt``: everything needed to continue the run, rewritten after every round
  (:mod:`server.checkpoint`);
- ``final_model.pt``: the global model after the last round (a torch state dict);
- ``summary.json``: status (``running``, ``completed`` or ``failed`` with the reason), resolved
  configuration, final metrics and wall time.

Every file is replaced atomically (temporary file, then rename), so a crash never leaves one torn.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .checkpoint import atomic_torch_save


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class RunRecorder:
    """Writes one run's metrics, checkpoints and summary."""

    def __init__(
        self,
        output_dir: str | Path,
        run_name: str,
        config: Mapping[str, Any],
        resume_round: int | None = None,
    ) -> None:
        """Start a run folder, or, with ``resume_round``, continue one after that round.

        A resumed run keeps the metrics of rounds up to ``resume_round`` and forgets later ones
        (rounds the crashed run began, or finished without checkpointing, are run again).
        """
        self.directory = Path(output_dir).expanduser().resolve() / run_name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.directory / "metrics.jsonl"
        self.config = dict(config)
        self.started = time.time()
        self.rounds: list[dict[str, Any]] = []
        self.resumed_from = resume_round
        if resume_round is not None and self.metrics_path.is_file():
            lines = self.metrics_path.read_text(encoding="utf-8").splitlines()
            rounds = [json.loads(line) for line in lines if line.strip()]
            self.rounds = [entry for entry in rounds if entry.get("round", 0) <= resume_round]
        _atomic_write_text(
            self.metrics_path,
            "".join(json.dumps(entry, sort_keys=True) + "\n" for entry in self.rounds),
        )
        self.write_summary("running")

    def log_round(self, entry: Mapping[str, Any]) -> None:
        """Append one round's metrics as a JSON line."""
        record = _jsonable(dict(entry))
        self.rounds.append(record)
        with self.metrics_path.open("a", encoding="utf-8") as stream:
            stream.write(json.dumps(record, sort_keys=True) + "\n")

    def save_model(self, state_dict: Mapping[str, torch.Tensor]) -> Path:
        """Save the final global model (a torch state dict) as ``final_model.pt``."""
        state = {key: value.detach().cpu() for key, value in state_dict.items()}
        return atomic_torch_save(state, self.directory / "final_model.pt")

    def write_summary(self, status: str, error: str | None = None) -> Path:
        """Write ``summary.json`` (status is 'running', 'completed' or 'failed')."""
        summary: dict[str, Any] = {
            "status": status,
            "config": self.config,
            "wall-seconds": round(time.time() - self.started, 3),
            "rounds-completed": max((r.get("round", 0) for r in self.rounds), default=0),
            "final": self.rounds[-1] if self.rounds else None,
        }
        if self.resumed_from is not None:
            summary["resumed-from-round"] = self.resumed_from
        if error is not None:
            summary["error"] = error
        path = self.directory / "summary.json"
        _atomic_write_text(path, json.dumps(_jsonable(summary), indent=2, sort_keys=True))
        return path


def _atomic_write_text(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
