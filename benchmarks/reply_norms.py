"""How far honest clients' replies spread, per round, for the runner
(``benchmarks/specs/reply-norms.toml``): max / median norm ratios in an in-process federation
with the norm filter off (the default ``update-norm-factor`` rests on them). docs/reliability.md
("Honest norm ratios") defines every figure and gives the command.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.interactive import Federation, federation
from beyond_averaging.server.runs.recorder import RunRecorder
from beyond_averaging.strategies.replies.influence import (
    max_over_median,
    record_norms,
    update_norms,
)


def spread(fed: Federation, server_round: int) -> dict[str, float | None]:
    """Train and aggregate one round; the spread of its honest replies, read before aggregation."""
    sent = {k: a.numpy().astype(np.float64) for k, a in fed.arrays.items()}
    contents = [reply.content for reply in fed.round(server_round)]
    replied = [{k: a.numpy() for k, a in c.array_records["arrays"].items()} for c in contents]
    updates = update_norms(sent, replied)
    counts = [float(c.metric_records["metrics"]["num-examples"]) for c in contents]  # type: ignore[arg-type]
    floating = [{k: v for k, v in sent.items() if np.issubdtype(v.dtype, np.floating)}]
    # max / median: the ratio the strategies log and filter on
    figures = {"update": max_over_median(updates), "weight-share": max(counts) / sum(counts)}
    # What an all-zero model would score: ||0 - w|| / median honest update norm.
    figures["zero-model"] = float(record_norms(floating)[0] / np.median(updates))
    for name in ("sensitivity", "gradient"):
        records = [c.array_records[name] for c in contents if name in c.array_records]
        if records:
            norms = record_norms([{k: a.numpy() for k, a in r.items()} for r in records])
            figures[name] = max_over_median(norms)
    return figures


def run(settings: Mapping[str, Any]) -> None:
    """One run of the spec: the federation of ``settings`` (its ``update-norm-factor`` 0, so that
    no reply is dropped by the bound being measured), each round's spread and test accuracy
    written to the run folder's ``metrics.jsonl`` as the app writes its rounds."""
    config = parse_run_config(settings)
    recorder = RunRecorder(config.output_dir, config.run_name, config.to_run_config())
    try:
        fed = federation(settings)
        for server_round in range(config.num_server_rounds + 1):
            figures = spread(fed, server_round) if server_round else {}
            loss, accuracy = fed.evaluate()  # round 0: the initial model, as the app logs it
            evaluated = {"test-accuracy": accuracy, "test-loss": loss}
            recorder.log_round({"round": server_round, **evaluated, **figures})
    except Exception as error:
        recorder.write_summary("failed", recorder.failure(error))
        raise
    recorder.write_summary("completed")
