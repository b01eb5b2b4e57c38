"""Where a run's results land: ``<output-dir>/<run-name>/``.

- ``metrics.jsonl``: one JSON line per round (round 0 is the initial model);
- ``checkpoint.pt``: the latest global model, rewritten every round so a crash loses no work;
- ``final_model.pt``: the global model after the last round (a torch state dict);
- ``summary.json``: status, resolved configuration, final metrics and wall time.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


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

    def __init__(self, output_dir: str | Path, run_name: str, config: Mapping[str, Any]) -> None:
        self.directory = Path(output_dir).expanduser().resolve() / run_name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.directory / "metrics.jsonl"
        self.metrics_path.write_text("", encoding="utf-8")
        self.config = dict(config)
        self.started = time.time()
        self.rounds: list[dict[str, Any]] = []
        self.write_summary("running")

    def log_round(self, entry: Mapping[str, Any]) -> None:
        """Append one round's metrics as a JSON line."""
        record = _jsonable(dict(entry))
        self.rounds.append(record)
        with self.metrics_path.open("a", encoding="utf-8") as stream:
            stream.write(json.dumps(record, sort_keys=True) + "\n")

    def save_model(self, state_dict: Mapping[str, torch.Tensor], final: bool = False) -> Path:
        """Save a state dict as the rolling checkpoint, or as the final model."""
        path = self.directory / ("final_model.pt" if final else "checkpoint.pt")
        torch.save({key: value.detach().cpu() for key, value in state_dict.items()}, path)
        return path

    def write_summary(self, status: str, error: str | None = None) -> Path:
        """Write ``summary.json`` (status is 'running', 'completed' or 'failed')."""
        summary: dict[str, Any] = {
            "status": status,
            "config": self.config,
            "wall-seconds": round(time.time() - self.started, 3),
            "rounds-completed": max((r.get("round", 0) for r in self.rounds), default=0),
            "final": self.rounds[-1] if self.rounds else None,
        }
        if error is not None:
            summary["error"] = error
        path = self.directory / "summary.json"
        path.write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True), "utf-8")
        return path
